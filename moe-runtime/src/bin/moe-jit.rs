//! moe-jit: render and compile moeforge kernels without a GPU, and manage the kernel cache.

use clap::{Parser, Subcommand};
use moe_codegen::{render, variants, Arch, REFERENCE_GEOMETRIES};
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
    /// Render every supported (family, format) variant of the reference geometries and compile
    /// each with NVRTC for the given archs.
    Check {
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_120a")]
        arch: Vec<Arch>,
        /// Print the ptxas register / spill report of every entry point.
        #[arg(long)]
        resources: bool,
        /// Write each CUBIN and its source into this folder (for nvdisasm / cuobjdump).
        #[arg(long)]
        dump: Option<std::path::PathBuf>,
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
        Cmd::Check { arch, resources, dump } => check(&arch, resources, dump.as_deref()),
        Cmd::Cache { op } => cache(op),
    }
}

fn check(archs: &[Arch], resources: bool, dump: Option<&std::path::Path>) -> ExitCode {
    let tk = match toolkit() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!("NVRTC {}.{}, headers in {}", tk.nvrtc_version.0, tk.nvrtc_version.1, tk.include.display());
    let (mut ok, mut failed) = (0, 0);
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        for (spec, family) in variants(h, i, e, k) {
            for &arch in archs {
                let t0 = std::time::Instant::now();
                let res = render(&spec, family, arch)
                    .map_err(moe_runtime::RuntimeError::from)
                    .and_then(|src| compile(&src, &CompileOptions::for_arch(tk, arch)).map(|c| (src, c)));
                match res {
                    Ok((src, c)) => {
                        ok += 1;
                        println!(
                            "ok    {geo:<14} {:<44} {arch:<8} {:>7} B cubin  {:>5} ms",
                            src.name,
                            c.cubin.len(),
                            t0.elapsed().as_millis()
                        );
                        if let Some(dir) = dump {
                            let base = dir.join(format!("{}.{arch}", src.name));
                            let written = std::fs::create_dir_all(dir)
                                .and_then(|_| std::fs::write(base.with_extension(format!("{arch}.cubin")), &c.cubin))
                                .and_then(|_| std::fs::write(base.with_extension(format!("{arch}.cu")), &src.source));
                            if let Err(e) = written {
                                eprintln!("cannot write into {}: {e}", dir.display());
                                return ExitCode::FAILURE;
                            }
                        }
                        if resources {
                            for (f, regs, spill, stack) in resource_report(&c.log) {
                                println!("        {f:<20} {regs:>3} regs  {spill:>4} B spill  {stack:>4} B stack");
                            }
                        }
                    }
                    Err(err) => {
                        failed += 1;
                        println!("FAIL  {geo:<14} {} {family} {arch}\n{err}", spec.id());
                    }
                }
            }
        }
    }
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
