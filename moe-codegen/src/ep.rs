//! The expert-parallel exchange module: the kernels around an expert-parallel step's NCCL
//! transfers (count, place, combine), rendered per spec like the families (hidden size, top-k,
//! experts and activation dtype baked in). The runtime's `ep` module launches them.

use crate::params;
use crate::render::{count_render, CodegenError, KernelSource};
use crate::spec::{Arch, KernelFamily, MoeSpec};
use askama::Template;

/// The most ranks an expert-parallel layer spans (a token's destinations are one 64-bit mask).
pub const EP_MAX_RANKS: u32 = 64;
/// Tokens (one per thread) of a block of the count and place kernels.
pub const EP_PLAN_THREADS: u32 = 128;
/// Threads per block of the pack and combine kernels (one block per token).
pub const EP_ROW_THREADS: u32 = 128;

/// The exchange module's entry points.
pub mod ep_entry {
    /// Per block of tokens, how many go to each slab.
    pub const COUNT: &str = "moe_ep_count";
    /// Each token's rows in the slabs it goes to, with its routing and activations.
    pub const PLACE: &str = "moe_ep_place";
    /// Activations into the peers' slabs.
    pub const PACK: &str = "moe_ep_pack";
    /// fp8 dispatch: received rows back into the activation dtype.
    pub const UNPACK: &str = "moe_ep_unpack";
    /// Partial outputs summed in rank order.
    pub const COMBINE: &str = "moe_ep_combine";
    /// Router logits of the whole layer to routing ids and weights (the spec's router).
    pub const ROUTE: &str = "moe_route";
}

#[derive(Template)]
#[template(path = "ep.cu", escape = "none")]
struct EpCu {
    spec_id: String,
    act_type: &'static str,
    params: String,
    hidden: u32,
    experts: u32,
    top_k: u32,
    max_ranks: u32,
    plan_threads: u32,
    row_threads: u32,
    /// Tokens travel in e4m3 with per-128-column scales ([`render_ep`]'s `fp8`).
    wire_fp8: bool,
    /// The spec has shared experts: every token has work on its own rank.
    shared: bool,
    /// The whole layer's router (`router.cuh`), for steps from logits.
    router: crate::router::RouterCtx,
}

/// Render the exchange kernels of `spec` (the whole layer's spec, every expert counted) for
/// `arch`; `fp8`: tokens travel to their peers in e4m3 with one f32 scale per 128 columns (the
/// hidden size a multiple of 128). Like the dequant probe, the module is not a compute family:
/// its `family` field reads `WarpDecode` and it belongs in no family's source list.
pub fn render_ep(spec: &MoeSpec, arch: Arch, fp8: bool) -> Result<KernelSource, CodegenError> {
    count_render();
    let unsupported = |what: String| CodegenError::Unsupported { family: KernelFamily::WarpDecode, arch, what };
    if fp8 && spec.hidden() % 128 != 0 {
        return Err(unsupported(format!(
            "fp8 dispatch with hidden = {}: one scale per 128 columns needs a multiple of 128",
            spec.hidden()
        )));
    }
    let t = EpCu {
        spec_id: spec.id(),
        act_type: spec.act_dtype().cuda_type(),
        params: params::ep_decls(),
        hidden: spec.hidden(),
        experts: spec.experts(),
        top_k: spec.top_k(),
        max_ranks: EP_MAX_RANKS,
        plan_threads: EP_PLAN_THREADS,
        row_threads: EP_ROW_THREADS,
        wire_fp8: fp8,
        shared: spec.shared_experts() > 0,
        router: crate::router::RouterCtx::new(spec),
    };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family: KernelFamily::WarpDecode,
        arch,
        name: format!(
            "ep_exchange_h{}_e{}_k{}_{}{}{}{}",
            spec.hidden(),
            spec.experts(),
            spec.top_k(),
            spec.act_dtype(),
            if fp8 { "_fp8" } else { "" },
            if spec.shared_experts() > 0 { "_sh" } else { "" },
            if spec.router() == crate::Router::default() { String::new() } else { format!("_{}", spec.router()) }
        ),
        source,
        entry_points: [
            ep_entry::COUNT,
            ep_entry::PLACE,
            ep_entry::PACK,
            ep_entry::UNPACK,
            ep_entry::COMBINE,
            ep_entry::ROUTE,
        ]
        .map(String::from)
        .to_vec(),
        block_threads: EP_ROW_THREADS,
        decode_tiles: None,
        grouped_tiles: None,
        fused_tiles: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WeightFormat;

    #[test]
    fn geometry_is_baked_in_and_the_name_ignores_the_format() {
        let a = MoeSpec::builder(7168, 2048, 256, 8).build().unwrap();
        let b = MoeSpec::builder(7168, 2048, 256, 8).weight_format(WeightFormat::Fp8E4m3).build().unwrap();
        let (ka, kb) = (render_ep(&a, Arch::Sm90a, false).unwrap(), render_ep(&b, Arch::Sm90a, false).unwrap());
        for needle in ["constexpr int HIDDEN = 7168;", "constexpr int TOP_K = 8;", "constexpr int EXPERTS = 256;"] {
            assert!(ka.source.contains(needle), "missing {needle}");
        }
        assert_eq!(ka.name, kb.name);
        for ep in &ka.entry_points {
            assert!(ka.source.contains(&format!("{ep}(const __grid_constant__ ")), "{ep}");
        }
    }

    #[test]
    fn shared_experts_give_every_token_own_work() {
        let s = MoeSpec::builder(2048, 1408, 60, 4).build().unwrap().with_shared_experts(4, true).unwrap();
        let (k, plain) = (render_ep(&s, Arch::Sm90a, false).unwrap(), render_ep(&s.kernel_spec(), Arch::Sm90a, false));
        assert!(k.source.contains("constexpr bool SHARED = true;") && k.source.contains("constexpr int TOP_K = 4;"));
        assert_ne!(k.name, plain.unwrap().name);
    }

    #[test]
    fn fp8_dispatch_needs_whole_scale_blocks_and_is_its_own_module() {
        let a = MoeSpec::builder(7168, 2048, 256, 8).build().unwrap();
        let (plain, fp8) = (render_ep(&a, Arch::Sm90a, false).unwrap(), render_ep(&a, Arch::Sm90a, true).unwrap());
        assert_ne!(plain.name, fp8.name);
        assert!(fp8.source.contains("constexpr bool WIRE_FP8 = true;"));
        let gpt_oss = MoeSpec::builder(2880, 2880, 32, 4).build().unwrap();
        assert!(render_ep(&gpt_oss, Arch::Sm90a, false).is_ok());
        assert!(matches!(render_ep(&gpt_oss, Arch::Sm90a, true), Err(CodegenError::Unsupported { .. })));
    }
}
