//! A small model of each family written as a checkpoint, and its f64 formula.

use super::*;
use moe_checkpoint::ModelKind;
use rand::rngs::SmallRng;
use serde_json::{json, Value};

/// How the test writes expert projections.
#[derive(Clone, Copy, Debug)]
pub enum Store {
    Bf16,
    Fp8,
    Gptq { g: usize, sym: bool, g_idx: bool },
    Awq { g: usize },
}

/// Write projection `prefix` of `w [n, k]` and return it dequantized from the written tensors
/// with the format's own formula.
fn put_proj(ck: &mut Ckpt, prefix: &str, w: &[f32], n: usize, k: usize, s: Store) -> Vec<f64> {
    match s {
        Store::Bf16 => {
            ck.bf16(format!("{prefix}.weight"), &[n, k], w);
            ck.floats(&format!("{prefix}.weight"))
        }
        Store::Fp8 => {
            let (codes, si) = fp8_block(w, n, k);
            ck.add(format!("{prefix}.weight"), safetensors::Dtype::F8_E4M3, &[n, k], codes);
            ck.f32(format!("{prefix}.weight_scale_inv"), &[n / 128, k / 128], &si);
            // DeepSeek's weight_dequant: code * scale_inv of the 128x128 block.
            let (codes, si) =
                (ck.bytes(&format!("{prefix}.weight")).to_vec(), ck.floats(&format!("{prefix}.weight_scale_inv")));
            (0..n * k).map(|i| e4m3_value(codes[i]) * si[(i / k / 128) * (k / 128) + (i % k) / 128]).collect()
        }
        Store::Gptq { g, sym, g_idx } => {
            let (q, sc, z) = int4_groups(w, n, k, g, sym);
            let (qw, qz) = gptq_pack(&q, &z, n, k);
            ck.i32(format!("{prefix}.qweight"), &[k / 8, n], &qw);
            ck.i32(format!("{prefix}.qzeros"), &[k / g, n / 8], &qz);
            ck.f16(format!("{prefix}.scales"), &[k / g, n], &sc);
            if g_idx {
                ck.i32(format!("{prefix}.g_idx"), &[k], &(0..k).map(|c| (c / g) as u32).collect::<Vec<_>>());
            }
            // AutoGPTQ's forward: weight = scales[g_idx] * (q - (zeros + 1)).
            let (qw, qz, sc) = (
                ck.words(&format!("{prefix}.qweight")),
                ck.words(&format!("{prefix}.qzeros")),
                ck.floats(&format!("{prefix}.scales")),
            );
            let mut out = vec![0f64; n * k];
            for c in 0..k {
                for r in 0..n {
                    let q = (qw[(c / 8) * n + r] >> (4 * (c % 8))) & 15;
                    let z = ((qz[(c / g) * n / 8 + r / 8] >> (4 * (r % 8))) & 15) + 1;
                    out[r * k + c] = sc[(c / g) * n + r] * (q as f64 - z as f64);
                }
            }
            out
        }
        Store::Awq { g } => {
            let (q, sc, z) = int4_groups(w, n, k, g, false);
            let (qw, qz) = awq_pack(&q, &z, n, k);
            ck.i32(format!("{prefix}.qweight"), &[k, n / 8], &qw);
            ck.i32(format!("{prefix}.qzeros"), &[k / g, n / 8], &qz);
            ck.f16(format!("{prefix}.scales"), &[k / g, n], &sc);
            // AutoAWQ's dequantize: unpack, undo the [0, 2, 4, 6, 1, 3, 5, 7] order, (q - z) * s.
            let (qw, qz, sc) = (
                ck.words(&format!("{prefix}.qweight")),
                ck.words(&format!("{prefix}.qzeros")),
                ck.floats(&format!("{prefix}.scales")),
            );
            let rev = [0, 4, 1, 5, 2, 6, 3, 7];
            let nib = |t: &[u32], row: usize, col: usize| (t[row * n / 8 + col / 8] >> (4 * rev[col % 8])) & 15;
            let mut out = vec![0f64; n * k];
            for c in 0..k {
                for r in 0..n {
                    out[r * k + c] = sc[(c / g) * n + r] * (nib(&qw, c, r) as f64 - nib(&qz, c / g, r) as f64);
                }
            }
            out
        }
    }
}

