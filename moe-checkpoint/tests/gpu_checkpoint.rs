//! Loaded checkpoints on a real GPU: `MoeLayer::load` of each family's loaded layer, shared
//! experts included (DeepSeek-V3 / Kimi-K2 weight 1, Qwen2-MoE's gated ones: one layer, one
//! step, no second layer), routed on the device from the loaded router's logits
//! (`forward_logits`, DeepSeek's correction bias set), against the f64 model formula on the
//! written tensors at M = 1, 8 and 40. gpt-oss (MXFP4 and bf16: clamped SwiGLU, per-expert biases, router bias)
//! runs at M = 1, 8 and 40, warp decode at every step size (a spec with biases).
//! Ignored without a GPU; fails (never passes) when none is found.
//!
//! `cargo test --release -p moe-checkpoint --test gpu_checkpoint -- --ignored --nocapture`

mod common;

use common::gpt_oss::{gpt_oss, OssStore};
use common::model::*;
use common::*;
use moe_checkpoint::{load_layer, LoadedLayer, ModelKind};
use moe_codegen::KernelFamily;
use moe_runtime::{Device, MoeLayer};

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

/// One step of `l` (routed and shared experts together) on the device, as f32, the family the
/// step took and the routing the device chose (`[M, k]`).
fn step(dev: &Device, l: &LoadedLayer, x: &[f32]) -> (Vec<f32>, moe_codegen::KernelFamily, (Vec<i32>, Vec<f32>)) {
    let h = l.spec.hidden() as usize;
    let m = x.len() / h;
    let mut layer = MoeLayer::load(dev, l.spec, &l.weights).unwrap_or_else(|e| panic!("{}: {e}", l.spec.id()));
    if let Some(b) = &l.router.correction_bias {
        layer.set_router_bias(b).unwrap();
    }
    layer.reserve(m).unwrap();
    let s = layer.stream().clone();
    let xs: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let dx = s.clone_htod(&xs).unwrap();
    // Logits [M, E] over the routed experts only: the layer appends the shared ones.
    let dl = s.clone_htod(&l.router.logits(x)).unwrap();
    let mut y = s.alloc_zeros::<half::bf16>(m * h).unwrap();
    layer.forward_logits(&dx, &dl, &mut y).unwrap();
    let out: Vec<f32> = s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect();
    (out, layer.last_choice().unwrap().family, layer.last_routing(m).unwrap())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn loaded_checkpoints_run_on_the_gpu() {
    let dev = gpu();
    // The last field: the shared expert's intermediate over the routed one (Qwen2-MoE's
    // shared_expert_intermediate_size / moe_intermediate_size, DeepSeek's n_shared_experts).
    let cases = [
        (ModelKind::Qwen3Moe, Store::Bf16, 8, 2, 0),
        (ModelKind::Qwen2Moe, Store::Bf16, 8, 2, 2),
        (ModelKind::Qwen2Moe, Store::Bf16, 8, 2, 4),
        (ModelKind::Mixtral, Store::Gptq { g: 32, sym: false, g_idx: true }, 8, 2, 0),
        (ModelKind::Qwen3Moe, Store::Gptq { g: 128, sym: true, g_idx: false }, 8, 2, 0),
        (ModelKind::Olmoe, Store::Awq { g: 64 }, 8, 2, 0),
        (ModelKind::DeepseekV3, Store::Fp8, 16, 4, 1),
        (ModelKind::DeepseekV3, Store::Fp8, 16, 4, 2),
        (ModelKind::KimiK2, Store::Fp8, 16, 4, 1),
    ];
    for (n, (kind, store, e, k, shared)) in cases.into_iter().enumerate() {
        let m = model_shared(kind, store, e, k, 100 + n as u64, shared);
        let dir = tempfile::tempdir().unwrap();
        m.ck.write(dir.path(), 2);
        let l = load_layer(dir.path(), LAYER).unwrap();
        assert_eq!(l.spec.shared_experts() as usize, shared, "{kind:?}");
        for tokens_m in [1usize, 8, 40] {
            let x = tokens(&mut rng(7 + tokens_m as u64), tokens_m, m.h);
            let (got, family, (ids, rw)) = step(&dev, &l, &x);
            let got: Vec<f64> = got.into_iter().map(|v| v as f64).collect();
            let (want, _) = m.reference(&x);
            let rel = rel_l2(&got, &want);
            println!("{kind:?} {} shared {shared} m={tokens_m} {family}: rel_l2 {rel:.2e}", l.spec.weight_format());
            let fp8 = moe_codegen::grouped::quantizes_activations(&l.spec);
            if family == KernelFamily::GroupedGemm && fp8 {
                // The fp8 GEMMs take x and the intermediate in e4m3 (3 mantissa bits: a few
                // percent from the exact formula): check against the reference that quantizes
                // them the same way, on the loaded weights and the device's routing.
                let xr: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                let want8 = moe_runtime::reference::moe_forward_fp8_acts(&l.spec, &l.weights, &xr, &ids, &rw);
                let rel8 = rel_l2(&got, &want8);
                println!("  against the e4m3-activation reference: rel_l2 {rel8:.2e}");
                assert!(rel8 < 1e-2 && rel < 6e-2, "{kind:?} shared {shared} m={tokens_m}: {rel8:e} / {rel:e}");
            } else {
                // bf16 output rounding and f32 sums on the device.
                assert!(rel < 1e-2, "{kind:?} shared {shared} m={tokens_m}: rel_l2 {rel:e}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpt_oss_checkpoints_run_on_the_gpu() {
    let dev = gpu();
    for (n, (store, e, k)) in
        [(OssStore::Mxfp4, 8, 2), (OssStore::Bf16, 8, 2), (OssStore::Mxfp4, 32, 4)].into_iter().enumerate()
    {
        let m = gpt_oss(store, e, k, 200 + n as u64);
        let dir = tempfile::tempdir().unwrap();
        m.ck.write(dir.path(), 2);
        let l = load_layer(dir.path(), LAYER).unwrap();
        assert!(l.spec.has_bias());
        for tokens_m in [1usize, 8, 40] {
            let x = tokens(&mut rng(17 + tokens_m as u64), tokens_m, m.h);
            let (got, family, _) = step(&dev, &l, &x);
            // Both stores take the grouped GEMMs (biases in their epilogue and combine; MXFP4
            // decoded in registers) from the prefill threshold on; below it the dispatcher chooses.
            if tokens_m >= moe_runtime::DEFAULT_PREFILL_THRESHOLD {
                assert_eq!(family, KernelFamily::GroupedGemm, "{store:?} m={tokens_m}");
            }
            let got: Vec<f64> = got.into_iter().map(|v| v as f64).collect();
            let (want, _, clamps) = m.reference(&x);
            let rel = rel_l2(&got, &want);
            println!(
                "gpt-oss {} e={e} k={k} m={tokens_m} {family}: rel_l2 {rel:.2e} ({clamps:?})",
                l.spec.weight_format()
            );
            assert!(rel < 1e-2, "gpt-oss {store:?} e={e} m={tokens_m}: rel_l2 {rel:e}");
        }
    }
}
