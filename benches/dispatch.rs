//! The dispatcher's regret: for each step, the time of the family the dispatcher ran against the
//! best family found by timing every candidate in the same run.
//!
//! `cargo bench --bench dispatch -- [--report FILE] [--geometries qwen3-30b-a3b,...] [--formats
//! bf16,...] [--ms 1,2,4,...] [--routings uniform,skewed,balanced] [--profile] [--overhead US]
//! [--planes D0,DE,DP,G0,GE,GP[,F0,FE,FP]] [--decode-max 64] [--isolate]`
//!
//! Each case times, as graph replays of four steps with fresh routing each (so the touched
//! experts change and weights do not sit in L2 from one step to the next), warp decode alone
//! (up to `--decode-max` tokens), the grouped GEMMs alone, the dispatched layer (`forward` with the
//! dispatcher's models) and today's default before the dispatcher (the fixed 16-token threshold,
//! taken from the first two). `--profile` first fits the models on this device
//! (`moe_runtime::dispatch::profile`, as `moe-jit profile` does) and dispatches with them; without
//! it the analytic fallback (or a saved profile) dispatches. `--overhead US` overrides what the
//! models take device dispatch to cost (0: free; the host still settles a step whose family is
//! within its margin of the device's at every routing it weighs).
//! `--planes D0,DE,DP,G0,GE,GP` dispatches with hand-set models of warp decode and the grouped
//! GEMMs (c0, per expert, per pair; no fused family), such as `0,0,1,0,2,0`, which leave most
//! steps of 2 to 15 tokens to the device: the rows then show what choosing there costs
//! (`chosen_us` against the chosen family's own time). Three more numbers model the fused family
//! too: `0,1,0.45` puts it on the device's menu (it wins where a step's distinct experts are 45 to
//! 55% of its pairs) without taking most steps. Routing: uniform; skewed
//! (each token's experts from the first eighth of the experts with probability 0.85); balanced
//! (token t takes experts t k .. t k + k - 1 modulo E). Rows: `geometry`, `format`, `routing`,
//! `m`, `chosen`, `chosen_us`, `best`, `best_us`, `regret_pct`, `default_us`, `vs_default_pct`,
//! `pct_of_copy` (the dispatched step's bytes: touched experts' weights once, x, y, routing,
//! against the copy bandwidth measured in the same run), `model`, device, date.

use moe_runtime::cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use moe_runtime::dispatch::{DispatchModel, LinearCost, ModelSource};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::{self, capture, copy_gbps, time_graph};
use moe_runtime::{Device, MoeLayer, DEFAULT_PREFILL_THRESHOLD};
use moeforge::codegen::{KernelFamily, MoeSpec, WeightFormat, REFERENCE_GEOMETRIES};
use std::sync::Arc;

type Bf = half::bf16;

/// Steps per graph: consecutive steps touch different experts.
const STEPS: usize = 4;

/// One step's device inputs and host routing.
struct Step {
    x: CudaSlice<Bf>,
    ids: CudaSlice<i32>,
    w: CudaSlice<f32>,
    host_ids: Vec<i32>,
}

/// How a case runs: one family, or the dispatcher with a model.
#[derive(Clone, Copy)]
enum Run {
    Family(KernelFamily),
    Dispatched(DispatchModel),
}

fn list<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<Vec<T>> {
    let i = args.iter().position(|a| a == flag)?;
    Some(args.get(i + 1)?.split(',').filter_map(|v| v.parse().ok()).collect())
}

/// `STEPS` steps of `m` tokens with the routing `routing` (`uniform`, `skewed`, `balanced`, or a
/// skew in [0, 1], or `few`: every token on the same top_k experts).
fn steps(layer: &MoeLayer, spec: &MoeSpec, m: usize, routing: &str) -> Vec<Step> {
    let s = layer.stream();
    let (e, k) = (spec.experts() as usize, spec.top_k() as usize);
    (0..STEPS)
        .map(|j| {
            let skew = match routing {
                "skewed" => 0.85,
                r => r.parse().unwrap_or(0.0),
            };
            let (x, mut ids, rw) = random_step(spec, m, skew, fresh_seed());
            match routing {
                "balanced" => ids.iter_mut().enumerate().for_each(|(p, id)| *id = ((p + j * k) % e) as i32),
                "few" => ids.iter_mut().enumerate().for_each(|(p, id)| *id = ((p % k + j * k) % e) as i32),
                _ => {}
            }
            Step {
                x: s.clone_htod(&x.iter().map(|&v| Bf::from_f32(v)).collect::<Vec<_>>()).unwrap(),
                ids: s.clone_htod(&ids).unwrap(),
                w: s.clone_htod(&rw).unwrap(),
                host_ids: ids,
            }
        })
        .collect()
}