fn quant_config(s: Store) -> Value {
    match s {
        Store::Bf16 => Value::Null,
        Store::Fp8 => {
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
        }
        Store::Gptq { g, sym, .. } => {
            json!({"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": false, "sym": sym, "checkpoint_format": "gptq"})
        }
        Store::Awq { g } => {
            json!({"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": true, "version": "gemm"})
        }
    }
}

/// A shared expert: gate, up, down (f64), its intermediate size, Qwen2-MoE's sigmoid gate.
pub type Shared = ([Vec<f64>; 3], usize, Option<Vec<f64>>);

/// A written test model: the checkpoint and its f64 weights (dequantized from the tensors).
pub struct Model {
    pub kind: ModelKind,
    pub ck: Ckpt,
    pub h: usize,
    pub i: usize,
    pub k: usize,
    pub router: Vec<f64>,
    pub bias: Vec<f64>,
    pub experts: Vec<[Vec<f64>; 3]>,
    pub shared: Option<Shared>,
}

pub const LAYER: usize = 1;

/// A two-layer model of `kind` whose layer 1 is MoE: `e` experts, top-`k`, hidden 256,
/// intermediate 128, expert weights stored as `s`; Qwen2-MoE's shared expert twice the routed
/// intermediate, DeepSeek-V3 / Kimi-K2's one shared expert.
pub fn model(kind: ModelKind, s: Store, e: usize, k: usize, seed: u64) -> Model {
    let shared = if kind == ModelKind::Qwen2Moe { 2 } else { 1 };
    model_shared(kind, s, e, k, seed, shared)
}

/// [`model`] with a shared expert `shared` times the routed intermediate: Qwen2-MoE's
/// `shared_expert_intermediate_size`, DeepSeek-V3 / Kimi-K2's `n_shared_experts` (one MLP of
/// `n_shared_experts * moe_intermediate_size`, as DeepseekV3MoE builds it).
pub fn model_shared(kind: ModelKind, s: Store, e: usize, k: usize, seed: u64, shared: usize) -> Model {
    let (h, i) = (256usize, 128usize);
    let mut r = rng(seed);
    let p = format!("model.layers.{LAYER}");
    let mut cfg =
        json!({"model_type": kind.model_type(), "num_hidden_layers": 2, "hidden_size": h, "num_experts_per_tok": k});
    let c = cfg.as_object_mut().unwrap();
    let (experts_p, proj, router_name): (String, [&str; 3], String) = match kind {
        ModelKind::Mixtral => {
            c.insert("intermediate_size".into(), json!(i));
            c.insert("num_local_experts".into(), json!(e));
            (format!("{p}.block_sparse_moe.experts"), ["w1", "w3", "w2"], format!("{p}.block_sparse_moe.gate.weight"))
        }
        _ => {
            match kind {
                ModelKind::Olmoe => {
                    c.insert("intermediate_size".into(), json!(i));
                    c.insert("num_experts".into(), json!(e));
                    c.insert("norm_topk_prob".into(), json!(false));
                }
                ModelKind::Qwen3Moe | ModelKind::Qwen2Moe => {
                    c.insert("moe_intermediate_size".into(), json!(i));
                    c.insert("num_experts".into(), json!(e));
                    c.insert("norm_topk_prob".into(), json!(kind == ModelKind::Qwen3Moe));
                    c.insert("decoder_sparse_step".into(), json!(1));
                    c.insert("mlp_only_layers".into(), json!([]));
                    if kind == ModelKind::Qwen2Moe {
                        c.insert("shared_expert_intermediate_size".into(), json!(shared * i));
                    }
                }
                _ => {
                    // DeepSeek-V3 / Kimi-K2.
                    let (groups, topk_groups, scaling) =
                        if kind == ModelKind::KimiK2 { (1, 1, 2.827) } else { (4, 2, 2.5) };
                    for (f, v) in [
                        ("moe_intermediate_size", json!(i)),
                        ("n_routed_experts", json!(e)),
                        ("n_group", json!(groups)),
                        ("topk_group", json!(topk_groups)),
                        ("norm_topk_prob", json!(true)),
                        ("routed_scaling_factor", json!(scaling)),
                        ("n_shared_experts", json!(shared)),
                        ("first_k_dense_replace", json!(1)),
                        ("moe_layer_freq", json!(1)),
                        ("scoring_func", json!("sigmoid")),
                        ("topk_method", json!("noaux_tc")),
                    ] {
                        c.insert(f.into(), v);
                    }
                }
            }
            (format!("{p}.mlp.experts"), ["gate_proj", "up_proj", "down_proj"], format!("{p}.mlp.gate.weight"))
        }
    };
    let q = quant_config(s);
    if !q.is_null() {
        c.insert("quantization_config".into(), q);
    }
    let mut ck = Ckpt::new(cfg);
    let amp = |k: usize| 2.0 / (k as f32).sqrt();
    let write_expert = |ck: &mut Ckpt, r: &mut SmallRng, prefix: &str, inter: usize| -> [Vec<f64>; 3] {
        let g = uniform(r, inter * h, amp(h));
        let u = uniform(r, inter * h, amp(h));
        let d = uniform(r, h * inter, amp(inter));
        [
            put_proj(ck, &format!("{prefix}.{}", proj[0]), &g, inter, h, s),
            put_proj(ck, &format!("{prefix}.{}", proj[1]), &u, inter, h, s),
            put_proj(ck, &format!("{prefix}.{}", proj[2]), &d, h, inter, s),
        ]
    };
    let experts: Vec<[Vec<f64>; 3]> =
        (0..e).map(|x| write_expert(&mut ck, &mut r, &format!("{experts_p}.{x}"), i)).collect();
    let gate = uniform(&mut r, e * h, 2.0 / (h as f32).sqrt());
    ck.bf16(router_name.clone(), &[e, h], &gate);
    let router = ck.floats(&router_name);
    let mut bias = vec![0f64; e];
    let shared = match kind {
        ModelKind::DeepseekV3 | ModelKind::KimiK2 => {
            let b = uniform(&mut r, e, 0.5);
            let name = format!("{p}.mlp.gate.e_score_correction_bias");
            ck.f32(name.clone(), &[e], &b);
            bias = ck.floats(&name);
            Some((write_expert(&mut ck, &mut r, &format!("{p}.mlp.shared_experts"), shared * i), shared * i, None))
        }
        ModelKind::Qwen2Moe => {
            let w = write_expert(&mut ck, &mut r, &format!("{p}.mlp.shared_expert"), shared * i);
            let g = uniform(&mut r, h, 2.0 / (h as f32).sqrt());
            let name = format!("{p}.mlp.shared_expert_gate.weight");
            ck.bf16(name.clone(), &[1, h], &g);
            Some((w, shared * i, Some(ck.floats(&name))))
        }
        _ => None,
    };
    Model { kind, ck, h, i, k, router, bias, experts, shared }
}

