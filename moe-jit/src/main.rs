//! moe-jit: render and compile moeforge kernels without a GPU, warm a deployment's kernel cache,
//! and manage the cache.

#![warn(missing_docs)]

use clap::{Parser, Subcommand};
use moe_codegen::{
    family_supports, heuristics::large_step_tiles, render, render_grouped, ActDtype, Activation, Arch, CodegenError,
    DequantVariant, GemmTiles, KernelFamily, MoeSpec, SpecError, WeightFormat,
};
use moe_runtime::cache::{default_dir, Outcome};
use moe_runtime::jit::{cubin_code_sizes, cubin_entry_points, reference_variants, resource_report};
use moe_runtime::{compile, toolkit::toolkit, CompileOptions, DiskCache};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "moe-jit", version, about = "Render, compile and cache moeforge kernels")]
struct Cli {
    /// The kernel cache folder (default: $MOEFORGE_CACHE_DIR, else moeforge/ in the XDG cache dir).
    #[arg(long, global = true)]
    cache_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Render and compile with NVRTC, through the kernel cache, for the given archs. By default
    /// the reference set (the one the tests compile): every weight format each reference geometry
    /// takes, in each family, with every dequant variant on Qwen3-30B-A3B, and the group-limited
    /// router. With --hidden, --intermediate, --experts and --top-k: your spec instead, in every
    /// family and dequant variant it supports. Variants an arch lacks are listed as skipped.
    /// Exits non-zero when a compile fails, a spec is invalid, or nothing is selected.
    Check {
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_120a")]
        arch: Vec<Arch>,
        /// Only these formats (default: all). With a spec of your own: its formats (default: bf16).
        #[arg(long, value_delimiter = ',')]
        format: Vec<WeightFormat>,
        /// Only these kernel families (warp_decode, grouped_gemm, fused; default: every one).
        #[arg(long, value_delimiter = ',')]
        family: Vec<KernelFamily>,
        /// Your spec's hidden size (with --intermediate, --experts, --top-k: all four or none).
        #[arg(long)]
        hidden: Option<u32>,
        /// Your spec's intermediate (expert FFN) size.
        #[arg(long)]
        intermediate: Option<u32>,
        /// Your spec's expert count.
        #[arg(long)]
        experts: Option<u32>,
        /// Your spec's experts per token.
        #[arg(long)]
        top_k: Option<u32>,
        /// Your spec's activation dtype (bf16, fp16; default: the format's).
        #[arg(long)]
        act_dtype: Option<ActDtype>,
        /// Your spec's activation (silu, gelu_tanh, swiglu_oai; default: silu).
        #[arg(long)]
        activation: Option<Activation>,
        /// Your spec has per-expert biases on w13 and w2.
        #[arg(long)]
        bias: bool,
        /// Your spec's shared experts (every token uses them; default 0).
        #[arg(long, default_value_t = 0)]
        shared_experts: u32,
        /// Your spec's shared experts are gated (sigmoid(x . gate) per token).
        #[arg(long)]
        shared_gate: bool,
        /// Your spec's dequant variant (lut, bits, hardware; default: every one the format has).
        #[arg(long)]
        dequant: Option<DequantVariant>,
        /// (The default now: the reference set holds every format on every geometry.)
        #[arg(long, hide = true)]
        all_geometries: bool,
        /// Parallel NVRTC compiles (default: one per core).
        #[arg(long)]
        jobs: Option<usize>,
        /// Compile every module even where the cache holds it (and leave the cache as it is).
        #[arg(long)]
        no_cache: bool,
        /// Print the modules the selection renders, per arch, and compile nothing.
        #[arg(long)]
        list: bool,
        /// Print the ptxas register / spill report and the machine code's size of every entry
        /// point (compiles every module: the cache keeps no log).
        #[arg(long)]
        resources: bool,
        /// Write each CUBIN and its source into this folder (for nvdisasm / cuobjdump).
        #[arg(long)]
        dump: Option<PathBuf>,
        /// Grouped-GEMM tiles over each spec's defaults, as the prefill bench's `--tiles`:
        /// `bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]][,bmN]` (e.g. `256,256,4,1,1,1,0,16`).
        #[arg(long)]
        tiles: Option<String>,
    },
    /// Compile into the kernel cache everything a layer of each spec loads (every entry point of
    /// every family the spec supports, each as its own module) for the given archs, in parallel,
    /// so that a deployment's `MoeLayer::load` only reads the cache. The spec from --hidden,
    /// --intermediate, --experts and --top-k (one per --format), or the specs in a JSON file
    /// (--specs). Exits non-zero when a compile fails or a spec is invalid.
    Warm {
        /// Archs to compile for (default: the local GPU's if one is found, else all three).
        #[arg(long, value_delimiter = ',')]
        arch: Vec<Arch>,
        #[command(flatten)]
        spec: SpecFlags,
        /// A JSON array of specs instead of the flags, each an object with the flags' fields:
        /// `[{"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "format": "fp8_e4m3"}]`
        /// (format, act_dtype, activation and dequant optional).
        #[arg(long, conflicts_with_all = ["hidden", "intermediate", "experts", "top_k", "format", "act_dtype", "activation", "dequant"])]
        specs: Option<PathBuf>,
        /// Parallel NVRTC compiles (default: one per core).
        #[arg(long)]
        jobs: Option<usize>,
    },
    /// Fit the routing-aware dispatcher's cost models for each spec on GPU 0 (both families timed
    /// at 6 token counts x 5 routings, with synthetic weights quantized to the spec's format) and
    /// save them under the kernel cache, where `MoeLayer::load` picks them up for this GPU, spec
    /// and moeforge version. About 10-20 s a spec on an H100-class GPU plus its compiles.
    Profile {
        #[command(flatten)]
        spec: SpecFlags,
        /// A JSON array of specs instead of the flags, as `warm` takes.
        #[arg(long, conflicts_with_all = ["hidden", "intermediate", "experts", "top_k", "format", "act_dtype", "activation", "dequant"])]
        specs: Option<PathBuf>,
    },
    /// The on-disk kernel cache (--cache-dir, else $MOEFORGE_CACHE_DIR, else the XDG cache dir).
    /// list, stats and verify exit non-zero when an entry is corrupt.
    Cache {
        #[command(subcommand)]
        op: CacheOp,
    },
}

