//! Rendering: (spec, family, arch) -> CUDA C source with every geometry and format constant baked in.

use crate::format::WeightFormat;
use crate::spec::{Activation, Arch, KernelFamily, MoeSpec};
use askama::Template;

/// Why a kernel could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    #[error("template rendering failed: {0}")]
    Template(String),
    #[error("{family} does not support {what} on {arch}")]
    Unsupported { family: KernelFamily, arch: Arch, what: String },
}

/// Launch-shape constants of the warp-decode family. They are template constants, so they are
/// part of the source and therefore of the JIT cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeTiles {
    /// Warps per block.
    pub warps: u32,
    /// 16-byte vectors per lane per w13 row loaded before any math (gate_up).
    pub gu_chunk: u32,
    /// 16-byte vectors per lane per w2 row loaded before any math (down).
    pub dn_chunk: u32,
    /// Expert rows the down kernel streams at once.
    pub dn_experts: u32,
}

/// Token tiles (tokens served per pass over a weight row) rendered as separate entry points.
pub const TOKEN_TILES: [u32; 4] = [1, 2, 4, 8];

impl DecodeTiles {
    /// The default tiles for a spec: enough bytes in flight per warp to cover DRAM latency
    /// without spilling.
    pub fn for_spec(spec: &MoeSpec) -> DecodeTiles {
        let vec = spec.weight_format().elems_per_16b();
        let vpl_h = (spec.hidden() / vec).div_ceil(32);
        let vpl_i = (spec.intermediate() / vec).div_ceil(32);
        let dn_chunk = vpl_i.min(4);
        let dn_experts = (6 / dn_chunk).clamp(1, 2).min(spec.top_k());
        DecodeTiles { warps: 8, gu_chunk: vpl_h.min(4), dn_chunk, dn_experts }
    }

    /// The smallest token tile that covers a step of `m` tokens (the largest past it).
    pub fn token_tile(m: u32) -> u32 {
        TOKEN_TILES.into_iter().find(|&t| t >= m).unwrap_or(TOKEN_TILES[TOKEN_TILES.len() - 1])
    }
}

/// Rendered CUDA C for one (spec, family, arch), ready for NVRTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSource {
    pub family: KernelFamily,
    pub arch: Arch,
    /// A readable module name, e.g. `warp_decode_h2048_i768_e128_k8_bf16_bf16_silu`.
    pub name: String,
    pub source: String,
    /// `extern "C"` entry points the module defines.
    pub entry_points: Vec<String>,
    /// Threads per block every entry point is built for (its `__launch_bounds__`).
    pub block_threads: u32,
}

#[derive(Template)]
#[template(path = "warp_decode.cu", escape = "none")]
struct WarpDecodeCu {
    spec_id: String,
    hidden: u32,
    intermediate: u32,
    experts: u32,
    top_k: u32,
    activation: Activation,
    format: WeightFormat,
    act_type: &'static str,
    warps: u32,
    gu_chunk: u32,
    dn_chunk: u32,
    dn_experts: u32,
    token_tiles: [u32; 4],
}

/// Render one kernel family of a spec for an arch.
pub fn render(spec: &MoeSpec, family: KernelFamily, arch: Arch) -> Result<KernelSource, CodegenError> {
    match family {
        KernelFamily::WarpDecode => render_warp_decode(spec, arch, DecodeTiles::for_spec(spec)),
    }
}

/// Render the warp-decode family with explicit tiles.
pub fn render_warp_decode(spec: &MoeSpec, arch: Arch, tiles: DecodeTiles) -> Result<KernelSource, CodegenError> {
    let t = WarpDecodeCu {
        spec_id: spec.id(),
        hidden: spec.hidden(),
        intermediate: spec.intermediate(),
        experts: spec.experts(),
        top_k: spec.top_k(),
        activation: spec.activation(),
        format: spec.weight_format(),
        act_type: spec.act_dtype().cuda_type(),
        warps: tiles.warps,
        gu_chunk: tiles.gu_chunk,
        dn_chunk: tiles.dn_chunk,
        dn_experts: tiles.dn_experts,
        token_tiles: TOKEN_TILES,
    };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family: KernelFamily::WarpDecode,
        arch,
        name: format!("{}_{}", KernelFamily::WarpDecode, spec.id()),
        source,
        entry_points: entry_points(KernelFamily::WarpDecode),
        block_threads: tiles.warps * 32,
    })
}

/// Threads per block of a family's kernels for a spec: what [`render`] puts in
/// [`KernelSource::block_threads`].
pub fn block_threads(spec: &MoeSpec, family: KernelFamily) -> u32 {
    match family {
        KernelFamily::WarpDecode => DecodeTiles::for_spec(spec).warps * 32,
    }
}

