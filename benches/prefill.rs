//! Prefill throughput of the whole MoE layer on the grouped-GEMM family: route (from logits),
//! align, GEMM1 + SwiGLU, GEMM2 + routing weight, combine, as one CUDA-graph replay.
//!
//! `cargo bench --bench prefill -- [--report FILE] [--geometries qwen3-30b-a3b,mixtral-8x7b]
//! [--formats bf16,fp8_e4m3] [--ms 64,256] [--atomic] [--profile]` prints a table and appends one JSON
//! object per row to FILE. TFLOP/s counts 2 * M * top_k * 3 * H * I. The ceilings, measured in the
//! same run on random operands (zeros clock higher at the power limit), are dense 8192^3 matmuls:
//! bf16 through cuBLAS, and e4m3 x e4m3 -> bf16 through cuBLASLt (TN, fp32 compute, fast
//! accumulation). A row's `pct_of_dense` divides by the ceiling of its precision (`dense_precision`:
//! fp8 weights against the e4m3 one, 16-bit against bf16); a ceiling that fails leaves its fields
//! null and its error in the row (`dense_error`) rather than stopping the run. `--profile` first
//! fits each layer's dispatch profile (`moe_runtime::dispatch::profile`) and takes its start of the
//! large-step tiles (each row's `large_step_tokens`). `--dense-only`
//! measures the ceilings and exits. Uniform routing draws each token's
//! experts at random; skewed routing sends ~85% of assignments to the top eighth of the experts
//! (at least top_k of them). `--routings uniform,skewed,balanced` picks the routings; balanced
//! (not a default) gives every expert the same count, token t taking experts t k .. t k + k - 1
//! modulo E: no expert's last tile is partly empty where M k / E is a multiple of 128. Each row
//! also counts its bytes (the touched experts' packed weights and scales once, x, y, the logits
//! and the routing) against the device-to-device copy bandwidth measured in the same run
//! (`pct_of_copy`). `--tiles` sweeps grouped tile sets (see `main`); `--seed N` draws the same
//! routing for every tile set, so that they compare on the same steps.

use moe_runtime::cudarc::cublas::sys::cublasOperation_t;
use moe_runtime::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use moe_runtime::cudarc::cublaslt::{result as lt, sys as ltsys};
use moe_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::{self, capture, copy_gbps, time_graph};
use moe_runtime::{Device, MoeLayer};
use moeforge::codegen::numerics::e4m3_from_f32;
use moeforge::codegen::{GemmTiles, KernelFamily, MoeSpec, WeightFormat, REFERENCE_GEOMETRIES};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use std::ffi::c_void;
use std::sync::Arc;

type Bf = half::bf16;

/// The ceiling GEMMs' M = N = K.
const DENSE_N: usize = 8192;

/// `len` values drawn uniformly from [-1, 1) and encoded by `enc`, on every core (one seeded stream a
/// chunk): random operands, since zero-filled ones draw less power and clock higher.
fn random_fill<T: Send + Default + Clone>(len: usize, seed: u64, enc: impl Fn(f32) -> T + Sync) -> Vec<T> {
    let mut v = vec![T::default(); len];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = len.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (i, part) in v.chunks_mut(chunk).enumerate() {
            let enc = &enc;
            sc.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                part.iter_mut().for_each(|x| *x = enc(rng.random_range(-1.0f32..1.0)));
            });
        }
    });
    v
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// TFLOP/s of the 8192^3 GEMM that `gemm` enqueues: one warm-up call outside the capture (where a
/// failing library call surfaces), then the median of graph replays.
fn time_gemm(s: &Arc<CudaStream>, mut gemm: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    gemm()?;
    s.synchronize().map_err(err)?;
    let g = capture(s, || gemm().map_err(moe_runtime::RuntimeError::Nvrtc)).map_err(err)?;
    let us = time_graph(s, &g, 20).map_err(err)?;
    Ok(2.0 * (DENSE_N as f64).powi(3) / (us * 1e-6) / 1e12)
}

