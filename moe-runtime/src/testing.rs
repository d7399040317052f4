//! Random layers and steps for tests, examples and benchmarks: fresh data each call unless seeded.

use crate::weights::HostWeights;
use moe_codegen::{MoeSpec, WeightFormat};
use rand::rngs::SmallRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

/// A seed from the clock, printed by callers so a failure can be replayed.
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
}

/// Random weights drawn directly in the spec's format (no f32 detour, so large layers are cheap):
/// values of size about `1 / sqrt(K)` so that outputs stay O(1). Filled on every core.
pub fn random_weights(spec: &MoeSpec, seed: u64) -> HostWeights {
    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    let f = spec.weight_format();
    let (w13, w13_scales) = random_matrix(f, e * 2 * i, h, seed);
    let (w2, w2_scales) = random_matrix(f, e * h, i, seed ^ 0x9e37_79b9_7f4a_7c15);
    HostWeights { w13, w13_scales, w2, w2_scales }
}

fn random_matrix(f: WeightFormat, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let eb = f.elem_bytes() as usize;
    let mut data = vec![0u8; rows * cols * eb];
    let amp = 2.0 / (cols as f32).sqrt();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (n, part) in data.chunks_mut(rows_per * cols * eb).enumerate() {
            sc.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(n as u64 * 7919));
                match f {
                    WeightFormat::Bf16 => part.chunks_exact_mut(2).for_each(|b| {
                        b.copy_from_slice(&half::bf16::from_f32(rng.random_range(-amp..amp)).to_le_bytes())
                    }),
                    WeightFormat::Fp16 => part.chunks_exact_mut(2).for_each(|b| {
                        b.copy_from_slice(&half::f16::from_f32(rng.random_range(-amp..amp)).to_le_bytes())
                    }),
                    // Any finite e4m3 code (0x7f / 0xff are NaN).
                    _ => part.iter_mut().for_each(|b| {
                        *b = loop {
                            let c: u8 = rng.random();
                            if c & 0x7f != 0x7f {
                                break c;
                            }
                        }
                    }),
                }
            });
        }
    });
    let scales = if f.has_row_scales() {
        // e4m3 codes reach 448; scale rows back to the same amplitude as the 16-bit formats.
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5bd1_e995);
        (0..rows).map(|_| amp / 448.0 * rng.random_range(0.5f32..2.0)).collect()
    } else {
        vec![]
    };
    (data, scales)
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
