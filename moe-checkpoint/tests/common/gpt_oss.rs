//! A small gpt-oss checkpoint (MXFP4 as published, or bf16 as the dequantized snapshots) written
//! with the model's real tensor names, and `GptOssMLP`'s formula in f64 on the written tensors.

use super::*;
use safetensors::Dtype;
use serde_json::json;

/// How the experts are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OssStore {
    /// `gate_up_proj_{blocks,scales}`, `down_proj_{blocks,scales}` (`quant_method: mxfp4`).
    Mxfp4,
    /// `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]` bf16 (no `quantization_config`).
    Bf16,
}

/// gpt-oss's constants (`GptOssExperts.alpha`, `.limit`).
pub const ALPHA: f64 = 1.702;
pub const LIMIT: f64 = 7.0;

/// A written gpt-oss model (layer [`super::model::LAYER`]) and its weights dequantized from the
/// written tensors with the storage's own formula, in the file's order.
pub struct GptOss {
    pub ck: Ckpt,
    pub h: usize,
    pub i: usize,
    pub e: usize,
    pub k: usize,
    /// `[E, 2I, H]`: output `j` of expert `e`'s `gate_up` (HF's `gate_up_proj[e][:, j]`),
    /// interleaved: `j = 2n` gate, `2n + 1` up.
    pub gate_up: Vec<f64>,
    /// `[E, 2I]` interleaved like `gate_up`.
    pub gate_up_bias: Vec<f64>,
    /// `[E, H, I]`: `down[e][r][c]` = HF's `down_proj[e][c][r]`.
    pub down: Vec<f64>,
    /// `[E, H]`.
    pub down_bias: Vec<f64>,
    /// `[E, H]` and `[E]`.
    pub router: Vec<f64>,
    pub router_bias: Vec<f64>,
}

/// How often the reference met each clamp (pre-activation values past the limit).
#[derive(Debug, Default, Clone, Copy)]
pub struct Clamps {
    pub gate_above: usize,
    pub up_above: usize,
    pub up_below: usize,
    pub neurons: usize,
}

