//! gpt-oss's experts (Hugging Face layout, `GptOssExperts` / `GptOssTopKRouter`), as a layer with
//! [`Activation::SwigluOai`] and per-expert biases.
//!
//! MXFP4 (`quant_method: mxfp4`, the published checkpoints; `transformers.integrations.mxfp4`):
//!
//! - `mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]` u8: e2m1 codes, element `2j` in the low
//!   nibble of byte `j` of a 32-element block (the same order as moeforge's);
//! - `mlp.experts.gate_up_proj_scales [E, 2I, H/32]` u8: E8M0, `2^(s - 127)` (moeforge's too);
//! - `mlp.experts.down_proj_{blocks,scales}`: `[E, H, I/32, 16]`, `[E, H, I/32]`.
//!
//! bf16 / fp16 (no `quantization_config`: the dequantized snapshots), `GptOssExperts`'
//! parameters as they are, multiplied from the left (`x @ W`):
//!
//! - `mlp.experts.gate_up_proj [E, H, 2I]`, `mlp.experts.down_proj [E, I, H]`: transposed here
//!   into moeforge's `[2I, H]` / `[H, I]` rows (elements copied, not converted).
//!
//! Both: `mlp.experts.gate_up_proj_bias [E, 2I]`, `mlp.experts.down_proj_bias [E, H]` (bf16,
//! widened to f32 exactly), `mlp.router.weight [E, H]`, `mlp.router.bias [E]`.
//!
//! The 2I outputs of `gate_up` are interleaved (`gate, up = gate_up[..., ::2], gate_up[..., 1::2]`
//! in `GptOssExperts`): output `2n` is gate neuron `n`, output `2n + 1` its up neuron. moeforge
//! wants the I gate rows first, so the rows and the bias are de-interleaved; MXFP4 codes and
//! scales are copied row by row. The bias of `gate_up` is added before the clamps, the down bias
//! to each expert's output before its routing weight: exactly the spec's `bias` (`w13_bias`,
//! `w2_bias`). The router is `x @ W^T + b`, top-k, softmax over the k chosen logits: the same
//! weights as the spec's `Router::Softmax { renormalize: true }` on those logits.

use crate::config::{ModelConfig, Quantization};
use crate::error::{CheckpointError, Result};
use crate::store::{dtype_error, Store};
use crate::{LoadedLayer, RouterWeights};
use moe_codegen::spec::SWIGLU_OAI_LIMIT;
use moe_codegen::{Activation, MoeSpec, WeightFormat};
use moe_runtime::HostWeights;
use safetensors::Dtype;

/// Read layer `layer`'s experts and router (a MoE layer of a gpt-oss checkpoint: checked by the
/// caller).
pub(crate) fn load(store: &Store, cfg: &ModelConfig, layer: usize) -> Result<LoadedLayer> {
    let (e, h, i) = (cfg.experts as usize, cfg.hidden as usize, cfg.intermediate as usize);
    let model = cfg.model.to_string();
    // GptOssExperts clamps at 7 (`swiglu_limit`); the spec's activation has that constant.
    let limit = cfg.swiglu_limit.unwrap_or(7.0);
    if limit as f64 != SWIGLU_OAI_LIMIT {
        return Err(CheckpointError::Unsupported {
            model,
            feature: format!("swiglu_limit {limit} (moeforge's swiglu_oai clamps at {SWIGLU_OAI_LIMIT})"),
        });
    }
    let p = format!("model.layers.{layer}.mlp");
    let dense_name = |what: &str| format!("{p}.experts.{what}");
    let format = match cfg.quant {
        Quantization::Mxfp4 => WeightFormat::Mxfp4,
        Quantization::None => {
            let name = dense_name("gate_up_proj");
            match store.dtype(&name)? {
                Dtype::BF16 => WeightFormat::Bf16,
                Dtype::F16 => WeightFormat::Fp16,
                d => return Err(dtype_error(&name, &[Dtype::BF16, Dtype::F16], d)),
            }
        }
        q => {
            return Err(CheckpointError::Unsupported {
                model,
                feature: format!("gpt-oss experts stored as {q:?} (mxfp4 or bf16 / fp16 only)"),
            })
        }
    };
    // The spec first: a geometry moeforge cannot hold is refused before any tensor is read.
    let spec = MoeSpec::builder(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k)
        .activation(Activation::SwigluOai)
        .bias(true)
        .weight_format(format)
        .build()?
        .with_router(cfg.router)?;
    let weights = match format {
        WeightFormat::Mxfp4 => mxfp4(store, &p, e, h, i)?,
        _ => dense(store, &p, format, e, h, i)?,
    };
    let gu_bias = store.floats(&format!("{p}.experts.gate_up_proj_bias"), &[e, 2 * i])?;
    let w13_bias =
        (0..e).flat_map(|ex| (0..2 * i).map(move |r| (ex, r))).map(|(ex, r)| gu_bias[ex * 2 * i + src_row(r, i)]);
    let w2_bias = store.floats(&format!("{p}.experts.down_proj_bias"), &[e, h])?;
    let weights = weights.with_bias(w13_bias.collect(), w2_bias);
    let router = RouterWeights {
        hidden: h,
        gate: store.floats(&format!("{p}.router.weight"), &[e, h])?,
        correction_bias: None,
        logit_bias: Some(store.floats(&format!("{p}.router.bias"), &[e])?),
    };
    Ok(LoadedLayer { model: cfg.model, layer, spec, weights, router })
}

