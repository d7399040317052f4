//! The layer of every family with per-expert projections (Qwen3/Qwen2-MoE, OLMoE, Mixtral,
//! DeepSeek-V3 / Kimi-K2; gpt-oss's fused experts are `crate::gpt_oss`'s): the tensor names of
//! each family (as in transformers' modeling files and the published checkpoints), then the
//! experts stacked into `w13` / `w2`.

use crate::config::{ModelConfig, ModelKind, SharedConfig};
use crate::error::{CheckpointError, Result};
use crate::proj::{split_refusal, Proj, Storage};
use crate::store::Store;
use crate::{LoadedLayer, RouterWeights};
use moe_codegen::{MoeSpec, WeightFormat};
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

/// Read layer `layer` (a MoE layer of a per-expert family: checked by the caller), its routed
/// experts all or `only` those (ids checked by the caller), in that order. A shared expert becomes
/// `n` more experts of the routed intermediate size after the routed ones, `n` being its
/// intermediate over the routed one (its gate / up rows and down columns cut into chunks of that
/// size, which sum to its output), computed in the same step.
pub(crate) fn load(store: &Store, cfg: &ModelConfig, layer: usize, only: Option<&[u32]>) -> Result<LoadedLayer> {
    let n = names(cfg.model, layer);
    let (h, e, i) = (cfg.hidden as usize, cfg.experts as usize, cfg.intermediate as usize);
    let storage = Storage::detect(cfg.quant, store, &format!("{}.0.{}", n.experts, n.proj[0]), cfg.model.model_type())?;
    let format = storage.format();
    // The spec first: a geometry moeforge cannot hold is refused before any tensor is read (the
    // routed experts' first, then the shared expert's split).
    let mut spec = MoeSpec::builder(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k)
        .weight_format(format)
        .build()?
        .with_router(cfg.router)?;
    let shared = match (cfg.shared, &n.shared) {
        (Some(sc), Some(prefix)) => Some((sc, prefix, shared_count(cfg, sc, format)?)),
        _ => None,
    };
    if let Some((sc, _, count)) = shared {
        spec = spec.with_shared_experts(count, sc.gated)?;
    }
    let prefixes: Vec<String> = match only {
        None => (0..e).map(|x| format!("{}.{x}", n.experts)).collect(),
        Some(ids) => ids.iter().map(|x| format!("{}.{x}", n.experts)).collect(),
    };
    let mut weights = stack(store, storage, &prefixes, n.proj, h, i)?;
    if let Some((sc, prefix, count)) = shared {
        let si = sc.intermediate as usize;
        let [g, u, d] = expert(store, storage, prefix, n.proj, h, si)?;
        for j in 0..count as usize {
            let chunk = [g.rows(format, h, j * i, i), u.rows(format, h, j * i, i), d.cols(format, h, si, j * i, i)];
            push(&mut weights, chunk);
        }
        if let (true, Some(name)) = (sc.gated, &n.shared_gate) {
            // Qwen2-MoE's shared_expert_gate [1, H]: every shared slot weighs sigmoid(x . gate).
            weights.shared_gate = store.floats(name, &[1, h])?;
        }
    }
    let router = RouterWeights {
        hidden: h,
        gate: store.floats(&n.router, &[e, h])?,
        correction_bias: n.correction_bias.as_deref().map(|b| store.floats(b, &[e])).transpose()?,
        logit_bias: None,
    };
    Ok(LoadedLayer { model: cfg.model, layer, spec, weights, router })
}

/// How many experts of the routed intermediate size the shared expert makes: its intermediate
/// must be a multiple of the routed one, cut keeping whole blocks / groups of `format`.
fn shared_count(cfg: &ModelConfig, sc: SharedConfig, format: WeightFormat) -> Result<u32> {
    let (si, i) = (sc.intermediate, cfg.intermediate);
    let unsupported = |why: String| CheckpointError::Unsupported {
        model: cfg.model.model_type().to_string(),
        feature: format!("a shared expert of intermediate {si} with routed experts of intermediate {i} ({why})"),
    };
    if si % i != 0 {
        return Err(unsupported(format!(
            "{si} is not a multiple of {i}: it is computed as {si} / {i} experts of the routed size"
        )));
    }
    if let Some(why) = split_refusal(format, i as usize) {
        return Err(unsupported(why));
    }
    Ok(si / i)
}

/// Expert `p`'s gate, up (`[i, h]`) and down (`[h, i]`) projections.
fn expert(
    store: &Store,
    storage: Storage,
    p: &str,
    [gate, up, down]: [&str; 3],
    h: usize,
    i: usize,
) -> Result<[Proj; 3]> {
    Ok([
        storage.load(store, &format!("{p}.{gate}"), i, h)?,
        storage.load(store, &format!("{p}.{up}"), i, h)?,
        storage.load(store, &format!("{p}.{down}"), h, i)?,
    ])
}

/// Append one expert to `w13` (gate then up) and `w2`.
fn push(w: &mut HostWeights, [g, u, d]: [Proj; 3]) {
    w.w13.extend(g.data.into_iter().chain(u.data));
    w.w13_scales.extend(g.scales.into_iter().chain(u.scales));
    w.w2.extend(d.data);
    w.w2_scales.extend(d.scales);
}

/// `w13` (each expert's gate then up projection) and `w2` (down) of the experts at `prefixes`,
/// read on every core, stacked in expert order.
fn stack(
    store: &Store,
    storage: Storage,
    prefixes: &[String],
    proj: [&str; 3],
    h: usize,
    i: usize,
) -> Result<HostWeights> {
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(prefixes.len()).max(1);
    let chunk = prefixes.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<[Proj; 3]>>> = std::thread::scope(|sc| {
        let workers: Vec<_> = prefixes
            .chunks(chunk)
            .map(|ps| sc.spawn(move || ps.iter().map(|p| expert(store, storage, p, proj, h, i)).collect()))
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let mut w = HostWeights::default();
    for part in parts {
        for x in part? {
            push(&mut w, x);
        }
    }
    Ok(w)
}
