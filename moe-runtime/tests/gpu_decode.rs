//! Warp decode on a real GPU against the f64 CPU reference. Ignored without a GPU; run with
//! `cargo test -- --ignored` on a GPU machine. Each test fails (never passes) when no GPU is found.

use moe_codegen::{
    bulk_smem_bytes, render_warp_decode, resident_rows, Activation, DecodeTiles, MoeSpec, WeightFormat,
    REFERENCE_GEOMETRIES,
};
use moe_runtime::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use moe_runtime::cudarc::driver::CudaSlice;
use moe_runtime::reference::{compare, moe_forward};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::{ActElem, Device, HostWeights, MoeLayer, RuntimeError};

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

struct Step<T> {
    x: CudaSlice<T>,
    ids: CudaSlice<i32>,
    w: CudaSlice<f32>,
    y: CudaSlice<T>,
}

/// Upload a step; `y` is poisoned with NaN so that an unwritten output cannot pass.
fn upload<T: ActElem>(layer: &MoeLayer, x: &[f32], ids: &[i32], w: &[f32]) -> Step<T> {
    let s = layer.stream();
    let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let poison = vec![T::from_f32(f32::NAN); x.len()];
    Step {
        x: s.clone_htod(&xs).unwrap(),
        ids: s.clone_htod(ids).unwrap(),
        w: s.clone_htod(w).unwrap(),
        y: s.clone_htod(&poison).unwrap(),
    }
}

fn run<T: ActElem>(layer: &MoeLayer, st: &mut Step<T>) -> Vec<f32> {
    layer.forward(&st.x, &st.ids, &st.w, &mut st.y).unwrap();
    layer.stream().clone_dtoh(&st.y).unwrap().into_iter().map(T::to_f32).collect()
}

/// Runs the step with the default token-tile cap and with tiles of one token; returns the worse of the two.
fn check_case<T: ActElem>(layer: &mut MoeLayer, w: &HostWeights, m: usize, skew: f64, seed: u64) -> (f64, f64) {
    let spec = *layer.spec();
    let (x, ids, rw) = random_step(&spec, m, skew, seed);
    let want = moe_forward(&spec, w, &x, &ids, &rw);
    let mut worst = (0f64, 1f64);
    for cap in [1, moe_runtime::DEFAULT_MAX_TOKEN_TILE] {
        layer.set_max_token_tile(cap).unwrap();
        let mut st = upload::<T>(layer, &x, &ids, &rw);
        let got = run(layer, &mut st);
        let unwritten = got.iter().filter(|v| !v.is_finite()).count();
        assert_eq!(unwritten, 0, "{} cap={cap} m={m}: {unwritten} outputs unwritten or non-finite", spec.id());
        let (rel, cos) = compare(&got, &want);
        worst = (worst.0.max(rel), worst.1.min(cos));
    }
    worst
}

fn layer_cases(dev: &Device, spec: MoeSpec, ms: &[usize]) {
    layer_cases_with(dev, spec, DecodeTiles::for_spec(&spec), ms)
}

fn layer_cases_with(dev: &Device, spec: MoeSpec, tiles: DecodeTiles, ms: &[usize]) {
    layer_cases_opts(dev, spec, tiles, ms, true)
}

/// As `layer_cases_with`; `resident` false keeps one-token steps on the split kernels.
fn layer_cases_opts(dev: &Device, spec: MoeSpec, tiles: DecodeTiles, ms: &[usize], resident: bool) {
    let seed = fresh_seed();
    let w = random_weights(&spec, seed);
    let src = render_warp_decode(&spec, dev.arch(), tiles).unwrap();
    let mut layer = MoeLayer::with_source(dev, spec, src, &w).unwrap();
    layer.set_resident_one_token(resident);
    let (gu, dn) = bulk_smem_bytes(&spec, &tiles);
    let fits = |n: u32| n <= dev.max_smem_optin();
    assert_eq!(layer.bulk_one_token(), (tiles.bulk_gu && fits(gu), tiles.bulk_dn && fits(dn)));
    // Warp decode under test: keep every step off the grouped family.
    layer.set_prefill_threshold(usize::MAX);
    layer.set_validate_routing(true);
    for (n, &m) in ms.iter().enumerate() {
        let case_seed = seed.wrapping_add(1 + n as u64);
        let (rel, cos) = match spec.act_dtype() {
            moe_codegen::ActDtype::Bf16 => check_case::<half::bf16>(&mut layer, &w, m, 0.3, case_seed),
            moe_codegen::ActDtype::Fp16 => check_case::<half::f16>(&mut layer, &w, m, 0.3, case_seed),
        };
        println!("{:<44} m={m:<3} rel_l2={rel:.3e} cos={cos:.8} seed={case_seed} {tiles:?}", spec.id());
        assert!(
            rel <= 5e-3 && cos >= 0.99999,
            "{} m={m}: rel_l2 {rel:.3e}, cos {cos:.8} (seed {case_seed})",
            spec.id()
        );
    }
}

