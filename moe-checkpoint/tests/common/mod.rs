//! Test checkpoints written from random f32 weights with each format's own packing, written here
//! independently of the loader (AutoGPTQ's, AutoAWQ's, DeepSeek's and gpt-oss's conventions), and
//! the f64 model formulas computed from the written tensors.

#![allow(dead_code)]

pub mod gpt_oss;
pub mod model;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::path::Path;

/// A checkpoint being written: tensors and `config.json`.
pub struct Ckpt {
    pub tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    pub config: Value,
}

impl Ckpt {
    pub fn new(config: Value) -> Ckpt {
        Ckpt { tensors: Vec::new(), config }
    }
    pub fn add(&mut self, name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) {
        self.tensors.push((name.into(), dtype, shape.to_vec(), data));
    }
    pub fn bf16(&mut self, name: impl Into<String>, shape: &[usize], v: &[f32]) {
        self.add(name, Dtype::BF16, shape, v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect());
    }
    pub fn f32(&mut self, name: impl Into<String>, shape: &[usize], v: &[f32]) {
        self.add(name, Dtype::F32, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    pub fn i32(&mut self, name: impl Into<String>, shape: &[usize], v: &[u32]) {
        self.add(name, Dtype::I32, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    pub fn f16(&mut self, name: impl Into<String>, shape: &[usize], v: &[half::f16]) {
        self.add(name, Dtype::F16, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    /// The bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> &[u8] {
        &self.tensors.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("no tensor {name}")).3
    }
    pub fn floats(&self, name: &str) -> Vec<f64> {
        let t = self.tensors.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("no tensor {name}"));
        match t.1 {
            Dtype::BF16 => t.3.chunks(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
            Dtype::F16 => t.3.chunks(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
            Dtype::F32 => t.3.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
            d => panic!("{name}: {d:?} is not a float"),
        }
    }
    pub fn words(&self, name: &str) -> Vec<u32> {
        self.bytes(name).chunks(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect()
    }
    pub fn remove(&mut self, name: &str) {
        self.tensors.retain(|t| t.0 != name);
    }

    /// Write `config.json` and the tensors: one `model.safetensors`, or `shards` files named by a
    /// `model.safetensors.index.json`.
    pub fn write(&self, dir: &Path, shards: usize) {
        std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&self.config).unwrap()).unwrap();
        let views: Vec<(String, TensorView)> =
            self.tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        if shards <= 1 {
            safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
            return;
        }
        let mut map = serde_json::Map::new();
        for s in 0..shards {
            let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
            let part: Vec<_> =
                views.iter().enumerate().filter(|(i, _)| i % shards == s).map(|(_, v)| v.clone()).collect();
            for (n, _) in &part {
                map.insert(n.clone(), json!(file));
            }
            safetensors::serialize_to_file(part, None, &dir.join(&file)).unwrap();
        }
        let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    }
}

/// One expert-parallel rank's load of the layer `l` came from (`dir`, layer `l.layer`): experts
/// 2 and 0 read alone, the same bytes as cutting them from the whole layer, shared experts
/// (and their gate) after them; the spec and the router the whole layer's.
#[allow(dead_code)]
pub fn check_rank_load(dir: &Path, l: &moe_checkpoint::LoadedLayer) {
    let pick = [2u32, 0];
    let part = moe_checkpoint::load_layer_experts(dir, l.layer, &pick).unwrap();
    let want = l.weights.select_experts(&l.spec, &pick).unwrap();
    assert_eq!((part.spec, &part.router), (l.spec, &l.router));
    let w = &part.weights;
    assert!(w.w13 == want.w13 && w.w13_scales == want.w13_scales, "{:?}: w13", l.model);
    assert!(w.w2 == want.w2 && w.w2_scales == want.w2_scales, "{:?}: w2", l.model);
    assert!(w.w13_bias == want.w13_bias && w.w2_bias == want.w2_bias, "{:?}: biases", l.model);
    assert_eq!(w.shared_gate, want.shared_gate);
    let experts = l.spec.experts();
    let bad = moe_checkpoint::load_layer_experts(dir, l.layer, &[0, experts]);
    assert!(
        matches!(bad, Err(moe_checkpoint::CheckpointError::ExpertOutOfRange { expert, .. }) if expert == experts),
        "{bad:?}"
    );
}

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// `n` uniform values in `[-amp, amp)`.
pub fn uniform(rng: &mut SmallRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Activations as the device sees them (bf16-rounded).
pub fn tokens(rng: &mut SmallRng, m: usize, h: usize) -> Vec<f32> {
    uniform(rng, m * h, 1.0).into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect()
}

pub fn round_bf16(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f64()).collect()
}

// ---- packers (the formats' own conventions, written here from their reference code) ----

/// e4m3fn value of a code: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff NaN.
pub fn e4m3_value(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f64);
    sign * if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) }
}

/// The nearest e4m3fn code (a search over the finite codes sorted by value).
pub fn e4m3_code(v: f64) -> u8 {
    static SORTED: std::sync::OnceLock<Vec<(f64, u8)>> = std::sync::OnceLock::new();
    let t = SORTED.get_or_init(|| {
        let mut t: Vec<(f64, u8)> = (0..=255u8).filter(|&b| b & 0x7f != 0x7f).map(|b| (e4m3_value(b), b)).collect();
        t.sort_by(|a, b| a.0.total_cmp(&b.0));
        t
    });
    let i = t.partition_point(|p| p.0 < v);
    let lo = t[i.saturating_sub(1)];
    let hi = t[i.min(t.len() - 1)];
    if (v - lo.0).abs() <= (hi.0 - v).abs() {
        lo.1
    } else {
        hi.1
    }
}

/// DeepSeek-V3's block FP8 of `w [n, k]`: e4m3 codes and f32 `weight_scale_inv [n/128, k/128]`
/// (w = code * scale_inv).
pub fn fp8_block(w: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let (bn, bk) = (n.div_ceil(128), k.div_ceil(128));
    let mut s = vec![0f32; bn * bk];
    for r in 0..n {
        for c in 0..k {
            let b = &mut s[(r / 128) * bk + c / 128];
            *b = b.max(w[r * k + c].abs() / 448.0);
        }
    }
    let codes = (0..n * k).map(|i| e4m3_code(w[i] as f64 / s[(i / k / 128) * bk + (i % k) / 128] as f64)).collect();
    (codes, s)
}

/// OCP e2m1 values by code.
pub const E2M1: [f64; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// gpt-oss MXFP4 of `w [rows, k]`: blocks `[rows, k/32, 16]` (element 2j low nibble of byte j)
/// and E8M0 scales `[rows, k/32]` (2^(s - 127)).
pub fn mxfp4(w: &[f32], rows: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    for r in 0..rows {
        for b in 0..k / 32 {
            let v = &w[r * k + b * 32..r * k + b * 32 + 32];
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            let e = if amax > 0.0 { amax.log2().floor() as i32 - 2 } else { -127 };
            scales.push((e + 127) as u8);
            let x = 2f64.powi(e);
            let code = |v: f32| {
                (0..16u8)
                    .min_by(|&a, &b| {
                        (E2M1[a as usize] - v as f64 / x).abs().total_cmp(&(E2M1[b as usize] - v as f64 / x).abs())
                    })
                    .unwrap()
            };
            for j in 0..16 {
                blocks.push(code(v[2 * j]) | code(v[2 * j + 1]) << 4);
            }
        }
    }
    (blocks, scales)
}

/// Per-group int4 quantization of `w [n, k]` as GPTQ / AWQ compute it: `(q [n, k], scale [k/g, n],
/// zero [k/g, n])` with `w ≈ (q - zero) * scale`. Symmetric: zero 8 (GPTQ's `(maxq + 1) / 2`).
pub fn int4_groups(w: &[f32], n: usize, k: usize, g: usize, sym: bool) -> (Vec<u8>, Vec<half::f16>, Vec<u8>) {
    let ng = k / g;
    let (mut q, mut s, mut z) = (vec![0u8; n * k], vec![half::f16::ZERO; ng * n], vec![0u8; ng * n]);
    for r in 0..n {
        for gi in 0..ng {
            let v = &w[r * k + gi * g..r * k + gi * g + g];
            let mut lo = v.iter().fold(0f32, |m, &x| m.min(x));
            let mut hi = v.iter().fold(0f32, |m, &x| m.max(x));
            if sym {
                hi = hi.max(-lo);
                lo = -hi;
            }
            let scale = half::f16::from_f32((hi - lo) / 15.0);
            let zero = if sym { 8.0 } else { (-lo / scale.to_f32()).round().clamp(1.0, 15.0) };
            s[gi * n + r] = scale;
            z[gi * n + r] = zero as u8;
            for (c, &x) in v.iter().enumerate() {
                q[r * k + gi * g + c] = ((x / scale.to_f32()).round() + zero).clamp(0.0, 15.0) as u8;
            }
        }
    }
    (q, s, z)
}

/// AutoGPTQ's packing: `qweight [k/8, n]` along K, `qzeros [k/g, n/8]` along N storing zero - 1.
pub fn gptq_pack(q: &[u8], z: &[u8], n: usize, k: usize) -> (Vec<u32>, Vec<u32>) {
    let mut qw = vec![0u32; k / 8 * n];
    for r in 0..n {
        for c in 0..k {
            qw[(c / 8) * n + r] |= (q[r * k + c] as u32) << (4 * (c % 8));
        }
    }
    let ng = z.len() / n;
    let mut qz = vec![0u32; ng * n / 8];
    for gi in 0..ng {
        for r in 0..n {
            qz[gi * n / 8 + r / 8] |= ((z[gi * n + r] as u32 - 1) & 15) << (4 * (r % 8));
        }
    }
    (qw, qz)
}

/// AutoAWQ's GEMM packing: along N, output `8 j + ORDER[i]` in nibble `i`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
pub fn awq_pack(q: &[u8], z: &[u8], n: usize, k: usize) -> (Vec<u32>, Vec<u32>) {
    let pack = |rows: usize, at: &dyn Fn(usize, usize) -> u8| {
        let mut out = vec![0u32; rows * n / 8];
        for row in 0..rows {
            for j in 0..n / 8 {
                for (i, &o) in AWQ_ORDER.iter().enumerate() {
                    out[row * n / 8 + j] |= (at(row, 8 * j + o) as u32) << (4 * i);
                }
            }
        }
        out
    };
    (pack(k, &|c, r| q[r * k + c]), pack(z.len() / n, &|gi, r| z[gi * n + r]))
}

// ---- the models' formulas in f64 ----

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `w [n, k] @ x [k]`.
pub fn matvec(w: &[f64], x: &[f64], n: usize, k: usize) -> Vec<f64> {
    (0..n).map(|r| w[r * k..(r + 1) * k].iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

/// A SwiGLU expert: `down @ (silu(gate @ x) * (up @ x))`.
pub fn expert(gate: &[f64], up: &[f64], down: &[f64], x: &[f64], h: usize, i: usize) -> Vec<f64> {
    let (g, u) = (matvec(gate, x, i, h), matvec(up, x, i, h));
    let mid: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| silu(a) * b).collect();
    matvec(down, &mid, h, i)
}

/// Softmax over all logits, the top k, renormalised if asked (Qwen, OLMoE, Mixtral).
pub fn softmax_topk(logits: &[f64], k: usize, renorm: bool) -> Vec<(usize, f64)> {
    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
    let mut p: Vec<(usize, f64)> = logits.iter().map(|l| (l - mx).exp() / sum).enumerate().collect();
    p.sort_by(|a, b| b.1.total_cmp(&a.1));
    p.truncate(k);
    if renorm {
        let s: f64 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= s);
    }
    p
}

/// DeepSeek-V3's noaux_tc routing (DeepseekV3TopkRouter / MoEGate): sigmoid scores, choice by
/// score + bias within the topk_group best groups (a group scores its two best), weights the
/// plain scores, renormalised, times the scaling factor.
pub fn deepseek_route(
    logits: &[f64],
    bias: &[f64],
    k: usize,
    groups: usize,
    topk_groups: usize,
    renorm: bool,
    scaling: f64,
) -> Vec<(usize, f64)> {
    let e = logits.len();
    let s: Vec<f64> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let gsize = e / groups;
    let mut gs: Vec<(usize, f64)> = (0..groups)
        .map(|g| {
            let mut v = choice[g * gsize..(g + 1) * gsize].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (g, v[0] + v[1])
        })
        .collect();
    gs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let kept: Vec<usize> = gs[..topk_groups].iter().map(|x| x.0).collect();
    let mut cand: Vec<usize> = (0..e).filter(|j| kept.contains(&(j / gsize))).collect();
    cand.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
    cand.truncate(k);
    let mut w: Vec<(usize, f64)> = cand.iter().map(|&j| (j, s[j])).collect();
    if renorm {
        let t: f64 = w.iter().map(|x| x.1).sum();
        w.iter_mut().for_each(|x| x.1 /= t);
    }
    w.iter_mut().for_each(|x| x.1 *= scaling);
    w
}

/// Relative L2 distance of `got` from `want`.
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let d: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let w: f64 = want.iter().map(|b| b * b).sum();
    (d / w).sqrt()
}

// ---- the loaded layer's output, through moeforge's CPU reference ----

/// The loaded layer on `x [M, H]`: routing from `router.logits` by moe-runtime's CPU router (the
/// spec's router, with DeepSeek's correction bias), then the f64 reference on the loaded
/// weights with that routed routing `[M, k]` only: `moe_forward` appends the spec's shared
/// experts (weight 1, or Qwen2-MoE's `sigmoid(shared_gate . x)`) itself.
pub fn loaded_output(l: &moe_checkpoint::LoadedLayer, x: &[f32]) -> (Vec<f64>, Vec<i32>) {
    use moe_runtime::reference::{moe_forward, route};
    let logits = l.router.logits(x);
    let bias = l.router.correction_bias.clone().unwrap_or_else(|| vec![0.0; l.spec.experts() as usize]);
    let (ids, w) = route(&l.spec, &logits, &bias);
    assert_eq!(ids.len(), x.len() / l.spec.hidden() as usize * l.spec.top_k() as usize);
    (moe_forward(&l.spec, &l.weights, x, &ids, &w), ids)
}
