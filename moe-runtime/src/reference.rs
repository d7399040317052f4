//! The f64 CPU reference of the whole layer given the routing, on the same dequantized weights
//! the kernels read. Every GPU test and the example compare against this one function.

use crate::weights::HostWeights;
use moe_codegen::{MoeSpec, Router};

/// `y[M, H]` in f64. `x` holds the activations as the device sees them (already rounded to the
/// activation dtype); `ids` / `weights` are `[M, k]`. Rows are dequantized only for the experts
/// the step touches. Runs on every core. The weights' biases apply where the spec has them.
pub fn moe_forward(spec: &MoeSpec, w: &HostWeights, x: &[f32], ids: &[i32], weights: &[f32]) -> Vec<f64> {
    let bias = spec.has_bias().then_some((w.w13_bias.as_slice(), w.w2_bias.as_slice()));
    let (ids, weights) = expand_routing(spec, w, x, ids, weights);
    let rows = (|e, r| w.w13_row(spec, e, r), |e, r| w.w2_row(spec, e, r));
    forward_rows(&spec.kernel_spec(), rows.0, rows.1, bias, x, &ids, &weights, |_| {})
}

/// The routing `[M, k]` with the spec's shared experts appended as slots `k .. k + S` naming
/// experts `E .. E + S`, weighted 1 or `sigmoid(x . shared_gate)` (in f64, from `x` as given):
/// what the layer computes with ([`MoeSpec::kernel_spec`]). The routing itself without shared
/// experts.
pub fn expand_routing(
    spec: &MoeSpec,
    w: &HostWeights,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
) -> (Vec<i32>, Vec<f32>) {
    let (s, k, e, h) =
        (spec.shared_experts() as usize, spec.top_k() as usize, spec.experts() as i32, spec.hidden() as usize);
    if s == 0 {
        return (ids.to_vec(), weights.to_vec());
    }
    let m = ids.len() / k;
    let (mut out_ids, mut out_w) = (Vec::with_capacity(m * (k + s)), Vec::with_capacity(m * (k + s)));
    for t in 0..m {
        out_ids.extend_from_slice(&ids[t * k..(t + 1) * k]);
        out_w.extend_from_slice(&weights[t * k..(t + 1) * k]);
        let g = if spec.shared_gated() {
            let d: f64 = x[t * h..(t + 1) * h].iter().zip(&w.shared_gate).map(|(&a, &b)| a as f64 * b as f64).sum();
            (1.0 / (1.0 + (-d).exp())) as f32
        } else {
            1.0
        };
        out_ids.extend((0..s as i32).map(|j| e + j));
        out_w.extend(std::iter::repeat_n(g, s));
    }
    (out_ids, out_w)
}

/// [`moe_forward`] on f32 weights in the spec's layout (`w13 [E, 2I, H]`, `w2 [E, H, I]`), e.g. the
/// original weights a quantized layer approximates.
pub fn moe_forward_f32(spec: &MoeSpec, w13: &[f32], w2: &[f32], x: &[f32], ids: &[i32], weights: &[f32]) -> Vec<f64> {
    let (h, i) = (spec.hidden() as usize, spec.intermediate() as usize);
    let w13_row = |e: usize, r: usize| w13[(e * 2 * i + r) * h..(e * 2 * i + r + 1) * h].to_vec();
    let w2_row = |e: usize, r: usize| w2[(e * h + r) * i..(e * h + r + 1) * i].to_vec();
    moe_forward_rows(spec, w13_row, w2_row, x, ids, weights)
}

/// [`moe_forward`] with the weights given row by row: `w13_row(e, r)` (`r < 2I`) and `w2_row(e, r)`
/// (`r < H`) as f32.
pub fn moe_forward_rows<A, B>(
    spec: &MoeSpec,
    w13_row: A,
    w2_row: B,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
) -> Vec<f64>
where
    A: Fn(usize, usize) -> Vec<f32> + Sync,
    B: Fn(usize, usize) -> Vec<f32> + Sync,
{
    forward_rows(spec, w13_row, w2_row, None, x, ids, weights, |_| {})
}