/// Row `row` of a `[rows, k/32, 16]` blocks tensor dequantized as transformers'
/// `convert_moe_packed_tensors` does: low nibble first, `lut[code] * 2^(scale - 127)`.
pub fn mxfp4_row(ck: &Ckpt, name: &str, row: usize, k: usize) -> Vec<f64> {
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

/// A two-layer gpt-oss of `e` experts, top-`k`, hidden 256, intermediate 128. `gate_up` is large
/// enough (amplitude 1 on tokens in [-1, 1]) that gate and up often pass +-7 and are clamped.
pub fn gpt_oss(store: OssStore, e: usize, k: usize, seed: u64) -> GptOss {
    let (h, i) = (256usize, 128usize);
    let mut cfg = json!({
        "model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": h, "intermediate_size": i,
        "num_local_experts": e, "num_experts_per_tok": k, "swiglu_limit": 7.0,
        "experts_per_token": k, "router_aux_loss_coef": 0.9, "output_router_logits": false
    });
    if store == OssStore::Mxfp4 {
        cfg["quantization_config"] = json!({
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
        });
    }
    let mut ck = Ckpt::new(cfg);
    let mut r = rng(seed);
    let p = format!("model.layers.{}.mlp", super::model::LAYER);
    let ex = format!("{p}.experts");
    // Written in the file's row order: gate_up's outputs interleaved (gate, up, gate, up, ...).
    let gu = uniform(&mut r, e * 2 * i * h, 1.0);
    let dn = uniform(&mut r, e * h * i, 2.0 / (i as f32).sqrt());
    let (gate_up, down) = match store {
        OssStore::Mxfp4 => {
            let (b, s) = mxfp4(&gu, e * 2 * i, h);
            ck.add(format!("{ex}.gate_up_proj_blocks"), Dtype::U8, &[e, 2 * i, h / 32, 16], b);
            ck.add(format!("{ex}.gate_up_proj_scales"), Dtype::U8, &[e, 2 * i, h / 32], s);
            let (b, s) = mxfp4(&dn, e * h, i);
            ck.add(format!("{ex}.down_proj_blocks"), Dtype::U8, &[e, h, i / 32, 16], b);
            ck.add(format!("{ex}.down_proj_scales"), Dtype::U8, &[e, h, i / 32], s);
            let gate_up =
                (0..e * 2 * i).flat_map(|row| mxfp4_row(&ck, &format!("{ex}.gate_up_proj"), row, h)).collect();
            let down = (0..e * h).flat_map(|row| mxfp4_row(&ck, &format!("{ex}.down_proj"), row, i)).collect();
            (gate_up, down)
        }
        OssStore::Bf16 => {
            // GptOssExperts' parameters: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W).
            let t = |w: &[f32], rows: usize, cols: usize| -> Vec<f32> {
                let mut o = vec![0f32; w.len()];
                for x in 0..e {
                    for a in 0..rows {
                        for b in 0..cols {
                            o[(x * cols + b) * rows + a] = w[(x * rows + a) * cols + b];
                        }
                    }
                }
                o
            };
            ck.bf16(format!("{ex}.gate_up_proj"), &[e, h, 2 * i], &t(&gu, 2 * i, h));
            ck.bf16(format!("{ex}.down_proj"), &[e, i, h], &t(&dn, h, i));
            // Read back from the file's layout: out[x][a][b] = file[x][b][a].
            let back = |f: Vec<f64>, rows: usize, cols: usize| -> Vec<f64> {
                let mut o = vec![0f64; f.len()];
                for x in 0..e {
                    for a in 0..rows {
                        for b in 0..cols {
                            o[(x * rows + a) * cols + b] = f[(x * cols + b) * rows + a];
                        }
                    }
                }
                o
            };
            (
                back(ck.floats(&format!("{ex}.gate_up_proj")), 2 * i, h),
                back(ck.floats(&format!("{ex}.down_proj")), h, i),
            )
        }
    };
    ck.bf16(format!("{ex}.gate_up_proj_bias"), &[e, 2 * i], &uniform(&mut r, e * 2 * i, 1.0));
    ck.bf16(format!("{ex}.down_proj_bias"), &[e, h], &uniform(&mut r, e * h, 1.0));
    ck.bf16(format!("{p}.router.weight"), &[e, h], &uniform(&mut r, e * h, 2.0 / (h as f32).sqrt()));
    ck.bf16(format!("{p}.router.bias"), &[e], &uniform(&mut r, e, 0.5));
    GptOss {
        gate_up,
        gate_up_bias: ck.floats(&format!("{ex}.gate_up_proj_bias")),
        down,
        down_bias: ck.floats(&format!("{ex}.down_proj_bias")),
        router: ck.floats(&format!("{p}.router.weight")),
        router_bias: ck.floats(&format!("{p}.router.bias")),
        ck,
        h,
        i,
        e,
        k,
    }
}

impl GptOss {
    /// `GptOssMLP` on `x [M, H]` in f64: `GptOssTopKRouter` (logits `x @ W^T + b`, top-k, softmax
    /// over the k) then `GptOssExperts`: `gate_up = x @ W + b`, `gate, up = gate_up[::2],
    /// gate_up[1::2]`, `gate.clamp(max=7)`, `up.clamp(-7, 7)`, `glu = gate * sigmoid(1.702 gate)`,
    /// `(up + 1) * glu @ down + down_bias`, times the routing weight. Returns `y`, the experts
    /// chosen per token and the clamps met.
    pub fn reference(&self, x: &[f32]) -> (Vec<f64>, Vec<Vec<usize>>, Clamps) {
        let (h, i, e, k) = (self.h, self.i, self.e, self.k);
        let (mut y, mut chosen, mut clamps) = (Vec::new(), Vec::new(), Clamps::default());
        for xt in x.chunks(h) {
            let xt: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            let logits: Vec<f64> =
                matvec(&self.router, &xt, e, h).iter().zip(&self.router_bias).map(|(l, b)| l + b).collect();
            let mut top: Vec<usize> = (0..e).collect();
            top.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            top.truncate(k);
            let mx = logits[top[0]];
            let sum: f64 = top.iter().map(|&j| (logits[j] - mx).exp()).sum();
            let mut out = vec![0f64; h];
            for &j in &top {
                let w = (logits[j] - mx).exp() / sum;
                let gu: Vec<f64> = matvec(&self.gate_up[j * 2 * i * h..(j + 1) * 2 * i * h], &xt, 2 * i, h)
                    .iter()
                    .zip(&self.gate_up_bias[j * 2 * i..(j + 1) * 2 * i])
                    .map(|(a, b)| a + b)
                    .collect();
                let mid: Vec<f64> = (0..i)
                    .map(|n| {
                        let (gate, up) = (gu[2 * n], gu[2 * n + 1]);
                        clamps.neurons += 1;
                        clamps.gate_above += (gate > LIMIT) as usize;
                        clamps.up_above += (up > LIMIT) as usize;
                        clamps.up_below += (up < -LIMIT) as usize;
                        let gate = gate.min(LIMIT);
                        let up = up.clamp(-LIMIT, LIMIT);
                        let glu = gate * sigmoid(gate * ALPHA);
                        (up + 1.0) * glu
                    })
                    .collect();
                let d = matvec(&self.down[j * h * i..(j + 1) * h * i], &mid, h, i);
                for ((o, v), b) in out.iter_mut().zip(d).zip(&self.down_bias[j * h..(j + 1) * h]) {
                    *o += w * (v + b);
                }
            }
            chosen.push(top);
            y.extend(out);
        }
        (y, chosen, clamps)
    }
}
