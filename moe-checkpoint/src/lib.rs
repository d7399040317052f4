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
//! experts come back beside the routed layer as a one-expert layer ([`SharedExpert`]) that the
//! caller adds. `docs/checkpoints.md` has the tensor names and everything refused.
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

/// A shared expert that every token goes through, beside the routed experts: a one-expert,
/// top-1 spec in the routed experts' format. Run it as a second layer with `topk_ids` 0 and
/// `topk_weights` 1 (or, where `gate` is set, `sigmoid(gate . x)` per token) and add its output
/// to the routed layer's. Computing it inside the routed layer's step is later work.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// `experts = 1`, `top_k = 1`, intermediate the shared expert's.
    pub spec: MoeSpec,
    /// Its `w13` / `w2` in the spec's layout.
    pub weights: HostWeights,
    /// Qwen2-MoE: `shared_expert_gate.weight [H]`: the token's weight is `sigmoid(gate . x)`.
    /// `None` (DeepSeek-V3): weight 1.
    pub gate: Option<Vec<f32>>,
}

/// One MoE layer of a checkpoint, in moeforge's layout.
#[derive(Debug, Clone)]
pub struct LoadedLayer {
    /// The model family.
    pub model: ModelKind,
    /// The layer index.
    pub layer: usize,
    /// Geometry, format (the checkpoint's, mapped exactly), activation, biases (gpt-oss) and
    /// router (the model's formula).
    pub spec: MoeSpec,
    /// The routed experts: `w13 [E, 2I, H]` gate rows first, `w2 [E, H, I]`; gpt-oss: with
    /// `w13_bias [E, 2I]` (gate first) and `w2_bias [E, H]`.
    pub weights: HostWeights,
    /// The router's weights.
    pub router: RouterWeights,
    /// The shared expert, where the model has one: its output must be added (see [`SharedExpert`]).
    pub shared: Option<SharedExpert>,
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
        _ => layer::load(&store, &cfg, layer),
    }
}