/// [`moe_forward`] as the grouped family computes it with fp8 weights: x and the intermediate
/// (rounded to the activation dtype first) are quantized to e4m3 before each GEMM, as
/// `moe_quant_x` and GEMM1's epilogue (or `moe_quant_mid`) do: the intermediate with one f32 scale
/// per 128 along K, x with one per token where the weights have per-channel scales
/// ([`moe_codegen::grouped::x_per_token`]), else one per 128 too.
pub fn moe_forward_fp8_acts(spec: &MoeSpec, w: &HostWeights, x: &[f32], ids: &[i32], weights: &[f32]) -> Vec<f64> {
    let x_group = if moe_codegen::grouped::x_per_token(spec) { spec.hidden() as usize } else { 128 };
    let xq = quant_e4m3(x, x_group);
    let act = spec.act_dtype();
    // The shared gate reads x as the device holds it (before the GEMMs' e4m3 copy).
    let (ids, weights) = expand_routing(spec, w, x, ids, weights);
    forward_rows(
        &spec.kernel_spec(),
        |e, r| w.w13_row(spec, e, r),
        |e, r| w.w2_row(spec, e, r),
        spec.has_bias().then_some((w.w13_bias.as_slice(), w.w2_bias.as_slice())),
        &xq,
        &ids,
        &weights,
        |mid| {
            let rounded: Vec<f32> = mid.iter().map(|&v| act.round(v as f32)).collect();
            for (m, q) in mid.iter_mut().zip(quant_e4m3(&rounded, 128)) {
                *m = q as f64;
            }
        },
    )
}

/// Values after e4m3 quantization with one f32 scale (amax / 448) per `group` consecutive values.
pub fn quant_e4m3(v: &[f32], group: usize) -> Vec<f32> {
    use moe_codegen::numerics::{e4m3_from_f32, e4m3_to_f32};
    let mut out = Vec::with_capacity(v.len());
    for b in v.chunks(group) {
        let amax = b.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        let inv = 1.0 / scale;
        out.extend(b.iter().map(|&x| e4m3_to_f32(e4m3_from_f32(x * inv)) * scale));
    }
    out
}

