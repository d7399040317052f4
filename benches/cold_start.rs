//! How long a layer takes to be ready for any step: `load` plus `reserve` for a large step,
//! with an empty kernel cache (cold) and then with the cache that run filled (warm), each in a
//! fresh process (so neither the in-memory module map nor an earlier compile helps), over the
//! reference geometries in bf16, fp8 and mxfp4. The weights are uploaded first and moved into the
//! layer (`DeviceWeights`, as an engine that loads its checkpoint itself does), so `load` times the
//! kernels alone; the upload is timed apart and reported beside it (`*_with_upload_s`).
//!
//! `cargo bench --bench cold_start -- [--report FILE] [--geometries a,b] [--formats f,g]`

use moeforge::codegen::REFERENCE_GEOMETRIES;
use moeforge::runtime::cache::DiskCache;
use moeforge::runtime::testing::random_weights;
use moeforge::runtime::{timing, Device, DeviceWeights, MoeLayer};
use moeforge::{MoeSpec, WeightFormat};
use std::process::Command;
use std::time::Instant;

/// The step `reserve` sizes for: large enough that every family and buffer is in place.
const LARGEST_STEP: usize = 16384;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn spec_of(geometry: &str, format: &str) -> MoeSpec {
    let (_, h, i, e, k) = REFERENCE_GEOMETRIES.iter().copied().find(|g| g.0 == geometry).expect("a reference geometry");
    let format: WeightFormat = format.parse().expect("a weight format");
    MoeSpec::builder(h, i, e, k).weight_format(format).build().expect("a valid spec")
}

/// One measurement in this process: prints `load_s reserve_s upload_s` on its last line.
fn child(geometry: &str, format: &str, cache: &str) {
    let spec = spec_of(geometry, format);
    let w = random_weights(&spec, 7);
    let dev = Device::new(0).expect("a GPU").with_cache(DiskCache::new(cache));
    // The upload, in the layer's own path (`MoeLayer::load` from host weights does the same).
    let s = dev.stream();
    let t = Instant::now();
    let up = |v: &[u8]| (!v.is_empty()).then(|| s.clone_htod(v).unwrap());
    let dw = DeviceWeights {
        w13: s.clone_htod(&w.w13).unwrap(),
        w13_scales: up(&w.w13_scales),
        w2: s.clone_htod(&w.w2).unwrap(),
        w2_scales: up(&w.w2_scales),
        bias: None,
        shared_gate: None,
    };
    s.synchronize().unwrap();
    let upload = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let layer = MoeLayer::load(&dev, spec, dw).expect("load");
    let load = t.elapsed().as_secs_f64();
    let t = Instant::now();
    layer.reserve(LARGEST_STEP).expect("reserve");
    layer.stream().synchronize().unwrap();
    let reserve = t.elapsed().as_secs_f64();
    println!("{load:.4} {reserve:.4} {upload:.4}");
}

fn run(exe: &str, geometry: &str, format: &str, cache: &str) -> Result<(f64, f64, f64), String> {
    let out =
        Command::new(exe).args(["--child", geometry, format, cache]).output().map_err(|e| format!("spawn: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("");
    let v: Vec<f64> = last.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    if !out.status.success() || v.len() != 3 {
        return Err(format!("{}{}", text, String::from_utf8_lossy(&out.stderr)));
    }
    Ok((v[0], v[1], v[2]))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1], &args[i + 2], &args[i + 3]);
        return;
    }
    if args.iter().any(|a| a == "--bench") && Device::new(0).is_err() {
        println!("cold_start: no GPU, nothing measured");
        return;
    }
    let exe = std::env::current_exe().unwrap().display().to_string();
    let geometries: Vec<String> = arg("--geometries")
        .map(|s| s.split(',').map(String::from).collect())
        .unwrap_or_else(|| REFERENCE_GEOMETRIES.iter().map(|g| g.0.to_string()).collect());
    let formats: Vec<String> = arg("--formats")
        .map(|s| s.split(',').map(String::from).collect())
        .unwrap_or_else(|| ["bf16", "fp8_e4m3", "mxfp4"].map(String::from).into());
    let device = Device::new(0).map(|d| d.name()).unwrap_or_else(|e| panic!("cold_start needs a GPU: {e}"));
    let mut rows = Vec::new();
    let (mut colds, mut warms, mut worst_warm) = (Vec::new(), Vec::new(), 0f64);
    println!(
        "{:<14} {:<10} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "geometry", "format", "cold", "load", "reserve", "upload", "warm"
    );
    for g in &geometries {
        for f in &formats {
            let dir = tempfile::tempdir().unwrap();
            let cache = dir.path().display().to_string();
            let cold = run(&exe, g, f, &cache);
            let warm = run(&exe, g, f, &cache);
            match (cold, warm) {
                (Ok(c), Ok(w)) => {
                    let (cold_s, warm_s) = (c.0 + c.1, w.0 + w.1);
                    println!("{g:<14} {f:<10} {cold_s:>8.3}s {:>8.3}s {:>8.3}s {:>8.3}s {warm_s:>8.3}s", c.0, c.1, c.2);
                    worst_warm = worst_warm.max(warm_s);
                    colds.push(cold_s);
                    warms.push(warm_s);
                    rows.push(serde_json::json!({
                        "bench": "cold_start", "device": device, "date": timing::today(),
                        "geometry": g, "format": f, "largest_step": LARGEST_STEP,
                        "cold_s": cold_s, "cold_load_s": c.0, "cold_reserve_s": c.1, "upload_s": c.2,
                        "warm_s": warm_s, "warm_load_s": w.0, "warm_reserve_s": w.1,
                        "weights": "device", "cold_with_upload_s": cold_s + c.2, "warm_with_upload_s": warm_s + w.2,
                    }));
                }
                (c, w) => println!("{g:<14} {f:<10} FAILED: {:?} {:?}", c.err(), w.err()),
            }
        }
    }
    let (mc, mw) = (median(colds), median(warms));
    println!("median cold {mc:.3} s, warm {mw:.3} s, slowest warm {worst_warm:.3} s (bars: cold 2 s, warm 0.15 s)");
    if let Some(path) = arg("--report") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        for r in rows {
            writeln!(f, "{r}").unwrap();
        }
        println!("appended to {path}");
    }
}
