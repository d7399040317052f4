//! A corrupt or mismatched checkpoint gives a typed error naming the tensor, field or file,
//! never a panic nor a layer.

mod common;

use common::model::*;
use common::*;
use moe_checkpoint::{inspect, load_layer, CheckpointError, ModelKind};
use safetensors::Dtype;
use serde_json::json;

fn qwen() -> Ckpt {
    model(ModelKind::Qwen3Moe, Store::Bf16, 8, 2, 21).ck
}

/// Write `ck` (in `shards` files) and load layer `layer`.
fn load(ck: &Ckpt, shards: usize, layer: usize) -> CheckpointError {
    let dir = tempfile::tempdir().unwrap();
    ck.write(dir.path(), shards);
    match load_layer(dir.path(), layer) {
        Ok(_) => panic!("loaded a broken checkpoint"),
        Err(e) => {
            println!("{e}");
            e
        }
    }
}

const UP3: &str = "model.layers.1.mlp.experts.3.up_proj.weight";

#[test]
fn missing_tensor_is_named() {
    for shards in [1, 3] {
        let mut ck = qwen();
        ck.remove(UP3);
        match load(&ck, shards, 1) {
            CheckpointError::MissingTensor { tensor, .. } => assert_eq!(tensor, UP3),
            e => panic!("{e:?}"),
        }
    }
    let mut ck = qwen();
    ck.remove("model.layers.1.mlp.gate.weight");
    assert!(
        matches!(load(&ck, 1, 1), CheckpointError::MissingTensor { tensor, .. } if tensor == "model.layers.1.mlp.gate.weight")
    );
}

