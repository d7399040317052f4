//! Expert parallelism over the GPUs of one host, one thread per rank: dispatch, combine and
//! their round trip alone (no expert runs), and the whole layer against one GPU running every
//! expert on the same tokens per GPU, measured in the same run. Every step is a CUDA graph,
//! replayed back to back on every rank (the transfers pair the ranks up); a row's time is the
//! slowest rank's median over five batches of replays.
//!
//! `cargo bench --bench ep -- [--ranks N] [--geometries qwen3-30b-a3b,deepseek-v3]
//!  [--tokens 1,8,128,1024,4096] [--layer-tokens 4096] [--fp8-dispatch] [--kernels] [--shared N]
//!  [--shared-apart N|none] [--split-own N|none] [--report FILE]`

use half::bf16;
use moeforge::runtime::cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use moeforge::runtime::cudarc::driver::{CudaContext, CudaGraph, CudaStream};
use moeforge::runtime::ep::{Comm, EpConfig, EpLayer, ExpertMap, UniqueId};
use moeforge::runtime::testing::random_step;
use moeforge::runtime::{timing, Device, DeviceWeights, MoeLayer};
use moeforge::MoeSpec;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

const GEOMETRIES: [(&str, u32, u32, u32, u32); 2] =
    [("qwen3-30b-a3b", 2048, 768, 128, 8), ("deepseek-v3", 7168, 2048, 256, 8)];
const REPLAYS: usize = 20;
const WARMUP: usize = 50;

fn list<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<Vec<T>> {
    let i = args.iter().position(|a| a == flag)?;
    Some(args.get(i + 1)?.split(',').filter_map(|v| v.parse().ok()).collect())
}

/// bf16 weights of `experts` experts filled on the device from one random 64 MiB block (the
/// values only need to be realistic for the tensor cores' power draw).
fn device_weights(s: &Arc<CudaStream>, spec: &MoeSpec, seed: u64) -> DeviceWeights {
    let mut rng = SmallRng::seed_from_u64(seed);
    // bf16 codes are the format's code bytes: little-endian bits.
    let block: Vec<u8> =
        (0..32 << 20).flat_map(|_| bf16::from_f32(rng.random_range(-0.03f32..0.03)).to_bits().to_le_bytes()).collect();
    let fill = |elems: usize| {
        let bytes = elems * 2;
        let mut d = s.alloc_zeros::<u8>(bytes).unwrap();
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(block.len());
            s.memcpy_htod(&block[..n], &mut d.slice_mut(at..at + n)).unwrap();
            at += n;
        }
        s.synchronize().unwrap();
        d
    };
    // The shared experts (plain, ungated) after the routed ones.
    let spec = &spec.kernel_spec();
    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    DeviceWeights {
        w13: fill(e * 2 * i * h),
        w13_scales: None,
        w2: fill(e * h * i),
        w2_scales: None,
        bias: None,
        shared_gate: None,
    }
}

/// Median microseconds of one replay: five batches of `REPLAYS` back-to-back replays after
/// `WARMUP` replays.
fn time(s: &Arc<CudaStream>, g: &CudaGraph) -> f64 {
    // Warm-up (clocks ramp up from idle). A fixed count: every rank must replay as many times,
    // each replay's transfers pairing with the peers'.
    for _ in 0..WARMUP {
        g.launch().unwrap();
    }
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            for _ in 0..REPLAYS {
                g.launch().unwrap();
            }
            let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            b.synchronize().unwrap();
            a.elapsed_ms(&b).unwrap() as f64 * 1e3 / REPLAYS as f64
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[2]
}

fn capture(s: &Arc<CudaStream>, f: impl FnOnce()) -> CudaGraph {
    s.synchronize().unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    f();
    s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a graph")
}

/// One GPU running every expert: microseconds per step at each token count.
fn one_gpu(spec: &MoeSpec, tokens: &[usize]) -> Vec<f64> {
    let dev = Device::new(0).unwrap();
    let s = dev.stream().clone();
    let layer = MoeLayer::load(&dev, *spec, device_weights(&s, spec, 1)).unwrap();
    tokens
        .iter()
        .map(|&m| {
            layer.reserve(m).unwrap();
            let (x, ids, rw) = random_step(spec, m, 0.0, 3);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let (dx, di, dw) = (s.clone_htod(&xb).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&rw).unwrap());
            let mut y = s.alloc_zeros::<bf16>(xb.len()).unwrap();
            let g = capture(&s, || layer.forward(&dx, &di, &dw, &mut y).unwrap());
            time(&s, &g)
        })
        .collect()
}

