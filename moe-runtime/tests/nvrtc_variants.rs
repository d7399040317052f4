//! Every kernel module of the reference set ([`reference_variants`]: every supported (family,
//! format) of every reference geometry, every dequant variant on Qwen3-30B-A3B) compiles with
//! NVRTC for sm_90a, sm_100a and sm_120a: no GPU needed. `moe-jit check` compiles the same set by
//! default; both go through the disk cache (`$MOEFORGE_CACHE_DIR`), so a run that does both
//! compiles each module once.

use moe_codegen::{render, variants, Arch, CodegenError, KernelSource, REFERENCE_GEOMETRIES};
use moe_runtime::cache::{DiskCache, Outcome};
use moe_runtime::jit::{cubin_code_sizes, cubin_entry_points, reference_variants};
use moe_runtime::toolkit::toolkit;
use moe_runtime::CompileOptions;
use std::collections::{HashMap, HashSet};

fn jobs() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Every module of the reference set for every arch, rendered; those an arch lacks are left out
/// (their count second).
fn reference_sources() -> (Vec<KernelSource>, usize) {
    let mut out = Vec::new();
    let mut unavailable = 0;
    for (_, spec, family) in reference_variants() {
        for arch in Arch::ALL {
            match render(&spec, family, arch) {
                Ok(src) => out.push(src),
                Err(CodegenError::DequantUnavailable { .. }) => unavailable += 1,
                Err(e) => panic!("{} {family} {arch}: {e}", spec.id()),
            }
        }
    }
    (out, unavailable)
}

/// The set holds every variant the old per-geometry lists held, each module once.
#[test]
fn reference_set_covers_every_variant_of_every_geometry_once() {
    let (sources, _) = reference_sources();
    let mut by_text: HashMap<(Arch, &str), &str> = HashMap::new();
    for s in &sources {
        if let Some(other) = by_text.insert((s.arch, s.source.as_str()), &s.name) {
            panic!("{} and {other} render the same source for {}: it would be compiled twice", s.name, s.arch);
        }
    }
    let names: HashSet<(Arch, &str)> = sources.iter().map(|s| (s.arch, s.name.as_str())).collect();
    assert_eq!(names.len(), sources.len(), "two modules share a name");
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        for (spec, family) in variants(h, i, e, k) {
            for arch in Arch::ALL {
                let src = render(&spec, family, arch).unwrap();
                assert!(
                    by_text.contains_key(&(arch, src.source.as_str())),
                    "{geo}: {} for {arch} is not in the reference set",
                    src.name
                );
            }
        }
    }
}

#[test]
fn every_variant_compiles_for_every_arch() {
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let (sources, unavailable) = reference_sources();
    let items: Vec<_> = sources
        .into_iter()
        .map(|s| {
            let o = CompileOptions::for_arch(tk, s.arch);
            (s, o)
        })
        .collect();
    let cache = DiskCache::open_default();
    let t0 = std::time::Instant::now();
    let results = cache.get_or_compile_all(&items, jobs());
    let mut failures = Vec::new();
    for ((src, _), r) in items.iter().zip(&results) {
        match r {
            Ok((cubin, _)) => {
                // Every entry point the host launches is a kernel of the binary.
                let mut want = src.entry_points.clone();
                want.sort();
                match cubin_entry_points(cubin) {
                    Ok(got) if got == want => {}
                    got => failures.push(format!("{} {}: kernels {got:?}, expected {want:?}", src.name, src.arch)),
                }
                // ... each with a code section of its own, of whole 16-byte instructions.
                let code = cubin_code_sizes(cubin).unwrap_or_default();
                for entry in &want {
                    match code.iter().find(|(k, _)| k == entry) {
                        Some(&(_, b)) if b > 0 && b % 16 == 0 => {}
                        c => failures.push(format!("{} {} {entry}: code section {c:?}", src.name, src.arch)),
                    }
                }
            }
            Err(e) => failures.push(format!("{} {}: {e}", src.name, src.arch)),
        }
    }
    let hits = results.iter().filter(|r| matches!(r, Ok((_, Outcome::Hit)))).count();
    eprintln!(
        "{} modules ({} from the cache in {}), {unavailable} unavailable on their arch, {:.1} s on {} threads",
        items.len(),
        hits,
        cache.dir().display(),
        t0.elapsed().as_secs_f64(),
        jobs()
    );
    assert!(failures.is_empty(), "{} of {} failed:\n{}", failures.len(), items.len(), failures.join("\n"));
}

#[test]
fn entry_points_of_what_is_no_cubin_are_an_error() {
    assert!(cubin_entry_points(b"not an ELF image").is_err());
    assert!(cubin_entry_points(b"\x7fELF\x02\x01\x01").is_err(), "a header cut short");
    assert!(cubin_code_sizes(b"not an ELF image").is_err());
    assert!(cubin_code_sizes(b"\x7fELF\x02\x01\x01").is_err(), "a header cut short");
}