/// Dense bf16 C[8192, 8192] = A . B through cuBLAS on random operands: median TFLOP/s over graph
/// replays.
fn dense_bf16(dev: &Device) -> Result<f64, String> {
    let n = DENSE_N;
    let s = dev.stream().clone();
    let blas = CudaBlas::new(s.clone()).map_err(|e| format!("cuBLAS: {e}"))?;
    let a: CudaSlice<Bf> = s.clone_htod(&random_fill(n * n, 1, Bf::from_f32)).map_err(err)?;
    let b: CudaSlice<Bf> = s.clone_htod(&random_fill(n * n, 2, Bf::from_f32)).map_err(err)?;
    let mut c: CudaSlice<Bf> = s.alloc_zeros(n * n).map_err(err)?;
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
    time_gemm(&s, || unsafe { blas.gemm(cfg, &a, &b, &mut c) }.map_err(|e| format!("cuBLAS gemm: {e}")))
}

/// The cuBLASLt descriptors of one matmul, destroyed on drop.
#[derive(Default)]
struct LtObjects {
    handle: Option<ltsys::cublasLtHandle_t>,
    desc: Option<ltsys::cublasLtMatmulDesc_t>,
    layouts: Vec<ltsys::cublasLtMatrixLayout_t>,
    pref: Option<ltsys::cublasLtMatmulPreference_t>,
}

impl Drop for LtObjects {
    fn drop(&mut self) {
        unsafe {
            if let Some(p) = self.pref.take() {
                let _ = lt::destroy_matmul_pref(p);
            }
            for l in self.layouts.drain(..) {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(d) = self.desc.take() {
                let _ = lt::destroy_matmul_desc(d);
            }
            if let Some(h) = self.handle.take() {
                let _ = lt::destroy_handle(h);
            }
        }
    }
}

/// Dense e4m3 x e4m3 -> bf16 D[8192, 8192] through cuBLASLt on random operands: median TFLOP/s over
/// graph replays. FP8 needs the "TN" layout: A is stored K x M column-major (each output row's K
/// values contiguous, lda = K) and used transposed (TRANSA = T), B is K x N column-major (ldb = K)
/// and not transposed, D (and C, unread with beta = 0) bf16 M x N (ldd = M); fp32 compute and
/// scales (CUBLAS_COMPUTE_32F, alpha 1, beta 0, no A/B scale pointers: scale 1). `fast_accum`: the
/// tensor cores' accumulator holds the whole of K (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 1, as in the
/// per-channel GEMM1) rather than being promoted to fp32 every few k-steps.
/// Errors (no libcublasLt, an unsupported layout, a panic inside cudarc) come back as text.
fn dense_fp8(dev: &Device, fast_accum: bool) -> Result<f64, String> {
    if !unsafe { ltsys::is_culib_present() } {
        return Err("libcublasLt not found".into());
    }
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dense_fp8_lt(dev, fast_accum))).unwrap_or_else(|p| {
        let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(format!("cuBLASLt panicked: {}", why.unwrap_or_default()))
    })
}

