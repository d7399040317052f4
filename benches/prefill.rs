//! Prefill throughput of the whole MoE layer on the grouped-GEMM family: route (from logits),
//! align, GEMM1 + SwiGLU, GEMM2 + routing weight, combine, as one CUDA-graph replay.
//!
//! `cargo bench --bench prefill -- [--report FILE] [--geometries qwen3-30b-a3b,mixtral-8x7b]
//! [--formats bf16,fp8_e4m3] [--ms 64,256] [--atomic]` prints a table and appends one JSON
//! object per row to FILE. TFLOP/s counts 2 * M * top_k * 3 * H * I. The ceiling, measured in the
//! same run, is a dense bf16 8192^3 matmul through cuBLAS. Uniform routing draws each token's
//! experts at random; skewed routing sends ~85% of assignments to the top eighth of the experts
//! (at least top_k of them). `--routings uniform,skewed,balanced` picks the routings; balanced
//! (not a default) gives every expert the same count, token t taking experts t k .. t k + k - 1
//! modulo E: no expert's last tile is partly empty where M k / E is a multiple of 128.

use moe_runtime::cudarc::cublas::sys::cublasOperation_t;
use moe_runtime::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use moe_runtime::cudarc::driver::CudaSlice;
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::{self, capture, time_graph};
use moe_runtime::{Device, MoeLayer};
use moeforge::codegen::{KernelFamily, MoeSpec, WeightFormat, REFERENCE_GEOMETRIES};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

type Bf = half::bf16;

/// Dense bf16 C[8192, 8192] = A . B through cuBLAS: median TFLOP/s over graph replays.
fn dense_tflops(dev: &Device) -> f64 {
    let n = 8192usize;
    let s = dev.stream().clone();
    let blas = CudaBlas::new(s.clone()).expect("cuBLAS");
    let a: CudaSlice<Bf> = s.alloc_zeros(n * n).unwrap();
    let b: CudaSlice<Bf> = s.alloc_zeros(n * n).unwrap();
    let mut c: CudaSlice<Bf> = s.alloc_zeros(n * n).unwrap();
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: n as i32,
        k: n as i32,
        alpha: Bf::ONE,
        lda: n as i32,
        ldb: n as i32,
        beta: Bf::ZERO,
        ldc: n as i32,
    };
    unsafe { blas.gemm(cfg, &a, &b, &mut c) }.unwrap(); // warm-up outside the capture
    let g = capture(&s, || {
        unsafe { blas.gemm(cfg, &a, &b, &mut c) }.map_err(|e| moe_runtime::RuntimeError::Nvrtc(e.to_string()))
    })
    .unwrap();
    let us = time_graph(&s, &g, 20).unwrap();
    2.0 * (n as f64).powi(3) / (us * 1e-6) / 1e12
}

/// Logits that make the router choose exactly `ids` (each chosen expert far above the rest).
fn logits_for(ids: &[i32], m: usize, e: usize, k: usize, rng: &mut SmallRng) -> Vec<f32> {
    let mut l: Vec<f32> = (0..m * e).map(|_| rng.random_range(-1.0f32..0.0)).collect();
    for t in 0..m {
        for s in 0..k {
            l[t * e + ids[t * k + s] as usize] = 6.0 + rng.random_range(0.0f32..1.0);
        }
    }
    l
}

