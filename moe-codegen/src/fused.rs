//! The fused three-phase family (`templates/fused.cu`): up-projection, activation and
//! down-projection of a step of up to [`FusedTiles::max_tokens`] tokens in one cooperative launch
//! on tensor cores (`mma.sync` on every arch), every weight format decoded in registers.

use crate::render::{count_render, resolve_dequant, routing_smem_bytes, CodegenError, FormatCtx, KernelSource};
use crate::spec::{ActDtype, Activation, Arch, KernelFamily, MoeSpec};
use crate::WeightFormat;
use askama::Template;

/// The fused kernel's one entry point.
pub const ENTRY: &str = "moe_fused";

/// Launch-shape constants of the fused family (template constants, so part of the cache key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedTiles {
    /// Warps per block.
    pub warps: u32,
    /// Intermediate neurons per up item (its gate and up rows: `2 * bi / 16` fragments, a whole
    /// number per warp, or a whole number of warps per fragment: see [`FusedTiles::ksplit`]);
    /// divides the intermediate size.
    pub bi: u32,
    /// Tokens of one expert an MMA pass covers (8, 16, 24 or 32); more run as further passes.
    pub ntok: u32,
    /// Tokens one launch takes; larger steps run as several launches.
    pub max_tokens: u32,
    /// Chunks of weights each warp keeps in flight (registers).
    pub depth: u32,
    /// Whether a down item brings its next expert's w2 rows into L2 before it waits for or
    /// computes the current one.
    pub prefetch: bool,
    /// Codes of a row each lane takes per chunk (16 or 32, whole 16-byte vectors); a chunk is four
    /// lanes' worth, and the hidden and intermediate sizes must hold whole chunks.
    pub lane_codes: u32,
    /// The most blocks the step's experts of one down item (16 hidden rows) are split over (1 or
    /// 2). With 2, each step whose grid holds two blocks an SM and which touches more experts
    /// than a block has warps splits them: block h takes the experts h, h + 2, .., twice the down
    /// items with half the experts each, and the block that finishes a row second sums both
    /// halves in order. Other steps run one block a row.
    pub down_split: u32,
}

impl FusedTiles {
    /// The default tiles for a spec: 8 warps, one gate or up fragment per warp of an up item (64
    /// neurons), 32-token passes, 64 tokens per launch, 4 chunks in flight per warp (the best of
    /// the sets swept on an H100, docs/dispatch.md).
    pub fn for_spec(spec: &MoeSpec) -> FusedTiles {
        // Swept on an H100 (Qwen3-30B-A3B, bf16 / fp8 / mxfp4, M = 1 to 16): 16 or 32 neurons an
        // item (K split over warps), 8 chunks in flight and the w2 prefetch all measured slower
        // (docs/fused.md), and so did 32 codes a lane for fp8 and MXFP8 (the 32 bytes of a row
        // per lane that 16-bit weights take): 16 a lane, but a whole vector of 4-bit codes.
        let lane_codes = spec.weight_format().elems_per_16b().max(16);
        FusedTiles { warps: 8, bi: 64, ntok: 32, max_tokens: 64, depth: 4, prefetch: false, lane_codes, down_split: 2 }
    }
}

impl FusedTiles {
    /// Warps that share one gate or up fragment of an up item, each summing its share of K: more
    /// warps than the item's fragments split K (`fused.cu`'s KSPLIT).
    pub fn ksplit(&self) -> u32 {
        let frags = 2 * self.bi / 16;
        if frags >= self.warps || frags == 0 {
            1
        } else {
            self.warps / frags
        }
    }
}

/// The fewest codes along K one chunk takes: four lanes of 16 codes (one or two 16-byte vectors
/// each), or of one 16-byte vector where it holds more.
fn chunk_codes(f: WeightFormat) -> u32 {
    4 * f.elems_per_16b().max(16)
}

/// Whether the fused family can serve `spec` (`Err(why)` where not).
pub fn fused_support(spec: &MoeSpec) -> Result<(), String> {
    let spec = spec.kernel_spec();
    let ck = chunk_codes(spec.weight_format());
    let (h, i) = (spec.hidden(), spec.intermediate());
    if h % ck != 0 || i % ck != 0 {
        return Err(format!(
            "the fused kernel takes K in chunks of {ck} codes: hidden {h} and intermediate {i} do not divide"
        ));
    }
    Ok(())
}