fn dense_fp8_lt(dev: &Device, fast_accum: bool) -> Result<f64, String> {
    use ltsys::cublasLtMatmulDescAttributes_t as Desc;
    let n = DENSE_N;
    let (m, nn, k) = (n as u64, n as u64, n as u64);
    assert!(k % 16 == 0, "cuBLASLt fp8 wants K and the leading dimensions a multiple of 16");
    let s = dev.stream().clone();
    s.context().bind_to_thread().map_err(err)?;
    let a: CudaSlice<u8> = s.clone_htod(&random_fill(n * n, 3, e4m3_from_f32)).map_err(err)?;
    let b: CudaSlice<u8> = s.clone_htod(&random_fill(n * n, 4, e4m3_from_f32)).map_err(err)?;
    let d: CudaSlice<Bf> = s.alloc_zeros(n * n).map_err(err)?;
    // NVIDIA's recommended workspace on Hopper.
    let ws_bytes = 32usize << 20;
    let ws: CudaSlice<u8> = s.alloc_zeros(ws_bytes).map_err(err)?;
    fn lterr(what: &'static str) -> impl Fn(lt::CublasError) -> String {
        move |e| format!("cuBLASLt {what}: {e}")
    }
    let mut o = LtObjects::default();
    let handle = *o.handle.insert(lt::create_handle().map_err(lterr("create"))?);
    let desc = *o.desc.insert(
        lt::create_matmul_desc(ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F, ltsys::cudaDataType::CUDA_R_32F)
            .map_err(lterr("matmul desc"))?,
    );
    let transa = cublasOperation_t::CUBLAS_OP_T as i32;
    let transb = cublasOperation_t::CUBLAS_OP_N as i32;
    let fast = fast_accum as i8;
    unsafe {
        let set = |attr: Desc, p: *const c_void, size: usize| {
            lt::set_matmul_desc_attribute(desc, attr, p, size).map_err(lterr("desc attribute"))
        };
        set(Desc::CUBLASLT_MATMUL_DESC_TRANSA, &transa as *const i32 as *const c_void, 4)?;
        set(Desc::CUBLASLT_MATMUL_DESC_TRANSB, &transb as *const i32 as *const c_void, 4)?;
        set(Desc::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast as *const i8 as *const c_void, 1)?;
    }
    let mut layout = |t: ltsys::cudaDataType, rows: u64, cols: u64, ld: u64| -> Result<_, String> {
        let l = lt::create_matrix_layout(t, rows, cols, ld as i64).map_err(lterr("layout"))?;
        o.layouts.push(l);
        Ok(l)
    };
    let la = layout(ltsys::cudaDataType::CUDA_R_8F_E4M3, k, m, k)?; // A^T stored K x M
    let lb = layout(ltsys::cudaDataType::CUDA_R_8F_E4M3, k, nn, k)?; // B stored K x N
    let ld = layout(ltsys::cudaDataType::CUDA_R_16BF, m, nn, m)?; // C = D, M x N
    let pref = *o.pref.insert(lt::create_matmul_pref().map_err(lterr("preference"))?);
    unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(ws_bytes as u64) as *const u64 as *const c_void,
            8,
        )
        .map_err(lterr("workspace preference"))?;
    }
    let heuristic = unsafe { lt::get_matmul_algo_heuristic(handle, desc, la, lb, ld, ld, pref) }
        .map_err(lterr("no algorithm (heuristic)"))?;
    let (pa, pb, pd, pw) = (a.device_ptr(&s).0, b.device_ptr(&s).0, d.device_ptr(&s).0, ws.device_ptr(&s).0);
    let (alpha, beta) = (1f32, 0f32);
    let stream = s.cu_stream() as ltsys::cudaStream_t;
    time_gemm(&s, || unsafe {
        lt::matmul(
            handle,
            desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            pa as *const c_void,
            la,
            pb as *const c_void,
            lb,
            pd as *const c_void,
            ld,
            pd as *mut c_void,
            ld,
            &heuristic.algo,
            pw as *mut c_void,
            ws_bytes,
            stream,
        )
        .map_err(lterr("matmul"))
    })
}

/// The dense ceilings of the run.
struct Ceilings {
    bf16: Result<f64, String>,
    /// e4m3 with fast accumulation: the fp8 rows' ceiling.
    fp8: Result<f64, String>,
    /// e4m3 with cuBLASLt's default (promoting) accumulation, for reference.
    fp8_promoted: Result<f64, String>,
}

impl Ceilings {
    fn measure(dev: &Device) -> Ceilings {
        let bf16 = dense_bf16(dev);
        let fp8 = dense_fp8(dev, true);
        let fp8_promoted = dense_fp8(dev, false);
        let show = |r: &Result<f64, String>| match r {
            Ok(t) => format!("{t:.1} TFLOP/s"),
            Err(e) => format!("FAILED ({e})"),
        };
        println!("{}: dense 8192^3 on random data:", dev.name());
        println!("  bf16 (cuBLAS)                                  {}", show(&bf16));
        println!("  e4m3 x e4m3 -> bf16 (cuBLASLt TN, fast accum)  {}", show(&fp8));
        println!("  e4m3 x e4m3 -> bf16 (cuBLASLt TN, promoting)   {}", show(&fp8_promoted));
        Ceilings { bf16, fp8, fp8_promoted }
    }