const MS: [usize; 6] = [1, 2, 3, 8, 32, 64];

/// The 16-bit and per-row fp8 formats on every geometry; tests/gpu_formats.rs covers the
/// quantized formats and their dequant variants.
const FORMATS: [WeightFormat; 3] = [WeightFormat::Bf16, WeightFormat::Fp16, WeightFormat::Fp8E4m3];

fn geometry_all_formats(name: &str) {
    let dev = gpu();
    let (_, h, i, e, k) = REFERENCE_GEOMETRIES.iter().copied().find(|g| g.0 == name).unwrap();
    for format in FORMATS {
        let spec = MoeSpec::builder(h, i, e, k).weight_format(format).build().unwrap();
        layer_cases(&dev, spec, &MS);
    }
}

/// The tile options the defaults do not take for these formats: 16 lanes per w13 row in the
/// multi-token gate_up (two items per warp), one row per down item, the early first unit flipped.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn other_decode_tiles_match_reference() {
    let dev = gpu();
    for format in [WeightFormat::Int4G128, WeightFormat::Fp8E4m3, WeightFormat::Bf16] {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
        let d = DecodeTiles::for_spec(&spec);
        let lanes = if d.gu_lanes == 16 { 32 } else { 16 };
        for tiles in [DecodeTiles { gu_lanes: lanes, ..d }, DecodeTiles { dn_rows: 1, gu_early: !d.gu_early, ..d }] {
            layer_cases_with(&dev, spec, tiles, &[1, 2, 3, 8]);
        }
    }
}

/// The bulk one-token pair (`decode_bulk.cuh`) against the reference on Qwen3 with every scale
/// layout and codec (default variants; tests/gpu_formats.rs runs every 4-bit variant through it,
/// the 4-bit default): with the rings the tiles size, with two stages each for some (so that they
/// wrap), and the register pair where the bulk one is the default. Then an out-of-range id at
/// M = 1: skipped and counted.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bulk_one_token_matches_reference() {
    use WeightFormat::*;
    let dev = gpu();
    let mut cases = Vec::new();
    for format in [Bf16, Fp16, Fp8E4m3, Fp8E4m3B128, Mxfp8, Int8, Int8G64, Int4, Int4G128, Int4AsymG64, Nvfp4, Mxfp4] {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
        let d = DecodeTiles::for_spec(&spec);
        let bulk = DecodeTiles { bulk_gu: true, bulk_dn: true, ..d };
        cases.push((spec, bulk));
        if matches!(format, Fp8E4m3 | Int8G64 | Int4G128 | Nvfp4) {
            cases.push((spec, DecodeTiles { bulk_gu_stages: 2, bulk_dn_stages: 2, ..bulk }));
            cases.push((spec, DecodeTiles { bulk_dn_h2: !bulk.bulk_dn_h2, ..bulk }));
        }
        // Each bulk kernel beside the other's register-fed one.
        cases.push((spec, DecodeTiles { bulk_gu: !d.bulk_gu, bulk_dn: d.bulk_gu, ..d }));
    }
    let sources: Vec<_> = cases.iter().map(|(s, t)| render_warp_decode(s, dev.arch(), *t).unwrap()).collect();
    dev.prepare(&sources).unwrap();
    for (spec, tiles) in cases {
        let (gu, dn) = bulk_smem_bytes(&spec, &tiles);
        if (tiles.bulk_gu && gu > dev.max_smem_optin()) || (tiles.bulk_dn && dn > dev.max_smem_optin()) {
            println!("{}: bulk rings of {gu} / {dn} bytes do not fit this device", spec.id());
            continue;
        }
        // The bulk pair under test, not the resident kernel (16-bit weights).
        layer_cases_opts(&dev, spec, tiles, &[1], false);
    }
    let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Int4G128).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let tiles = DecodeTiles { bulk_gu: true, bulk_dn: true, ..DecodeTiles::for_spec(&spec) };
    let mut layer =
        MoeLayer::with_source(&dev, spec, render_warp_decode(&spec, dev.arch(), tiles).unwrap(), &w).unwrap();
    assert_eq!(layer.bulk_one_token(), (true, true));
    layer.set_prefill_threshold(usize::MAX);
    layer.set_validate_routing(false);
    let (x, mut ids, mut rw) = random_step(&spec, 1, 0.0, fresh_seed());
    ids[2] = 128;
    let mut st = upload::<half::bf16>(&layer, &x, &ids, &rw);
    let got = run(&layer, &mut st);
    assert_eq!(layer.take_routing_errors().unwrap(), 1);
    // The reference without that pair: any valid id with a zero weight.
    (ids[2], rw[2]) = ((0..128).find(|e| !ids.contains(e)).unwrap(), 0.0);
    let (rel, cos) = compare(&got, &moe_forward(&spec, &w, &x, &ids, &rw));
    println!("bulk, one id out of range: rel_l2={rel:.3e} cos={cos:.8}");
    assert!(rel <= 5e-3 && cos >= 0.99999);
}

