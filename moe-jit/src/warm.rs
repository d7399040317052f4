//! `moe-jit warm`: build into the kernel cache every module a layer of each spec loads, for each
//! arch, without a GPU, so that a deployment's `MoeLayer::load` only reads the cache.
//!
//! What a layer loads: the warp-decode family (the spec's own dequant variant) and, where the spec
//! allows it, the grouped family with the spec's default tiles; every entry point of each as its
//! own module (`CompileOptions::for_arch(..).for_entry(entry)`), as `Device::compile_entries`
//! builds them. The cache keys are the same, so the layer's compiles become cache reads.

use indicatif::{ProgressBar, ProgressStyle};
use moe_codegen::{family_supports, render, Arch, CodegenError, KernelFamily, KernelSource, MoeSpec};
use moe_runtime::cache::Outcome;
use moe_runtime::jit::cubin_entry_points;
use moe_runtime::{cache_key, toolkit::toolkit, CompileOptions, Device, DiskCache};
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `--arch` when given, else the local GPU's arch, else every arch.
fn archs(given: &[Arch]) -> Vec<Arch> {
    if !given.is_empty() {
        let mut v: Vec<Arch> = Vec::new();
        for &a in given {
            if !v.contains(&a) {
                v.push(a);
            }
        }
        return v;
    }
    match Device::new(0) {
        Ok(d) => {
            println!("arch: {} (GPU 0, {})", d.arch(), d.name());
            vec![d.arch()]
        }
        Err(e) => {
            println!("arch: every one ({e}); --arch picks");
            Arch::ALL.to_vec()
        }
    }
}

/// The sources a layer of `spec` renders on `arch` (the grouped family's large-step module
/// included, where it has one): `Ok(None)` where the arch lacks the spec's
/// dequant variant (no layer of it loads there).
fn layer_sources(spec: &MoeSpec, arch: Arch) -> Result<Option<Vec<KernelSource>>, CodegenError> {
    let mut out = Vec::new();
    for family in KernelFamily::ALL.into_iter().filter(|&f| family_supports(f, spec)) {
        match render(spec, family, arch) {
            Ok(src) => out.push(src),
            Err(CodegenError::DequantUnavailable { .. }) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    // The grouped family's large-step module, which the layer loads beside its default.
    if family_supports(KernelFamily::GroupedGemm, spec) {
        if let Some(tiles) = moe_codegen::heuristics::large_step_tiles(spec, arch) {
            out.push(moe_codegen::render_grouped(spec, arch, tiles)?);
        }
    }
    Ok(Some(out))
}

/// Compile into `cache`, on `jobs` threads, every module a layer of each spec loads on each arch
/// (`arch`, else the local GPU's, else every arch), each module once, and check that each CUBIN
/// defines its entry point. Failure when a module fails or when nothing is left to compile.
pub fn warm(cache: &DiskCache, specs: &[MoeSpec], arch: &[Arch], jobs: usize) -> ExitCode {
    let archs = archs(arch);
    let tk = match toolkit() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!("NVRTC {}.{}; kernel cache: {}", tk.nvrtc_version.0, tk.nvrtc_version.1, cache.dir().display());

    // Every (source, entry point) of every spec x arch, each with its options.
    let (mut sources, mut skipped, mut failed) = (Vec::new(), 0, 0);
    for spec in specs {
        for &a in &archs {
            match layer_sources(spec, a) {
                Ok(Some(srcs)) => {
                    let names: Vec<String> =
                        srcs.iter().map(|s| format!("{} ({} entry points)", s.name, s.entry_points.len())).collect();
                    println!("{} {a}: {}", spec.id(), names.join(", "));
                    sources.extend(srcs);
                }
                Ok(None) => {
                    skipped += 1;
                    println!("skip  {} {a}: the arch lacks its dequant variant", spec.id());
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {} {a}: {e}", spec.id());
                }
            }
        }
    }
    // Each module once (specs that render the same source share it).
    let mut keys = HashSet::new();
    let items: Vec<(&KernelSource, &str, CompileOptions)> = sources
        .iter()
        .flat_map(|s| {
            let opts = CompileOptions::for_arch(tk, s.arch);
            s.entry_points.iter().map(move |e| (s, e.as_str(), opts.for_entry(e)))
        })
        .filter(|(s, _, o)| keys.insert(cache_key(s, o)))
        .collect();

    let t0 = std::time::Instant::now();
    let bar = ProgressBar::new(items.len() as u64).with_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} modules  {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let next = AtomicUsize::new(0);
    let [hits, misses, rebuilt] = [0, 0, 0].map(AtomicUsize::new);
    let errors = Mutex::new(Vec::new());
    let threads = jobs.clamp(1, items.len().max(1));
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                while let Some((src, entry, opts)) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                    bar.set_message(format!("{entry} of {} ({})", src.name, src.arch));
                    let what = format!("{} `{entry}` for {}", src.name, src.arch);
                    let res = match cache.get_or_compile(src, opts) {
                        // The module defines the entry point (a cached CUBIN is checked like a new one).
                        Ok((cubin, how)) => match cubin_entry_points(&cubin) {
                            Ok(got) if got.iter().any(|g| g == entry) => Ok(how),
                            Ok(got) => Err(format!("{what}: the CUBIN defines {got:?}")),
                            Err(e) => Err(format!("{what}: not a CUBIN: {e}")),
                        },
                        Err(e) => Err(format!("{what}:\n{e}")),
                    };
                    match res {
                        Ok(Outcome::Hit) => hits.fetch_add(1, Ordering::Relaxed),
                        Ok(Outcome::Miss) => misses.fetch_add(1, Ordering::Relaxed),
                        Ok(Outcome::Rebuilt) => rebuilt.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            bar.suspend(|| println!("FAIL  {e}"));
                            errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                            0
                        }
                    };
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    let [hits, misses, rebuilt] = [hits, misses, rebuilt].map(AtomicUsize::into_inner);
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    println!(
        "{} modules of {} specs x {} archs in {:.1} s on {threads} threads: {hits} from the cache, {} compiled by \
         NVRTC{}, {} failed",
        items.len(),
        specs.len(),
        archs.len(),
        t0.elapsed().as_secs_f64(),
        misses + rebuilt,
        if rebuilt > 0 { format!(" ({rebuilt} corrupt cache entries rebuilt)") } else { String::new() },
        errors.len() + failed,
    );
    if skipped > 0 {
        println!("{skipped} spec x arch skipped (the arch lacks the spec's dequant variant)");
    }
    if !errors.is_empty() || failed > 0 {
        ExitCode::FAILURE
    } else if items.is_empty() {
        eprintln!("moe-jit warm: nothing to compile: every spec's dequant variant is unavailable on {archs:?}");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
