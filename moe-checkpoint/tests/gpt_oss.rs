//! gpt-oss: MXFP4 blocks and scales mapped into moeforge's `mxfp4` layout (gate/up
//! de-interleaved, nibble order and E8M0 scales kept), biases kept beside, and `load_layer`
//! refusing the layer (the spec cannot compute its biases and clamped SwiGLU yet).

mod common;

use common::*;
use moe_checkpoint::{load_layer, load_layer_parts, CheckpointError, LayerParts};
use moe_codegen::WeightFormat;
use safetensors::Dtype;
use serde_json::json;

const H: usize = 256;
const I: usize = 128;
const E: usize = 4;

/// A gpt-oss checkpoint (layer 1 written) from random weights, MXFP4-packed here.
fn gpt_oss() -> Ckpt {
    let cfg = json!({
        "model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": H, "intermediate_size": I,
        "num_local_experts": E, "num_experts_per_tok": 2, "swiglu_limit": 7.0,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
    });
    let mut ck = Ckpt::new(cfg);
    let mut r = rng(11);
    let p = "model.layers.1.mlp";
    let gu = uniform(&mut r, E * 2 * I * H, 0.2);
    let (b, s) = mxfp4(&gu, E * 2 * I, H);
    ck.add(format!("{p}.experts.gate_up_proj_blocks"), Dtype::U8, &[E, 2 * I, H / 32, 16], b);
    ck.add(format!("{p}.experts.gate_up_proj_scales"), Dtype::U8, &[E, 2 * I, H / 32], s);
    ck.bf16(format!("{p}.experts.gate_up_proj_bias"), &[E, 2 * I], &uniform(&mut r, E * 2 * I, 1.0));
    let dn = uniform(&mut r, E * H * I, 0.2);
    let (b, s) = mxfp4(&dn, E * H, I);
    ck.add(format!("{p}.experts.down_proj_blocks"), Dtype::U8, &[E, H, I / 32, 16], b);
    ck.add(format!("{p}.experts.down_proj_scales"), Dtype::U8, &[E, H, I / 32], s);
    ck.bf16(format!("{p}.experts.down_proj_bias"), &[E, H], &uniform(&mut r, E * H, 1.0));
    ck.bf16(format!("{p}.router.weight"), &[E, H], &uniform(&mut r, E * H, 0.1));
    ck.bf16(format!("{p}.router.bias"), &[E], &uniform(&mut r, E, 0.1));
    ck
}

/// Row `row` of a `[rows, k/32, 16]` blocks tensor dequantized as transformers'
/// `convert_moe_packed_tensors` does: low nibble first, `lut[code] * 2^(scale - 127)`.
fn file_row(ck: &Ckpt, name: &str, row: usize, k: usize) -> Vec<f64> {
    let (b, s) = (ck.bytes(&format!("{name}_blocks")), ck.bytes(&format!("{name}_scales")));
    let mut out = Vec::with_capacity(k);
    for blk in 0..k / 32 {
        let x = 2f64.powi(s[row * k / 32 + blk] as i32 - 127);
        for j in 0..16 {
            let byte = b[(row * k / 32 + blk) * 16 + j];
            out.push(E2M1[(byte & 15) as usize] * x);
            out.push(E2M1[(byte >> 4) as usize] * x);
        }
    }
    out
}

