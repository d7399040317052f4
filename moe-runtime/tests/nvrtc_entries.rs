//! A layer compiles each kernel as its own module (`CompileOptions::for_entry`, in parallel):
//! every entry point of both families, for every arch, compiles alone and its CUBIN defines that
//! kernel and no other. No GPU needed.

use moe_codegen::{render, Arch, KernelFamily, MoeSpec, WeightFormat};
use moe_runtime::jit::cubin_entry_points;
use moe_runtime::toolkit::toolkit;
use moe_runtime::{compile, CompileOptions};

#[test]
fn each_entry_point_compiles_alone() {
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    // Small geometries: the point is the guards, not the sizes.
    let specs = [
        MoeSpec::builder(256, 128, 8, 2).build().unwrap(),
        MoeSpec::builder(256, 128, 8, 2).weight_format(WeightFormat::Fp8E4m3).build().unwrap(),
        MoeSpec::builder(256, 128, 8, 2).weight_format(WeightFormat::Mxfp4).build().unwrap(),
    ];
    let mut jobs = Vec::new();
    for spec in specs {
        for family in KernelFamily::ALL {
            for arch in Arch::ALL {
                let Ok(src) = render(&spec, family, arch) else { continue };
                for entry in src.entry_points.clone() {
                    jobs.push((src.clone(), entry));
                }
            }
        }
    }
    assert!(jobs.len() > 40, "{} jobs", jobs.len());
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((src, entry)) = jobs.get(i) else { return };
                let opts = CompileOptions::for_arch(tk, src.arch).for_entry(entry);
                let c = compile(src, &opts).unwrap_or_else(|e| panic!("{} {entry} on {}: {e}", src.name, src.arch));
                let defined = cubin_entry_points(&c.cubin).unwrap();
                assert_eq!(defined, vec![entry.clone()], "{} {entry} on {}", src.name, src.arch);
            });
        }
    });
}

/// The parameter structs' layout asserts bite: a C declaration that drifts from the Rust struct
/// (a field widened, as a hand edit of one side would do) fails NVRTC, naming the field.
#[test]
fn a_parameter_struct_that_drifts_does_not_compile() {
    use moe_codegen::params::{DownParams, KernelParams};
    let tk = toolkit().expect("NVRTC: run scripts/setup-cuda.sh");
    let spec = MoeSpec::builder(256, 128, 8, 2).build().unwrap();
    let mut src = render(&spec, KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    let decl = DownParams::c_decl();
    assert!(src.source.contains(&decl));
    let opts = CompileOptions::for_arch(tk, src.arch).for_entry("moe_down");
    compile(&src, &opts).expect("the rendered module compiles");
    src.source = src.source.replace(&decl, &decl.replace("    int m;\n", "    long long m;\n"));
    let err = compile(&src, &opts).expect_err("a drifted layout must not compile").to_string();
    assert!(err.contains("DownParams::m"), "{err}");
}
