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
    /// Partial outputs summed in rank order.
    pub const COMBINE: &str = "moe_ep_combine";
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
}

/// Render the exchange kernels of `spec` (the whole layer's spec, every expert counted) for
/// `arch`. Like the dequant probe, the module is not a compute family: its `family` field reads
/// `WarpDecode` and it belongs in no family's source list.
pub fn render_ep(spec: &MoeSpec, arch: Arch) -> Result<KernelSource, CodegenError> {
    count_render();
    if spec.shared_experts() > 0 {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: "expert parallelism with shared experts (run them on the token's own rank)".into(),
        });
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
    };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family: KernelFamily::WarpDecode,
        arch,
        name: format!("ep_exchange_h{}_e{}_k{}_{}", spec.hidden(), spec.experts(), spec.top_k(), spec.act_dtype()),
        source,
        entry_points: [ep_entry::COUNT, ep_entry::PLACE, ep_entry::PACK, ep_entry::COMBINE].map(String::from).to_vec(),
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
        let (ka, kb) = (render_ep(&a, Arch::Sm90a).unwrap(), render_ep(&b, Arch::Sm90a).unwrap());
        for needle in ["constexpr int HIDDEN = 7168;", "constexpr int TOP_K = 8;", "constexpr int EXPERTS = 256;"] {
            assert!(ka.source.contains(needle), "missing {needle}");
        }
        assert_eq!(ka.name, kb.name);
        for ep in &ka.entry_points {
            assert!(ka.source.contains(&format!("{ep}(const __grid_constant__ ")), "{ep}");
        }
    }

    #[test]
    fn shared_experts_are_refused() {
        let s = MoeSpec::builder(2048, 1408, 60, 4).build().unwrap().with_shared_experts(4, true).unwrap();
        assert!(matches!(render_ep(&s, Arch::Sm90a), Err(CodegenError::Unsupported { .. })));
    }
}
