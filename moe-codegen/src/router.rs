//! How a layer turns router logits into `topk_ids` / `topk_weights`.

use crate::spec::SpecError;
use std::fmt;

/// The router of a MoE layer. Ties are broken by the lowest expert (and group) id, on the GPU
/// and in the CPU reference alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Router {
    /// `p = softmax(logits)`, the `top_k` largest, weights `p` (renormalised to sum 1 if asked:
    /// Qwen3, Mixtral, gpt-oss renormalise; OLMoE does not).
    Softmax {
        /// Rescale the chosen weights to sum to 1.
        renormalize: bool,
    },
    /// DeepSeek-V3: `s = sigmoid(logits)`, choice by `s + bias` (a per-expert correction bias)
    /// within the `topk_groups` best of `groups` contiguous expert groups (a group scores the sum
    /// of its two best), weights `s` of the chosen (renormalised if asked) times `scaling`.
    GroupLimited(GroupLimited),
}

/// Parameters of [`Router::GroupLimited`]; `scaling` is kept as f32 bits so the spec stays `Eq`
/// and hashable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct GroupLimited {
    /// Contiguous expert groups (must divide the expert count).
    pub groups: u32,
    /// Groups kept per token, by the sum of each group's two best `s + bias`.
    pub topk_groups: u32,
    /// Rescale the chosen weights to sum to 1 before `scaling`.
    pub renormalize: bool,
    scaling_bits: u32,
}

impl GroupLimited {
    /// The parameters, `scaling` being the factor applied to the final weights.
    pub const fn new(groups: u32, topk_groups: u32, renormalize: bool, scaling: f32) -> GroupLimited {
        GroupLimited { groups, topk_groups, renormalize, scaling_bits: scaling.to_bits() }
    }
    /// The factor applied to the final routing weights.
    pub fn scaling(&self) -> f32 {
        f32::from_bits(self.scaling_bits)
    }
}

impl Default for Router {
    fn default() -> Self {
        Router::Softmax { renormalize: true }
    }
}

impl Router {
    /// DeepSeek-V3's router: 8 groups, 4 of them kept, renormalised, scaled by 2.5.
    pub fn deepseek_v3() -> Router {
        Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5))
    }

    /// Check the router against the layer's experts and top-k.
    pub fn validate(&self, experts: u32, top_k: u32) -> Result<(), SpecError> {
        let Router::GroupLimited(g) = self else { return Ok(()) };
        let bad = |why: String| Err(SpecError::Router { why });
        if g.groups == 0 || experts % g.groups != 0 {
            return bad(format!("groups = {} must divide experts = {experts}", g.groups));
        }
        if experts / g.groups < 2 {
            return bad(format!("a group scores its two best experts, but {experts} / {} is below 2", g.groups));
        }
        if g.topk_groups == 0 || g.topk_groups > g.groups {
            return bad(format!("topk_groups = {} must lie in 1..={}", g.topk_groups, g.groups));
        }
        if top_k > g.topk_groups * (experts / g.groups) {
            return bad(format!(
                "top_k = {top_k} exceeds the {} experts of {} groups",
                g.topk_groups * (experts / g.groups),
                g.topk_groups
            ));
        }
        if !g.scaling().is_finite() || g.scaling() <= 0.0 {
            return bad(format!("scaling = {} must be finite and positive", g.scaling()));
        }
        Ok(())
    }

    /// A short name for ids: `softmax`, `softmax_raw`, `grouped8x4s2.5`.
    pub fn name(&self) -> String {
        match self {
            Router::Softmax { renormalize: true } => "softmax".into(),
            Router::Softmax { renormalize: false } => "softmax_raw".into(),
            Router::GroupLimited(g) => {
                format!(
                    "grouped{}x{}{}s{}",
                    g.groups,
                    g.topk_groups,
                    if g.renormalize { "" } else { "raw" },
                    g.scaling()
                )
            }
        }
    }
}

impl fmt::Display for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// The router's constants as `router.cuh` reads them (both families render it).
pub(crate) struct RouterCtx {
    /// The routed experts and choices (the spec's, shared experts not counted).
    pub experts: u32,
    pub top_k: u32,
    pub grouped: bool,
    pub renormalize: bool,
    pub groups: u32,
    pub topk_groups: u32,
    pub scaling: String,
}

impl RouterCtx {
    pub(crate) fn new(spec: &crate::MoeSpec) -> RouterCtx {
        let (experts, top_k) = (spec.experts(), spec.top_k());
        match spec.router() {
            Router::Softmax { renormalize } => RouterCtx {
                experts,
                top_k,
                grouped: false,
                renormalize,
                groups: 0,
                topk_groups: 0,
                scaling: "1.0f".into(),
            },
            Router::GroupLimited(g) => RouterCtx {
                experts,
                top_k,
                grouped: true,
                renormalize: g.renormalize,
                groups: g.groups,
                topk_groups: g.topk_groups,
                scaling: format!("{:?}f", g.scaling()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_limited_is_validated() {
        assert!(Router::deepseek_v3().validate(256, 8).is_ok());
        assert!(Router::GroupLimited(GroupLimited::new(7, 4, true, 1.0)).validate(256, 8).is_err());
        assert!(Router::GroupLimited(GroupLimited::new(8, 9, true, 1.0)).validate(256, 8).is_err());
        assert!(Router::GroupLimited(GroupLimited::new(8, 1, true, 1.0)).validate(64, 9).is_err());
        assert!(Router::GroupLimited(GroupLimited::new(8, 1, true, f32::NAN)).validate(64, 8).is_err());
        assert!(Router::GroupLimited(GroupLimited::new(64, 1, true, 1.0)).validate(64, 1).is_err());
        assert!(Router::default().validate(8, 8).is_ok());
    }
}