#[test]
fn load_layer_refuses_gpt_oss_with_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    gpt_oss().write(dir.path(), 1);
    match load_layer(dir.path(), 1) {
        Err(CheckpointError::Unsupported { model, feature }) => {
            assert_eq!(model, "gpt_oss");
            assert!(feature.contains("bias") && feature.contains("SwiGLU"), "{feature}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn gpt_oss_parts_deinterleave_gate_up_and_keep_nibbles_scales_biases() {
    let dir = tempfile::tempdir().unwrap();
    let ck = gpt_oss();
    ck.write(dir.path(), 2);
    let LayerParts::GptOss(p) = load_layer_parts(dir.path(), 1).unwrap() else { panic!("not gpt-oss parts") };
    assert_eq!(p.spec.weight_format(), WeightFormat::Mxfp4);
    assert_eq!(
        (p.spec.hidden(), p.spec.intermediate(), p.spec.experts(), p.spec.top_k()),
        (H as u32, I as u32, E as u32, 2)
    );
    assert_eq!((p.swiglu_alpha, p.swiglu_limit), (1.702, 7.0));
    p.weights.validate(&p.spec).unwrap();
    let pre = "model.layers.1.mlp.experts";
    let gu_bias = ck.floats(&format!("{pre}.gate_up_proj_bias"));
    for e in 0..E {
        for r in 0..2 * I {
            // gpt-oss: gate = gate_up[..., ::2], up = gate_up[..., 1::2].
            let src = if r < I { 2 * r } else { 2 * (r - I) + 1 };
            let want = file_row(&ck, &format!("{pre}.gate_up_proj"), e * 2 * I + src, H);
            let got: Vec<f64> = p.weights.w13_row(&p.spec, e, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {e} w13 row {r}");
            assert_eq!(p.w13_bias[e * 2 * I + r] as f64, gu_bias[e * 2 * I + src]);
        }
        for r in 0..H {
            let want = file_row(&ck, &format!("{pre}.down_proj"), e * H + r, I);
            let got: Vec<f64> = p.weights.w2_row(&p.spec, e, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {e} w2 row {r}");
        }
    }
    let b: Vec<f32> = ck.floats(&format!("{pre}.down_proj_bias")).iter().map(|&v| v as f32).collect();
    assert_eq!(p.w2_bias, b);
    let rb: Vec<f32> = ck.floats("model.layers.1.mlp.router.bias").iter().map(|&v| v as f32).collect();
    assert_eq!(p.router.logit_bias.as_deref(), Some(&rb[..]));
    // The logits include the router bias.
    let x = tokens(&mut rng(3), 1, H);
    let gate = ck.floats("model.layers.1.mlp.router.weight");
    let l = p.router.logits(&x);
    for j in 0..E {
        let want: f64 = gate[j * H..(j + 1) * H].iter().zip(&x).map(|(a, &b)| a * b as f64).sum::<f64>() + rb[j] as f64;
        assert!((l[j] as f64 - want).abs() < 1e-5);
    }
}

#[test]
fn gpt_oss_nibble_order_and_scale_bias_by_hand() {
    // Expert 0's first gate row: byte 0 = 0x1f (element 0 = code 0xf = -6, element 1 = code 1 =
    // 0.5), scale 128 (x2); its first up row (file row 1) is all code 2 (1.0) at scale 126 (x0.5).
    let mut ck = gpt_oss();
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    let mut b = ck.bytes(&format!("{name}_blocks")).to_vec();
    let mut s = ck.bytes(&format!("{name}_scales")).to_vec();
    b[0] = 0x1f;
    s[0] = 128;
    let row1 = H / 32 * 16;
    b[row1..2 * row1].fill(0x22);
    s[H / 32..2 * (H / 32)].fill(126);
    ck.remove(&format!("{name}_blocks"));
    ck.remove(&format!("{name}_scales"));
    ck.add(format!("{name}_blocks"), Dtype::U8, &[E, 2 * I, H / 32, 16], b);
    ck.add(format!("{name}_scales"), Dtype::U8, &[E, 2 * I, H / 32], s);
    let dir = tempfile::tempdir().unwrap();
    ck.write(dir.path(), 1);
    let LayerParts::GptOss(p) = load_layer_parts(dir.path(), 1).unwrap() else { panic!() };
    let gate0 = p.weights.w13_row(&p.spec, 0, 0);
    assert_eq!((gate0[0], gate0[1]), (-12.0, 1.0));
    assert!(p.weights.w13_row(&p.spec, 0, I).iter().all(|&v| v == 0.5));
}
