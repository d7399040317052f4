//! Every family loads and computes what the model computes: a small checkpoint with the model's
//! real tensor names, dtypes, shapes and packing is written from random weights; the loaded
//! layer's output (moe-runtime's CPU reference on the loaded weights, routed from the loaded
//! router) must equal the f64 model formula evaluated directly on the written tensors. Shared
//! experts (DeepSeek-V3, Kimi-K2, Qwen2-MoE) are in the one loaded layer: the reference gets
//! the routed routing only and appends them itself, as the GPU layer does.

mod common;

use common::model::*;
use common::*;
use moe_checkpoint::{load_layer, ModelKind};
use moe_codegen::{Router, WeightFormat};

/// Write `m`, load its MoE layer, and compare on 6 random tokens.
fn check(m: &Model, shards: usize, format: WeightFormat) -> moe_checkpoint::LoadedLayer {
    let dir = tempfile::tempdir().unwrap();
    m.ck.write(dir.path(), shards);
    let l = load_layer(dir.path(), LAYER).unwrap_or_else(|e| panic!("{:?}: {e}", m.kind));
    assert_eq!(l.model, m.kind);
    assert_eq!(l.spec.weight_format(), format);
    assert_eq!((l.spec.hidden() as usize, l.spec.intermediate() as usize), (m.h, m.i));
    assert_eq!((l.spec.experts() as usize, l.spec.top_k() as usize), (m.experts.len(), m.k));
    // The model's shared expert as shared experts of the routed intermediate, in the one layer.
    let (shared, gated) = m.shared.as_ref().map_or((0, false), |(_, si, g)| (si / m.i, g.is_some()));
    assert_eq!((l.spec.shared_experts() as usize, l.spec.shared_gated()), (shared, gated), "{:?}", m.kind);
    assert_eq!(l.weights.shared_gate.len(), if gated { m.h } else { 0 });
    let ks = l.spec.kernel_spec();
    assert_eq!((ks.experts() as usize, ks.top_k() as usize), (m.experts.len() + shared, m.k + shared));
    assert_eq!(l.weights.validate(&l.spec).map_err(|e| e.to_string()), Ok(()));
    let x = tokens(&mut rng(99), 6, m.h);
    let (got, ids) = loaded_output(&l, &x);
    let (want, chosen) = m.reference(&x);
    for (t, c) in chosen.iter().enumerate() {
        let mut a: Vec<usize> = ids[t * m.k..(t + 1) * m.k].iter().map(|&v| v as usize).collect();
        let mut b = c.clone();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{:?} token {t}: chosen experts", m.kind);
    }
    let rel = rel_l2(&got, &want);
    println!("{:?} {format}: rel_l2 {rel:.2e}", m.kind);
    assert!(rel < 1e-5, "{:?} {format}: rel_l2 {rel:e}", m.kind);
    check_rank_load(dir.path(), &l);
    l
}

#[test]
fn qwen3_moe_bf16_from_sharded_checkpoint() {
    let m = model(ModelKind::Qwen3Moe, Store::Bf16, 8, 2, 1);
    let l = check(&m, 3, WeightFormat::Bf16);
    assert_eq!(l.spec.router(), Router::Softmax { renormalize: true });
    assert_eq!(l.spec.shared_experts(), 0);
}

#[test]
fn qwen2_moe_shared_expert_with_sigmoid_gate() {
    // shared_expert_intermediate_size 256 = 2 x 128: two gated shared experts in the layer.
    let m = model(ModelKind::Qwen2Moe, Store::Bf16, 8, 2, 2);
    let l = check(&m, 1, WeightFormat::Bf16);
    assert_eq!((l.spec.shared_experts(), l.spec.shared_gated(), l.spec.intermediate()), (2, true, 128));
    assert_eq!(l.spec.router(), Router::Softmax { renormalize: false });
    // The gate is shared_expert_gate.weight [1, H] as written.
    let gate = m.shared.as_ref().and_then(|s| s.2.clone()).unwrap();
    assert!(l.weights.shared_gate.iter().zip(&gate).all(|(&a, &b)| a as f64 == b));
}

