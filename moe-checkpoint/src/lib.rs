//! moe-checkpoint: one Mixture-of-Experts layer of a local Hugging Face checkpoint (a directory
//! with `config.json` and safetensors shards) mapped into moeforge's layout, ready for
//! `MoeLayer::load`.
//!
//! ```no_run
//! use std::path::Path;
//! let dir = Path::new("/models/Qwen3-30B-A3B");
//! let cfg = moe_checkpoint::inspect(dir)?;
//! println!("{:?}: {} layers, {} experts, top-{}", cfg.model, cfg.layers, cfg.experts, cfg.top_k);
//! let layer = moe_checkpoint::load_layer(dir, 0)?;
//! println!("{}", layer.spec.id());
//! // On a GPU: MoeLayer::load(&device, layer.spec, &layer.weights), then forward_logits with the
//! // router logits (layer.router.logits(x)) or forward with routing computed elsewhere.
//! # Ok::<(), moe_checkpoint::CheckpointError>(())
//! ```
//!
//! What loads ([`load_layer`]): Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral (bf16 / fp16, or GPTQ /
//! AWQ int4), DeepSeek-V3 and Kimi-K2 (block FP8, or any of the above storages), gpt-oss (MXFP4,
//! or bf16 / fp16: its clamped SwiGLU `swiglu_oai`, per-expert biases and router bias). Shared
//! experts (DeepSeek-V3, Kimi-K2, Qwen2-MoE) are in the layer: its spec has them
//! (`MoeSpec::with_shared_experts`) and its weights stack them after the routed experts, so one
//! step computes routed and shared experts from the routed routing `[M, k]`.
//! `docs/checkpoints.md` has the tensor names and everything refused.
//!
//! One rank of an expert-parallel layer reads only its own experts ([`load_layer_experts`]).
//!
//! Nothing is downloaded: fetching the snapshot is the caller's business.

#![warn(missing_docs)]

mod config;
mod error;
mod gpt_oss;
mod int4;
mod layer;
mod proj;
mod store;

pub use config::{ModelConfig, ModelKind, Quantization, SharedConfig};
pub use error::{CheckpointError, Result};

use moe_codegen::MoeSpec;
use moe_runtime::HostWeights;
use std::path::Path;

/// A layer's router in f32 (widened exactly from the checkpoint's dtype).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterWeights {
    /// `H`: the row length of `gate`.
    pub hidden: usize,
    /// `[E, H]`: `logits = x @ gate^T`.
    pub gate: Vec<f32>,
    /// DeepSeek-V3 / Kimi-K2: `[E]` `e_score_correction_bias`, added to the sigmoid scores to
    /// choose experts, not to the weights (`MoeLayer::set_router_bias`, or the CPU router's bias).
    pub correction_bias: Option<Vec<f32>>,
    /// gpt-oss: `[E]` bias added to the logits (by [`RouterWeights::logits`]).
    pub logit_bias: Option<Vec<f32>>,
}

impl RouterWeights {
    /// `logits [M, E]` of `x [M, H]` (`x @ gate^T + logit_bias`), summed in f64.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let h = self.hidden.max(1);
        let mut out = Vec::with_capacity(x.len() / h * (self.gate.len() / h));
        for xt in x.chunks_exact(h) {
            for (j, row) in self.gate.chunks_exact(h).enumerate() {
                let dot: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bias = self.logit_bias.as_ref().map_or(0.0, |b| b[j] as f64);
                out.push((dot + bias) as f32);
            }
        }
        out
    }
}

/// One MoE layer of a checkpoint, in moeforge's layout.
#[derive(Debug, Clone)]
pub struct LoadedLayer {
    /// The model family.
    pub model: ModelKind,
    /// The layer index.
    pub layer: usize,
    /// Geometry, format (the checkpoint's, mapped exactly), activation, biases (gpt-oss), router
    /// (the model's formula) and shared experts (DeepSeek-V3 / Kimi-K2: `n_shared_experts`,
    /// weight 1; Qwen2-MoE: `shared_expert_intermediate_size / moe_intermediate_size`, gated:
    /// `spec.shared_experts()`, `spec.shared_gated()`), computed in the same step.
    pub spec: MoeSpec,
    /// The experts: `w13 [E + S, 2I, H]` gate rows first, `w2 [E + S, H, I]`, the `S` shared
    /// experts after the `E` routed ones (the model's shared expert cut along its intermediate
    /// dimension into `S` experts of the routed size `I`: gate / up rows and down columns in
    /// chunks of `I`, whose outputs sum to its output); Qwen2-MoE: `shared_gate [H]` (the
    /// shared experts weigh `sigmoid(x . shared_gate)` per token); gpt-oss: `w13_bias [E, 2I]`
    /// (gate first) and `w2_bias [E, H]`.
    pub weights: HostWeights,
    /// The router's weights (`[E, H]`: the routed experts only; the layer appends the shared
    /// experts to every token's routing).
    pub router: RouterWeights,
}

/// The model's `config.json`, parsed and checked (nothing else is read).
pub fn inspect(dir: &Path) -> Result<ModelConfig> {
    ModelConfig::read(dir)
}

/// Layer `layer` of the checkpoint in `dir`, ready for `MoeLayer::load(&device, l.spec, &l.weights)`.
///
/// gpt-oss comes back with `Activation::SwigluOai`, per-expert biases (`spec.has_bias()`) and
/// its router bias in [`RouterWeights::logit_bias`]; on the GPU a spec with biases runs warp
/// decode at every step size.
pub fn load_layer(dir: &Path, layer: usize) -> Result<LoadedLayer> {
    let cfg = ModelConfig::read(dir)?;
    cfg.check_layer(layer)?;
    let store = store::Store::open(dir)?;
    match cfg.model {
        ModelKind::GptOss => gpt_oss::load(&store, &cfg, layer),
        _ => layer::load(&store, &cfg, layer, None),
    }
}

/// Layer `layer` with only the routed experts `experts` (in that order) in its weights, then its
/// shared experts: what one rank of an expert-parallel layer loads
/// (`EpLayer::new(&device, comm, l.spec, map, &l.weights, cfg)` with
/// `experts = map.experts_of(rank)`). The spec and the router are the whole layer's; the weights
/// are what `load_layer(dir, layer)?.weights.select_experts(&spec, experts)` gives, but only the
/// chosen experts' tensors are read (gpt-oss's fused expert tensors are read whole, then cut).
pub fn load_layer_experts(dir: &Path, layer: usize, experts: &[u32]) -> Result<LoadedLayer> {
    let cfg = ModelConfig::read(dir)?;
    cfg.check_layer(layer)?;
    if let Some(&expert) = experts.iter().find(|&&e| e >= cfg.experts) {
        return Err(CheckpointError::ExpertOutOfRange { expert, experts: cfg.experts });
    }
    let store = store::Store::open(dir)?;
    match cfg.model {
        ModelKind::GptOss => {
            let mut l = gpt_oss::load(&store, &cfg, layer)?;
            l.weights = l.weights.select_experts(&l.spec, experts).map_err(|e| CheckpointError::Unsupported {
                model: cfg.model.model_type().to_string(),
                feature: format!("selecting experts of this layer ({e})"),
            })?;
            Ok(l)
        }
        _ => layer::load(&store, &cfg, layer, Some(experts)),
    }
}