#[test]
fn wrong_shape_names_the_tensor_and_both_shapes() {
    let mut ck = qwen();
    ck.remove(UP3);
    ck.bf16(UP3, &[64, 256], &vec![0.0; 64 * 256]);
    match load(&ck, 1, 1) {
        CheckpointError::Shape { tensor, expected, got } => {
            assert_eq!((tensor.as_str(), expected, got), (UP3, vec![128, 256], vec![64, 256]));
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn wrong_dtype_names_the_tensor() {
    let mut ck = qwen();
    ck.remove(UP3);
    ck.f32(UP3, &[128, 256], &vec![0.0; 128 * 256]);
    match load(&ck, 1, 1) {
        CheckpointError::Dtype { tensor, expected, got } => {
            assert_eq!((tensor.as_str(), expected.as_str(), got.as_str()), (UP3, "BF16", "F32"));
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn truncated_file_is_corrupt_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    qwen().write(dir.path(), 1);
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    for cut in [len - 100, 40, 4] {
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(cut).unwrap();
        match load_layer(dir.path(), 1) {
            Err(CheckpointError::Corrupt { file, .. }) => assert_eq!(file, path),
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(load_layer(dir.path(), 1), Err(CheckpointError::Io { path: p, .. }) if p == path));
}

#[test]
fn bad_config_fields_are_named() {
    let cases = [
        ("hidden_size", json!(null), "hidden_size"),
        ("hidden_size", json!("2048"), "hidden_size"),
        ("num_experts", json!(0), "num_experts"),
        ("norm_topk_prob", json!("yes"), "norm_topk_prob"),
        ("quantization_config", json!({"quant_method": "gptq", "bits": 4}), "quantization_config.group_size"),
    ];
    for (field, value, named) in cases {
        let mut ck = qwen();
        ck.config[field] = value;
        match load(&ck, 1, 1) {
            CheckpointError::Config { field, .. } => assert_eq!(field, named),
            e => panic!("{field}: {e:?}"),
        }
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), b"{\"model_type\": ").unwrap();
    assert!(matches!(inspect(dir.path()), Err(CheckpointError::Json { .. })));
    assert!(matches!(inspect(&dir.path().join("nowhere")), Err(CheckpointError::Io { .. })));
}

#[test]
fn unsupported_models_and_quantizations_are_typed() {
    let unsupported = |ck: &Ckpt| match load(ck, 1, 1) {
        CheckpointError::Unsupported { model, feature } => (model, feature),
        e => panic!("{e:?}"),
    };
    let mut ck = qwen();
    ck.config["model_type"] = json!("llama");
    assert_eq!(unsupported(&ck).0, "llama");
    let mut ck = qwen();
    ck.config["quantization_config"] = json!({"quant_method": "gptq", "bits": 4, "group_size": 256, "sym": true});
    assert!(unsupported(&ck).1.contains("group_size 256"));
    let mut ck = qwen();
    ck.config["quantization_config"] = json!({"quant_method": "gptq", "bits": 8, "group_size": 128});
    assert!(unsupported(&ck).1.contains("8 bits"));
    let mut ck = qwen();
    ck.config["quantization_config"] = json!({"quant_method": "bitsandbytes"});
    assert!(unsupported(&ck).1.contains("bitsandbytes"));
    let mut ck = qwen();
    ck.config["quantization_config"] = json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"});
    assert!(unsupported(&ck).1.contains("gemv"));
}

#[test]
fn layer_out_of_range_and_dense_layers() {
    assert!(matches!(load(&qwen(), 1, 2), CheckpointError::LayerOutOfRange { layer: 2, layers: 2 }));
    let mut ck = qwen();
    ck.config["mlp_only_layers"] = json!([1]);
    assert!(matches!(load(&ck, 1, 1), CheckpointError::DenseLayer { layer: 1, .. }));
    // DeepSeek-V3: first_k_dense_replace = 1 makes layer 0 dense.
    let ds = model(ModelKind::DeepseekV3, Store::Bf16, 16, 4, 22).ck;
    assert!(matches!(load(&ds, 1, 0), CheckpointError::DenseLayer { layer: 0, .. }));
}

#[test]
fn geometry_the_spec_cannot_hold_is_a_spec_error() {
    let mut ck = qwen();
    ck.config["num_experts_per_tok"] = json!(9);
    assert!(matches!(load(&ck, 1, 1), CheckpointError::Spec(_)));
}

const GPTQ_UP: &str = "model.layers.1.mlp.experts.0.up_proj";

#[test]
fn gptq_act_order_permutation_is_refused() {
    let mut ck = model(ModelKind::Qwen3Moe, Store::Gptq { g: 32, sym: true, g_idx: true }, 8, 2, 23).ck;
    let name = format!("{GPTQ_UP}.g_idx");
    let mut g: Vec<u32> = (0..256).map(|c| c / 32).collect();
    g.swap(5, 200); // act-order: channel 5 in group 6, channel 200 in group 0
    ck.remove(&name);
    ck.i32(name.clone(), &[256], &g);
    match load(&ck, 1, 1) {
        CheckpointError::ActOrder { tensor, k, got, expected } => {
            assert_eq!((tensor, k, got, expected), (name, 5, 6, 0))
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn gptq_zero_points_moeforge_cannot_hold_are_refused() {
    // v1 stores zero - 1: a stored 15 reads back as 16, past moeforge's 0..=15.
    let mut ck = model(ModelKind::Qwen3Moe, Store::Gptq { g: 32, sym: false, g_idx: false }, 8, 2, 24).ck;
    let name = format!("{GPTQ_UP}.qzeros");
    let mut z = ck.words(&name);
    z[0] |= 0xf;
    ck.remove(&name);
    ck.i32(name.clone(), &[256 / 32, 128 / 8], &z);
    assert!(matches!(load(&ck, 1, 1), CheckpointError::Value { tensor, .. } if tensor == name));
    // A symmetric config whose zero points are not 8.
    let mut ck = model(ModelKind::Qwen3Moe, Store::Gptq { g: 32, sym: true, g_idx: false }, 8, 2, 25).ck;
    let mut z = ck.words(&name);
    z[3] ^= 0x30;
    ck.remove(&name);
    ck.i32(name.clone(), &[256 / 32, 128 / 8], &z);
    assert!(matches!(load(&ck, 1, 1), CheckpointError::Value { tensor, .. } if tensor == name));
}

#[test]
fn fp8_scale_of_the_wrong_dtype_or_shape() {
    let mut ck = model(ModelKind::DeepseekV3, Store::Fp8, 16, 4, 26).ck;
    let name = "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv";
    ck.remove(name);
    ck.add(name, Dtype::F8_E4M3, &[2, 1], vec![0; 2]);
    match load(&ck, 1, 1) {
        CheckpointError::Dtype { tensor, .. } => assert_eq!(tensor, name),
        e => panic!("{e:?}"),
    }
}

#[test]
fn shared_expert_not_a_multiple_of_the_routed_intermediate() {
    // Qwen2-MoE's shared expert of 192 beside routed experts of 128: not whole experts.
    let mut ck = model(ModelKind::Qwen2Moe, Store::Bf16, 8, 2, 27).ck;
    ck.config["shared_expert_intermediate_size"] = json!(192);
    match load(&ck, 1, 1) {
        CheckpointError::Unsupported { model, feature } => {
            assert_eq!(model, "qwen2_moe");
            assert!(feature.contains("192") && feature.contains("128"), "{feature}");
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn shared_experts_past_the_top_k_limit_or_missing() {
    // 40 shared experts of 128 beside top-4: top_k + shared > 32, the spec's limit.
    let mut ck = model(ModelKind::DeepseekV3, Store::Bf16, 16, 4, 28).ck;
    ck.config["n_shared_experts"] = json!(40);
    assert!(matches!(load(&ck, 1, 1), CheckpointError::Spec(moe_codegen::SpecError::TooLarge { .. })));
    // Qwen2-MoE's gate tensor, and DeepSeek's shared down_proj, are named when missing.
    for (kind, name) in [
        (ModelKind::Qwen2Moe, "model.layers.1.mlp.shared_expert_gate.weight"),
        (ModelKind::DeepseekV3, "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ] {
        let mut ck = model(kind, Store::Bf16, 16, 4, 29).ck;
        ck.remove(name);
        assert!(matches!(load(&ck, 1, 1), CheckpointError::MissingTensor { tensor, .. } if tensor == name));
    }
}