#[test]
fn qwen2_moe_shared_expert_four_times_the_routed_intermediate() {
    // Qwen1.5-MoE-A2.7B's ratio (5632 = 4 x 1408): four gated shared experts.
    let m = model_shared(ModelKind::Qwen2Moe, Store::Bf16, 8, 2, 11, 4);
    let l = check(&m, 2, WeightFormat::Bf16);
    assert_eq!(l.spec.shared_experts(), 4);
}

#[test]
fn qwen2_moe_gptq_g32_shared_expert_split_along_k_in_whole_groups() {
    // down_proj [H, 4I] cut along K into four [H, I]: 4 groups of 32 each, scales and zeros kept.
    let m = model_shared(ModelKind::Qwen2Moe, Store::Gptq { g: 32, sym: false, g_idx: true }, 8, 2, 12, 4);
    check(&m, 1, WeightFormat::Int4AsymG32);
}

#[test]
fn qwen2_moe_awq_g64_shared_expert() {
    let m = model_shared(ModelKind::Qwen2Moe, Store::Awq { g: 64 }, 8, 2, 13, 2);
    check(&m, 1, WeightFormat::Int4AsymG64);
}

#[test]
fn olmoe_bf16_without_renormalisation() {
    let m = model(ModelKind::Olmoe, Store::Bf16, 8, 2, 3);
    let l = check(&m, 1, WeightFormat::Bf16);
    assert_eq!(l.spec.router(), Router::Softmax { renormalize: false });
}

#[test]
fn mixtral_bf16_w1_w3_w2() {
    let m = model(ModelKind::Mixtral, Store::Bf16, 8, 2, 4);
    check(&m, 2, WeightFormat::Bf16);
}

#[test]
fn deepseek_v3_fp8_blocks_group_limited_routing_and_shared_expert() {
    let m = model(ModelKind::DeepseekV3, Store::Fp8, 16, 4, 5);
    let l = check(&m, 2, WeightFormat::Fp8E4m3B128);
    let Router::GroupLimited(g) = l.spec.router() else { panic!("{:?}", l.spec.router()) };
    assert_eq!((g.groups, g.topk_groups, g.renormalize, g.scaling()), (4, 2, true, 2.5));
    assert_eq!(l.router.correction_bias.as_ref().map(Vec::len), Some(16));
    assert_eq!((l.spec.shared_experts(), l.spec.shared_gated()), (1, false));
    assert!(l.weights.shared_gate.is_empty());
}

#[test]
fn deepseek_v3_fp8_two_shared_experts_split_in_whole_blocks() {
    // n_shared_experts 2: one MLP of intermediate 256 cut into two experts of 128, its down_proj
    // [256, 256] and weight_scale_inv [2, 2] along K in whole 128x128 blocks.
    let m = model_shared(ModelKind::DeepseekV3, Store::Fp8, 16, 4, 14, 2);
    let l = check(&m, 2, WeightFormat::Fp8E4m3B128);
    assert_eq!((l.spec.shared_experts(), l.spec.top_k(), l.spec.kernel_spec().top_k()), (2, 4, 6));
}

#[test]
fn kimi_k2_fp8_one_group() {
    let m = model(ModelKind::KimiK2, Store::Fp8, 16, 4, 6);
    let l = check(&m, 1, WeightFormat::Fp8E4m3B128);
    assert_eq!((l.spec.shared_experts(), l.spec.shared_gated()), (1, false));
}

#[test]
fn qwen3_moe_gptq_symmetric_g128() {
    let m = model(ModelKind::Qwen3Moe, Store::Gptq { g: 128, sym: true, g_idx: true }, 8, 2, 7);
    check(&m, 1, WeightFormat::Int4G128);
}

#[test]
fn mixtral_gptq_asymmetric_g32() {
    let m = model(ModelKind::Mixtral, Store::Gptq { g: 32, sym: false, g_idx: false }, 8, 2, 8);
    check(&m, 1, WeightFormat::Int4AsymG32);
}

#[test]
fn qwen3_moe_awq_g64() {
    let m = model(ModelKind::Qwen3Moe, Store::Awq { g: 64 }, 8, 2, 9);
    check(&m, 1, WeightFormat::Int4AsymG64);
}

#[test]
fn deepseek_v3_awq_g128() {
    // Another storage under the DeepSeek router (a community AWQ of DeepSeek-V3).
    let m = model(ModelKind::DeepseekV3, Store::Awq { g: 128 }, 16, 4, 10);
    check(&m, 1, WeightFormat::Int4AsymG128);
}