#[derive(Subcommand)]
enum CacheOp {
    /// One line per entry: key, size, whether it passes its checksum.
    List,
    /// Entry count, total size and corrupt entries.
    Stats,
    /// Check every entry against its checksum; name each corrupt one and why.
    Verify,
    /// Remove the entries that fail their checksum, and only those.
    PruneCorrupt,
    /// Remove every entry.
    Clear,
}

/// A spec given on the command line, field by field.
struct SpecArgs {
    sizes: [Option<u32>; 4],
    formats: Vec<WeightFormat>,
    act_dtype: Option<ActDtype>,
    activation: Option<Activation>,
    bias: bool,
    shared: (u32, bool),
    dequant: Option<DequantVariant>,
}

/// Exit status of a command used wrongly (bad flags, an invalid spec, an empty selection).
const USAGE: u8 = 2;

mod profile;
mod warm;

/// `warm`'s spec: the fields of one spec, as flags (and as the keys of `--specs`' objects).
#[derive(clap::Args, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFlags {
    /// The spec's hidden size (with --intermediate, --experts, --top-k: all four, or --specs).
    #[arg(long)]
    hidden: Option<u32>,
    /// The spec's intermediate (expert FFN) size.
    #[arg(long)]
    intermediate: Option<u32>,
    /// The spec's expert count.
    #[arg(long)]
    experts: Option<u32>,
    /// The spec's experts per token.
    #[arg(long)]
    top_k: Option<u32>,
    /// Weight formats, one spec each (default: bf16).
    #[arg(long, value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    format: Vec<String>,
    /// Activation dtype (bf16, fp16; default: the format's).
    #[arg(long)]
    act_dtype: Option<String>,
    /// Activation (silu, gelu_tanh, swiglu_oai; default: silu).
    #[arg(long)]
    activation: Option<String>,
    /// Per-expert biases on w13 and w2.
    #[arg(long)]
    #[serde(default)]
    bias: bool,
    /// Dequant variant (lut, bits, hardware; default: the format's on each arch).
    #[arg(long)]
    dequant: Option<String>,
}