/// The `extern "C"` entry points a family's rendered module defines: the list [`render`] puts in
/// [`KernelSource::entry_points`]. `#[moe_kernel]` rebuilds its `KernelSource`s with it.
pub fn entry_points(family: KernelFamily) -> Vec<String> {
    match family {
        KernelFamily::WarpDecode => {
            TOKEN_TILES.iter().flat_map(|mt| ["gate_up", "down", "fused"].map(|k| format!("moe_{k}_t{mt}"))).collect()
        }
    }
}

/// Shared-memory bytes the routing tables of a step of `m` tokens need (mirrors `routing.cuh`).
pub fn routing_smem_bytes(spec: &MoeSpec, m: u32) -> u32 {
    let pairs = m * spec.top_k();
    let e = spec.experts();
    4 * (e + 5 * pairs.min(e) + 2 * pairs + 1)
}

/// Every (family, format) variant for a geometry, as specs (used by `moe-jit check` and tests).
pub fn variants(hidden: u32, intermediate: u32, experts: u32, top_k: u32) -> Vec<(MoeSpec, KernelFamily)> {
    let mut out = Vec::new();
    for format in WeightFormat::ALL {
        let spec = MoeSpec::builder(hidden, intermediate, experts, top_k).weight_format(format).build();
        if let Ok(spec) = spec {
            for family in KernelFamily::ALL {
                out.push((spec, family));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ActDtype, REFERENCE_GEOMETRIES};

    fn qwen(format: WeightFormat) -> MoeSpec {
        MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap()
    }

    #[test]
    fn geometry_is_baked_in_as_constants() {
        let k = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
        for needle in [
            "constexpr int HIDDEN = 2048;",
            "constexpr int INTER = 768;",
            "constexpr int EXPERTS = 128;",
            "constexpr int TOP_K = 8;",
            "typedef __nv_bfloat16 act_t;",
            "constexpr int W_VEC = 8;",
            "return g / (1.0f + __expf(-g));",
        ] {
            assert!(k.source.contains(needle), "missing {needle}");
        }
        for ep in &k.entry_points {
            assert!(k.source.contains(&format!("void __launch_bounds__(WARPS * 32) {ep}(")), "{ep}");
        }
        assert_eq!(k.name, "warp_decode_h2048_i768_e128_k8_bf16_bf16_silu");
    }

    #[test]
    fn format_picks_its_include_and_nothing_else() {
        let fp8 = render(&qwen(WeightFormat::Fp8E4m3), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
        assert!(fp8.source.contains("constexpr int W_VEC = 16;"));
        assert!(fp8.source.contains("__NV_E4M3"));
        assert_eq!(fp8.source.matches("constexpr int W_VEC").count(), 1);
        let fp16 = render(&qwen(WeightFormat::Fp16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
        assert!(fp16.source.contains("typedef __half act_t;"));
        assert!(!fp16.source.contains("__NV_E4M3"));
    }

    #[test]
    fn activation_is_rendered() {
        let spec = MoeSpec::builder(512, 256, 8, 2).activation(Activation::GeluTanh).build().unwrap();
        let k = render(&spec, KernelFamily::WarpDecode, Arch::Sm120a).unwrap();
        assert!(k.source.contains("tanhf"));
        assert!(!k.source.contains("__expf(-g)"));
    }

    #[test]
    fn rendering_is_deterministic_and_spec_sensitive() {
        let a = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
        let b = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
        assert_eq!(a, b);
        let c = render(&MoeSpec::builder(2048, 768, 64, 8).build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a);
        assert_ne!(a.source, c.unwrap().source);
    }

    #[test]
    fn every_reference_geometry_has_all_variants() {
        for (_, h, i, e, k) in REFERENCE_GEOMETRIES {
            let v = variants(h, i, e, k);
            assert_eq!(v.len(), WeightFormat::ALL.len() * KernelFamily::ALL.len());
            for (spec, fam) in v {
                render(&spec, fam, Arch::Sm100a).unwrap();
            }
        }
    }

    #[test]
    fn tiles_and_smem() {
        let s = qwen(WeightFormat::Bf16);
        let t = DecodeTiles::for_spec(&s);
        assert_eq!((t.gu_chunk, t.dn_chunk, t.dn_experts), (4, 3, 2));
        assert_eq!(DecodeTiles::token_tile(1), 1);
        assert_eq!(DecodeTiles::token_tile(3), 4);
        assert_eq!(DecodeTiles::token_tile(64), 8);
        // 128 map + 5*8 + 2*8 + 1 ints at M = 1.
        assert_eq!(routing_smem_bytes(&s, 1), 4 * (128 + 40 + 16 + 1));
        let _ = ActDtype::Bf16;
    }
}
