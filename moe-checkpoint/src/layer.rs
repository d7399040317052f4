//! The layer of every family with per-expert projections (Qwen3/Qwen2-MoE, OLMoE, Mixtral,
//! DeepSeek-V3 / Kimi-K2; gpt-oss's fused experts are `crate::gpt_oss`'s): the tensor names of
//! each family (as in transformers' modeling files and the published checkpoints), then the
//! experts stacked into `w13` / `w2`.

use crate::config::{ModelConfig, ModelKind};
use crate::error::Result;
use crate::proj::{Proj, Storage};
use crate::store::Store;
use crate::{LoadedLayer, RouterWeights, SharedExpert};
use moe_codegen::{MoeSpec, Router};
use moe_runtime::HostWeights;

/// Tensor name prefixes of one layer.
struct Names {
    /// `[E, H]` router weight.
    router: String,
    /// DeepSeek's `[E]` correction bias (added to the scores for the choice only).
    correction_bias: Option<String>,
    /// Prefix of expert `e`'s projections, and the three projection names (gate, up, down).
    experts: String,
    proj: [&'static str; 3],
    /// The shared expert's prefix, and Qwen2-MoE's `[1, H]` sigmoid gate.
    shared: Option<String>,
    shared_gate: Option<String>,
}

fn names(model: ModelKind, layer: usize) -> Names {
    let p = format!("model.layers.{layer}");
    const GUD: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
    match model {
        ModelKind::Qwen3Moe | ModelKind::Olmoe => Names {
            router: format!("{p}.mlp.gate.weight"),
            correction_bias: None,
            experts: format!("{p}.mlp.experts"),
            proj: GUD,
            shared: None,
            shared_gate: None,
        },
        ModelKind::Qwen2Moe => Names {
            router: format!("{p}.mlp.gate.weight"),
            correction_bias: None,
            experts: format!("{p}.mlp.experts"),
            proj: GUD,
            shared: Some(format!("{p}.mlp.shared_expert")),
            shared_gate: Some(format!("{p}.mlp.shared_expert_gate.weight")),
        },
        // Mixtral: w1 = gate, w3 = up, w2 = down (MixtralBlockSparseTop2MLP).
        ModelKind::Mixtral => Names {
            router: format!("{p}.block_sparse_moe.gate.weight"),
            correction_bias: None,
            experts: format!("{p}.block_sparse_moe.experts"),
            proj: ["w1", "w3", "w2"],
            shared: None,
            shared_gate: None,
        },
        // gpt-oss never gets here (crate::gpt_oss reads its fused experts).
        ModelKind::DeepseekV3 | ModelKind::KimiK2 | ModelKind::GptOss => Names {
            router: format!("{p}.mlp.gate.weight"),
            correction_bias: Some(format!("{p}.mlp.gate.e_score_correction_bias")),
            experts: format!("{p}.mlp.experts"),
            proj: GUD,
            shared: Some(format!("{p}.mlp.shared_experts")),
            shared_gate: None,
        },
    }
}

/// Read layer `layer` (a MoE layer of a per-expert family: checked by the caller).
pub(crate) fn load(store: &Store, cfg: &ModelConfig, layer: usize) -> Result<LoadedLayer> {
    let n = names(cfg.model, layer);
    let (h, e) = (cfg.hidden as usize, cfg.experts as usize);
    let storage = Storage::detect(cfg.quant, store, &format!("{}.0.{}", n.experts, n.proj[0]), cfg.model.model_type())?;
    let format = storage.format();
    // The spec first: a geometry moeforge cannot hold is refused before any tensor is read.
    let spec = MoeSpec::builder(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k)
        .weight_format(format)
        .build()?
        .with_router(cfg.router)?;
    let prefixes: Vec<String> = (0..e).map(|x| format!("{}.{x}", n.experts)).collect();
    let weights = stack(store, storage, &prefixes, n.proj, h, cfg.intermediate as usize)?;
    let router = RouterWeights {
        hidden: h,
        gate: store.floats(&n.router, &[e, h])?,
        correction_bias: n.correction_bias.as_deref().map(|b| store.floats(b, &[e])).transpose()?,
        logit_bias: None,
    };
    let shared = match (cfg.shared, &n.shared) {
        (Some(sc), Some(prefix)) => {
            // One expert, top-1: the caller runs it as a second layer with ids 0 and weight 1
            // (Qwen2-MoE: weight sigmoid(gate . x) per token).
            let spec = MoeSpec::builder(cfg.hidden, sc.intermediate, 1, 1)
                .weight_format(format)
                .build()?
                .with_router(Router::Softmax { renormalize: true })?;
            let weights = stack(store, storage, std::slice::from_ref(prefix), n.proj, h, sc.intermediate as usize)?;
            let gate = match (&n.shared_gate, sc.gated) {
                (Some(g), true) => Some(store.floats(g, &[1, h])?),
                _ => None,
            };
            Some(SharedExpert { spec, weights, gate })
        }
        _ => None,
    };
    Ok(LoadedLayer { model: cfg.model, layer, spec, weights, router, shared })
}

/// `w13` (each expert's gate then up projection) and `w2` (down) of the experts at `prefixes`,
/// read on every core, stacked in expert order.
fn stack(
    store: &Store,
    storage: Storage,
    prefixes: &[String],
    [gate, up, down]: [&str; 3],
    h: usize,
    i: usize,
) -> Result<HostWeights> {
    let expert = |p: &String| -> Result<[Proj; 3]> {
        Ok([
            storage.load(store, &format!("{p}.{gate}"), i, h)?,
            storage.load(store, &format!("{p}.{up}"), i, h)?,
            storage.load(store, &format!("{p}.{down}"), h, i)?,
        ])
    };
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(prefixes.len()).max(1);
    let chunk = prefixes.len().div_ceil(threads);
    let parts: Vec<Result<Vec<[Proj; 3]>>> = std::thread::scope(|sc| {
        let workers: Vec<_> =
            prefixes.chunks(chunk).map(|ps| sc.spawn(move || ps.iter().map(expert).collect())).collect();
        workers.into_iter().map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let mut w = HostWeights::default();
    for part in parts {
        for [g, u, d] in part? {
            w.w13.extend(g.data.into_iter().chain(u.data));
            w.w13_scales.extend(g.scales.into_iter().chain(u.scales));
            w.w2.extend(d.data);
            w.w2_scales.extend(d.scales);
        }
    }
    Ok(w)
}