/// `"format": "bf16"` or `"format": ["bf16", "fp8_e4m3"]`.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match serde::Deserialize::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl SpecFlags {
    /// The specs these fields describe (one per format), each checked by the spec builder.
    /// `Err`: what is missing, unknown or invalid.
    fn specs(&self) -> Result<Vec<MoeSpec>, String> {
        let sizes = [self.hidden, self.intermediate, self.experts, self.top_k];
        let [Some(h), Some(i), Some(e), Some(k)] = sizes else {
            const NAMES: [&str; 4] = ["--hidden", "--intermediate", "--experts", "--top-k"];
            let missing: Vec<&str> = NAMES.iter().zip(sizes).filter(|(_, v)| v.is_none()).map(|(n, _)| *n).collect();
            return Err(format!("a spec needs all four sizes (or --specs FILE): {} missing", missing.join(", ")));
        };
        fn parse<T: std::str::FromStr<Err = SpecError>>(v: &Option<String>) -> Result<Option<T>, String> {
            v.as_deref().map(str::parse).transpose().map_err(|e: SpecError| e.to_string())
        }
        let (act_dtype, activation, dequant) = (
            parse::<ActDtype>(&self.act_dtype)?,
            parse::<Activation>(&self.activation)?,
            parse::<DequantVariant>(&self.dequant)?,
        );
        let formats = match self.format.is_empty() {
            true => vec![WeightFormat::Bf16],
            false => self
                .format
                .iter()
                .map(|f| f.parse::<WeightFormat>().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?,
        };
        formats
            .into_iter()
            .map(|f| {
                let mut b = MoeSpec::builder(h, i, e, k).weight_format(f).bias(self.bias);
                if let Some(a) = activation {
                    b = b.activation(a);
                }
                if let Some(d) = act_dtype {
                    b = b.act_dtype(d);
                }
                if let Some(d) = dequant {
                    b = b.dequant(d);
                }
                b.build().map_err(|err| {
                    format!("invalid spec (hidden {h}, intermediate {i}, experts {e}, top_k {k}, format {f}): {err}")
                })
            })
            .collect()
    }
}