/// The resident one-token kernel (`moe_decode_resident`) against the reference, and the split
/// kernels on the same steps: Qwen3-30B-A3B in bf16 and fp16, a small geometry with biases and
/// gpt-oss's activation, one with gated shared experts, and OLMoE (whose w2 rows do not fit a
/// block of a 132-SM GPU: the layer runs the split kernels). Then a graph of one step replayed on
/// fresh routing (the grid barrier's counters reset between launches) and an id out of range
/// (counted and skipped).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn resident_one_token_matches_reference() {
    let dev = gpu();
    let specs = [
        MoeSpec::builder(2048, 768, 128, 8).build().unwrap(),
        MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Fp16).build().unwrap(),
        MoeSpec::builder(1024, 512, 16, 4).bias(true).activation(Activation::SwigluOai).build().unwrap(),
        MoeSpec::builder(1024, 256, 32, 4).build().unwrap().with_shared_experts(2, true).unwrap(),
        MoeSpec::builder(2048, 1024, 64, 8).build().unwrap(),
    ];
    for spec in specs {
        let w = random_weights(&spec, fresh_seed());
        let src = render_warp_decode(&spec, dev.arch(), DecodeTiles::for_spec(&spec)).unwrap();
        let mut layer = MoeLayer::with_source(&dev, spec, src, &w).unwrap();
        layer.set_prefill_threshold(usize::MAX);
        layer.set_validate_routing(false);
        let fits = resident_rows(&spec, dev.arch(), dev.sm_count(), dev.max_smem_optin()).is_some();
        assert_eq!(layer.resident_one_token(), fits, "{}", spec.id());
        println!("{}: resident kernel {}", spec.id(), if fits { "on" } else { "does not fit" });
        match spec.act_dtype() {
            moe_codegen::ActDtype::Bf16 => resident_cases::<half::bf16>(&mut layer, &w),
            moe_codegen::ActDtype::Fp16 => resident_cases::<half::f16>(&mut layer, &w),
        }
    }
}