impl Model {
    /// The model's own formula on `x [M, H]`, in f64, with the chosen experts per token.
    pub fn reference(&self, x: &[f32]) -> (Vec<f64>, Vec<Vec<usize>>) {
        let (h, i, e) = (self.h, self.i, self.experts.len());
        let cfg = &self.ck.config;
        let mut y = Vec::new();
        let mut chosen = Vec::new();
        for xt in x.chunks(h) {
            let xt: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            let logits = matvec(&self.router, &xt, e, h);
            let route = match self.kind {
                ModelKind::DeepseekV3 | ModelKind::KimiK2 => deepseek_route(
                    &logits,
                    &self.bias,
                    self.k,
                    cfg["n_group"].as_u64().unwrap() as usize,
                    cfg["topk_group"].as_u64().unwrap() as usize,
                    true,
                    cfg["routed_scaling_factor"].as_f64().unwrap(),
                ),
                // Mixtral: top-k of the logits, softmax over them: softmax then renormalised top-k.
                ModelKind::Mixtral => softmax_topk(&logits, self.k, true),
                _ => softmax_topk(&logits, self.k, cfg["norm_topk_prob"].as_bool().unwrap()),
            };
            let mut out = vec![0f64; h];
            for &(j, w) in &route {
                let [g, u, d] = &self.experts[j];
                for (o, v) in out.iter_mut().zip(expert(g, u, d, &xt, h, i)) {
                    *o += w * v;
                }
            }
            if let Some(([g, u, d], si, gate)) = &self.shared {
                // Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x); DeepSeek: weight 1.
                let w = gate.as_ref().map_or(1.0, |g| sigmoid(g.iter().zip(&xt).map(|(a, b)| a * b).sum()));
                for (o, v) in out.iter_mut().zip(expert(g, u, d, &xt, h, *si)) {
                    *o += w * v;
                }
            }
            chosen.push(route.iter().map(|r| r.0).collect());
            y.extend(out);
        }
        (y, chosen)
    }
}
