//! gpt-oss loads as a runnable layer: MXFP4 blocks and scales mapped into moeforge's `mxfp4`
//! layout (gate/up de-interleaved, nibble order and E8M0 scales kept) or bf16 parameters
//! transposed, the biases de-interleaved beside, `Activation::SwigluOai`, and the router with its
//! bias. The loaded layer (moe-runtime's f64 reference) must compute `GptOssMLP`'s formula,
//! written independently in `common::gpt_oss`, clamps included.

mod common;

use common::gpt_oss::*;
use common::model::LAYER;
use common::*;
use moe_checkpoint::{load_layer, CheckpointError, LoadedLayer, ModelKind};
use moe_codegen::{Activation, Router, WeightFormat};
use safetensors::Dtype;
use serde_json::json;

/// Write `m` in `shards` files, load its layer and compare on 16 random tokens.
fn check(m: &GptOss, shards: usize, format: WeightFormat) -> LoadedLayer {
    let dir = tempfile::tempdir().unwrap();
    m.ck.write(dir.path(), shards);
    let l = load_layer(dir.path(), LAYER).unwrap_or_else(|e| panic!("gpt-oss {format}: {e}"));
    assert_eq!((l.model, l.layer), (ModelKind::GptOss, LAYER));
    assert_eq!(l.spec.weight_format(), format);
    assert_eq!(l.spec.activation(), Activation::SwigluOai);
    assert!(l.spec.has_bias());
    // Top-k of the logits then softmax over them = softmax, top-k, renormalised.
    assert_eq!(l.spec.router(), Router::Softmax { renormalize: true });
    assert_eq!(
        (l.spec.hidden() as usize, l.spec.intermediate() as usize, l.spec.experts() as usize, l.spec.top_k() as usize),
        (m.h, m.i, m.e, m.k)
    );
    assert!(l.spec.shared_experts() == 0 && l.router.correction_bias.is_none());
    assert_eq!(l.weights.validate(&l.spec).map_err(|e| e.to_string()), Ok(()));
    let x = tokens(&mut rng(99), 16, m.h);
    let (got, ids) = loaded_output(&l, &x);
    let (want, chosen, clamps) = m.reference(&x);
    println!("{format}: {clamps:?}");
    // The clamps are exercised: gate above 7, up past both limits, and most neurons unclamped.
    assert!(clamps.gate_above > 0 && clamps.up_above > 0 && clamps.up_below > 0, "{clamps:?}");
    assert!(clamps.gate_above + clamps.up_above + clamps.up_below < clamps.neurons / 2, "{clamps:?}");
    for (t, c) in chosen.iter().enumerate() {
        let mut a: Vec<usize> = ids[t * m.k..(t + 1) * m.k].iter().map(|&v| v as usize).collect();
        let mut b = c.clone();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{format} token {t}: chosen experts");
    }
    let rel = rel_l2(&got, &want);
    println!("gpt-oss {format}: rel_l2 {rel:.2e}");
    assert!(rel <= 1e-5, "gpt-oss {format}: rel_l2 {rel:e}");
    check_rank_load(dir.path(), &l);
    l
}

#[test]
fn gpt_oss_mxfp4_layer_computes_the_model_formula() {
    check(&gpt_oss(OssStore::Mxfp4, 8, 2, 11), 2, WeightFormat::Mxfp4);
}

#[test]
fn gpt_oss_mxfp4_top4_of_16_single_file() {
    check(&gpt_oss(OssStore::Mxfp4, 16, 4, 12), 1, WeightFormat::Mxfp4);
}

#[test]
fn gpt_oss_bf16_layer_computes_the_model_formula() {
    check(&gpt_oss(OssStore::Bf16, 8, 2, 13), 3, WeightFormat::Bf16);
}