/// The reference with a hook on each pair's intermediate row (`[I]`, f64) before the down GEMM,
/// and `(w13_bias [E, 2I], w2_bias [E, H])` where the experts have biases.
#[allow(clippy::too_many_arguments)]
fn forward_rows<A, B>(
    spec: &MoeSpec,
    w13_row: A,
    w2_row: B,
    bias: Option<(&[f32], &[f32])>,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    mid_hook: impl Fn(&mut [f64]),
) -> Vec<f64>
where
    A: Fn(usize, usize) -> Vec<f32> + Sync,
    B: Fn(usize, usize) -> Vec<f32> + Sync,
{
    let (h, i, k) = (spec.hidden() as usize, spec.intermediate() as usize, spec.top_k() as usize);
    let m = x.len() / h;
    // Pairs p = t * k + s grouped by expert, so each expert row is produced (dequantized) once
    // per step however many tokens the expert serves.
    let mut by_expert: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for (p, &e) in ids.iter().enumerate().take(m * k) {
        by_expert.entry(e as usize).or_default().push(p);
    }
    let experts: Vec<(usize, Vec<usize>)> = by_expert.into_iter().collect();
    let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    const BLOCK: usize = 64;
    // mid[p][n] = act(gate_n . x_t) * (up_n . x_t), jobs of BLOCK neurons of one expert.
    let jobs: Vec<(usize, usize)> =
        (0..experts.len()).flat_map(|j| (0..i).step_by(BLOCK).map(move |n0| (j, n0))).collect();
    let parts = parallel(&jobs, |&(j, n0)| {
        let (e, ps) = (&experts[j].0, &experts[j].1);
        let n1 = (n0 + BLOCK).min(i);
        let mut out = vec![0f64; ps.len() * (n1 - n0)];
        for n in n0..n1 {
            let (g, u) = (w13_row(*e, n), w13_row(*e, i + n));
            let (bg, bu) = bias.map_or((0.0, 0.0), |(b, _)| (b[e * 2 * i + n] as f64, b[e * 2 * i + i + n] as f64));
            for (q, &p) in ps.iter().enumerate() {
                let xt = &xs[(p / k) * h..(p / k + 1) * h];
                out[q * (n1 - n0) + n - n0] = spec.activation().glu(dot(&g, xt) + bg, dot(&u, xt) + bu);
            }
        }
        out
    });
    let mut mid = vec![0f64; m * k * i];
    for (&(j, n0), part) in jobs.iter().zip(&parts) {
        let n1 = (n0 + BLOCK).min(i);
        for (q, &p) in experts[j].1.iter().enumerate() {
            mid[p * i + n0..p * i + n1].copy_from_slice(&part[q * (n1 - n0)..(q + 1) * (n1 - n0)]);
        }
    }
    for row in mid.chunks_mut(i) {
        mid_hook(row);
    }
    // y[t] += weight[p] * (w2 . mid[p]), jobs of BLOCK output rows of one expert.
    let jobs: Vec<(usize, usize)> =
        (0..experts.len()).flat_map(|j| (0..h).step_by(BLOCK).map(move |r0| (j, r0))).collect();
    let parts = parallel(&jobs, |&(j, r0)| {
        let (e, ps) = (&experts[j].0, &experts[j].1);
        let r1 = (r0 + BLOCK).min(h);
        let mut out = vec![0f64; ps.len() * (r1 - r0)];
        for r in r0..r1 {
            let row = w2_row(*e, r);
            let b = bias.map_or(0.0, |(_, b)| b[e * h + r] as f64);
            for (q, &p) in ps.iter().enumerate() {
                out[q * (r1 - r0) + r - r0] = dot(&row, &mid[p * i..(p + 1) * i]) + b;
            }
        }
        out
    });
    let mut y = vec![0f64; m * h];
    for (&(j, r0), part) in jobs.iter().zip(&parts) {
        let r1 = (r0 + BLOCK).min(h);
        for (q, &p) in experts[j].1.iter().enumerate() {
            let (t, wt) = (p / k, weights[p] as f64);
            for (yo, c) in y[t * h + r0..t * h + r1].iter_mut().zip(&part[q * (r1 - r0)..(q + 1) * (r1 - r0)]) {
                *yo += wt * c;
            }
        }
    }
    y
}

/// The router on the CPU: `logits [M, E]` -> `(topk_ids, topk_weights)`, each `[M, k]`. Choice
/// compares f32 scores as the kernel does (ties to the lowest id); weights are computed in f64.
pub fn route(spec: &MoeSpec, logits: &[f32], bias: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let (e, k) = (spec.experts() as usize, spec.top_k() as usize);
    let mut ids = Vec::with_capacity(logits.len() / e * k);
    let mut weights = Vec::with_capacity(ids.capacity());
    // The k best of `score` among `allowed`, ties to the lowest index.
    let top = |score: &[f32], allowed: &dyn Fn(usize) -> bool, n: usize| -> Vec<usize> {
        let mut idx: Vec<usize> = (0..score.len()).filter(|&j| allowed(j)).collect();
        idx.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
        idx.truncate(n);
        idx
    };
    for row in logits.chunks(e) {
        let (chosen, mut w): (Vec<usize>, Vec<f64>) = match spec.router() {
            Router::Softmax { renormalize } => {
                let mx = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                let sum: f64 = row.iter().map(|&v| (v as f64 - mx).exp()).sum();
                let chosen = top(row, &|_| true, k);
                let mut w: Vec<f64> = chosen.iter().map(|&j| (row[j] as f64 - mx).exp() / sum).collect();
                if renormalize {
                    let s: f64 = w.iter().sum();
                    w.iter_mut().for_each(|v| *v /= s);
                }
                (chosen, w)
            }
            Router::GroupLimited(g) => {
                let sig = |v: f32| 1.0 / (1.0 + (-(v as f64)).exp());
                let score: Vec<f32> = row.iter().zip(bias).map(|(&v, &b)| sig(v) as f32 + b).collect();
                let gsize = e / g.groups as usize;
                let gscore: Vec<f32> = score
                    .chunks(gsize)
                    .map(|c| {
                        let mut c = c.to_vec();
                        c.sort_by(|a, b| b.total_cmp(a));
                        c[0] + c[1]
                    })
                    .collect();
                let kept = top(&gscore, &|_| true, g.topk_groups as usize);
                let chosen = top(&score, &|j| kept.contains(&(j / gsize)), k);
                let mut w: Vec<f64> = chosen.iter().map(|&j| sig(row[j])).collect();
                if g.renormalize {
                    let s: f64 = w.iter().sum();
                    w.iter_mut().for_each(|v| *v /= s);
                }
                w.iter_mut().for_each(|v| *v *= g.scaling() as f64);
                (chosen, w)
            }
        };
        ids.extend(chosen.iter().map(|&j| j as i32));
        weights.extend(w.drain(..).map(|v| v as f32));
    }
    (ids, weights)
}

