//! `moe-jit profile`: fit the dispatcher's models for each spec on GPU 0 and save them under the
//! kernel cache, where `MoeLayer::load` finds them (docs/dispatch.md).

use moe_codegen::MoeSpec;
use moe_runtime::dispatch::{profile as fit_profile, DispatchProfile};
use moe_runtime::{Device, DiskCache, HostWeights, MoeLayer};
use std::process::ExitCode;
use std::time::Instant;

/// Synthetic weights of the spec's shapes, drawn uniformly at about `1 / sqrt(K)` and quantized to
/// its format: timing needs realistic codes (zeros draw less power), not a model's values.
fn weights(spec: &MoeSpec) -> Result<HostWeights, String> {
    let k = spec.kernel_spec();
    let (e, h, i) = (k.experts() as usize, k.hidden() as usize, k.intermediate() as usize);
    let fill = |n: usize, cols: usize, seed: u64| -> Vec<f32> {
        let scale = 2.0 / (cols as f32).sqrt();
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    let mut w = HostWeights::quantize(spec, &fill(e * 2 * i * h, h, 1), &fill(e * h * i, i, 2))
        .map_err(|e| format!("quantizing synthetic weights: {e}"))?;
    if spec.shared_gated() {
        w.shared_gate = fill(h, h, 3);
    }
    if spec.has_bias() {
        w = w.with_bias(fill(e * 2 * i, 1, 4), fill(e * h, 1, 5));
    }
    Ok(w)
}

/// Profile each spec on GPU 0 through `cache`; failure on the first spec that cannot be.
pub fn profile(cache: &DiskCache, specs: &[MoeSpec]) -> ExitCode {
    let dev = match Device::new(0) {
        Ok(d) => d.with_cache(cache.clone()),
        Err(e) => {
            eprintln!("moe-jit profile needs an NVIDIA GPU: {e}");
            return ExitCode::FAILURE;
        }
    };
    for spec in specs {
        let start = Instant::now();
        let result = weights(spec).and_then(|w| {
            let mut layer = MoeLayer::load(&dev, *spec, &w).map_err(|e| e.to_string())?;
            drop(w);
            let loaded = start.elapsed().as_secs_f64();
            let p: DispatchProfile = fit_profile(&mut layer).map_err(|e| e.to_string())?;
            let path = p.save(dev.cache_dir(), spec).map_err(|e| e.to_string())?;
            Ok((p, path, loaded))
        });
        match result {
            Ok((p, path, loaded)) => {
                let m = p.model;
                let fused = m.fused.map_or(String::new(), |f| {
                    format!(", fused {:.2} + {:.3} D + {:.3} P us", f.c0, f.per_expert, f.per_pair)
                });
                let one = m.one_token.map_or(String::new(), |f| format!(", one token: {f}"));
                let one =
                    one + &p.large_step_tokens.map_or(String::new(), |t| format!(", large-step tiles from {t} tokens"));
                println!(
                    "{}: warp decode {:.2} + {:.3} D + {:.3} P us, grouped {:.2} + {:.3} D + {:.3} P us{fused}{one}, device choice {:.1} us; \
                     {} samples in {:.1} s (load {:.1} s) -> {}",
                    spec.id(),
                    m.decode.c0,
                    m.decode.per_expert,
                    m.decode.per_pair,
                    m.grouped.c0,
                    m.grouped.per_expert,
                    m.grouped.per_pair,
                    m.overhead_us,
                    p.samples.len(),
                    start.elapsed().as_secs_f64(),
                    loaded,
                    path.display()
                );
            }
            Err(e) => {
                eprintln!("moe-jit profile {}: {e}", spec.id());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