fn list<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<Vec<T>> {
    let i = args.iter().position(|a| a == flag)?;
    Some(args.get(i + 1)?.split(',').filter_map(|v| v.parse().ok()).collect())
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args: Vec<String> = std::env::args().collect();
    let report = args.iter().position(|a| a == "--report").and_then(|i| args.get(i + 1)).cloned();
    let geos: Vec<String> = list(&args, "--geometries").unwrap_or(vec!["qwen3-30b-a3b".into(), "mixtral-8x7b".into()]);
    let formats: Vec<WeightFormat> =
        list(&args, "--formats").unwrap_or(vec![WeightFormat::Bf16, WeightFormat::Fp8E4m3]);
    let ms: Vec<usize> = list(&args, "--ms").unwrap_or(vec![64, 256, 1024, 4096, 16384]);
    // The layer's default combine is the gather-reduce one; `--atomic` times the f32-atomic one.
    let deterministic = !args.iter().any(|a| a == "--atomic");
    // `--with-decode`: time warp decode on the same steps too (where the threshold should sit).
    let families: Vec<KernelFamily> = if args.iter().any(|a| a == "--with-decode") {
        vec![KernelFamily::GroupedGemm, KernelFamily::WarpDecode]
    } else {
        vec![KernelFamily::GroupedGemm]
    };
    let routings: Vec<String> = list(&args, "--routings").unwrap_or(vec!["uniform".into(), "skewed".into()]);
    // `--tiles 128,128,4,1/256,128,4,1,1,1`: bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]]
    // sets to sweep
    // (default: the spec's).
    let tile_sets: Vec<String> = args
        .iter()
        .position(|a| a == "--tiles")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split('/').map(String::from).collect())
        .unwrap_or_default();
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("prefill bench needs an NVIDIA GPU: {e}");
            std::process::exit(1);
        }
    };
    let dense = dense_tflops(&dev);
    println!("{}: dense bf16 8192^3 (cuBLAS) {dense:.1} TFLOP/s", dev.name());
    let mut out = report
        .as_ref()
        .map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap_or_else(|e| panic!("{p}: {e}")));
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
            layer.set_prefill_threshold(1);
            layer.set_deterministic(deterministic);
            let defaults = layer.grouped_tiles().expect("grouped family");
            let mut tilings: Vec<_> = tile_sets.iter().filter_map(|t| defaults.parse(t)).collect();
            if tilings.is_empty() {
                tilings.push(defaults);
            }
            for tiles in tilings {
                if let Err(err) = layer.set_grouped_tiles(&dev, tiles) {
                    println!("{geo} {format} tiles {tiles:?}: {err}");
                    continue;
                }
                let mut cluster = if tiles.cluster > 1 { format!("c{}", tiles.cluster) } else { String::new() };
                if tiles.lag > 0 {
                    cluster += &format!("l{}", tiles.lag);
                }
                let ext = tiles.extended_rows(&spec);
                if ext > 0 {
                    cluster += &format!("t{ext}");
                }
                let tname = format!(
                    "{}x{}x{}s{}b{}{cluster}",
                    tiles.bm, tiles.bn1, tiles.bn2, tiles.stages, tiles.blocks_per_sm
                );
                for (&m, &family) in ms.iter().flat_map(|m| families.iter().map(move |f| (m, f))) {
                    layer.set_prefill_threshold(if family == KernelFamily::GroupedGemm { 1 } else { usize::MAX });
                    for routing in &routings {
                        let seed = fresh_seed();
                        let skew = if routing == "skewed" { 0.85 } else { 0.0 };
                        let (x, mut ids, _) = random_step(&spec, m, skew, seed);
                        if routing == "balanced" {
                            ids.iter_mut().enumerate().for_each(|(j, id)| *id = (j % e as usize) as i32);
                        }
                        let mut rng = SmallRng::seed_from_u64(seed);
                        let logits = logits_for(&ids, m, e as usize, k as usize, &mut rng);
                        let s = layer.stream().clone();
                        let dx = s.clone_htod(&x.iter().map(|&v| Bf::from_f32(v)).collect::<Vec<_>>()).unwrap();
                        let dl = s.clone_htod(&logits).unwrap();
                        let mut y: CudaSlice<Bf> = s.alloc_zeros(m * h as usize).unwrap();
                        layer.reserve(m).unwrap();
                        assert_eq!(layer.family_for(m), family);
                        let g = capture(&s, || layer.forward_logits(&dx, &dl, &mut y)).unwrap();
                        let reps = if m >= 4096 { 20 } else { 50 };
                        let us = time_graph(&s, &g, reps).unwrap();
                        let flops = 2.0 * m as f64 * k as f64 * 3.0 * h as f64 * i as f64;
                        let tflops = flops / (us * 1e-6) / 1e12;
                        println!(
                        "{geo:<14} {format:<10} {family:<12} {tname:<16} {routing:<8} m={m:<6} {us:>10.1} us {tflops:>7.1} TFLOP/s {:>5.1}% of dense",
                        100.0 * tflops / dense
                    );
                        if let Some(f) = out.as_mut() {
                            use std::io::Write;
                            let row = serde_json::json!({
                                "device": dev.name(),
                                "family": family.name(),
                                "format": format.name(),
                                "geometry": geo,
                                "hidden": h, "intermediate": i, "experts": e, "top_k": k,
                                "m": m,
                                "routing": routing,
                                "tiles": tname,
                                "combine": if deterministic { "rows" } else { "atomic" },
                                "median_us": (us * 1000.0).round() / 1000.0,
                                "tflops": (tflops * 10.0).round() / 10.0,
                                "dense_bf16_tflops": (dense * 10.0).round() / 10.0,
                                "pct_of_dense": (10000.0 * tflops / dense).round() / 100.0,
                                "date": timing::today(),
                            });
                            writeln!(f, "{row}").unwrap();
                        }
                    }
                }
            }
        }
    }
}
