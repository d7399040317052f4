//! Random layers and steps for tests, examples and benchmarks: fresh data each call unless seeded.

use crate::weights::HostWeights;
use moe_codegen::numerics::{e4m3_from_f32, E2M1_MAX, E4M3_MAX};
use moe_codegen::{Codec, MoeSpec, Packed, ScaleLayout, WeightFormat};
use rand::rngs::SmallRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

/// A seed from the clock, printed by callers so a failure can be replayed.
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
}

fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Random weights drawn directly in the spec's format (no f32 detour, so large layers are cheap):
/// values of size about `1 / sqrt(K)` so that outputs stay O(1). Filled on every core.
pub fn random_weights(spec: &MoeSpec, seed: u64) -> HostWeights {
    // The shared experts' weights after the routed ones, and their gate where they have one.
    let gated = spec.shared_gated();
    let spec = &spec.kernel_spec();
    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    let f = spec.weight_format();
    let a = random_packed(f, e, 2 * i, h, seed, false);
    let b = random_packed(f, e, h, i, seed ^ 0x9e37_79b9_7f4a_7c15, false);
    let mut w =
        HostWeights { w13: a.data, w13_scales: a.scales, w2: b.data, w2_scales: b.scales, ..Default::default() };
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xb1a5);
    let mut draw = |n: usize, scale: f32| (0..n).map(|_| rng.random_range(-scale..scale)).collect::<Vec<f32>>();
    if gated {
        // x . gate of order 1: the sigmoid away from its saturation.
        w.shared_gate = draw(h, 2.0 / (h as f32).sqrt());
    }
    if !spec.has_bias() {
        return w;
    }
    // Biases of the order of the projections they are added to.
    let (b13, b2) = (draw(e * 2 * i, 1.0), draw(e * h, 1.0));
    w.with_bias(b13, b2)
}

/// `tensors` stacked random `[rows, cols]` matrices in `format`: every code uniformly (NaN codes
/// excepted). `wide = false`: scales put values at about `2 / sqrt(cols)`, as a layer wants;
/// `wide = true`: scales drawn over the whole range of their type too (subnormal and huge E8M0
/// and f16 scales, any zero point), for bit-exactness tests of the decoders.
pub fn random_packed(format: WeightFormat, tensors: usize, rows: usize, cols: usize, seed: u64, wide: bool) -> Packed {
    let total = tensors * rows;
    let amp = 2.0 / (cols as f32).sqrt();
    let mut data = vec![0u8; format.data_bytes(total, cols)];
    let row_bytes = format.data_bytes(1, cols).max(1);
    let rows_per = total.div_ceil(threads()).max(1);
    std::thread::scope(|sc| {
        for (n, part) in data.chunks_mut(rows_per * row_bytes).enumerate() {
            sc.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(n as u64 * 7919));
                match format.codec() {
                    Codec::Bf16 => part.chunks_exact_mut(2).for_each(|b| {
                        b.copy_from_slice(&half::bf16::from_f32(rng.random_range(-amp..amp)).to_le_bytes())
                    }),
                    Codec::Fp16 => part.chunks_exact_mut(2).for_each(|b| {
                        b.copy_from_slice(&half::f16::from_f32(rng.random_range(-amp..amp)).to_le_bytes())
                    }),
                    // Any finite e4m3 code (0x7f / 0xff are NaN).
                    Codec::E4m3 => part.iter_mut().for_each(|b| *b = finite_e4m3(&mut rng)),
                    // Every INT8, INT4 and e2m1 code is a value.
                    Codec::Int8 | Codec::Uint4 | Codec::E2m1 => rng.fill(part),
                }
            });
        }
    });
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5bd1_e995);
    let u = |rng: &mut SmallRng| rng.random_range(0.5f32..2.0);
    let qmax = match format.codec() {
        Codec::E4m3 => E4M3_MAX,
        Codec::Int8 => 127.0,
        Codec::E2m1 => E2M1_MAX,
        _ => 8.0,
    };
    let layout = format.scale_layout();
    let count = |group: u32| if group == 0 { total } else { total * (cols / group as usize) };
    let scales: Vec<u8> = match layout {
        ScaleLayout::None => vec![],
        ScaleLayout::RowF32 => (0..total).flat_map(|_| (amp / qmax * u(&mut rng)).to_le_bytes()).collect(),
        ScaleLayout::Block128F32 => {
            let n = format.scale_bytes(tensors, rows, cols) / 4;
            (0..n).flat_map(|_| (amp / qmax * u(&mut rng)).to_le_bytes()).collect()
        }
        ScaleLayout::E8m0 { group } => {
            let centre = 127 + (amp / qmax).log2().round() as i32;
            (0..count(group))
                .map(|_| if wide { rng.random_range(0..=254u8) } else { (centre + rng.random_range(-1..=1)) as u8 })
                .collect()
        }
        ScaleLayout::GroupF16 { group } => (0..count(group))
            .flat_map(|_| {
                if wide { finite_f16(&mut rng) } else { half::f16::from_f32(amp / qmax * u(&mut rng)) }.to_le_bytes()
            })
            .collect(),
        ScaleLayout::GroupF16Zero { group } => (0..count(group))
            .flat_map(|_| {
                let s = if wide { finite_f16(&mut rng) } else { half::f16::from_f32(amp / qmax * u(&mut rng)) };
                (s.to_bits() as u32 | (rng.random_range(0..16u32) << 16)).to_le_bytes()
            })
            .collect(),
        ScaleLayout::Nvfp4 => {
            // Block scales near 64 and a global that maps 6 * 64 to `amp`.
            let mut out: Vec<u8> = (0..tensors)
                .flat_map(|_| {
                    let g = if wide { rng.random_range(1e-6f32..1e3) } else { amp / (E2M1_MAX * 64.0) * u(&mut rng) };
                    g.to_le_bytes()
                })
                .collect();
            out.extend((0..total * cols / 16).map(|_| {
                if wide {
                    finite_e4m3(&mut rng)
                } else {
                    e4m3_from_f32(64.0 * u(&mut rng))
                }
            }));
            out
        }
    };
    debug_assert_eq!(scales.len(), format.scale_bytes(tensors, rows, cols));
    Packed { rows: total, cols, tensors, data, scales }
}

