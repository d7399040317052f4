//! The f64 CPU reference of the whole layer given the routing, on the same dequantized weights
//! the kernels read. Every GPU test and the example compare against this one function.

use crate::weights::HostWeights;
use moe_codegen::MoeSpec;

/// `y[M, H]` in f64. `x` holds the activations as the device sees them (already rounded to the
/// activation dtype); `ids` / `weights` are `[M, k]`. Rows are dequantized only for the experts
/// the step touches. Runs on every core.
pub fn moe_forward(spec: &MoeSpec, w: &HostWeights, x: &[f32], ids: &[i32], weights: &[f32]) -> Vec<f64> {
    let (h, i, k) = (spec.hidden() as usize, spec.intermediate() as usize, spec.top_k() as usize);
    let m = x.len() / h;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // One task per (token, slot) pair: the expert's contribution, unweighted.
    let pairs: Vec<(usize, usize)> = (0..m).flat_map(|t| (0..k).map(move |s| (t, s))).collect();
    let mut contrib: Vec<Vec<f64>> = vec![Vec::new(); pairs.len()];
    let chunk = pairs.len().div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (ps, out) in pairs.chunks(chunk).zip(contrib.chunks_mut(chunk)) {
            sc.spawn(move || {
                for (&(t, s), o) in ps.iter().zip(out.iter_mut()) {
                    let e = ids[t * k + s] as usize;
                    let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
                    let mid: Vec<f64> = (0..i)
                        .map(|n| {
                            let g = dot(&w.w13_row(spec, e, n), &xt);
                            let u = dot(&w.w13_row(spec, e, i + n), &xt);
                            spec.activation().eval(g) * u
                        })
                        .collect();
                    *o = (0..h).map(|r| dot(&w.w2_row(spec, e, r), &mid)).collect();
                }
            });
        }
    });
    let mut y = vec![0f64; m * h];
    for (p, &(t, s)) in pairs.iter().enumerate() {
        let r = weights[t * k + s] as f64;
        for (yo, c) in y[t * h..(t + 1) * h].iter_mut().zip(&contrib[p]) {
            *yo += r * c;
        }
    }
    y
}

fn dot(w: &[f32], x: &[f64]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum()
}

/// Relative L2 error `|got - want| / |want|` and cosine similarity.
pub fn compare(got: &[f32], want: &[f64]) -> (f64, f64) {
    let (mut d2, mut w2, mut g2, mut gw) = (0f64, 0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let g = g as f64;
        d2 += (g - w) * (g - w);
        w2 += w * w;
        g2 += g * g;
        gw += g * w;
    }
    let rel = if w2 > 0.0 { (d2 / w2).sqrt() } else { d2.sqrt() };
    let cos = if g2 > 0.0 && w2 > 0.0 { gw / (g2.sqrt() * w2.sqrt()) } else { 0.0 };
    (rel, cos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_codegen::{Activation, WeightFormat};

    #[test]
    fn matches_a_hand_computed_layer() {
        // H = I = 8, 2 experts, top-1; w13 gate row n of expert e is all (e + 1), up rows all 1;
        // w2 rows all 0.5. x = 1: gate = 8 (e + 1), up = 8, mid = silu(gate) * 8, y = 0.5 * 8 * mid.
        let spec = MoeSpec::builder(8, 8, 2, 1).activation(Activation::Silu).build().unwrap();
        let mut w13 = vec![0f32; 2 * 16 * 8];
        for e in 0..2 {
            for r in 0..16 {
                for c in 0..8 {
                    w13[(e * 16 + r) * 8 + c] = if r < 8 { (e + 1) as f32 } else { 1.0 };
                }
            }
        }
        let w2 = vec![0.5f32; 2 * 8 * 8];
        let w = HostWeights::quantize(&spec, &w13, &w2).unwrap();
        let x = vec![1f32; 16];
        let y = moe_forward(&spec, &w, &x, &[1, 0], &[0.25, 1.0]);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        let want = |e: f64, r: f64| r * 0.5 * 8.0 * silu(8.0 * (e + 1.0)) * 8.0;
        assert!((y[0] - want(1.0, 0.25)).abs() < 1e-9);
        assert!((y[8] - want(0.0, 1.0)).abs() < 1e-9);
        let (rel, cos) = compare(&y.iter().map(|&v| v as f32).collect::<Vec<_>>(), &y);
        assert!(rel < 1e-6 && cos > 0.999999);
        let _ = WeightFormat::Bf16;
    }
}