/// The warp-specialised grouped GEMMs' options that are not defaults (so not among the variants
/// above): 2-block clusters and a consumer warpgroup lag, each compiled for sm_90a in each format
/// the grouped family takes.
#[test]
fn warp_specialised_options_compile_for_sm90a() {
    use moe_codegen::{grouped_support, render_grouped, GemmTiles, MoeSpec, WeightFormat};
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let mut items = Vec::new();
    for &(_, h, i, e, k) in &REFERENCE_GEOMETRIES {
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Fp8E4m3B128] {
            let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
            if grouped_support(&spec).is_err() {
                continue;
            }
            let defaults = GemmTiles::for_spec(&spec, Arch::Sm90a);
            for tiles in [GemmTiles { cluster: 2, ..defaults }, GemmTiles { lag: 2, ..defaults }] {
                let Ok(src) = render_grouped(&spec, Arch::Sm90a, tiles) else { continue };
                items.push((src, CompileOptions::for_arch(tk, Arch::Sm90a)));
            }
        }
    }
    // The large-step tiles of weights the producer decodes (gpt-oss-20b's in 96 x 192).
    for &(_, h, i, e, k) in &REFERENCE_GEOMETRIES {
        for f in [WeightFormat::Mxfp4, WeightFormat::Int8] {
            let spec = MoeSpec::builder(h, i, e, k).weight_format(f).build().unwrap();
            let tiles = moe_codegen::heuristics::large_step_tiles(&spec, Arch::Sm90a).expect("large-step tiles");
            items.push((render_grouped(&spec, Arch::Sm90a, tiles).unwrap(), CompileOptions::for_arch(tk, Arch::Sm90a)));
        }
    }
    assert!(items.len() >= 20, "only {} variants rendered", items.len());
    let results = DiskCache::open_default().get_or_compile_all(&items, jobs());
    for ((src, _), r) in items.iter().zip(results) {
        let (cubin, _) = r.unwrap_or_else(|e| panic!("{}: {e}", src.name));
        assert!(cubin.starts_with(b"\x7fELF"));
    }
}

/// The expert-parallel exchange module of every reference geometry (bf16 activations, and fp16
/// on one; with shared experts and DeepSeek-V3's router on one; with fp8 dispatch where the hidden size allows it) compiles for every arch and defines
/// the kernels the host launches.
#[test]
fn expert_parallel_exchange_compiles_for_every_arch() {
    use moe_codegen::{render_ep, ActDtype, MoeSpec};
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let mut specs: Vec<MoeSpec> =
        REFERENCE_GEOMETRIES.iter().map(|&(_, h, i, e, k)| MoeSpec::builder(h, i, e, k).build().unwrap()).collect();
    specs.push(MoeSpec::builder(2048, 768, 128, 8).act_dtype(ActDtype::Fp16).build().unwrap());
    // Shared experts and the group-limited router (DeepSeek-V3's).
    let deepseek = MoeSpec::builder(7168, 2048, 256, 8).build().unwrap().with_shared_experts(1, false).unwrap();
    specs.push(deepseek.with_router(moe_codegen::Router::deepseek_v3()).unwrap());
    let items: Vec<_> = specs
        .iter()
        .flat_map(|s| [false, true].map(|fp8| (s, fp8)))
        .filter(|&(s, fp8)| !fp8 || s.hidden() % 128 == 0)
        .flat_map(|(s, fp8)| Arch::ALL.map(|a| (render_ep(s, a, fp8).unwrap(), CompileOptions::for_arch(tk, a))))
        .collect();
    let results = DiskCache::open_default().get_or_compile_all(&items, jobs());
    for ((src, _), r) in items.iter().zip(results) {
        let (cubin, _) = r.unwrap_or_else(|e| panic!("{} {}: {e}", src.name, src.arch));
        let mut want = src.entry_points.clone();
        want.sort();
        assert_eq!(cubin_entry_points(&cubin).unwrap(), want, "{} {}", src.name, src.arch);
    }
}

/// A spread of the grouped family's tile space (`GemmTiles::space`, what a profiler would time)
/// compiles: every 24th configuration of Qwen3-30B-A3B in bf16 and fp8 on sm_90a, and every 8th
/// of mxfp4 on sm_120a.
#[test]
fn a_spread_of_the_tile_space_compiles() {
    use moe_codegen::{render_grouped, GemmTiles, MoeSpec, WeightFormat};
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let mut items = Vec::new();
    for (f, arch, every) in [
        (WeightFormat::Bf16, Arch::Sm90a, 24),
        (WeightFormat::Fp8E4m3, Arch::Sm90a, 24),
        (WeightFormat::Mxfp4, Arch::Sm120a, 8),
    ] {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(f).build().unwrap();
        for t in GemmTiles::space(&spec, arch).into_iter().step_by(every) {
            items.push((render_grouped(&spec, arch, t).unwrap(), CompileOptions::for_arch(tk, arch)));
        }
    }
    assert!(items.len() >= 20, "{} configurations", items.len());
    let results = DiskCache::open_default().get_or_compile_all(&items, jobs());
    for ((src, _), r) in items.iter().zip(results) {
        let (cubin, _) = r.unwrap_or_else(|e| panic!("{}: {e}", src.name));
        assert!(cubin.starts_with(b"\x7fELF"), "{}", src.name);
    }
}