/// The specs of `--specs FILE`: a JSON array of [`SpecFlags`] objects.
fn specs_from_file(file: &Path) -> Result<Vec<MoeSpec>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let all: Vec<SpecFlags> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: expected a JSON array of specs ({{\"hidden\": .., \"intermediate\": .., \"experts\": .., \"top_k\": .., \"format\": ..}}): {e}", file.display()))?;
    if all.is_empty() {
        return Err(format!("{}: no spec", file.display()));
    }
    let mut out = Vec::new();
    for (n, s) in all.iter().enumerate() {
        out.extend(s.specs().map_err(|e| format!("{} spec {n}: {e}", file.display()))?);
    }
    Ok(out)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let cli = Cli::parse();
    let cache = DiskCache::new(cli.cache_dir.unwrap_or_else(default_dir));
    match cli.cmd {
        Cmd::Check {
            arch,
            format,
            family,
            hidden,
            intermediate,
            experts,
            top_k,
            act_dtype,
            activation,
            bias,
            shared_experts,
            shared_gate,
            dequant,
            all_geometries: _,
            jobs,
            no_cache,
            list: list_only,
            resources,
            dump,
            tiles,
        } => {
            let jobs = jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
            let shape_ok = |t: &str| {
                let any = MoeSpec::builder(2048, 768, 128, 8).build().expect("a valid spec");
                GemmTiles::for_spec(&any, Arch::Sm90a).parse(t).is_some()
            };
            if let Some(t) = tiles.as_deref().filter(|t| !shape_ok(t)) {
                eprintln!("--tiles {t}: expected bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]][,bmN]");
                return ExitCode::from(USAGE);
            }
            let spec = SpecArgs {
                sizes: [hidden, intermediate, experts, top_k],
                formats: format,
                act_dtype,
                activation,
                bias,
                shared: (shared_experts, shared_gate),
                dequant,
            };
            let mut list = match check_list(&spec) {
                Ok(list) => list,
                Err(msg) => {
                    eprintln!("{msg}");
                    return ExitCode::from(USAGE);
                }
            };
            list.retain(|(_, _, f)| family.is_empty() || family.contains(f));
            if list.is_empty() {
                eprintln!(
                    "moe-jit check: the filters select no kernel module (formats {:?}, families {:?}): nothing to compile",
                    spec.formats.iter().map(|f| f.name()).collect::<Vec<_>>(),
                    family.iter().map(|f| f.name()).collect::<Vec<_>>()
                );
                return ExitCode::from(USAGE);
            }
            if list_only {
                return print_selection(&arch, &list, tiles.as_deref());
            }
            let cache = (!no_cache && !resources).then_some(&cache);
            let opts =
                CheckOptions { jobs: jobs.max(1), resources, dump: dump.as_deref(), tiles: tiles.as_deref(), cache };
            check(&arch, &list, &opts)
        }
        Cmd::Warm { arch, spec, specs, jobs } => {
            let specs = match specs {
                Some(file) => specs_from_file(&file),
                None => spec.specs(),
            };
            let specs = match specs {
                Ok(specs) => specs,
                Err(msg) => {
                    eprintln!("moe-jit warm: {msg}");
                    return ExitCode::from(USAGE);
                }
            };
            let jobs = jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
            warm::warm(&cache, &specs, &arch, jobs.max(1))
        }
        Cmd::Profile { spec, specs } => match specs.map_or_else(|| spec.specs(), |f| specs_from_file(&f)) {
            Ok(specs) => profile::profile(&cache, &specs),
            Err(msg) => {
                eprintln!("moe-jit profile: {msg}");
                ExitCode::from(USAGE)
            }
        },
        Cmd::Cache { op } => cache_op(&cache, op),
    }
}

/// What `check` renders: (geometry, spec, family) in a stable order. The reference set (filtered
/// by format) when no size is given, else the command line's spec in every family and dequant
/// variant it supports. `Err`: a message for an incomplete or invalid spec.
fn check_list(args: &SpecArgs) -> Result<Vec<(&'static str, MoeSpec, KernelFamily)>, String> {
    const SIZES: [&str; 4] = ["--hidden", "--intermediate", "--experts", "--top-k"];
    let given: Vec<u32> = args.sizes.iter().flatten().copied().collect();
    if given.is_empty() {
        let custom = args.bias || args.shared != (0, false);
        if args.act_dtype.is_some() || args.activation.is_some() || args.dequant.is_some() || custom {
            return Err("--act-dtype, --activation, --bias and --dequant describe a spec of your own: give --hidden, \
                        --intermediate, --experts and --top-k too"
                .into());
        }
        let keep = |s: &MoeSpec| args.formats.is_empty() || args.formats.contains(&s.weight_format());
        return Ok(reference_variants().into_iter().filter(|(_, s, _)| keep(s)).collect());
    }
    if given.len() < 4 {
        let missing: Vec<&str> = SIZES.iter().zip(args.sizes).filter(|(_, v)| v.is_none()).map(|(n, _)| *n).collect();
        return Err(format!("a spec needs all four sizes: {} missing", missing.join(", ")));
    }
    let [h, i, e, k] = [given[0], given[1], given[2], given[3]];
    let formats = if args.formats.is_empty() { vec![WeightFormat::Bf16] } else { args.formats.clone() };
    let invalid = |f: WeightFormat, err: SpecError| {
        format!("invalid spec (hidden {h}, intermediate {i}, experts {e}, top_k {k}, format {f}): {err}")
    };
    let mut out = Vec::new();
    for f in formats {
        let mut b = MoeSpec::builder(h, i, e, k).weight_format(f).bias(args.bias);
        if let Some(a) = args.activation {
            b = b.activation(a);
        }
        if let Some(d) = args.act_dtype {
            b = b.act_dtype(d);
        }
        let base = match args.dequant {
            Some(d) => b.dequant(d).build(),
            None => b.build(),
        }
        .and_then(|s| s.with_shared_experts(args.shared.0, args.shared.1))
        .map_err(|err| invalid(f, err))?;
        match args.dequant {
            Some(_) => out.push(("spec", base, KernelFamily::WarpDecode)),
            // Every dequant variant the format has (a spec naming the arch's default renders the
            // same source as `base`).
            None => out.extend(
                f.dequant_variants()
                    .iter()
                    .filter_map(|&d| b.dequant(d).build().ok())
                    .map(|s| ("spec", s, KernelFamily::WarpDecode)),
            ),
        }
        out.extend(
            KernelFamily::ALL
                .into_iter()
                .filter(|&fam| fam != KernelFamily::WarpDecode && family_supports(fam, &base))
                .map(|fam| ("spec", base, fam)),
        );
    }
    Ok(out)
}