/// `f` over every job on every core, results in job order.
fn parallel<J: Sync, T: Send>(jobs: &[J], f: impl Fn(&J) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(jobs.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<T>> = (0..jobs.len()).map(|_| None).collect();
    let done: Vec<Vec<(usize, T)>> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let j = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(job) = jobs.get(j) else { return mine };
                        mine.push((j, f(job)));
                    }
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("reference thread panicked")).collect()
    });
    for (j, t) in done.into_iter().flatten() {
        out[j] = Some(t);
    }
    out.into_iter().map(|t| t.expect("every job ran")).collect()
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

    #[test]
    fn router_reference_breaks_ties_low_and_limits_groups() {
        let spec = MoeSpec::builder(64, 64, 8, 2).build().unwrap();
        let (ids, w) = route(&spec, &[0.0; 8], &[0.0; 8]);
        assert_eq!(ids, [0, 1]);
        assert!((w[0] - 0.5).abs() < 1e-7);
        let (ids, _) = route(&spec, &[0.0, 3.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0], &[0.0; 8]);
        assert_eq!(ids, [1, 3]);
        // Groups {0,1} {2,3} {4,5} {6,7}; one kept. Group 3 scores highest by its two members
        // even though expert 0 alone is the best.
        let g = Router::GroupLimited(moe_codegen::GroupLimited::new(4, 1, false, 2.0));
        let spec = spec.with_router(g).unwrap();
        let logits = [5.0, -9.0, 0.0, 0.0, 0.0, 0.0, 4.0, 4.0];
        let (ids, w) = route(&spec, &logits, &[0.0; 8]);
        assert_eq!(ids, [6, 7]);
        let sig4 = 1.0 / (1.0 + (-4.0f64).exp());
        assert!((w[0] as f64 - 2.0 * sig4).abs() < 1e-6);
        // The bias steers the choice, not the weight.
        let (ids, w) = route(&spec, &logits, &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]);
        assert_eq!(ids, [7, 6]);
        assert!((w[0] as f64 - 2.0 * sig4).abs() < 1e-6);
    }

    #[test]
    fn fp8_activation_quantization_keeps_block_maxima() {
        let v: Vec<f32> = (0..256).map(|j| (j as f32 - 100.0) / 7.0).collect();
        let q = quant_e4m3(&v, 128);
        assert_eq!(q[0], v[0]);
        assert!((q[255] - v[255]).abs() < 1e-5);
        let (rel, _) = compare(&q, &v.iter().map(|&x| x as f64).collect::<Vec<_>>());
        assert!(rel < 0.05 && rel > 0.0, "{rel}");
        // One group over all of it: the overall maximum stays exact; the others round differently.
        let q = quant_e4m3(&v, 256);
        assert!((q[255] - v[255]).abs() < 1e-5);
        assert_ne!(q, quant_e4m3(&v, 128));
    }
}
