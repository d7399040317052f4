//! gpt-oss's MXFP4 experts (Hugging Face layout, `transformers.integrations.mxfp4`):
//!
//! - `mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]` u8: e2m1 codes, element `2j` in the low
//!   nibble of byte `j` of a 32-element block (the same order as moeforge's);
//! - `mlp.experts.gate_up_proj_scales [E, 2I, H/32]` u8: E8M0, `2^(s - 127)` (moeforge's too);
//! - `mlp.experts.gate_up_proj_bias [E, 2I]` (bf16);
//! - `mlp.experts.down_proj_{blocks,scales,bias}`: `[E, H, I/32, 16]`, `[E, H, I/32]`, `[E, H]`;
//! - `mlp.router.weight [E, H]`, `mlp.router.bias [E]`.
//!
//! The 2I rows of `gate_up` are interleaved (`gate, up = gate_up[..., ::2], gate_up[..., 1::2]`
//! in `GptOssExperts`): row `2n` is gate neuron `n`, row `2n + 1` its up neuron. moeforge wants
//! the I gate rows first, so rows (and the bias) are de-interleaved; codes and scales are copied.
//!
//! What the spec cannot express yet: the biases, and the activation
//! `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`
//! (alpha 1.702, limit `swiglu_limit` = 7). So a gpt-oss layer comes back as [`GptOssParts`]
//! (raw mapped tensors), never as a layer to run.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::store::Store;
use crate::RouterWeights;
use moe_codegen::{MoeSpec, WeightFormat};
use moe_runtime::HostWeights;
use safetensors::Dtype;

/// gpt-oss's SwiGLU `alpha` (`GptOssExperts.alpha`; not in the config).
pub const SWIGLU_ALPHA: f32 = 1.702;

/// A gpt-oss layer's tensors mapped into moeforge's layout, for callers that compute the parts
/// moeforge cannot yet (biases, the clamped SwiGLU). `spec` describes the weight layout only:
/// its activation (SiLU) is **not** gpt-oss's, so running it as a layer computes something else.
#[derive(Debug, Clone)]
pub struct GptOssParts {
    /// Geometry and format (`mxfp4`) of `weights`; the router is gpt-oss's (top-k logits then
    /// softmax, the same weights as softmax then renormalised top-k).
    pub spec: MoeSpec,
    /// `w13 [E, 2I, H]` gate rows first (de-interleaved), `w2 [E, H, I]`, MXFP4 with E8M0 scales.
    pub weights: HostWeights,
    /// `[E, 2I]`: the gate_up bias, de-interleaved like the rows (gate first).
    pub w13_bias: Vec<f32>,
    /// `[E, H]`: the down bias.
    pub w2_bias: Vec<f32>,
    /// The router: `gate [E, H]` and its logit bias.
    pub router: RouterWeights,
    /// The activation's alpha (1.702).
    pub swiglu_alpha: f32,
    /// The activation's clamp (`swiglu_limit`, 7.0).
    pub swiglu_limit: f32,
}

/// Read layer `layer`'s experts and router.
pub(crate) fn load(store: &Store, cfg: &ModelConfig, layer: usize) -> Result<GptOssParts> {
    let (e, h, i, k) = (cfg.experts as usize, cfg.hidden as usize, cfg.intermediate as usize, cfg.top_k);
    let spec = MoeSpec::builder(cfg.hidden, cfg.intermediate, cfg.experts, k)
        .weight_format(WeightFormat::Mxfp4)
        .build()?
        .with_router(cfg.router)?;
    let p = format!("model.layers.{layer}.mlp");
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
    let gu_bias = store.floats(&format!("{p}.experts.gate_up_proj_bias"), &[e, 2 * i])?;
    let w2_bias = store.floats(&format!("{p}.experts.down_proj_bias"), &[e, h])?;
    // Row r of moeforge's expert matrix is the file's row 2r (gate, r < I) or 2(r - I) + 1 (up).
    let src_row = |r: usize| if r < i { 2 * r } else { 2 * (r - i) + 1 };
    let (rb, sb) = (h / 2, h / 32);
    let mut w13 = Vec::with_capacity(gu.len());
    let mut w13_s = Vec::with_capacity(gu_s.len());
    let mut w13_bias = Vec::with_capacity(gu_bias.len());
    for ex in 0..e {
        for r in 0..2 * i {
            let src = ex * 2 * i + src_row(r);
            w13.extend_from_slice(&gu[src * rb..(src + 1) * rb]);
            w13_s.extend_from_slice(&gu_s[src * sb..(src + 1) * sb]);
            w13_bias.push(gu_bias[src]);
        }
    }
    let weights = HostWeights { w13, w13_scales: w13_s, w2: dn, w2_scales: dn_s, ..Default::default() };
    let router = RouterWeights {
        hidden: h,
        gate: store.floats(&format!("{p}.router.weight"), &[e, h])?,
        correction_bias: None,
        logit_bias: Some(store.floats(&format!("{p}.router.bias"), &[e])?),
    };
    Ok(GptOssParts {
        spec,
        weights,
        w13_bias,
        w2_bias,
        router,
        swiglu_alpha: SWIGLU_ALPHA,
        swiglu_limit: cfg.swiglu_limit.unwrap_or(7.0),
    })
}