/// The interleaved output (of `gate_up`) that is row `r` of moeforge's gate-first `[2I, H]`:
/// `2r` for gate neuron `r < I`, `2(r - I) + 1` for up neuron `r - I`.
fn src_row(r: usize, i: usize) -> usize {
    if r < i {
        2 * r
    } else {
        2 * (r - i) + 1
    }
}

/// MXFP4 blocks and scales: rows de-interleaved, bytes copied.
fn mxfp4(store: &Store, p: &str, e: usize, h: usize, i: usize) -> Result<HostWeights> {
    let scale_dtypes = [Dtype::U8, Dtype::F8_E8M0];
    let blocks = |name: &str, rows: usize, cols: usize| -> Result<(Vec<u8>, Vec<u8>)> {
        let bn = format!("{p}.experts.{name}_blocks");
        let (b, _) = store.get(&bn, &[Dtype::U8], &[e, rows, cols / 32, 16])?;
        let sn = format!("{p}.experts.{name}_scales");
        let (s, _) = store.get(&sn, &scale_dtypes, &[e, rows, cols / 32])?;
        Ok((b.data.to_vec(), s.data.to_vec()))
    };
    let (gu, gu_s) = blocks("gate_up_proj", 2 * i, h)?;
    let (dn, dn_s) = blocks("down_proj", h, i)?;
    let (rb, sb) = (h / 2, h / 32);
    let mut w13 = Vec::with_capacity(gu.len());
    let mut w13_scales = Vec::with_capacity(gu_s.len());
    for ex in 0..e {
        for r in 0..2 * i {
            let src = ex * 2 * i + src_row(r, i);
            w13.extend_from_slice(&gu[src * rb..(src + 1) * rb]);
            w13_scales.extend_from_slice(&gu_s[src * sb..(src + 1) * sb]);
        }
    }
    Ok(HostWeights { w13, w13_scales, w2: dn, w2_scales: dn_s, ..Default::default() })
}

/// bf16 / fp16 `gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]` transposed (and gate_up
/// de-interleaved) into `w13 [E, 2I, H]` and `w2 [E, H, I]`, element by element, on every core.
fn dense(store: &Store, p: &str, format: WeightFormat, e: usize, h: usize, i: usize) -> Result<HostWeights> {
    let dtype = if format == WeightFormat::Bf16 { Dtype::BF16 } else { Dtype::F16 };
    let gn = format!("{p}.experts.gate_up_proj");
    let (gu, _) = store.get(&gn, &[dtype], &[e, h, 2 * i])?;
    let dn_name = format!("{p}.experts.down_proj");
    let (dn, _) = store.get(&dn_name, &[dtype], &[e, i, h])?;
    // Expert `ex`'s `[rows, cols]` from the file's `[cols, src_cols]`: out[r][c] = in[c][src(r)].
    let transpose = |src: &[u8], rows: usize, cols: usize, src_of: &(dyn Fn(usize) -> usize + Sync)| -> Vec<u8> {
        let mut out = vec![0u8; e * rows * cols * 2];
        let per = rows * cols * 2;
        let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(e).max(1);
        let chunk = e.div_ceil(threads);
        std::thread::scope(|sc| {
            for (n, experts) in out.chunks_mut(chunk * per).enumerate() {
                sc.spawn(move || {
                    for (j, o) in experts.chunks_mut(per).enumerate() {
                        let a = &src[(n * chunk + j) * per..(n * chunk + j + 1) * per];
                        for r in 0..rows {
                            let s = src_of(r);
                            for c in 0..cols {
                                let (to, from) = ((r * cols + c) * 2, (c * rows + s) * 2);
                                o[to..to + 2].copy_from_slice(&a[from..from + 2]);
                            }
                        }
                    }
                });
            }
        });
        out
    };
    let w13 = transpose(gu.data, 2 * i, h, &|r| src_row(r, i));
    let w2 = transpose(dn.data, h, i, &|r| r);
    Ok(HostWeights { w13, w2, ..Default::default() })
}