fn configure(layer: &mut MoeLayer, run: Run) {
    match run {
        Run::Family(KernelFamily::GroupedGemm) => layer.set_prefill_threshold(1),
        Run::Family(_) => layer.set_prefill_threshold(usize::MAX),
        Run::Dispatched(model) => {
            layer.set_prefill_threshold(DEFAULT_PREFILL_THRESHOLD);
            layer.set_dispatch_model(Some(model));
        }
    }
}

/// A case's graph of `STEPS` steps run as `run` says, and the families the steps ran (read back
/// after one eager run of each).
fn prepare(layer: &mut MoeLayer, run: Run, steps: &[Step], y: &mut CudaSlice<Bf>) -> (CudaGraph, Vec<KernelFamily>) {
    configure(layer, run);
    let m = y.len() / layer.spec().hidden() as usize;
    layer.reserve(m).unwrap();
    let s = layer.stream().clone();
    // `--isolate`: a 4-byte memset before each step, as another layer's kernels would sit there, so
    // no step overlaps the one before it (programmatic dependent launch chains back-to-back steps).
    let isolate = std::env::args().any(|a| a == "--isolate");
    let mut fence = s.alloc_zeros::<u8>(4).unwrap();
    let g = capture(&s, || {
        steps.iter().try_for_each(|st| {
            if isolate {
                s.memset_zeros(&mut fence)?;
            }
            forward(layer, run, st, y)
        })
    })
    .unwrap();
    let families = steps
        .iter()
        .map(|st| {
            forward(layer, run, st, y).unwrap();
            layer.last_choice().unwrap().family
        })
        .collect();
    (g, families)
}

/// One step as `run` says: the family named, or the layer's own choice.
fn forward(layer: &MoeLayer, run: Run, st: &Step, y: &mut CudaSlice<Bf>) -> moe_runtime::Result<()> {
    match run {
        Run::Family(f) => layer.forward_family(f, &st.x, &st.ids, &st.w, y),
        Run::Dispatched(_) => layer.forward(&st.x, &st.ids, &st.w, y),
    }
}

/// Median microseconds per step of each graph: three interleaved rounds (clocks drift between
/// back-to-back measurements of the same code by several percent at large M), the median of each
/// graph's round medians.
fn time_all(s: &Arc<CudaStream>, graphs: &[&CudaGraph], m: usize) -> Vec<f64> {
    let reps = if m >= 4096 { 10 } else { 30 };
    let mut t = vec![Vec::new(); graphs.len()];
    for _ in 0..3 {
        for (g, t) in graphs.iter().zip(&mut t) {
            t.push(time_graph(s, g, reps).unwrap() / STEPS as f64);
        }
    }
    t.into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[1]
        })
        .collect()
}

fn distinct(ids: &[i32]) -> u32 {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    v.len() as u32
}