#[test]
fn gpt_oss_deinterleaves_gate_up_and_keeps_nibbles_scales_biases() {
    let dir = tempfile::tempdir().unwrap();
    let m = gpt_oss(OssStore::Mxfp4, 4, 2, 14);
    let (e, h, i) = (m.e, m.h, m.i);
    m.ck.write(dir.path(), 2);
    let l = load_layer(dir.path(), LAYER).unwrap();
    let pre = "model.layers.1.mlp.experts";
    for ex in 0..e {
        for r in 0..2 * i {
            // gpt-oss: gate = gate_up[..., ::2], up = gate_up[..., 1::2].
            let src = if r < i { 2 * r } else { 2 * (r - i) + 1 };
            let want = mxfp4_row(&m.ck, &format!("{pre}.gate_up_proj"), ex * 2 * i + src, h);
            let got: Vec<f64> = l.weights.w13_row(&l.spec, ex, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {ex} w13 row {r}");
            assert_eq!(l.weights.w13_bias[ex * 2 * i + r] as f64, m.gate_up_bias[ex * 2 * i + src]);
        }
        for r in 0..h {
            let want = mxfp4_row(&m.ck, &format!("{pre}.down_proj"), ex * h + r, i);
            let got: Vec<f64> = l.weights.w2_row(&l.spec, ex, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {ex} w2 row {r}");
        }
    }
    let b: Vec<f32> = m.down_bias.iter().map(|&v| v as f32).collect();
    assert_eq!(l.weights.w2_bias, b);
    let rb: Vec<f32> = m.router_bias.iter().map(|&v| v as f32).collect();
    assert_eq!(l.router.logit_bias.as_deref(), Some(&rb[..]));
    // The logits include the router bias.
    let x = tokens(&mut rng(3), 1, h);
    let lg = l.router.logits(&x);
    for j in 0..e {
        let want: f64 =
            m.router[j * h..(j + 1) * h].iter().zip(&x).map(|(a, &b)| a * b as f64).sum::<f64>() + rb[j] as f64;
        assert!((lg[j] as f64 - want).abs() < 1e-5);
    }
}

#[test]
fn gpt_oss_bf16_transposes_and_deinterleaves_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let m = gpt_oss(OssStore::Bf16, 4, 2, 15);
    let (e, h, i) = (m.e, m.h, m.i);
    m.ck.write(dir.path(), 1);
    let l = load_layer(dir.path(), LAYER).unwrap();
    // HF's gate_up_proj [E, H, 2I]: moeforge's w13 row r is its column 2r (gate) / 2(r - I) + 1.
    let gu = m.ck.floats("model.layers.1.mlp.experts.gate_up_proj");
    let dn = m.ck.floats("model.layers.1.mlp.experts.down_proj");
    for ex in 0..e {
        for r in 0..2 * i {
            let src = if r < i { 2 * r } else { 2 * (r - i) + 1 };
            let want: Vec<f64> = (0..h).map(|c| gu[(ex * h + c) * 2 * i + src]).collect();
            let got: Vec<f64> = l.weights.w13_row(&l.spec, ex, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {ex} w13 row {r}");
        }
        for r in 0..h {
            let want: Vec<f64> = (0..i).map(|c| dn[(ex * i + c) * h + r]).collect();
            let got: Vec<f64> = l.weights.w2_row(&l.spec, ex, r).iter().map(|&v| v as f64).collect();
            assert_eq!(got, want, "expert {ex} w2 row {r}");
        }
    }
}

#[test]
fn gpt_oss_nibble_order_and_scale_bias_by_hand() {
    // Expert 0's first gate row: byte 0 = 0x1f (element 0 = code 0xf = -6, element 1 = code 1 =
    // 0.5), scale 128 (x2); its first up row (file row 1) is all code 2 (1.0) at scale 126 (x0.5).
    let mut ck = gpt_oss(OssStore::Mxfp4, 4, 2, 16).ck;
    let (e, h, i) = (4, 256, 128);
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    let mut b = ck.bytes(&format!("{name}_blocks")).to_vec();
    let mut s = ck.bytes(&format!("{name}_scales")).to_vec();
    b[0] = 0x1f;
    s[0] = 128;
    let row1 = h / 32 * 16;
    b[row1..2 * row1].fill(0x22);
    s[h / 32..2 * (h / 32)].fill(126);
    ck.remove(&format!("{name}_blocks"));
    ck.remove(&format!("{name}_scales"));
    ck.add(format!("{name}_blocks"), Dtype::U8, &[e, 2 * i, h / 32, 16], b);
    ck.add(format!("{name}_scales"), Dtype::U8, &[e, 2 * i, h / 32], s);
    let dir = tempfile::tempdir().unwrap();
    ck.write(dir.path(), 1);
    let l = load_layer(dir.path(), 1).unwrap();
    let gate0 = l.weights.w13_row(&l.spec, 0, 0);
    assert_eq!((gate0[0], gate0[1]), (-12.0, 1.0));
    assert!(l.weights.w13_row(&l.spec, 0, i).iter().all(|&v| v == 0.5));
}

#[test]
fn gpt_oss_other_limits_and_storages_are_refused() {
    let unsupported = |ck: &Ckpt| {
        let dir = tempfile::tempdir().unwrap();
        ck.write(dir.path(), 1);
        match load_layer(dir.path(), LAYER) {
            Err(CheckpointError::Unsupported { model, feature }) => {
                assert_eq!(model, "gpt_oss");
                feature
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    };
    // moeforge's swiglu_oai clamps at 7.
    let mut ck = gpt_oss(OssStore::Mxfp4, 4, 2, 17).ck;
    ck.config["swiglu_limit"] = json!(5.0);
    assert!(unsupported(&ck).contains("swiglu_limit 5"));
    let mut ck = gpt_oss(OssStore::Bf16, 4, 2, 18).ck;
    ck.config["quantization_config"] = json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true});
    assert!(unsupported(&ck).contains("Gptq"));
    // A bf16 gpt-oss whose fused experts are f32: a typed dtype error naming the tensor.
    let mut ck = gpt_oss(OssStore::Bf16, 4, 2, 19).ck;
    let name = "model.layers.1.mlp.experts.down_proj";
    ck.remove(name);
    ck.f32(name, &[4, 128, 256], &vec![0.0; 4 * 128 * 256]);
    let dir = tempfile::tempdir().unwrap();
    ck.write(dir.path(), 1);
    match load_layer(dir.path(), LAYER) {
        Err(CheckpointError::Dtype { tensor, .. }) => assert_eq!(tensor, name),
        other => panic!("expected Dtype, got {other:?}"),
    }
}
