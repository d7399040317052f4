//! The fused three-phase family on a real GPU: one cooperative launch per step of up to 64 tokens
//! (more run as several), every weight format decoded on the way to the tensor cores. Against the
//! f64 reference on the same dequantized weights, poisoned outputs, fresh weights and routing.
//! Ignored without a GPU; each test fails (never passes) when no GPU is found.

use moe_codegen::{ActDtype, KernelFamily, MoeSpec, WeightFormat};
use moe_runtime::cudarc::driver::CudaSlice;
use moe_runtime::reference::{compare, moe_forward};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::capture;
use moe_runtime::{Device, HostWeights, MoeLayer};

type Bf = half::bf16;

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

/// One fused step of the routing given into a poisoned y, eagerly or as a graph replayed twice.
fn fused_step(layer: &MoeLayer, x: &[f32], ids: &[i32], rw: &[f32], graph: bool) -> Vec<f32> {
    let s = layer.stream().clone();
    let xb: Vec<Bf> = x.iter().map(|&v| Bf::from_f32(v)).collect();
    let (dx, dids, dw) = (s.clone_htod(&xb).unwrap(), s.clone_htod(ids).unwrap(), s.clone_htod(rw).unwrap());
    let mut y: CudaSlice<Bf> = s.clone_htod(&vec![Bf::from_f32(f32::NAN); x.len()]).unwrap();
    if graph {
        let g = capture(&s, || layer.forward_family(KernelFamily::Fused, &dx, &dids, &dw, &mut y)).unwrap();
        g.launch().unwrap();
        g.launch().unwrap();
    } else {
        layer.forward_family(KernelFamily::Fused, &dx, &dids, &dw, &mut y).unwrap();
    }
    s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

fn check(spec: &MoeSpec, got: &[f32], want: &[f64], what: &str) {
    let unwritten = got.iter().filter(|v| !v.is_finite()).count();
    assert_eq!(unwritten, 0, "{what}: {unwritten} outputs unwritten");
    let (rel, cos) = compare(got, want);
    println!("{} {what}: rel_l2={rel:.3e} cos={cos:.8}", spec.id());
    assert!(rel <= 5e-3 && cos >= 0.99999, "{} {what}: rel_l2 {rel:.3e} cos {cos:.8}", spec.id());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_format_matches_the_reference() {
    let dev = gpu();
    let formats = [
        WeightFormat::Bf16,
        WeightFormat::Fp8E4m3,
        WeightFormat::Fp8E4m3B128,
        WeightFormat::Mxfp8,
        WeightFormat::Int8,
        WeightFormat::Int4G128,
        WeightFormat::Int4AsymG32,
        WeightFormat::Nvfp4,
        WeightFormat::Mxfp4,
    ];
    for format in formats {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
        let w = random_weights(&spec, fresh_seed());
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(false);
        layer.fused_available().unwrap();
        for (m, skew) in [(1usize, 0.0), (5, 0.85), (16, 0.0), (37, 0.85), (64, 0.0), (130, 0.85)] {
            let seed = fresh_seed();
            let (x, ids, rw) = random_step(&spec, m, skew, seed);
            let got = fused_step(&layer, &x, &ids, &rw, false);
            check(&spec, &got, &moe_forward(&spec, &w, &x, &ids, &rw), &format!("m={m} skew={skew} seed={seed}"));
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn reference_geometries_graphs_and_bad_ids() {
    let dev = gpu();
    let specs = [
        MoeSpec::builder(4096, 14336, 8, 2).build().unwrap(),
        MoeSpec::builder(2048, 1024, 64, 8)
            .act_dtype(ActDtype::Fp16)
            .weight_format(WeightFormat::Fp16)
            .build()
            .unwrap(),
        MoeSpec::builder(2880, 2880, 32, 4)
            .weight_format(WeightFormat::Fp8E4m3)
            .activation(moe_codegen::Activation::SwigluOai)
            .bias(true)
            .build()
            .unwrap(),
    ];
    for spec in specs {
        let w = random_weights(&spec, fresh_seed());
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(false);
        layer.reserve(64).unwrap();
        for (m, skew, graph) in [(3usize, 0.0, false), (24, 0.85, true), (64, 0.0, true)] {
            let seed = fresh_seed();
            let (x, ids, rw) = random_step(&spec, m, skew, seed);
            let got = if spec.act_dtype() == ActDtype::Fp16 {
                fp16_step(&layer, &x, &ids, &rw)
            } else {
                fused_step(&layer, &x, &ids, &rw, graph)
            };
            check(&spec, &got, &moe_forward(&spec, &w, &x, &ids, &rw), &format!("m={m} graph={graph} seed={seed}"));
            // Bit for bit again: the sums run in a fixed order.
            if spec.act_dtype() == ActDtype::Bf16 {
                assert_eq!(got, fused_step(&layer, &x, &ids, &rw, graph), "{} m={m}: a rerun differs", spec.id());
            }
        }
    }
    // Out-of-range ids are counted and contribute nothing; their tokens' other slots still do.
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    layer.set_validate_routing(false);
    let (x, mut ids, rw) = random_step(&spec, 9, 0.0, fresh_seed());
    ids[3] = 128;
    ids[17] = -5;
    ids[8..16].iter_mut().for_each(|e| *e = 1000); // token 1: no valid slot at all
    let got = fused_step(&layer, &x, &ids, &rw, false);
    assert!(layer.take_routing_errors().unwrap() > 0);
    let mut clean = ids.clone();
    let mut weights = rw.clone();
    for (e, wt) in clean.iter_mut().zip(weights.iter_mut()) {
        if !(0..128).contains(e) {
            *e = 0;
            *wt = 0.0;
        }
    }
    check(&spec, &got, &moe_forward(&spec, &w, &x, &clean, &weights), "bad ids");
    assert!(got[2048..4096].iter().all(|&v| v == 0.0), "a token without valid slots is zero");
}

fn fp16_step(layer: &MoeLayer, x: &[f32], ids: &[i32], rw: &[f32]) -> Vec<f32> {
    let s = layer.stream().clone();
    let xh: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let (dx, dids, dw) = (s.clone_htod(&xh).unwrap(), s.clone_htod(ids).unwrap(), s.clone_htod(rw).unwrap());
    let mut y: CudaSlice<half::f16> = s.clone_htod(&vec![half::f16::NAN; x.len()]).unwrap();
    layer.forward_family(KernelFamily::Fused, &dx, &dids, &dw, &mut y).unwrap();
    s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

/// Qwen3-30B-A3B's geometry in `format` on fresh weights (routing unchecked, so tests may repeat
/// or misplace ids), with the weights and the spec's default fused tiles.
fn qwen3_layer(dev: &Device, format: WeightFormat) -> (MoeLayer, HostWeights, moe_codegen::FusedTiles) {
    let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(dev, spec, &w).unwrap();
    layer.set_validate_routing(false);
    (layer, w, moe_codegen::FusedTiles::for_spec(&spec))
}

/// The down items' experts in one block or split over two (`FusedTiles::down_split`), the second
/// block to finish a row summing both halves: the same reference either way, graph replays bit
/// for bit. The split runs where the grid holds two blocks an SM (fp8 on an H100 or H200) and
/// the step touches more experts than a block has warps (here every step but one token's).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn down_items_in_one_block_or_split_over_two() {
    let dev = gpu();
    for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let (mut layer, w, base) = qwen3_layer(&dev, format);
        let spec = *layer.spec();
        for down_split in [1, 2] {
            layer.set_fused_tiles(&dev, moe_codegen::FusedTiles { down_split, ..base }).unwrap();
            for (m, skew) in [(1usize, 0.0), (3, 0.85), (8, 0.85), (40, 0.0), (100, 0.85)] {
                let seed = fresh_seed();
                let (x, ids, rw) = random_step(&spec, m, skew, seed);
                let got = fused_step(&layer, &x, &ids, &rw, false);
                let what = format!("down_split={down_split} m={m} skew={skew} seed={seed}");
                check(&spec, &got, &moe_forward(&spec, &w, &x, &ids, &rw), &what);
                assert_eq!(got, fused_step(&layer, &x, &ids, &rw, true), "{what}: a graph replay differs");
            }
        }
    }
}

/// Every pass width (`FusedTiles::ntok` 8 to 32), with ids repeated within tokens so that one
/// expert holds up to 8 m pairs and runs several passes, the last of them partial. (With 24 tokens
/// a pass, a pass of 17 to 24 pairs once ran four fragments: the fourth wrote past the pass's 24
/// columns of gate / up sums and added the next pass's pairs in down.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_pass_width_with_repeated_ids() {
    let dev = gpu();
    for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let (mut layer, w, base) = qwen3_layer(&dev, format);
        let spec = *layer.spec();
        for ntok in [8, 16, 24, 32] {
            layer.set_fused_tiles(&dev, moe_codegen::FusedTiles { ntok, ..base }).unwrap();
            for (m, skew) in [(1usize, 0.0), (6, 0.85), (8, 0.0), (12, 0.85), (16, 0.0), (23, 0.85), (64, 0.85)] {
                let seed = fresh_seed();
                let (x, mut ids, rw) = random_step(&spec, m, skew, seed);
                // Every slot of every other token on one expert: up to 8 m pairs for expert 7.
                for t in (0..m).step_by(2) {
                    ids[t * 8..t * 8 + 8].fill(7);
                }
                let got = fused_step(&layer, &x, &ids, &rw, m % 2 == 0);
                let what = format!("ntok={ntok} m={m} skew={skew} seed={seed}");
                check(&spec, &got, &moe_forward(&spec, &w, &x, &ids, &rw), &what);
            }
        }
    }
}