/// Per token count: (dispatch, combine, round trip, layer, layer launched eagerly, the layer's
/// kernels without its transfers, this rank's experts on its own tokens alone, on twice as many
/// in one launch, the exchange's own kernels alone, the step's kernels without transfers with only
/// the own tokens' experts, with only the received slabs') microseconds on this rank; whether its
/// transfers ran on the copy engines.
fn rank(
    r: usize,
    n: usize,
    id: &UniqueId,
    spec: &MoeSpec,
    tokens: &[usize],
    layer_tokens: &[usize],
    options: EpConfig,
) -> (Vec<[f64; 11]>, bool) {
    let dev = Device::new(r).unwrap();
    let comm = Comm::new(&dev, r, n, id, Duration::from_secs(120)).unwrap();
    let map = ExpertMap::contiguous(spec.experts(), n).unwrap();
    let s = dev.stream().clone();
    let mut local = MoeSpec::builder(spec.hidden(), spec.intermediate(), map.count(r), spec.top_k()).build().unwrap();
    if spec.shared_experts() > 0 {
        local = local.with_shared_experts(spec.shared_experts(), false).unwrap();
    }
    let w = device_weights(&s, &local, 2 + r as u64);
    let max = *tokens.iter().max().unwrap();
    let cfg = EpConfig { max_tokens: max, ..options };
    let mut layer = EpLayer::new(&dev, comm, *spec, map.clone(), w, cfg).unwrap();
    let on_copy_engines = layer.copy_engines();
    let times = tokens
        .iter()
        .map(|&m| {
            let (x, ids, rw) = random_step(spec, m, 0.0, 10 + r as u64);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let (dx, di, dw) = (s.clone_htod(&xb).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&rw).unwrap());
            let mut y = s.alloc_zeros::<bf16>(xb.len()).unwrap();
            // Warm: the first step sets up the NCCL connections.
            layer.forward(&dx, &di, &dw, &mut y).unwrap();
            layer.synchronize().unwrap();
            // This rank's experts alone on `tokens` tokens of fresh routing: one launch of the local
            // layer (its own tokens: m; its own and a peer's in one launch: 2m). Before any
            // capture: `reserve` may move the local layer's buffers.
            let local_alone = |tokens: usize| {
                let (x, ids, rw) = random_step(spec, tokens, 0.0, 20 + r as u64);
                let local_ids: Vec<i32> = ids
                    .iter()
                    .map(|&e| if map.owner(e as u32) == r { map.local_index(e as u32) as i32 } else { -1 })
                    .collect();
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let (dx, dl, dw) =
                    (s.clone_htod(&xb).unwrap(), s.clone_htod(&local_ids).unwrap(), s.clone_htod(&rw).unwrap());
                let mut y2 = s.alloc_zeros::<bf16>(xb.len()).unwrap();
                layer.local_layer().reserve(tokens).unwrap();
                let g = capture(&s, || layer.local_layer().forward(&dx, &dl, &dw, &mut y2).unwrap());
                let t = time(&s, &g);
                s.synchronize().unwrap();
                t
            };
            let own_only = layer_tokens.contains(&m).then(|| (local_alone(m), local_alone(2 * m)));
            layer.set_exchange_only(true);
            let xt = || moeforge::runtime::DeviceTensor::new(&dx, &s);
            let dispatch = capture(&s, || {
                layer
                    .dispatch_send(
                        xt(),
                        moeforge::runtime::DeviceTensor::new(&di, &s),
                        moeforge::runtime::DeviceTensor::new(&dw, &s),
                    )
                    .unwrap();
                layer.run_local_experts(xt()).unwrap();
                layer.dispatch_recv().unwrap();
            });
            let combine = capture(&s, || {
                layer.combine_send().unwrap();
                layer.combine_recv(moeforge::runtime::DeviceTensorMut::new(&mut y, &s)).unwrap();
            });
            let round_trip = capture(&s, || layer.forward(&dx, &di, &dw, &mut y).unwrap());
            layer.set_exchange_only(false);
            let full = layer_tokens.contains(&m).then(|| capture(&s, || layer.forward(&dx, &di, &dw, &mut y).unwrap()));
            let mut variant = |no_transfers: bool, exchange_only: bool| {
                layer.set_no_transfers(no_transfers);
                layer.set_exchange_only(exchange_only);
                let g = capture(&s, || layer.forward(&dx, &di, &dw, &mut y).unwrap());
                layer.set_no_transfers(false);
                layer.set_exchange_only(false);
                g
            };
            let (kernels_only, ep_kernels) = if layer_tokens.contains(&m) {
                (Some(variant(true, false)), Some(variant(true, true)))
            } else {
                (None, None)
            };
            // The step's kernels without transfers, with only the own tokens' experts, then only the
            // received slabs'.
            let mut one_side = |own: bool| {
                layer.set_no_transfers(true);
                layer.set_skip_experts(!own, own);
                let g = capture(&s, || layer.forward(&dx, &di, &dw, &mut y).unwrap());
                layer.set_no_transfers(false);
                layer.set_skip_experts(false, false);
                g
            };
            let sides = layer_tokens.contains(&m).then(|| (one_side(true), one_side(false)));
            let mut t = [
                time(&s, &dispatch),
                time(&s, &combine),
                time(&s, &round_trip),
                full.map_or(0.0, |g| time(&s, &g)),
                0.0,
                kernels_only.map_or(0.0, |g| time(&s, &g)),
                own_only.map_or(0.0, |t| t.0),
                own_only.map_or(0.0, |t| t.1),
                ep_kernels.map_or(0.0, |g| time(&s, &g)),
                sides.as_ref().map_or(0.0, |g| time(&s, &g.0)),
                sides.as_ref().map_or(0.0, |g| time(&s, &g.1)),
            ];
            if layer_tokens.contains(&m) {
                // The same step launched from the host each time (no graph): the streams' priorities
                // apply as set, which a graph's nodes may not keep.
                let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                for _ in 0..REPLAYS {
                    layer.forward(&dx, &di, &dw, &mut y).unwrap();
                }
                let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                layer.synchronize().unwrap();
                t[4] = a.elapsed_ms(&b).unwrap() as f64 * 1e3 / REPLAYS as f64;
            }
            layer.synchronize().unwrap();
            t
        })
        .collect();
    (times, on_copy_engines)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let report = args.iter().position(|a| a == "--report").and_then(|i| args.get(i + 1)).cloned();
    let devices = CudaContext::device_count().unwrap_or(0) as usize;
    let n = list(&args, "--ranks").and_then(|v: Vec<usize>| v.first().copied()).unwrap_or(devices.min(2));
    if n < 2 || n > devices {
        eprintln!("the ep bench needs at least 2 GPUs ({n} ranks asked, {devices} GPUs found)");
        std::process::exit(1);
    }
    let geos: Vec<String> = list(&args, "--geometries").unwrap_or(GEOMETRIES.iter().map(|g| g.0.to_string()).collect());
    let tokens: Vec<usize> = list(&args, "--tokens").unwrap_or(vec![1, 8, 128, 1024, 4096]);
    // `--layer-tokens none`: no whole-layer rows (and no one-GPU baseline).
    let layer_tokens: Vec<usize> = list(&args, "--layer-tokens").unwrap_or(vec![4096]);
    // `--fp8-dispatch`: tokens travel to their peers in e4m3 (EpConfig::fp8_dispatch).
    let fp8_dispatch = args.iter().any(|a| a == "--fp8-dispatch");
    // `--kernels`: a send and a receive per peer on NCCL's kernels (EpConfig::copy_engines off).
    let copy_engines = !args.iter().any(|a| a == "--kernels");
    // Every option but the bound, which each geometry's rank sets from its token counts.
    // `--shared-apart N|none`: the shared experts in a launch of their own from N tokens
    // (EpConfig::shared_apart_tokens).
    let shared_apart_tokens = match args.iter().position(|a| a == "--shared-apart").and_then(|i| args.get(i + 1)) {
        Some(v) if v == "none" => None,
        Some(v) => Some(v.parse().unwrap_or_else(|_| panic!("--shared-apart {v}: a token count or none"))),
        None => EpConfig::new(1).shared_apart_tokens,
    };
    // `--split-own N|none`: the own tokens' launch split around the peers' slabs from N tokens
    // (EpConfig::split_own_tokens).
    let split_own_tokens = match args.iter().position(|a| a == "--split-own").and_then(|i| args.get(i + 1)) {
        Some(v) if v == "none" => None,
        Some(v) => Some(v.parse().unwrap_or_else(|_| panic!("--split-own {v}: a token count or none"))),
        None => EpConfig::new(1).split_own_tokens,
    };
    let options = EpConfig { fp8_dispatch, copy_engines, shared_apart_tokens, split_own_tokens, ..EpConfig::new(1) };
    // `--shared N`: the layer with N shared experts (weight 1), every rank holding them.
    let shared: u32 = list(&args, "--shared").and_then(|v: Vec<u32>| v.first().copied()).unwrap_or(0);
    // NCCL's environment as this run had it (NCCL_GRAPH_MIXING_SUPPORT changes graph replays).
    let mut nccl_env: Vec<String> =
        std::env::vars().filter(|(k, _)| k.starts_with("NCCL_")).map(|(k, v)| format!("{k}={v}")).collect();
    nccl_env.sort();
    let nccl_env = nccl_env.join(" ");
    let device = Device::new(0).unwrap().name();
    let date = timing::today();
    let mut out = report
        .as_ref()
        .map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap_or_else(|e| panic!("{p}: {e}")));
    for (geo, h, i, e, k) in GEOMETRIES {
        if !geos.iter().any(|g| g == geo) {
            continue;
        }
        let mut spec = MoeSpec::builder(h, i, e, k).build().unwrap();
        if shared > 0 {
            spec = spec.with_shared_experts(shared, false).unwrap();
        }
        let single = if layer_tokens.is_empty() { Vec::new() } else { one_gpu(&spec, &layer_tokens) };
        let id = UniqueId::new().unwrap();
        let all: Vec<usize> = tokens
            .iter()
            .chain(&layer_tokens)
            .copied()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let per_rank: Vec<(Vec<[f64; 11]>, bool)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    sc.spawn({
                        let (id, spec, all, layer_tokens) = (&id, &spec, &all, &layer_tokens);
                        move || rank(r, n, id, spec, all, layer_tokens, options)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (ti, &m) in all.iter().enumerate() {
            let slowest = |kind: usize| per_rank.iter().map(|t| t.0[ti][kind]).fold(0.0, f64::max);
            let transport = if per_rank.iter().all(|t| t.1) { "copy_engines" } else { "kernels" };
            let mut rows = Vec::new();
            if tokens.contains(&m) {
                for (kind, name) in [(0, "dispatch"), (1, "combine"), (2, "round_trip")] {
                    rows.push((name, slowest(kind), None));
                }
            }
            if let Some(li) = layer_tokens.iter().position(|&l| l == m) {
                let t = slowest(3);
                rows.push(("layer", t, Some((single[li], n as f64 * single[li] / t))));
            }
            for (kind, us, layer) in rows {
                let mut row = serde_json::json!({
                    "kind": kind, "geometry": geo, "format": "bf16", "tokens_per_rank": m, "ranks": n,
                    "median_us": (us * 1000.0).round() / 1000.0, "hidden": h, "experts": e, "top_k": k,
                    "nccl_env": nccl_env, "dispatch_dtype": if fp8_dispatch { "e4m3" } else { "bf16" },
                    "transport": transport, "shared_experts": shared,
                    "shared_apart_tokens": if shared > 0 { serde_json::json!(shared_apart_tokens) } else { serde_json::Value::Null },
                    "split_own_tokens": split_own_tokens,
                    "device": device, "date": date,
                });
                let mut line = format!("{geo} {kind:<10} m={m:<5} ranks={n} {transport}: {us:9.1} us");
                if let Some((one, speedup)) = layer {
                    row["one_gpu_us"] = serde_json::json!((one * 1000.0).round() / 1000.0);
                    row["speedup_vs_1gpu"] = serde_json::json!((speedup * 1000.0).round() / 1000.0);
                    row["kernels_without_transfers_us"] = serde_json::json!((slowest(5) * 1000.0).round() / 1000.0);
                    row["own_tokens_only_us"] = serde_json::json!((slowest(6) * 1000.0).round() / 1000.0);
                    row["twice_the_tokens_in_one_launch_us"] =
                        serde_json::json!((slowest(7) * 1000.0).round() / 1000.0);
                    row["exchange_kernels_only_us"] = serde_json::json!((slowest(8) * 1000.0).round() / 1000.0);
                    row["without_transfers_own_experts_only_us"] =
                        serde_json::json!((slowest(9) * 1000.0).round() / 1000.0);
                    row["without_transfers_received_experts_only_us"] =
                        serde_json::json!((slowest(10) * 1000.0).round() / 1000.0);
                    line += &format!(
                        "  (one GPU {one:.1} us: {speedup:.2}x the throughput; launched eagerly {:.1} us; without \
                         transfers {:.1} us; own tokens alone {:.1} us; twice \
                         as many in one launch {:.1} us; exchange kernels alone {:.1} us; without transfers, \
                         own experts only {:.1} us, received experts only {:.1} us)",
                        slowest(4),
                        slowest(5),
                        slowest(6),
                        slowest(7),
                        slowest(8),
                        slowest(9),
                        slowest(10)
                    );
                }
                println!("{line}");
                if let Some(f) = out.as_mut() {
                    use std::io::Write;
                    writeln!(f, "{row}").unwrap();
                }
            }
        }
    }
}