fn finite_e4m3(rng: &mut SmallRng) -> u8 {
    loop {
        let c: u8 = rng.random();
        if c & 0x7f != 0x7f {
            return c;
        }
    }
}

/// Any finite f16, subnormals included.
fn finite_f16(rng: &mut SmallRng) -> half::f16 {
    loop {
        let h = half::f16::from_bits(rng.random());
        if h.is_finite() {
            return h;
        }
    }
}

/// Random f32 weights `(w13 [E, 2I, H], w2 [E, H, I])`, uniform in `±2 / sqrt(K)`, drawn on
/// every core: the "original" weights a quantized layer approximates.
pub fn random_f32_weights(spec: &MoeSpec, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    (random_f32(e * 2 * i * h, h, seed), random_f32(e * h * i, i, seed ^ 0x2545_f491_4f6c_dd1d))
}

fn random_f32(n: usize, k: usize, seed: u64) -> Vec<f32> {
    let amp = 2.0 / (k as f32).sqrt();
    let mut v = vec![0f32; n];
    let per = n.div_ceil(threads()).max(1);
    std::thread::scope(|sc| {
        for (c, part) in v.chunks_mut(per).enumerate() {
            sc.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(c as u64 * 104_729));
                part.iter_mut().for_each(|x| *x = rng.random_range(-amp..amp));
            });
        }
    });
    v
}

/// One decode step: `x [M, H]` (as f32 values exactly representable in the activation dtype),
/// `ids [M, k]` with k distinct experts per token, `weights [M, k]` positive, summing to 1.
/// `skew` in [0, 1): probability that a slot is drawn from the first eighth of the experts.
pub fn random_step(spec: &MoeSpec, m: usize, skew: f64, seed: u64) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (h, k, e) = (spec.hidden() as usize, spec.top_k() as usize, spec.experts() as usize);
    let x = (0..m * h).map(|_| spec.act_dtype().round(rng.random_range(-1.0f32..1.0))).collect();
    let hot = (e / 8).max(k);
    let mut ids = Vec::with_capacity(m * k);
    let mut weights = Vec::with_capacity(m * k);
    for _ in 0..m {
        let pool = if rng.random_bool(skew) { hot } else { e };
        ids.extend(sample(&mut rng, pool, k).into_iter().map(|v| v as i32));
        let w: Vec<f32> = (0..k).map(|_| rng.random_range(0.1f32..1.0)).collect();
        let sum: f32 = w.iter().sum();
        weights.extend(w.iter().map(|v| v / sum));
    }
    (x, ids, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_packed_matches_the_layout_and_decodes_to_finite_values() {
        for f in WeightFormat::ALL {
            for wide in [false, true] {
                let p = random_packed(f, 2, 128, 256, 7, wide);
                assert_eq!(p.data.len(), f.data_bytes(256, 256), "{f}");
                assert_eq!(p.scales.len(), f.scale_bytes(2, 128, 256), "{f}");
                let d = f.dequantize(&p);
                assert_eq!(d.len(), 256 * 256);
                if !wide {
                    let rms = (d.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d.len() as f64).sqrt();
                    assert!(d.iter().all(|v| v.is_finite()), "{f}");
                    // Values of the order of 2 / sqrt(256) = 0.125.
                    assert!(rms > 0.01 && rms < 0.5, "{f}: rms {rms}");
                }
            }
        }
    }
}