/// One line of `check`'s output and whether it counts as compiled, failed or skipped.
enum Line {
    Ok { line: String, hit: bool },
    Skipped(String),
    Failed(String),
}

/// How `check` compiles: threads, what it reports and keeps, grouped tiles to override, and the
/// cache it goes through (`None`: NVRTC for every module).
struct CheckOptions<'a> {
    jobs: usize,
    resources: bool,
    dump: Option<&'a Path>,
    tiles: Option<&'a str>,
    cache: Option<&'a DiskCache>,
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

/// `check --list`: one line per module the selection renders (or an arch lacks), nothing compiled.
fn print_selection(archs: &[Arch], list: &[(&'static str, MoeSpec, KernelFamily)], tiles: Option<&str>) -> ExitCode {
    let (mut n, mut skipped, mut failed) = (0, 0, 0);
    for (geo, spec, family, arch, large) in check_jobs(archs, list, tiles) {
        match render_job(&spec, family, arch, large, tiles) {
            Ok(src) => {
                n += 1;
                println!("{geo:<14} {:<56} {arch}", src.name);
            }
            Err(e @ CodegenError::DequantUnavailable { .. }) => {
                skipped += 1;
                println!("skip  {geo:<14} {} {family} {arch}: {e}", spec.id());
            }
            Err(e) => {
                failed += 1;
                println!("FAIL  {geo:<14} {} {family} {arch}\n{e}", spec.id());
            }
        }
    }
    println!("{n} modules to compile, {skipped} unavailable on their arch, {failed} failed to render");
    if failed > 0 || n == 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// What `check` compiles: each (geometry, spec, family) once per arch, then (without `--tiles`)
/// the grouped family's large-step module where the spec has one on the arch (weights the
/// producer warpgroup decodes, sm_90a), which the layer loads beside its default: `large` true.
fn check_jobs(
    archs: &[Arch],
    list: &[(&'static str, MoeSpec, KernelFamily)],
    tiles: Option<&str>,
) -> Vec<(&'static str, MoeSpec, KernelFamily, Arch, bool)> {
    let has_large = |s: &MoeSpec, f: KernelFamily, a: Arch| {
        f == KernelFamily::GroupedGemm && tiles.is_none() && large_step_tiles(s, a).is_some()
    };
    let mut jobs = Vec::new();
    for large in [false, true] {
        for &(g, s, f) in list {
            for &a in archs {
                if !large || has_large(&s, f, a) {
                    jobs.push((g, s, f, a, large));
                }
            }
        }
    }
    jobs
}

/// The source of one of `check_jobs`' entries.
fn render_job(
    spec: &MoeSpec,
    family: KernelFamily,
    arch: Arch,
    large: bool,
    tiles: Option<&str>,
) -> Result<moe_codegen::KernelSource, CodegenError> {
    match large_step_tiles(spec, arch).filter(|_| large) {
        Some(t) => render_grouped(spec, arch, t),
        None => render_for_check(spec, family, arch, tiles),
    }
}

fn check(archs: &[Arch], list: &[(&'static str, MoeSpec, KernelFamily)], opts: &CheckOptions) -> ExitCode {
    let CheckOptions { jobs, resources, dump, tiles, cache } = *opts;
    let tk = match toolkit() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!("NVRTC {}.{}, headers in {}", tk.nvrtc_version.0, tk.nvrtc_version.1, tk.include.display());
    match cache {
        Some(c) => println!("kernel cache: {}", c.dir().display()),
        None => println!("kernel cache: not used (--no-cache or --resources)"),
    }
    let list = check_jobs(archs, list, tiles);
    if let Some(dir) = dump {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("cannot create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    let t_all = std::time::Instant::now();
    let one = |&(geo, spec, family, arch, large): &(&str, MoeSpec, KernelFamily, Arch, bool)| -> Line {
        let t0 = std::time::Instant::now();
        let src = match render_job(&spec, family, arch, large, tiles) {
            Ok(src) => src,
            Err(e @ CodegenError::DequantUnavailable { .. }) => {
                return Line::Skipped(format!("skip  {geo:<14} {} {family} {arch}: {e}", spec.id()))
            }
            Err(e) => return Line::Failed(format!("FAIL  {geo:<14} {} {family} {arch}\n{e}", spec.id())),
        };
        let copts = CompileOptions::for_arch(tk, arch);
        let (cubin, log, how) = match cache {
            Some(c) => match c.get_or_compile(&src, &copts) {
                Ok((cubin, o)) => (cubin, None, o),
                Err(err) => return Line::Failed(format!("FAIL  {geo:<14} {} {family} {arch}\n{err}", src.name)),
            },
            None => match compile(&src, &copts) {
                Ok(c) => (c.cubin, Some(c.log), Outcome::Miss),
                Err(err) => return Line::Failed(format!("FAIL  {geo:<14} {} {family} {arch}\n{err}", src.name)),
            },
        };
        // Every entry point the host launches is in the binary (read from its ELF symbols, so a
        // cached CUBIN is checked as well as a fresh one).
        let mut want = src.entry_points.clone();
        want.sort();
        match cubin_entry_points(&cubin) {
            Ok(got) if got == want => {}
            Ok(got) => {
                return Line::Failed(format!(
                    "FAIL  {geo:<14} {} {arch}: the CUBIN defines kernels {got:?}, expected {want:?}",
                    src.name
                ))
            }
            Err(e) => return Line::Failed(format!("FAIL  {geo:<14} {} {arch}: not a CUBIN: {e}", src.name)),
        }
        let how = match how {
            Outcome::Hit => "cached",
            Outcome::Miss => "nvrtc",
            Outcome::Rebuilt => "REBUILT",
        };
        let mut line = format!(
            "ok    {geo:<14} {:<56} {arch:<8} {:>7} B cubin  {how:<7} {:>6} ms",
            src.name,
            cubin.len(),
            t0.elapsed().as_millis()
        );
        if let Some(dir) = dump {
            let base = dir.join(format!("{}.{arch}", src.name));
            let written = std::fs::write(base.with_extension(format!("{arch}.cubin")), &cubin)
                .and_then(|_| std::fs::write(base.with_extension(format!("{arch}.cu")), &src.source));
            if let Err(e) = written {
                return Line::Failed(format!("FAIL  cannot write into {}: {e}", dir.display()));
            }
        }
        if let (true, Some(log)) = (resources, log) {
            let code = cubin_code_sizes(&cubin).unwrap_or_default();
            for (f, regs, spill, stack) in resource_report(&log) {
                let bytes = code.iter().find(|(k, _)| *k == f).map_or(0, |&(_, b)| b);
                line += &format!(
                    "\n        {f:<20} {regs:>3} regs  {spill:>4} B spill  {stack:>4} B stack  {bytes:>6} B code"
                );
            }
            // ptxas warnings and performance notes, e.g. wgmma serialized (C7518).
            for w in log.lines().filter(|l| l.contains("warning") || l.contains("Performance Loss")) {
                line += &format!("\n        {w}");
            }
        }
        Line::Ok { line, hit: how == "cached" }
    };
    // Compile on `jobs` threads; print in list order as results arrive.
    let results: Vec<std::sync::Mutex<Option<Line>>> = list.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Condvar::new();
    let lock = std::sync::Mutex::new(());
    let (mut ok, mut hits, mut failed, mut skipped) = (0, 0, 0, 0);
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
                Line::Ok { line, hit } => {
                    ok += 1;
                    hits += usize::from(hit);
                    println!("{line}");
                }
                Line::Skipped(l) => {
                    skipped += 1;
                    println!("{l}");
                }
                Line::Failed(l) => {
                    failed += 1;
                    println!("{l}");
                }
            }
        }
    });
    let rebuilt = cache.map_or(0, |c| c.counts().rebuilt);
    println!(
        "{skipped} skipped (the arch lacks the variant); {:.1} s on {jobs} threads",
        t_all.elapsed().as_secs_f64()
    );
    println!(
        "{ok} variants ok ({hits} from the cache, {} compiled by NVRTC{}), {failed} failed",
        ok - hits,
        if rebuilt > 0 { format!(", {rebuilt} corrupt cache entries rebuilt") } else { String::new() }
    );
    if failed > 0 {
        ExitCode::FAILURE
    } else if ok == 0 {
        eprintln!("moe-jit check: nothing compiled: every variant selected is unavailable on {archs:?}");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn cache_op(c: &DiskCache, op: CacheOp) -> ExitCode {
    let hint = "remove them with `moe-jit cache prune-corrupt` (they are rebuilt when next needed)";
    let res = match op {
        CacheOp::List => c.list().map(|entries| {
            for e in &entries {
                let state = match &e.problem {
                    None => "ok".to_string(),
                    Some(why) => format!("CORRUPT: {why}"),
                };
                println!("{}  {:>9} B  {state}", e.key, e.bytes);
            }
            println!("{} entries in {}", entries.len(), c.dir().display());
            entries.iter().filter(|e| !e.valid).count()
        }),
        CacheOp::Stats => c.list().map(|entries| {
            let bytes: u64 = entries.iter().map(|e| e.bytes).sum();
            let bad = entries.iter().filter(|e| !e.valid).count();
            println!("{}: {} entries, {} bytes, {} corrupt", c.dir().display(), entries.len(), bytes, bad);
            bad
        }),
        CacheOp::Verify => c.list().map(|entries| {
            let bad: Vec<_> = entries.iter().filter(|e| !e.valid).collect();
            for e in &bad {
                println!("CORRUPT {}: {}", c.path_of(&e.key).display(), e.problem.as_deref().unwrap_or("?"));
            }
            println!("{} entries checked in {}, {} corrupt", entries.len(), c.dir().display(), bad.len());
            bad.len()
        }),
        CacheOp::PruneCorrupt => c.prune_corrupt().map(|removed| {
            for e in &removed {
                println!("removed {} ({})", c.path_of(&e.key).display(), e.problem.as_deref().unwrap_or("?"));
            }
            println!("removed {} corrupt entries from {}", removed.len(), c.dir().display());
            0
        }),
        CacheOp::Clear => c.clear().map(|n| {
            println!("removed {n} files from {}", c.dir().display());
            0
        }),
    };
    match res {
        Ok(0) => ExitCode::SUCCESS,
        Ok(bad) => {
            eprintln!("{bad} corrupt cache entries in {}: {hint}", c.dir().display());
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
