//! `#[moe_kernel]`'s `load` on a real GPU: the layer is built from the sources embedded at compile
//! time (nothing is rendered at run time), has the grouped family, and matches the f64 CPU
//! reference; an undeclared arch is a typed error. Ignored without a GPU; run with
//! `cargo test --test gpu_macro -- --ignored` on a GPU machine. Each test fails (never passes) when
//! no GPU is found.
//!
//! `render_count` counts renders in the whole process: keep every test here render-free, or the
//! counts of concurrently running tests would mix.

use moeforge::codegen::render_count;
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{fresh_seed, random_step, random_weights};
use moeforge::runtime::{Device, MoeLayer, RuntimeError};
use moeforge::{moe_kernel, Arch, KernelFamily};

type Bf = half::bf16;

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

/// Small enough to JIT quickly; the grouped family accepts it (hidden a multiple of 64, hidden and
/// intermediate whole 128-byte k-tiles in bf16). Families default to all three.
#[moe_kernel(hidden = 256, intermediate = 128, experts = 8, top_k = 2, format = bf16)]
struct SmallBf16;

/// One step through `family`, y poisoned with NaN so that an unwritten output cannot pass.
fn run_step(layer: &MoeLayer, family: KernelFamily, x: &[f32], ids: &[i32], rw: &[f32]) -> Vec<f32> {
    let s = layer.stream();
    let xs: Vec<Bf> = x.iter().map(|&v| Bf::from_f32(v)).collect();
    let dx = s.clone_htod(&xs).unwrap();
    let did = s.clone_htod(ids).unwrap();
    let dw = s.clone_htod(rw).unwrap();
    let mut y = s.clone_htod(&vec![Bf::from_f32(f32::NAN); x.len()]).unwrap();
    layer.forward_family(family, &dx, &did, &dw, &mut y).unwrap_or_else(|e| panic!("{family}: {e}"));
    s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn macro_layer_loads_the_embedded_sources_and_renders_nothing() {
    let dev = gpu();
    let spec = SmallBf16::SPEC;
    // Every family the spec supports (the fused one too, since it became a default).
    assert_eq!(SmallBf16::FAMILIES, &KernelFamily::ALL);
    let seed = fresh_seed();
    let w = random_weights(&spec, seed);

    let before = render_count();
    let layer = SmallBf16::load(&dev, &w).unwrap_or_else(|e| panic!("load on {}: {e}", dev.arch()));
    assert_eq!(render_count(), before, "load rendered a kernel at run time");
    assert_eq!(layer.grouped_available(), Ok(()), "the embedded grouped source gives the layer that family");
    let embedded = SmallBf16::kernel_source(KernelFamily::GroupedGemm, dev.arch()).unwrap();
    assert_eq!(layer.grouped_tiles(), embedded.grouped_tiles);

    for (m, family) in [(1usize, KernelFamily::WarpDecode), (64, KernelFamily::GroupedGemm)] {
        let step_seed = seed.wrapping_add(m as u64);
        let (x, ids, rw) = random_step(&spec, m, 0.3, step_seed);
        let want = moe_forward(&spec, &w, &x, &ids, &rw);
        let got = run_step(&layer, family, &x, &ids, &rw);
        let unwritten = got.iter().filter(|v| !v.is_finite()).count();
        assert_eq!(unwritten, 0, "{family} m={m}: {unwritten} outputs unwritten or non-finite (seed {step_seed})");
        let (rel, cos) = compare(&got, &want);
        println!("{} {family} m={m}: rel_l2={rel:.3e} cos={cos:.8} seed={step_seed}", spec.id());
        assert!(rel < 1e-2 && cos > 0.9999, "{family} m={m}: rel_l2 {rel:.3e}, cos {cos:.8} (seed {step_seed})");
    }
    // `forward` at M = 1 picks warp decode, the family that step ran through above.
    assert_eq!(layer.family_for(1), Some(KernelFamily::WarpDecode));
    assert_eq!(render_count(), before, "a step rendered a kernel at run time");
}

#[moe_kernel(hidden = 256, intermediate = 128, experts = 8, top_k = 2, archs = [sm_90a])]
struct OnlySm90;

#[moe_kernel(hidden = 256, intermediate = 128, experts = 8, top_k = 2, archs = [sm_120a])]
struct OnlySm120;

/// A device whose arch was not declared: `RuntimeError::MissingSource`, not a panic.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn undeclared_arch_is_a_typed_error() {
    let dev = gpu();
    let arch = dev.arch();
    let w = random_weights(&OnlySm90::SPEC, fresh_seed());
    let before = render_count();
    let r = if arch == Arch::Sm90a { OnlySm120::load(&dev, &w) } else { OnlySm90::load(&dev, &w) };
    match r {
        Err(RuntimeError::MissingSource { family: KernelFamily::WarpDecode, arch: a }) => assert_eq!(a, arch),
        Err(e) => panic!("expected MissingSource for warp_decode on {arch}, got {e}"),
        Ok(_) => panic!("a layer declared without {arch} loaded on {arch}"),
    }
    assert_eq!(render_count(), before);
}
