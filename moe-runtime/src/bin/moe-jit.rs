//! moe-jit: render and compile moeforge kernels without a GPU, and manage the kernel cache.

use clap::{Parser, Subcommand};
use moe_codegen::{
    dequant_variants, render, render_grouped, variants, Arch, CodegenError, GemmTiles, KernelFamily, MoeSpec,
    WeightFormat, REFERENCE_GEOMETRIES,
};
use moe_runtime::jit::resource_report;
use moe_runtime::{compile, toolkit::toolkit, CompileOptions, DiskCache};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "moe-jit", about = "Render, compile and cache moeforge kernels")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Render and compile with NVRTC, for the given archs: every weight format with every dequant
    /// variant on the Qwen3-30B-A3B geometry, and bf16, fp16, fp8_e4m3 and mxfp4 (default
    /// variants) on the other reference geometries. Variants an arch lacks are listed as skipped.
    Check {
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_120a")]
        arch: Vec<Arch>,
        /// Only these formats (default: all).
        #[arg(long, value_delimiter = ',')]
        format: Vec<WeightFormat>,
        /// Only these kernel families (warp_decode, grouped_gemm; default: both).
        #[arg(long, value_delimiter = ',')]
        family: Vec<KernelFamily>,
        /// Every format the other geometries accept too, not only bf16, fp16, fp8_e4m3, mxfp4.
        #[arg(long)]
        all_geometries: bool,
        /// Parallel NVRTC compiles (default: one per core).
        #[arg(long)]
        jobs: Option<usize>,
        /// Print the ptxas register / spill report of every entry point.
        #[arg(long)]
        resources: bool,
        /// Write each CUBIN and its source into this folder (for nvdisasm / cuobjdump).
        #[arg(long)]
        dump: Option<std::path::PathBuf>,
        /// Grouped-GEMM tiles over each spec's defaults, as the prefill bench's `--tiles`:
        /// `bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]]` (e.g. `256,256,4,1,1,1,0,16`).
        #[arg(long)]
        tiles: Option<String>,
    },
    /// The on-disk kernel cache ($MOEFORGE_CACHE_DIR, else the XDG cache dir).
    Cache {
        #[command(subcommand)]
        op: CacheOp,
    },
}

#[derive(Subcommand)]
enum CacheOp {
    /// One line per entry: key, size, whether it passes its checksum.
    List,
    /// Entry count and total size.
    Stats,
    /// Remove every entry.
    Clear,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    match Cli::parse().cmd {
        Cmd::Check { arch, format, family, all_geometries, jobs, resources, dump, tiles } => {
            let jobs = jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
            let shape_ok = |t: &str| {
                let any = MoeSpec::builder(2048, 768, 128, 8).build().expect("a valid spec");
                GemmTiles::for_spec(&any, Arch::Sm90a).parse(t).is_some()
            };
            if let Some(t) = tiles.as_deref().filter(|t| !shape_ok(t)) {
                eprintln!("--tiles {t}: expected bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]]");
                return ExitCode::FAILURE;
            }
            let opts = CheckOptions { jobs: jobs.max(1), resources, dump: dump.as_deref(), tiles: tiles.as_deref() };
            let mut list = check_list(&format, all_geometries);
            list.retain(|(_, _, f)| family.is_empty() || family.contains(f));
            check(&arch, &list, &opts)
        }
        Cmd::Cache { op } => cache(op),
    }
}

/// Formats `check` compiles on the geometries other than Qwen3-30B-A3B (default variants): the
/// 16-bit and fp8 paths as before quantized formats, and gpt-oss's MXFP4. The other formats differ
/// from these only in the dequant include, which the Qwen3 geometry covers in every variant.
const OTHER_GEOMETRY_FORMATS: [WeightFormat; 4] =
    [WeightFormat::Bf16, WeightFormat::Fp16, WeightFormat::Fp8E4m3, WeightFormat::Mxfp4];

/// What `check` renders: (geometry, spec, family) in a stable order.
fn check_list(formats: &[WeightFormat], all_geometries: bool) -> Vec<(&'static str, MoeSpec, KernelFamily)> {
    let keep = |s: &MoeSpec| formats.is_empty() || formats.contains(&s.weight_format());
    let mut out = Vec::new();
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        let specs = if geo == "qwen3-30b-a3b" {
            let mut v = dequant_variants(h, i, e, k);
            v.extend(variants(h, i, e, k).into_iter().filter(|(_, f)| *f == KernelFamily::GroupedGemm));
            v
        } else {
            let mut v = variants(h, i, e, k);
            v.retain(|(s, _)| all_geometries || OTHER_GEOMETRY_FORMATS.contains(&s.weight_format()));
            v
        };
        out.extend(specs.into_iter().filter(|(s, _)| keep(s)).map(|(s, f)| (geo, s, f)));
    }
    // The group-limited (DeepSeek-V3) router lives in the grouped module: one spec carries it.
    let grouped_router = MoeSpec::builder(2048, 768, 128, 8)
        .build()
        .and_then(|s| s.with_router(moe_codegen::Router::GroupLimited(moe_codegen::GroupLimited::new(8, 4, true, 2.5))))
        .expect("a valid spec");
    if keep(&grouped_router) {
        out.push(("qwen3-30b-a3b", grouped_router, KernelFamily::GroupedGemm));
    }
    out
}

/// One line of `check`'s output and whether it counts as compiled, failed or skipped.
enum Outcome {
    Ok(String),
    Skipped(String),
    Failed(String),
}

