//! Every supported (family, format) variant of every reference geometry compiles with NVRTC
//! for sm_90a, sm_100a and sm_120a: no GPU needed.

use moe_codegen::{render, variants, Arch, REFERENCE_GEOMETRIES};
use moe_runtime::jit::resource_report;
use moe_runtime::toolkit::toolkit;
use moe_runtime::{compile, CompileOptions};

#[test]
fn every_variant_compiles_for_every_arch() {
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let jobs: Vec<_> = REFERENCE_GEOMETRIES
        .iter()
        .flat_map(|&(_, h, i, e, k)| variants(h, i, e, k))
        .flat_map(|(spec, fam)| Arch::ALL.map(|a| (spec, fam, a)))
        .collect();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let failures: Vec<String> = std::thread::scope(|s| {
        let chunks: Vec<_> = jobs.chunks(jobs.len().div_ceil(threads)).collect();
        let hs: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for &(spec, fam, arch) in chunk {
                        let src = render(&spec, fam, arch).unwrap();
                        match compile(&src, &CompileOptions::for_arch(tk, arch)) {
                            Ok(c) => {
                                assert!(c.cubin.starts_with(b"\x7fELF"));
                                // ptxas reports every entry point (registers and spills: `moe-jit check --resources`).
                                let report = resource_report(&c.log);
                                let mut names: Vec<_> = report.into_iter().map(|r| r.0).collect();
                                let mut want = src.entry_points.clone();
                                names.sort();
                                want.sort();
                                assert_eq!(names, want, "{}: {}", src.name, c.log);
                            }
                            Err(e) => bad.push(format!("{} {arch}: {e}", src.name)),
                        }
                    }
                    bad
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{} of {} failed:\n{}", failures.len(), jobs.len(), failures.join("\n"));
}

/// The warp-specialised grouped GEMMs' options that are not defaults (so not among the variants
/// above): 2-block clusters and a consumer warpgroup lag, each compiled for sm_90a in each format
/// the grouped family takes.
#[test]
fn warp_specialised_options_compile_for_sm90a() {
    use moe_codegen::{grouped_support, render_grouped, GemmTiles, MoeSpec, WeightFormat};
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let mut compiled = 0;
    for &(_, h, i, e, k) in &REFERENCE_GEOMETRIES {
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Fp8E4m3B128] {
            let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
            if grouped_support(&spec).is_err() {
                continue;
            }
            let defaults = GemmTiles::for_spec(&spec, Arch::Sm90a);
            for tiles in [GemmTiles { cluster: 2, ..defaults }, GemmTiles { lag: 2, ..defaults }] {
                let Ok(src) = render_grouped(&spec, Arch::Sm90a, tiles) else { continue };
                let c = compile(&src, &CompileOptions::for_arch(tk, Arch::Sm90a))
                    .unwrap_or_else(|e| panic!("{}: {e}", src.name));
                assert!(c.cubin.starts_with(b"\x7fELF"));
                compiled += 1;
            }
        }
    }
    assert!(compiled >= 12, "only {compiled} variants rendered");
}