/// Dynamic shared memory of one fused block (`fused.cu` asserts the same layout): the routing
/// tables of `max_tokens` tokens, the larger of the up and down items' scratch, 16 bytes of flags.
pub fn fused_smem_bytes(spec: &MoeSpec, t: &FusedTiles) -> u32 {
    let spec = spec.kernel_spec();
    let routing = routing_smem_bytes(&spec, t.max_tokens).div_ceil(16) * 16;
    let up = t.ksplit() * 2 * t.bi * t.ntok * 4;
    let down = t.warps * 16 * t.max_tokens * 4;
    routing + up.max(down) + 16
}

#[derive(Template)]
#[template(path = "fused.cu", escape = "none")]
struct FusedCu {
    name: String,
    hidden: u32,
    intermediate: u32,
    experts: u32,
    top_k: u32,
    bias: bool,
    activation: Activation,
    fmt: FormatCtx,
    act_type: &'static str,
    mma_type: &'static str,
    w_raw: bool,
    e4m3_pairs: bool,
    act_bf16: bool,
    warps: u32,
    bi: u32,
    ntok: u32,
    max_tokens: u32,
    depth: u32,
    prefetch: bool,
    lane_codes: u32,
    down_split: u32,
    smem_bytes: u32,
    params: String,
}

/// Render the fused family with explicit tiles.
pub fn render_fused(spec: &MoeSpec, arch: Arch, t: FusedTiles) -> Result<KernelSource, CodegenError> {
    count_render();
    let routed = *spec;
    let spec = &spec.kernel_spec();
    let family = KernelFamily::Fused;
    let unsupported = |what: String| CodegenError::Unsupported { family, arch, what };
    fused_support(spec).map_err(unsupported)?;
    if t.warps == 0
        || t.bi % 16 != 0
        || spec.intermediate() % t.bi != 0
        || ((2 * t.bi / 16) % t.warps != 0 && t.warps % (2 * t.bi / 16) != 0)
        || !matches!(t.ntok, 8 | 16 | 24 | 32)
        || t.max_tokens == 0
        || t.max_tokens % 8 != 0
        || !(1..=8).contains(&t.depth)
        || !matches!(t.lane_codes, 16 | 32)
        || t.lane_codes % spec.weight_format().elems_per_16b() != 0
        || spec.hidden() % (4 * t.lane_codes) != 0
        || spec.intermediate() % (4 * t.lane_codes) != 0
        || !matches!(t.down_split, 1 | 2)
    {
        return Err(unsupported(format!("fused tiles {t:?}")));
    }
    let variant = resolve_dequant(spec, arch)?;
    let (act_type, mma_type) = match spec.act_dtype() {
        ActDtype::Bf16 => ("__nv_bfloat16", "bf16"),
        ActDtype::Fp16 => ("__half", "f16"),
    };
    let f = spec.weight_format();
    let w_raw =
        matches!((f, spec.act_dtype()), (WeightFormat::Bf16, ActDtype::Bf16) | (WeightFormat::Fp16, ActDtype::Fp16));
    // The other families' naming (`module_name`: the dequant variant last, where the format has
    // several), with the tiles before the variant.
    let shape = format!(
        "i{}t{}m{}d{}w{}l{}{}{}",
        t.bi,
        t.ntok,
        t.max_tokens,
        t.depth,
        t.warps,
        t.lane_codes,
        if t.prefetch { "p" } else { "" },
        if t.down_split > 1 { format!("s{}", t.down_split) } else { String::new() }
    );
    let base = crate::render::module_name(family, &routed, variant);
    let name = match base.strip_suffix(&format!("_{variant}")) {
        Some(stem) if f.dequant_variants().len() > 1 => format!("{stem}_{shape}_{variant}"),
        _ => format!("{base}_{shape}"),
    };
    let src = FusedCu {
        name: name.clone(),
        hidden: spec.hidden(),
        intermediate: spec.intermediate(),
        experts: spec.experts(),
        top_k: spec.top_k(),
        bias: spec.has_bias(),
        activation: spec.activation(),
        fmt: FormatCtx::new(f, variant, arch),
        act_type,
        mma_type,
        w_raw,
        e4m3_pairs: matches!(f, WeightFormat::Fp8E4m3 | WeightFormat::Mxfp8),
        act_bf16: spec.act_dtype() == ActDtype::Bf16,
        warps: t.warps,
        bi: t.bi,
        ntok: t.ntok,
        max_tokens: t.max_tokens,
        depth: t.depth,
        prefetch: t.prefetch,
        lane_codes: t.lane_codes,
        down_split: t.down_split,
        smem_bytes: fused_smem_bytes(spec, &t),
        params: crate::params::fused_decls(),
    }
    .render()
    .map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family,
        arch,
        name,
        source: src,
        entry_points: vec![ENTRY.to_string()],
        block_threads: t.warps * 32,
        decode_tiles: None,
        grouped_tiles: None,
        fused_tiles: Some(t),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::REFERENCE_GEOMETRIES;

    #[test]
    fn every_reference_geometry_renders_for_every_arch_where_it_divides() {
        for (_, h, i, e, k) in REFERENCE_GEOMETRIES {
            for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Mxfp4, WeightFormat::Int4G128] {
                let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(format).build() else {
                    continue;
                };
                for arch in Arch::ALL {
                    match render_fused(&spec, arch, FusedTiles::for_spec(&spec)) {
                        Ok(src) => {
                            assert!(src.source.contains("moe_fused"));
                            assert_eq!(src.fused_tiles, Some(FusedTiles::for_spec(&spec)));
                        }
                        Err(e) => assert!(fused_support(&spec).is_err(), "{spec:?} on {arch}: {e}"),
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_that_do_not_divide_are_refused() {
        let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
        let mut t = FusedTiles::for_spec(&spec);
        t.bi = 96;
        assert!(matches!(render_fused(&spec, Arch::Sm90a, t), Err(CodegenError::Unsupported { .. })));
        let t = FusedTiles { ntok: 40, ..FusedTiles::for_spec(&spec) };
        assert!(render_fused(&spec, Arch::Sm90a, t).is_err());
        let t = FusedTiles { down_split: 3, ..FusedTiles::for_spec(&spec) };
        assert!(render_fused(&spec, Arch::Sm90a, t).is_err());
        let t = FusedTiles { down_split: 1, ..FusedTiles::for_spec(&spec) };
        assert!(!render_fused(&spec, Arch::Sm90a, t).unwrap().name.contains("s1"));
        // 16 codes a lane are less than one 16-byte vector of 4-bit codes.
        let fp4 = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Mxfp4).build().unwrap();
        assert_eq!(FusedTiles::for_spec(&fp4).lane_codes, 32);
        let t = FusedTiles { lane_codes: 16, ..FusedTiles::for_spec(&fp4) };
        assert!(render_fused(&fp4, Arch::Sm90a, t).is_err());
        // fp8 may take 32 codes a lane where the sizes are whole 128-code chunks, not at 2880.
        let fp8 = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Fp8E4m3).build().unwrap();
        assert_eq!(FusedTiles::for_spec(&fp8).lane_codes, 16);
        render_fused(&fp8, Arch::Sm90a, FusedTiles { lane_codes: 32, ..FusedTiles::for_spec(&fp8) }).unwrap();
        let gpt8 = MoeSpec::builder(2880, 2880, 32, 4).weight_format(WeightFormat::Fp8E4m3).build().unwrap();
        render_fused(&gpt8, Arch::Sm90a, FusedTiles::for_spec(&gpt8)).unwrap();
        let t = FusedTiles { lane_codes: 32, ..FusedTiles::for_spec(&gpt8) };
        assert!(render_fused(&gpt8, Arch::Sm90a, t).is_err());
        // 4-bit codes take K in chunks of 128: a hidden size of 2880 does not divide.
        let gpt = MoeSpec::builder(2880, 2880, 32, 4).weight_format(WeightFormat::Mxfp4).build().unwrap();
        assert!(fused_support(&gpt).is_err());
        assert!(render_fused(&gpt, Arch::Sm90a, FusedTiles::for_spec(&gpt)).is_err());
    }

    #[test]
    fn shared_memory_follows_the_tiles() {
        let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
        let t = FusedTiles::for_spec(&spec);
        let routing = (4 * (128 + 1) + 16 * 512 + 20 * 128u32).div_ceil(16) * 16;
        assert_eq!(fused_smem_bytes(&spec, &t), routing + 8 * 16 * 64 * 4 + 16);
    }
}