/// `--fused-tiles`: the fused family alone with each set of tiles (warps, bi, ntok, max_tokens,
/// depth, prefetch 0 / 1, codes a lane, and optionally the down split, 1 or 2), every M and routing, printed (no report rows).
fn fused_sweep(
    dev: &Device,
    layer: &mut MoeLayer,
    spec: &MoeSpec,
    sets: &[Vec<u32>],
    ms: &[usize],
    routings: &[String],
    copy: f64,
) {
    let h = spec.hidden() as usize;
    for t in sets {
        let (&[warps, bi, ntok, max_tokens, depth, prefetch, lane_codes], split) = (&t[..t.len().min(7)], t.get(7))
        else {
            panic!("--fused-tiles wants 7 or 8 numbers a set: {t:?}")
        };
        let down_split = split.copied().unwrap_or(moe_codegen::FusedTiles::for_spec(spec).down_split);
        let tiles = moe_codegen::FusedTiles {
            warps,
            bi,
            ntok,
            max_tokens,
            depth,
            prefetch: prefetch != 0,
            lane_codes,
            down_split,
        };
        if let Err(e) = layer.set_fused_tiles(dev, tiles) {
            println!("{tiles:?}: {e}");
            continue;
        }
        for &m in ms {
            let mut y: CudaSlice<Bf> = layer.stream().alloc_zeros(m * h).unwrap();
            for routing in routings {
                let st = steps(layer, spec, m, routing);
                let (g, _) = prepare(layer, Run::Family(KernelFamily::Fused), &st, &mut y);
                let us = time_all(layer.stream(), &[&g], m)[0];
                let bytes: f64 =
                    st.iter().map(|s| (distinct(&s.host_ids) as usize * spec.expert_bytes()) as f64).sum::<f64>()
                        / STEPS as f64;
                let pct = 100.0 * bytes / (us * 1e-6) / 1e9 / copy;
                println!(
                    "fused w{warps} bi{bi} nt{ntok} mt{max_tokens} d{depth} p{prefetch} l{lane_codes} s{down_split} {} {routing:<8} m={m:<4} {us:>8.1} us {pct:>5.1}% of copy",
                    spec.weight_format()
                );
            }
        }
    }
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args: Vec<String> = std::env::args().collect();
    let report = args.iter().position(|a| a == "--report").and_then(|i| args.get(i + 1)).cloned();
    let geos: Vec<String> = list(&args, "--geometries").unwrap_or(vec!["qwen3-30b-a3b".into()]);
    let formats: Vec<WeightFormat> = list(&args, "--formats").unwrap_or(vec![WeightFormat::Bf16]);
    let ms: Vec<usize> = list(&args, "--ms").unwrap_or((0..13).map(|p| 1 << p).collect());
    let routings: Vec<String> =
        list(&args, "--routings").unwrap_or(vec!["uniform".into(), "skewed".into(), "balanced".into()]);
    let decode_max = list::<usize>(&args, "--decode-max").and_then(|v| v.first().copied()).unwrap_or(64);
    // `--fused-tiles warps,bi,ntok,max_tokens,depth,prefetch,lane_codes[,down_split][;...]`: only the fused family, with each set.
    let fused_tiles: Vec<Vec<u32>> = args
        .iter()
        .position(|a| a == "--fused-tiles")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(';').map(|t| t.split(',').filter_map(|n| n.parse().ok()).collect()).collect())
        .unwrap_or_default();
    // The fused family is timed up to this many tokens (`--fused-max`).
    let fused_max = list::<usize>(&args, "--fused-max").and_then(|v| v.first().copied()).unwrap_or(256);
    let profiled = args.iter().any(|a| a == "--profile");
    let dev = Device::new(0).unwrap_or_else(|e| {
        eprintln!("dispatch bench needs an NVIDIA GPU: {e}");
        std::process::exit(1);
    });
    let copy = copy_gbps(dev.stream()).unwrap();
    println!("{}: device-to-device copy {copy:.0} GB/s", dev.name());
    let mut out = report
        .as_ref()
        .map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap_or_else(|e| panic!("{p}: {e}")));
    let mut regrets = Vec::new();
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        if !geos.iter().any(|g| g == geo) {
            continue;
        }
        for &format in &formats {
            let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(format).build() else { continue };
            let w = random_weights(&spec, fresh_seed());
            let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
            drop(w);
            layer.set_validate_routing(false);
            if !fused_tiles.is_empty() {
                fused_sweep(&dev, &mut layer, &spec, &fused_tiles, &ms, &routings, copy);
                continue;
            }
            let Some(analytic) = layer.dispatch_model() else {
                println!("{geo} {format}: no grouped family, nothing to dispatch");
                continue;
            };
            let mut model = if profiled {
                let p = moe_runtime::dispatch::profile(&mut layer).unwrap();
                println!(
                    "profile: {:?}, large steps from {:?} ({} samples)",
                    p.model,
                    p.large_step_tokens,
                    p.samples.len()
                );
                if let Some(t) = p.large_step_tokens {
                    layer.set_large_step_tokens(t);
                }
                p.model
            } else {
                analytic
            };
            if let Some(&o) = list::<f32>(&args, "--overhead").as_ref().and_then(|v| v.first()) {
                model.overhead_us = o;
            }
            let mut model_name = match model.source {
                ModelSource::Profile => "profile",
                ModelSource::Analytic => "analytic",
            };
            if let Some(p) = list::<f32>(&args, "--planes") {
                assert!(
                    matches!(p.len(), 6 | 9),
                    "--planes takes decode's, the grouped GEMMs' and optionally the fused family's c0, per expert, per pair"
                );
                let lin = |c: &[f32]| LinearCost { c0: c[0], per_expert: c[1], per_pair: c[2] };
                model = DispatchModel {
                    decode: lin(&p[..3]),
                    grouped: lin(&p[3..6]),
                    fused: (p.len() == 9 && layer.fused_available().is_ok()).then(|| lin(&p[6..])),
                    one_token: None,
                    ..model
                };
                model_name = "planes";
            }
            for &m in &ms {
                let mut y: CudaSlice<Bf> = layer.stream().alloc_zeros(m * h as usize).unwrap();
                for routing in &routings {
                    let st = steps(&layer, &spec, m, routing);
                    let mut runs = vec![Run::Dispatched(model), Run::Family(KernelFamily::GroupedGemm)];
                    let with_decode = m <= decode_max;
                    if with_decode {
                        runs.push(Run::Family(KernelFamily::WarpDecode));
                    }
                    let with_fused = m <= fused_max && layer.fused_available().is_ok();
                    if with_fused {
                        runs.push(Run::Family(KernelFamily::Fused));
                    }
                    let prepared: Vec<(CudaGraph, Vec<KernelFamily>)> =
                        runs.iter().map(|&r| prepare(&mut layer, r, &st, &mut y)).collect();
                    let graphs: Vec<&CudaGraph> = prepared.iter().map(|p| &p.0).collect();
                    let times = time_all(layer.stream(), &graphs, m);
                    let (us, grouped) = (times[0], times[1]);
                    let decode = with_decode.then(|| times[2]);
                    let fused = with_fused.then(|| times[times.len() - 1]);
                    let chosen = &prepared[0].1;
                    let (best, best_us) = [
                        Some((KernelFamily::GroupedGemm, grouped)),
                        decode.map(|d| (KernelFamily::WarpDecode, d)),
                        fused.map(|f| (KernelFamily::Fused, f)),
                    ]
                    .into_iter()
                    .flatten()
                    .fold((KernelFamily::GroupedGemm, f64::INFINITY), |b, c| if c.1 < b.1 { c } else { b });
                    let default_us = if m < DEFAULT_PREFILL_THRESHOLD { decode.unwrap_or(f64::NAN) } else { grouped };
                    let regret = 100.0 * (us / best_us - 1.0);
                    regrets.push(regret);
                    let steps_on = |f: KernelFamily| chosen.iter().filter(|&&c| c == f).count();
                    let (dn, gn, fnn) = (
                        steps_on(KernelFamily::WarpDecode),
                        steps_on(KernelFamily::GroupedGemm),
                        steps_on(KernelFamily::Fused),
                    );
                    let chosen_name = match (dn, gn, fnn) {
                        (_, 0, 0) => "warp_decode".to_string(),
                        (0, _, 0) => "grouped_gemm".to_string(),
                        (0, 0, _) => "fused".to_string(),
                        _ => format!("mixed ({dn} decode, {gn} grouped, {fnn} fused of {STEPS})"),
                    };
                    let bytes: f64 = st
                        .iter()
                        .map(|s| {
                            (distinct(&s.host_ids) as usize * spec.expert_bytes()
                                + 2 * m * h as usize * 2
                                + m * k as usize * 8) as f64
                        })
                        .sum::<f64>()
                        / STEPS as f64;
                    let pct_copy = 100.0 * bytes / (us * 1e-6) / 1e9 / copy;
                    println!(
                        "{geo:<14} {format:<10} {routing:<8} m={m:<5} chosen {chosen_name:<22} {us:>9.1} us  best {:<12} {best_us:>9.1} us  regret {regret:>5.1}%  default {default_us:>9.1} us  {pct_copy:>5.1}% of copy",
                        best.name()
                    );
                    if let Some(f) = out.as_mut() {
                        use std::io::Write;
                        let r2 = |v: f64| {
                            if v.is_finite() {
                                serde_json::json!((v * 100.0).round() / 100.0)
                            } else {
                                serde_json::Value::Null
                            }
                        };
                        let row = serde_json::json!({
                            "device": dev.name(),
                            "date": timing::today(),
                            "geometry": geo,
                            "format": format.name(),
                            "routing": routing,
                            "m": m,
                            "chosen": chosen_name,
                            "chosen_us": r2(us),
                            "best": best.name(),
                            "best_us": r2(best_us),
                            "regret_pct": r2(regret),
                            "grouped_us": r2(grouped),
                            "decode_us": decode.map_or(serde_json::Value::Null, r2),
                            "fused_us": fused.map_or(serde_json::Value::Null, r2),
                            "default_us": r2(default_us),
                            "vs_default_pct": r2(100.0 * (us / default_us - 1.0)),
                            "pct_of_copy": r2(pct_copy),
                            "copy_gbps": r2(copy),
                            "model": model_name,
                            "steps_per_graph": STEPS,
                        });
                        writeln!(f, "{row}").unwrap();
                    }
                }
            }
        }
    }
    if !regrets.is_empty() {
        let mean = regrets.iter().sum::<f64>() / regrets.len() as f64;
        let max = regrets.iter().copied().fold(f64::MIN, f64::max);
        println!("regret over {} cases: mean {mean:.2}%, max {max:.2}%", regrets.len());
    }
}