fn resident_cases<T: ActElem>(layer: &mut MoeLayer, w: &HostWeights) {
    let spec = *layer.spec();
    let check = |got: &[f32], want: &[f64], what: &str| {
        assert!(got.iter().all(|v| v.is_finite()), "{} {what}: outputs unwritten or non-finite", spec.id());
        let (rel, cos) = compare(got, want);
        println!("{:<44} {what}: rel_l2={rel:.3e} cos={cos:.8}", spec.id());
        assert!(rel <= 5e-3 && cos >= 0.99999, "{} {what}: rel_l2 {rel:.3e}, cos {cos:.8}", spec.id());
    };
    for r in 0..3 {
        let (x, ids, rw) = random_step(&spec, 1, 0.0, fresh_seed() + r);
        let want = moe_forward(&spec, w, &x, &ids, &rw);
        for resident in [true, false] {
            layer.set_resident_one_token(resident);
            let got = run(layer, &mut upload::<T>(layer, &x, &ids, &rw));
            check(&got, &want, if resident { "resident" } else { "split" });
        }
    }
    layer.set_resident_one_token(true);
    // One graph, replayed on fresh inputs written into the captured buffers.
    layer.reserve(1).unwrap();
    let (x, ids, rw) = random_step(&spec, 1, 0.0, fresh_seed());
    let mut st = upload::<T>(layer, &x, &ids, &rw);
    let s = layer.stream().clone();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    layer.forward(&st.x, &st.ids, &st.w, &mut st.y).unwrap();
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("captured a graph");
    for r in 0..3 {
        let (x, ids, rw) = random_step(&spec, 1, 0.0, fresh_seed() + 10 + r);
        s.memcpy_htod(&x.iter().map(|&v| T::from_f32(v)).collect::<Vec<T>>(), &mut st.x).unwrap();
        s.memcpy_htod(&ids, &mut st.ids).unwrap();
        s.memcpy_htod(&rw, &mut st.w).unwrap();
        s.memcpy_htod(&vec![T::from_f32(f32::NAN); x.len()], &mut st.y).unwrap();
        graph.launch().unwrap();
        let got: Vec<f32> = s.clone_dtoh(&st.y).unwrap().into_iter().map(T::to_f32).collect();
        check(&got, &moe_forward(&spec, w, &x, &ids, &rw), &format!("graph replay {r}"));
    }
    // An id out of range: counted, its pair skipped.
    let (x, mut ids, mut rw) = random_step(&spec, 1, 0.0, fresh_seed());
    let experts = spec.experts() as i32;
    ids[1] = experts;
    let got = run(layer, &mut upload::<T>(layer, &x, &ids, &rw));
    assert_eq!(layer.take_routing_errors().unwrap(), 1, "{}", spec.id());
    (ids[1], rw[1]) = ((0..experts).find(|e| !ids.contains(e)).unwrap(), 0.0);
    check(&got, &moe_forward(&spec, w, &x, &ids, &rw), "one id out of range");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn qwen3_30b_a3b_matches_reference() {
    geometry_all_formats("qwen3-30b-a3b");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mixtral_8x7b_matches_reference() {
    geometry_all_formats("mixtral-8x7b");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn olmoe_matches_reference() {
    geometry_all_formats("olmoe");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpt_oss_20b_matches_reference() {
    geometry_all_formats("gpt-oss-20b");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gelu_and_every_token_on_one_expert() {
    let dev = gpu();
    let spec = MoeSpec::builder(1024, 512, 16, 4).activation(moe_codegen::Activation::GeluTanh).build().unwrap();
    layer_cases(&dev, spec, &[1, 5, 64]);
    // skew 1.0 with e / 8 < k: every token draws from the same k experts.
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    // Warp decode under test: keep every step off the grouped family.
    layer.set_prefill_threshold(usize::MAX);
    let (rel, cos) = check_case::<half::bf16>(&mut layer, &w, 40, 1.0, fresh_seed());
    assert!(rel <= 5e-3 && cos >= 0.99999, "rel {rel} cos {cos}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_capture_and_replay() {
    let dev = gpu();
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    // Warp decode under test: keep every step off the grouped family.
    layer.set_prefill_threshold(usize::MAX);
    layer.set_validate_routing(false);
    for cap in [1, moe_runtime::DEFAULT_MAX_TOKEN_TILE] {
        layer.set_max_token_tile(cap).unwrap();
        capture_and_replay(&layer, &w, cap);
    }
}

fn capture_and_replay(layer: &MoeLayer, w: &HostWeights, cap: u32) {
    let spec = *layer.spec();
    let m = 4;
    layer.reserve(m).unwrap();
    let (x, ids, rw) = random_step(&spec, m, 0.0, fresh_seed());
    let mut st = upload::<half::bf16>(layer, &x, &ids, &rw);
    let s = layer.stream().clone();
    // A step larger than reserved is refused inside a capture rather than allocating there.
    let big = 128; // tokens: more than this layer reserved (4)
    let (bx, bids, bw) = random_step(&spec, big, 0.0, fresh_seed());
    let mut bst = upload::<half::bf16>(layer, &bx, &bids, &bw);
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let refused = layer.forward(&bst.x, &bst.ids, &bst.w, &mut bst.y);
    let _ = s.end_capture(CUgraphInstantiate_flags(0));
    assert!(matches!(refused, Err(RuntimeError::NotReserved { m }) if m == big), "{refused:?}");
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    layer.forward(&st.x, &st.ids, &st.w, &mut st.y).unwrap();
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("captured a graph");
    // Replay on fresh inputs written into the captured buffers.
    for r in 0..4 {
        let (x, ids, rw) = random_step(&spec, m, 0.0, fresh_seed() + r);
        let xs: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        s.memcpy_htod(&xs, &mut st.x).unwrap();
        s.memcpy_htod(&ids, &mut st.ids).unwrap();
        s.memcpy_htod(&rw, &mut st.w).unwrap();
        s.memcpy_htod(&vec![half::bf16::NAN; m * 2048], &mut st.y).unwrap();
        graph.launch().unwrap();
        let got: Vec<f32> = s.clone_dtoh(&st.y).unwrap().into_iter().map(|v| v.to_f32()).collect();
        let (rel, cos) = compare(&got, &moe_forward(&spec, w, &x, &ids, &rw));
        println!("graph replay {r} cap={cap}: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(rel <= 5e-3 && cos >= 0.99999);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_input_is_a_typed_error() {
    let dev = gpu();
    let spec = MoeSpec::builder(512, 256, 16, 2).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    // Warp decode under test: keep every step off the grouped family.
    layer.set_prefill_threshold(usize::MAX);
    let (x, mut ids, rw) = random_step(&spec, 3, 0.0, fresh_seed());
    ids[3] = 16;
    layer.set_validate_routing(true);
    let mut st = upload::<half::bf16>(&layer, &x, &ids, &rw);
    let err = layer.forward(&st.x, &st.ids, &st.w, &mut st.y).unwrap_err();
    assert!(
        matches!(err, RuntimeError::ExpertIdOutOfRange { count: 1, experts: 16, first_pair: 3, first_id: 16 }),
        "{err}"
    );
    // Unchecked, the kernels skip the bad id, count it, and stay in bounds.
    layer.set_validate_routing(false);
    for cap in [1, moe_runtime::DEFAULT_MAX_TOKEN_TILE] {
        layer.set_max_token_tile(cap).unwrap();
        layer.forward(&st.x, &st.ids, &st.w, &mut st.y).unwrap();
        assert_eq!(layer.take_routing_errors().unwrap(), 1, "cap={cap}");
        assert_eq!(layer.take_routing_errors().unwrap(), 0);
    }
    // Shapes and dtypes.
    let short = layer.stream().clone_htod(&ids[..5]).unwrap();
    assert!(matches!(
        layer.forward(&st.x, &short, &st.w, &mut st.y),
        Err(RuntimeError::Shape { what: "topk_ids", .. })
    ));
    let xh: CudaSlice<half::f16> = layer.stream().alloc_zeros(3 * 512).unwrap();
    let mut yh: CudaSlice<half::f16> = layer.stream().alloc_zeros(3 * 512).unwrap();
    assert!(matches!(
        layer.forward(&xh, &st.ids, &st.w, &mut yh),
        Err(RuntimeError::Shape { what: "activation dtype", .. })
    ));
    let bad_weights = HostWeights { w13: vec![0; 10], ..w.clone() };
    assert!(matches!(MoeLayer::load(&dev, spec, &bad_weights), Err(RuntimeError::Shape { what: "w13 bytes", .. })));
}