    /// The ceiling of `format`'s rows: its name and TFLOP/s. fp8 weights run e4m3 x e4m3 MMAs;
    /// every other format of the grouped family runs 16-bit ones (fp16 at bf16's rate).
    fn of(&self, format: WeightFormat) -> (&'static str, &Result<f64, String>) {
        match format {
            WeightFormat::Fp8E4m3 | WeightFormat::Fp8E4m3B128 => ("fp8_e4m3", &self.fp8),
            _ => ("bf16", &self.bf16),
        }
    }
}

/// A TFLOP/s figure for a row: one decimal, null where its measurement failed.
fn tflops_json(r: &Result<f64, String>) -> Value {
    r.as_ref().map_or(Value::Null, |t| ((t * 10.0).round() / 10.0).into())
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
    // `--tiles 128,128,4,1/256,128,4,1,1,1`: bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]][,bmN]
    // sets to sweep
    // (default: the spec's).
    let base_seed: Option<u64> =
        args.iter().position(|a| a == "--seed").and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok());
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
    let ceilings = Ceilings::measure(&dev);
    if args.iter().any(|a| a == "--dense-only") {
        return;
    }
    let copy = copy_gbps(dev.stream()).unwrap();
    println!("device-to-device copy: {copy:.0} GB/s");
    let mut out = report
        .as_ref()
        .map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap_or_else(|e| panic!("{p}: {e}")));
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        if !geos.iter().any(|g| g == geo) {
            continue;
        }
        for &format in &formats {
            let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(format).build() else { continue };
            let (dense_name, dense) = ceilings.of(format);
            match dense {
                Ok(t) => println!("{geo} {format}: % of dense against the {dense_name} ceiling, {t:.1} TFLOP/s"),
                Err(e) => println!("{geo} {format}: the {dense_name} ceiling failed ({e}): no % of dense"),
            }
            let w = random_weights(&spec, fresh_seed());
            let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
            drop(w);
            layer.set_validate_routing(false);
            layer.set_prefill_threshold(1);
            layer.set_deterministic(deterministic);
            if args.iter().any(|a| a == "--profile") {
                let p = moe_runtime::dispatch::profile(&mut layer).unwrap();
                println!("{geo} {format}: profiled, large-step tiles from {:?} tokens", p.large_step_tokens);
                if let Some(t) = p.large_step_tokens {
                    layer.set_large_step_tokens(t);
                }
                layer.set_prefill_threshold(1);
            }
            let defaults = layer.grouped_tiles().expect("grouped family");
            // None: the layer's own tiles (which may change with M: large_step_tiles).
            let mut tilings: Vec<Option<GemmTiles>> =
                tile_sets.iter().filter_map(|t| defaults.parse(t)).map(Some).collect();
            if tilings.is_empty() {
                tilings.push(None);
            }
            for tiles in tilings {
                if let Some(tiles) = tiles {
                    if let Err(err) = layer.set_grouped_tiles(&dev, tiles) {
                        println!("{geo} {format} tiles {tiles:?}: {err}");
                        continue;
                    }
                }
                for (&m, &family) in ms.iter().flat_map(|m| families.iter().map(move |f| (m, f))) {
                    layer.set_prefill_threshold(if family == KernelFamily::GroupedGemm { 1 } else { usize::MAX });
                    for (ri, routing) in routings.iter().enumerate() {
                        // `--seed N`: the same routing for every tile set (an A/B of tiles).
                        let seed = base_seed.map_or_else(fresh_seed, |b| b ^ ((m as u64) << 8) ^ ri as u64);
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
                        assert_eq!(layer.family_for(m), Some(family));
                        let tname = tile_name(&tiles.or(layer.grouped_tiles_for(m)).expect("grouped family"), &spec);
                        let g = capture(&s, || layer.forward_logits(&dx, &dl, &mut y)).unwrap();
                        let reps = if m >= 4096 { 20 } else { 50 };
                        let us = time_graph(&s, &g, reps).unwrap();
                        let flops = 2.0 * m as f64 * k as f64 * 3.0 * h as f64 * i as f64;
                        let tflops = flops / (us * 1e-6) / 1e12;
                        let pct = dense.as_ref().ok().map(|d| 100.0 * tflops / d);
                        let pct_text = pct.map_or("  n/a".into(), |p| format!("{p:>5.1}"));
                        // Bytes: the touched experts' packed weights and scales once, x and y,
                        // the logits and the routing.
                        let mut touched = ids.clone();
                        touched.sort_unstable();
                        touched.dedup();
                        let bytes = touched.len() * spec.expert_bytes()
                            + 2 * m * h as usize * 2
                            + logits.len() * 4
                            + ids.len() * 8;
                        let pct_copy = 100.0 * bytes as f64 / (us * 1e-6) / 1e9 / copy;
                        println!(
                            "{geo:<14} {format:<10} {family:<12} {tname:<16} {routing:<8} m={m:<6} {us:>10.1} us {tflops:>7.1} TFLOP/s {pct_text}% of dense {dense_name} {pct_copy:>5.1}% of copy"
                        );
                        if let Some(f) = out.as_mut() {
                            use std::io::Write;
                            let mut row = serde_json::json!({
                                "device": dev.name(),
                                "family": family.name(),
                                "format": format.name(),
                                "geometry": geo,
                                "hidden": h, "intermediate": i, "experts": e, "top_k": k,
                                "m": m,
                                "routing": routing,
                                "tiles": tname,
                                "large_step_tokens": layer.large_step_tokens(),
                                "combine": if deterministic { "rows" } else { "atomic" },
                                "median_us": (us * 1000.0).round() / 1000.0,
                                "tflops": (tflops * 10.0).round() / 10.0,
                                "dense_precision": dense_name,
                                "dense_tflops": tflops_json(dense),
                                "dense_data": "random",
                                "dense_bf16_tflops": tflops_json(&ceilings.bf16),
                                "dense_fp8_e4m3_tflops": tflops_json(&ceilings.fp8),
                                "dense_fp8_e4m3_promoted_tflops": tflops_json(&ceilings.fp8_promoted),
                                "pct_of_dense": pct.map_or(Value::Null, |p| ((p * 100.0).round() / 100.0).into()),
                                "bytes": bytes,
                                "copy_gbps": (copy * 10.0).round() / 10.0,
                                "pct_of_copy": (pct_copy * 100.0).round() / 100.0,
                                "date": timing::today(),
                            });
                            if let Err(e) = dense {
                                row["dense_error"] = e.as_str().into();
                            }
                            writeln!(f, "{row}").unwrap();
                        }
                    }
                }
            }
        }
    }
}

/// A row's tiles as the report names them: `bm x bn1 x bn2 s<stages> b<blocks>`, then `c<cluster>`,
/// `l<lag>`, `t<extended rows>` where they are not the plain pipeline's, and `ws` for the
/// warp-specialised pipeline on weights its producer decodes.
fn tile_name(tiles: &GemmTiles, spec: &MoeSpec) -> String {
    let mut extra = if tiles.cluster > 1 { format!("c{}", tiles.cluster) } else { String::new() };
    if tiles.lag > 0 {
        extra += &format!("l{}", tiles.lag);
    }
    let ext = tiles.extended_rows(spec);
    if ext > 0 {
        extra += &format!("t{ext}");
    }
    if tiles.pack_ring(spec) > 0 {
        extra += "ws";
    }
    format!("{}x{}x{}s{}b{}{extra}", tiles.bm, tiles.bn1, tiles.bn2, tiles.stages, tiles.blocks_per_sm)
}