/// How `check` compiles: threads, what it reports and keeps, and grouped tiles to override.
struct CheckOptions<'a> {
    jobs: usize,
    resources: bool,
    dump: Option<&'a std::path::Path>,
    tiles: Option<&'a str>,
}

/// The kernel source `check` compiles: the family's default, or the grouped family with `tiles`
/// parsed over the spec's default tiles.
fn render_for_check(
    spec: &MoeSpec,
    family: KernelFamily,
    arch: Arch,
    tiles: Option<&str>,
) -> Result<moe_codegen::KernelSource, CodegenError> {
    match (family, tiles) {
        (KernelFamily::GroupedGemm, Some(t)) => {
            // (main checked that `t` parses; its shape, not the defaults, decides that)
            let parsed = GemmTiles::for_spec(spec, arch).parse(t).expect("checked in main");
            render_grouped(spec, arch, parsed)
        }
        _ => render(spec, family, arch),
    }
}

fn check(archs: &[Arch], list: &[(&'static str, MoeSpec, KernelFamily)], opts: &CheckOptions) -> ExitCode {
    let CheckOptions { jobs, resources, dump, tiles } = *opts;
    let tk = match toolkit() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!("NVRTC {}.{}, headers in {}", tk.nvrtc_version.0, tk.nvrtc_version.1, tk.include.display());
    let list: Vec<_> = list.iter().flat_map(|&(g, s, f)| archs.iter().map(move |&a| (g, s, f, a))).collect();
    if let Some(dir) = dump {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("cannot create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    let t_all = std::time::Instant::now();
    let one = |&(geo, spec, family, arch): &(&str, MoeSpec, KernelFamily, Arch)| -> Outcome {
        let t0 = std::time::Instant::now();
        let src = match render_for_check(&spec, family, arch, tiles) {
            Ok(src) => src,
            Err(e @ CodegenError::DequantUnavailable { .. }) => {
                return Outcome::Skipped(format!("skip  {geo:<14} {} {family} {arch}: {e}", spec.id()))
            }
            Err(e) => return Outcome::Failed(format!("FAIL  {geo:<14} {} {family} {arch}\n{e}", spec.id())),
        };
        match compile(&src, &CompileOptions::for_arch(tk, arch)) {
            Ok(c) => {
                let mut line = format!(
                    "ok    {geo:<14} {:<56} {arch:<8} {:>7} B cubin  {:>5} ms",
                    src.name,
                    c.cubin.len(),
                    t0.elapsed().as_millis()
                );
                if let Some(dir) = dump {
                    let base = dir.join(format!("{}.{arch}", src.name));
                    let written = std::fs::write(base.with_extension(format!("{arch}.cubin")), &c.cubin)
                        .and_then(|_| std::fs::write(base.with_extension(format!("{arch}.cu")), &src.source));
                    if let Err(e) = written {
                        return Outcome::Failed(format!("FAIL  cannot write into {}: {e}", dir.display()));
                    }
                }
                if resources {
                    for (f, regs, spill, stack) in resource_report(&c.log) {
                        line += &format!("\n        {f:<20} {regs:>3} regs  {spill:>4} B spill  {stack:>4} B stack");
                    }
                    // ptxas warnings, e.g. wgmma serialized for lack of registers.
                    for w in c.log.lines().filter(|l| l.contains("warning")) {
                        line += &format!("\n        {w}");
                    }
                }
                Outcome::Ok(line)
            }
            Err(err) => Outcome::Failed(format!("FAIL  {geo:<14} {} {family} {arch}\n{err}", src.name)),
        }
    };
    // Compile on `jobs` threads; print in list order as results arrive.
    let results: Vec<std::sync::Mutex<Option<Outcome>>> = list.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Condvar::new();
    let lock = std::sync::Mutex::new(());
    let (mut ok, mut failed, mut skipped) = (0, 0, 0);
    std::thread::scope(|sc| {
        for _ in 0..jobs.min(list.len()) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = list.get(i) else { break };
                let r = one(job);
                *results[i].lock().unwrap() = Some(r);
                let _g = lock.lock().unwrap();
                done.notify_all();
            });
        }
        for slot in &results {
            let mut g = lock.lock().unwrap();
            let r = loop {
                if let Some(r) = slot.lock().unwrap().take() {
                    break r;
                }
                g = done.wait(g).unwrap();
            };
            drop(g);
            match r {
                Outcome::Ok(l) => {
                    ok += 1;
                    println!("{l}");
                }
                Outcome::Skipped(l) => {
                    skipped += 1;
                    println!("{l}");
                }
                Outcome::Failed(l) => {
                    failed += 1;
                    println!("{l}");
                }
            }
        }
    });
    println!("{skipped} skipped (the arch lacks the variant); {} s on {jobs} threads", t_all.elapsed().as_secs());
    println!("{ok} variants compiled, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn cache(op: CacheOp) -> ExitCode {
    let c = DiskCache::open_default();
    let res = match op {
        CacheOp::List => c.list().map(|entries| {
            for e in &entries {
                println!("{}  {:>9} B  {}", e.key, e.bytes, if e.valid { "ok" } else { "CORRUPT" });
            }
            println!("{} entries in {}", entries.len(), c.dir().display());
        }),
        CacheOp::Stats => c.list().map(|entries| {
            let bytes: u64 = entries.iter().map(|e| e.bytes).sum();
            let bad = entries.iter().filter(|e| !e.valid).count();
            println!("{}: {} entries, {} bytes, {} corrupt", c.dir().display(), entries.len(), bytes, bad);
        }),
        CacheOp::Clear => c.clear().map(|n| println!("removed {n} files from {}", c.dir().display())),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
