//! Rendering: (spec, family, arch) -> CUDA C source with every geometry and format constant baked in.

use crate::dequant::DequantVariant;
use crate::format::{Codec, ScaleLayout, WeightFormat};
use crate::grouped;
pub use crate::heuristics::{BULK_SMEM_BUDGET, TOKEN_TILES, X_STAGE_MAX_BYTES};
use crate::numerics::{e2m1_to_f32, e4m3_to_f32};
use crate::spec::{Activation, Arch, KernelFamily, MoeSpec};
use askama::Template;

/// Why a kernel could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// askama failed to render a template (its message).
    #[error("template rendering failed: {0}")]
    Template(String),
    /// The family cannot serve this spec on this arch.
    #[error("{family} does not support {what} on {arch}")]
    Unsupported {
        /// The kernel family asked for.
        family: KernelFamily,
        /// The arch asked for.
        arch: Arch,
        /// What it lacks, e.g. the weight format or the geometry.
        what: String,
    },
    /// The spec's dequant variant does not exist for its format on this arch.
    #[error("dequant = {variant} is not available for {format} weights on {arch}: {why}")]
    DequantUnavailable {
        /// The spec's weight format.
        format: WeightFormat,
        /// The variant named or defaulted.
        variant: DequantVariant,
        /// The arch rendered for.
        arch: Arch,
        /// Why the variant is missing there.
        why: &'static str,
    },
    /// The dequant probe could not be rendered for this format.
    #[error("dequant probe of {format}: {why}")]
    Probe {
        /// The weight format probed.
        format: WeightFormat,
        /// Why the probe was refused.
        why: String,
    },
}

/// What `templates/dequant.cuh` needs to pick and fill a format's includes.
#[derive(Debug, Clone)]
pub(crate) struct FormatCtx {
    pub(crate) name: &'static str,
    /// Element codec include: `dequant_<codec>.cuh`.
    pub(crate) codec: &'static str,
    /// `lut`, `bits` or `hardware`.
    pub(crate) variant: &'static str,
    /// Scale include: `scales_<layout>.cuh`.
    pub(crate) scales: &'static str,
    /// Elements along K per scale (0: per row, or none).
    pub(crate) group: u32,
    /// Elements per 16-byte vector.
    pub(crate) vec: u32,
    /// Zero points come from the scales (asymmetric INT4).
    pub(crate) asym: bool,
    /// `lut`: the table, as f32 bit patterns (the Rust decoder's values), and its length.
    pub(crate) lut: String,
    pub(crate) lut_len: usize,
    /// The arch converts e2m1 itself (`cvt.rn.f16x2.e2m1x2`); sm_90's `hardware` goes through e4m3.
    pub(crate) native_e2m1: bool,
}

impl FormatCtx {
    pub(crate) fn new(format: WeightFormat, variant: DequantVariant, arch: Arch) -> FormatCtx {
        let table: Vec<f32> = match (variant, format.codec()) {
            (DequantVariant::Lut, Codec::E4m3) => (0..=255u8).map(e4m3_to_f32).collect(),
            (DequantVariant::Lut, Codec::Int8) => (0..=255u8).map(|b| b as i8 as f32).collect(),
            // Symmetric INT4 folds its zero point (8) into the table; asymmetric subtracts its own.
            (DequantVariant::Lut, Codec::Uint4) if format.has_zero_points() => (0..16).map(|u| u as f32).collect(),
            (DequantVariant::Lut, Codec::Uint4) => (0..16).map(|u| u as f32 - 8.0).collect(),
            (DequantVariant::Lut, Codec::E2m1) => (0..16u8).map(e2m1_to_f32).collect(),
            _ => Vec::new(),
        };
        let lut = table
            .chunks(8)
            .map(|c| c.iter().map(|v| format!("0x{:08x}u", v.to_bits())).collect::<Vec<_>>().join(", "))
            .collect::<Vec<_>>()
            .join(",\n    ");
        FormatCtx {
            name: format.name(),
            codec: format.codec().name(),
            variant: variant.name(),
            scales: format.scale_layout().name(),
            group: format.k_group(),
            vec: format.elems_per_16b(),
            asym: format.has_zero_points(),
            lut,
            lut_len: table.len(),
            native_e2m1: arch != Arch::Sm90a,
        }
    }
}

/// The variant `spec`'s kernels use on `arch`, or the typed error naming what `arch` lacks.
pub fn resolve_dequant(spec: &MoeSpec, arch: Arch) -> Result<DequantVariant, CodegenError> {
    spec.dequant_for(arch).map_err(|why| CodegenError::DequantUnavailable {
        format: spec.weight_format(),
        variant: spec.dequant().unwrap_or(spec.weight_format().default_dequant(arch)),
        arch,
        why,
    })
}

/// Static shared memory the dequant include of `spec` on `arch` declares (the `lut` table), in
/// bytes: it comes on top of the routing tables' dynamic shared memory. `warp_decode.cu` asserts
/// that its table takes exactly these.
pub fn static_smem_bytes(spec: &MoeSpec, arch: Arch) -> u32 {
    match resolve_dequant(spec, arch) {
        Ok(DequantVariant::Lut) => 4 * if spec.weight_format().elem_bits() == 4 { 16 } else { 256 },
        _ => 0,
    }
}

/// Launch-shape constants of the warp-decode family. They are template constants, so they are
/// part of the source and therefore of the JIT cache key. The defaults come from
/// [`crate::heuristics::decode_tiles`], which says why each is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeTiles {
    /// Warps per block.
    pub warps: u32,
    /// At most this many 16-byte vectors per lane per w13 row loaded before any math (gate_up;
    /// fewer when the row has fewer per lane).
    pub gu_chunk: u32,
    /// Lanes that share a w13 row in the multi-token gate_up kernels (token tiles 2 and 4): 32, or
    /// 16 (a warp then serves two neighbouring neurons of one expert at once, with twice the
    /// vectors per lane in flight). The one-token kernel always gives a row the whole warp.
    pub gu_lanes: u32,
    /// 16-byte vectors per lane loaded before any math (down, whose warps spread an item's
    /// top_k rows over their lanes as one flat run of vectors).
    pub dn_chunk: u32,
    /// Hidden outputs (rows of w2) per item of `moe_down`: each read of the
    /// intermediate serves that many rows. Divides the hidden size. `moe_down_stash` (M = 1)
    /// always takes one.
    pub dn_rows: u32,
    /// Whether the one-token gate_up loads each warp's first unit before the block has built
    /// its routing tables (the warp numbers the step's experts itself).
    pub gu_early: bool,
    /// Whether gate_up stages the step's activations in shared memory as fp32 (when they fit
    /// in [`X_STAGE_MAX_BYTES`]); the host sizes shared memory for it either way.
    pub stage_x: bool,
    /// 16-byte vectors per lane of each down warp's first item that `moe_down_stash` (the M = 1
    /// down) copies to shared memory before it waits on gate_up, beyond the `dn_chunk` in
    /// registers (static shared memory: `warps * dn_stash * 512` bytes, under 40 KiB); 0: none.
    pub dn_stash: u32,
    /// Whether one-token steps take the bulk gate_up (`moe_gate_up_bulk`) and the bulk down
    /// (`moe_down_bulk`): a producer warp per block streams whole weight tiles into a ring in
    /// shared memory with bulk copies; the bulk down loads its w2 before gate_up has finished.
    /// Either may pair with the other's register-fed kernel.
    pub bulk_gu: bool,
    /// Whether one-token steps take the bulk down (`moe_down_bulk`); see `bulk_gu`.
    pub bulk_dn: bool,
    /// Consumer warps of the bulk gate_up (its tile: that many neurons, gate and up rows) and
    /// of the bulk down (its tile: that many rows of w2 per slot); each block adds a producer warp.
    pub bulk_gu_warps: u32,
    /// Consumer warps of the bulk down; see `bulk_gu_warps`.
    pub bulk_dn_warps: u32,
    /// Whether the bulk down keeps the intermediate as fp16 pairs (scaled per row) and dots them
    /// with pair-FMAs, for codecs with a packed-half decode; else fp32 rows.
    pub bulk_dn_h2: bool,
    /// Tiles in the bulk gate_up's ring and in the bulk down's, 1 to 8.
    pub bulk_gu_stages: u32,
    /// Tiles in the bulk down's ring, 1 to 8; see `bulk_gu_stages`.
    pub bulk_dn_stages: u32,
}

impl DecodeTiles {
    /// The default tiles for a spec ([`crate::heuristics::decode_tiles`]).
    pub fn for_spec(spec: &MoeSpec) -> DecodeTiles {
        crate::heuristics::decode_tiles(&spec.kernel_spec())
    }

    /// Sets each bulk ring to as many stages (up to 8) as fit [`BULK_SMEM_BUDGET`] with the
    /// current consumer warps, else to one; false if one stage needs more than [`BULK_SMEM_MAX`]
    /// (or the tiles do not divide the spec).
    pub fn fit_bulk_stages(&mut self, spec: &MoeSpec) -> bool {
        crate::heuristics::fit_bulk_stages(self, spec)
    }

    /// Whether the bulk kernels' tiles divide the spec's intermediate and hidden sizes (and
    /// their blocks stay within 1024 threads).
    pub fn bulk_tiles_divide(&self, spec: &MoeSpec) -> bool {
        let (gw, dw) = (self.bulk_gu_warps, self.bulk_dn_warps);
        (1..32).contains(&gw) && (1..32).contains(&dw) && spec.intermediate() % gw == 0 && spec.hidden() % dw == 0
    }

    /// The smallest token tile that covers a step of `m` tokens (the largest past it):
    /// [`crate::heuristics::token_tile`].
    pub fn token_tile(m: u32) -> u32 {
        crate::heuristics::token_tile(m)
    }
}

/// Rendered CUDA C for one (spec, family, arch), ready for NVRTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSource {
    /// The kernel family rendered.
    pub family: KernelFamily,
    /// The arch it was rendered for (NVRTC's `--gpu-architecture`).
    pub arch: Arch,
    /// A readable module name, e.g. `warp_decode_h2048_i768_e128_k8_bf16_bf16_silu`.
    pub name: String,
    /// The CUDA C, every constant baked in.
    pub source: String,
    /// `extern "C"` entry points the module defines.
    pub entry_points: Vec<String>,
    /// Threads per block every entry point is built for (its `__launch_bounds__`).
    pub block_threads: u32,
    /// The tiles a warp-decode module was rendered with (None for the other families): the host
    /// sizes the decode grids from them.
    pub decode_tiles: Option<DecodeTiles>,
    /// The tiles a grouped module was rendered with (None for the other families): the host
    /// sizes its buffers and grids from them.
    pub grouped_tiles: Option<grouped::GemmTiles>,
    /// The tiles a fused module was rendered with (None for the other families): the host sizes
    /// its scratch and launches from them.
    pub fused_tiles: Option<crate::fused::FusedTiles>,
}

static RENDERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Kernel families rendered by this process so far (every [`render_warp_decode`] and
/// [`grouped::render_grouped`]): lets a test check that a layer built from sources rendered at
/// compile time renders nothing at run time.
pub fn render_count() -> u64 {
    RENDERS.load(std::sync::atomic::Ordering::Relaxed)
}

pub(crate) fn count_render() {
    RENDERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    /// Per-expert biases ([`MoeSpec::has_bias`]).
    bias: bool,
    fmt: FormatCtx,
    act_type: &'static str,
    warps: u32,
    gu_chunk: u32,
    gu_lanes: u32,
    gu_early: bool,
    dn_chunk: u32,
    dn_rows: u32,
    xs_max_bytes: u32,
    dn_stash: u32,
    bulk_dn_h2: bool,
    bulk_gu_warps: u32,
    bulk_dn_warps: u32,
    bulk_gu_stages: u32,
    bulk_dn_stages: u32,
    token_tiles: [u32; TOKEN_TILES.len()],
    /// The host's sizing terms, checked by the template's `static_assert`s.
    smem: DecodeSmem,
    /// [`bulk_smem_bytes`]: the bulk kernels' dynamic shared memory.
    bulk_gu_smem: u32,
    bulk_dn_smem: u32,
    /// The down stash's static shared memory the render checks against [`DN_STASH_MAX_BYTES`].
    dn_stash_smem: u32,
    /// [`static_smem_bytes`]: the dequant include's static shared memory.
    static_smem: u32,
    router: crate::router::RouterCtx,
    /// The kernels' parameter structs ([`crate::params`]).
    params: String,
    /// Shared experts ([`MoeSpec::shared_experts`]) and whether they are gated.
    shared: u32,
    shared_gated: bool,
    /// `moe_decode_resident` has a body ([`resident_renders`]), and its warps.
    resident: bool,
    res_warps: u32,
    /// [`resident_smem_bytes`] at 8 and 16 rows, which the template asserts.
    res_smem8: u32,
    res_smem16: u32,
}

/// Render one kernel family of a spec for an arch.
pub fn render(spec: &MoeSpec, family: KernelFamily, arch: Arch) -> Result<KernelSource, CodegenError> {
    match family {
        KernelFamily::WarpDecode => render_warp_decode(spec, arch, DecodeTiles::for_spec(spec)),
        KernelFamily::GroupedGemm => grouped::render_grouped(spec, arch, grouped::GemmTiles::for_spec(spec, arch)),
        KernelFamily::Fused => crate::fused::render_fused(spec, arch, crate::fused::FusedTiles::for_spec(spec)),
    }
}

/// The module name: the family, the spec's id without its dequant suffix, and the variant used when
/// the format has several. A spec naming its format's default and one naming nothing get the
/// same name, and the same source (so one cache entry).
pub(crate) fn module_name(family: KernelFamily, spec: &MoeSpec, variant: DequantVariant) -> String {
    let id = spec.id();
    let base = match spec.dequant() {
        Some(d) => id.strip_suffix(&format!("_{d}")).unwrap_or(&id).to_string(),
        None => id,
    };
    if spec.weight_format().dequant_variants().len() > 1 {
        format!("{family}_{base}_{variant}")
    } else {
        format!("{family}_{base}")
    }
}

/// Render the warp-decode family with explicit tiles.
pub fn render_warp_decode(spec: &MoeSpec, arch: Arch, tiles: DecodeTiles) -> Result<KernelSource, CodegenError> {
    count_render();
    // The kernels compute the layer with its shared experts as experts past the routed ones;
    // the router and the routing expansion see the routed counts.
    let routed = *spec;
    let spec = &spec.kernel_spec();
    let variant = resolve_dequant(spec, arch)?;
    if tiles.warps == 0 || tiles.gu_chunk == 0 || tiles.dn_chunk == 0 || tiles.dn_rows == 0 {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!("decode tiles with a zero count ({tiles:?})"),
        });
    }
    if !matches!(tiles.gu_lanes, 16 | 32) || spec.intermediate() % (32 / tiles.gu_lanes) != 0 {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!("{} lanes per gate_up row (16 or 32, two items sharing an expert)", tiles.gu_lanes),
        });
    }
    if spec.hidden() % tiles.dn_rows != 0 {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!("{} rows per down item with a hidden size of {}", tiles.dn_rows, spec.hidden()),
        });
    }
    // The stash is static shared memory, next to the LUT tables: keep the block under 48 KiB.
    let (dn_stash_smem, static_smem) = (tiles.warps * tiles.dn_stash * 512, static_smem_bytes(spec, arch));
    if dn_stash_smem + static_smem > DN_STASH_MAX_BYTES {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!(
                "a down stash of {} vectors per lane with {} warps (over 40 KiB)",
                tiles.dn_stash, tiles.warps
            ),
        });
    }
    let stages_ok = |n: u32| (1..=8).contains(&n);
    if !stages_ok(tiles.bulk_gu_stages) || !stages_ok(tiles.bulk_dn_stages) || !tiles.bulk_tiles_divide(spec) {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!(
                "bulk rings of {} and {} stages (1 to 8) with {} and {} consumer warps (1 to 31, dividing the \
                 intermediate size {} and the hidden size {})",
                tiles.bulk_gu_stages,
                tiles.bulk_dn_stages,
                tiles.bulk_gu_warps,
                tiles.bulk_dn_warps,
                spec.intermediate(),
                spec.hidden()
            ),
        });
    }
    let (gu, dn) = bulk_smem_bytes(spec, &tiles);
    if (tiles.bulk_gu && gu > BULK_SMEM_MAX) || (tiles.bulk_dn && dn > BULK_SMEM_MAX) {
        return Err(CodegenError::Unsupported {
            family: KernelFamily::WarpDecode,
            arch,
            what: format!("bulk kernels of {gu} and {dn} bytes of shared memory (at most {BULK_SMEM_MAX})"),
        });
    }
    let name = module_name(KernelFamily::WarpDecode, &routed, variant);
    let t = WarpDecodeCu {
        router: crate::router::RouterCtx::new(&routed),
        shared: routed.shared_experts(),
        shared_gated: routed.shared_gated(),
        params: crate::params::decode_decls(),
        spec_id: name.clone(),
        hidden: spec.hidden(),
        intermediate: spec.intermediate(),
        experts: spec.experts(),
        top_k: spec.top_k(),
        activation: spec.activation(),
        bias: spec.has_bias(),
        fmt: FormatCtx::new(spec.weight_format(), variant, arch),
        act_type: spec.act_dtype().cuda_type(),
        warps: tiles.warps,
        gu_chunk: tiles.gu_chunk,
        gu_lanes: tiles.gu_lanes,
        gu_early: tiles.gu_early,
        dn_chunk: tiles.dn_chunk,
        dn_rows: tiles.dn_rows,
        xs_max_bytes: if tiles.stage_x { X_STAGE_MAX_BYTES } else { 0 },
        dn_stash: tiles.dn_stash,
        bulk_dn_h2: tiles.bulk_dn_h2,
        bulk_gu_warps: tiles.bulk_gu_warps,
        bulk_dn_warps: tiles.bulk_dn_warps,
        bulk_gu_stages: tiles.bulk_gu_stages,
        bulk_dn_stages: tiles.bulk_dn_stages,
        token_tiles: TOKEN_TILES,
        smem: DecodeSmem::new(spec),
        bulk_gu_smem: gu,
        bulk_dn_smem: dn,
        dn_stash_smem,
        static_smem,
        resident: resident_renders(spec, arch),
        res_warps: RESIDENT_WARPS,
        res_smem8: resident_smem_bytes(spec, 8),
        res_smem16: resident_smem_bytes(spec, 16),
    };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family: KernelFamily::WarpDecode,
        arch,
        name,
        source,
        entry_points: entry_points(KernelFamily::WarpDecode),
        block_threads: tiles.warps * 32,
        decode_tiles: Some(tiles),
        grouped_tiles: None,
        fused_tiles: None,
    })
}

#[derive(Template)]
#[template(path = "dequant_probe.cu", escape = "none")]
struct DequantProbeCu {
    fmt: FormatCtx,
    rows: usize,
    cols: usize,
    tensors: usize,
}

/// Threads per block of the dequant probe.
pub const PROBE_THREADS: u32 = 256;

/// A test kernel around one format's dequant include (the very include the kernel families
/// render): `dequant_probe(w, scales, out)` decodes every 16-byte vector of `tensors` stacked
/// `[rows, cols]` matrices and writes `out[r][c] = w * group_scale * row_scale` in f32, the product
/// [`WeightFormat::dequantize_row`] computes. Launch with [`PROBE_THREADS`] threads per block.
/// `variant` `None`: the format's default on `arch`.
pub fn render_dequant_probe(
    format: WeightFormat,
    variant: Option<DequantVariant>,
    arch: Arch,
    tensors: usize,
    rows: usize,
    cols: usize,
) -> Result<KernelSource, CodegenError> {
    let variant = variant.unwrap_or(format.default_dequant(arch));
    format.dequant_on(variant, arch).map_err(|why| CodegenError::DequantUnavailable { format, variant, arch, why })?;
    format.check_matrix(rows, cols).map_err(|e| CodegenError::Probe { format, why: e.to_string() })?;
    if cols % format.elems_per_16b() as usize != 0 || tensors == 0 || rows == 0 {
        return Err(CodegenError::Probe { format, why: format!("{tensors} x [{rows}, {cols}] is not whole vectors") });
    }
    let t = DequantProbeCu { fmt: FormatCtx::new(format, variant, arch), rows, cols, tensors };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family: KernelFamily::WarpDecode,
        arch,
        name: format!("dequant_probe_{format}_{variant}_t{tensors}_r{rows}_c{cols}"),
        source,
        entry_points: vec!["dequant_probe".to_string()],
        block_threads: PROBE_THREADS,
        decode_tiles: None,
        grouped_tiles: None,
        fused_tiles: None,
    })
}

/// Threads per block of a family's kernels for a spec: what [`render`] puts in
/// [`KernelSource::block_threads`].
pub fn block_threads(spec: &MoeSpec, family: KernelFamily, arch: Arch) -> u32 {
    match family {
        KernelFamily::WarpDecode => DecodeTiles::for_spec(spec).warps * 32,
        KernelFamily::GroupedGemm => grouped::GemmTiles::for_spec(spec, arch).gemm_threads(),
        KernelFamily::Fused => crate::fused::FusedTiles::for_spec(spec).warps * 32,
    }
}

/// The decode tiles of a family's module for a spec: what [`render`] puts in
/// [`KernelSource::decode_tiles`].
pub fn decode_tiles(spec: &MoeSpec, family: KernelFamily) -> Option<DecodeTiles> {
    match family {
        KernelFamily::WarpDecode => Some(DecodeTiles::for_spec(spec)),
        KernelFamily::GroupedGemm | KernelFamily::Fused => None,
    }
}

/// The grouped tiles of a family's module for a spec on an arch: what [`render`] puts in
/// [`KernelSource::grouped_tiles`].
pub fn grouped_tiles(spec: &MoeSpec, family: KernelFamily, arch: Arch) -> Option<grouped::GemmTiles> {
    match family {
        KernelFamily::WarpDecode | KernelFamily::Fused => None,
        KernelFamily::GroupedGemm => Some(grouped::GemmTiles::for_spec(spec, arch)),
    }
}

/// The fused tiles of a family's module for a spec: what [`render`] puts in
/// [`KernelSource::fused_tiles`].
pub fn fused_tiles(spec: &MoeSpec, family: KernelFamily) -> Option<crate::fused::FusedTiles> {
    (family == KernelFamily::Fused).then(|| crate::fused::FusedTiles::for_spec(spec))
}

/// The names of warp decode's entry points, in one place for the renderer's list and the
/// runtime's loads (the template defines them; `moe-jit check` checks each CUBIN against the list).
pub mod decode_entry {
    /// down: one warp per (hidden output, token), routing weights folded in.
    pub const DOWN: &str = "moe_down";
    /// down for steps of one token, its first items stashed in shared memory before the wait.
    pub const DOWN_STASH: &str = "moe_down_stash";
    /// The one-token gate_up streaming its rows through a shared-memory ring.
    pub const GATE_UP_BULK: &str = "moe_gate_up_bulk";
    /// The one-token down streaming its rows through a shared-memory ring.
    pub const DOWN_BULK: &str = "moe_down_bulk";
    /// int64 routing ids narrowed to int32.
    pub const IDS_FROM_I64: &str = "moe_ids_from_i64";
    /// The routing widened with the shared experts' slots.
    pub const EXPAND_ROUTING: &str = "moe_expand_routing";
    /// The spec's router: logits to routing ids and weights (steps from logits).
    pub const ROUTE: &str = "moe_route";
    /// A one-token step in one cooperative launch, w2 rows resident in shared memory.
    pub const RESIDENT: &str = "moe_decode_resident";
    /// gate_up for a token tile (one of `TOKEN_TILES`).
    pub fn gate_up(tile: u32) -> String {
        format!("moe_gate_up_t{tile}")
    }
}

/// Warps per block of `moe_decode_resident`.
pub const RESIDENT_WARPS: u32 = 16;

/// Whether `moe_decode_resident` has a body for `spec` (its kernel spec: shared experts as
/// slots) on `arch`: 16-bit weights (no scales), whole 16-byte vectors per lane of a w13 row and
/// whole vectors in a w2 row. The kernel decodes through the format's `dequant_vec` and applies
/// row scales, but per-channel fp8, int8 and int4 measured slower with it than with the split
/// kernels (docs/decode-notes.md), so only 16-bit weights take it.
pub fn resident_renders(spec: &MoeSpec, arch: Arch) -> bool {
    let spec = spec.kernel_spec();
    let f = spec.weight_format();
    let vec = f.elems_per_16b();
    matches!(f.scale_layout(), ScaleLayout::None)
        && spec.dequant_for(arch).is_ok_and(|v| v != DequantVariant::Lut)
        && spec.hidden() % (32 * vec) == 0
        && spec.intermediate() % vec == 0
}

/// Dynamic shared memory of `moe_decode_resident` with `rows` hidden rows a block: the block's w2
/// rows of every slot (packed as stored), x in fp32, the (slot, row) sums and the mbarrier
/// (`decode_resident.cuh`'s `res_smem_bytes`).
pub fn resident_smem_bytes(spec: &MoeSpec, rows: u32) -> u32 {
    let spec = spec.kernel_spec();
    let (k, i, h) = (spec.top_k(), spec.intermediate(), spec.hidden());
    let row_bytes = i / spec.weight_format().elems_per_16b() * 16;
    k * rows * row_bytes + h * 4 + (k * rows * 4).div_ceil(8) * 8 + 8
}

/// Hidden rows a block of `moe_decode_resident` owns on a device of `sms` SMs (one block each)
/// whose blocks may take `max_smem` bytes of shared memory, or `None` where the kernel has no body
/// or a block's share of the step's w2 does not fit: ceil(H / sms) rounded up to whole 8-row
/// groups (the down's tasks).
pub fn resident_rows(spec: &MoeSpec, arch: Arch, sms: u32, max_smem: u32) -> Option<u32> {
    if !resident_renders(spec, arch) || sms == 0 {
        return None;
    }
    let rows = spec.hidden().div_ceil(sms).div_ceil(8) * 8;
    (rows <= RESIDENT_WARPS * 32 && resident_smem_bytes(spec, rows) <= max_smem).then_some(rows)
}

/// The `extern "C"` entry points a family's rendered module defines: the list [`render`] puts in
/// [`KernelSource::entry_points`]. `#[moe_kernel]` rebuilds its `KernelSource`s with it.
pub fn entry_points(family: KernelFamily) -> Vec<String> {
    use decode_entry::*;
    match family {
        KernelFamily::WarpDecode => {
            [DOWN, DOWN_STASH, GATE_UP_BULK, DOWN_BULK, IDS_FROM_I64, ROUTE, EXPAND_ROUTING, RESIDENT]
                .map(String::from)
                .into_iter()
                .chain(TOKEN_TILES.iter().map(|&t| gate_up(t)))
                .collect()
        }
        KernelFamily::GroupedGemm => grouped::entry_points(),
        KernelFamily::Fused => vec![crate::fused::ENTRY.to_string()],
    }
}

/// Dynamic shared memory one block of a bulk kernel may take (the H100's and B200's opt-in
/// limit; SM120 parts allow 99 KiB, where the host turns the bulk pair off).
pub const BULK_SMEM_MAX: u32 = 227 * 1024;

/// Static shared memory warp decode's down stash may take with the LUT tables (of 48 KiB).
pub const DN_STASH_MAX_BYTES: u32 = 40 * 1024;

/// Warp decode's shared-memory sizing terms for a spec, computed here and nowhere else: the host's
/// byte counts ([`routing_smem_bytes`], [`decode_smem_bytes`], [`decode_down_smem_bytes`],
/// [`bulk_smem_bytes`], [`decode_mid_floats`]) are built from them, and [`render_warp_decode`]
/// passes them to `warp_decode.cu` (the `HOST_*` constants), whose `static_assert`s check the
/// module's own layout against them for every step size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DecodeSmem {
    /// Routing tables (`routing.cuh`), bytes that do not depend on the step: the expert map and
    /// the unique count.
    routing_fixed: u32,
    /// Routing tables, bytes per (token, slot) pair: its entry, its rank and two ints of scratch.
    routing_per_pair: u32,
    /// Routing tables, bytes per possible unique expert (min(pairs, experts) of them): its id,
    /// count and first entry, and two ints of scratch.
    routing_per_unique: u32,
    /// Bytes of one token staged as fp32 (`stage_x`): whole 32-vector chunks.
    x_token: u32,
    /// Bytes per token of the exponent slot before the staged tokens (16-byte aligned as a whole).
    x_exp: u32,
    /// The staged tokens' fp32 bytes the host sizes for at most ([`X_STAGE_MAX_BYTES`]).
    x_max: u32,
    /// Bytes per (token, slot) pair of `moe_down`'s ids and routing weights (16-byte aligned as a
    /// whole).
    down_per_pair: u32,
    /// fp32 elements of one intermediate row (global memory): whole 32-vector chunks.
    mid_row_floats: u32,
}

impl DecodeSmem {
    fn new(spec: &MoeSpec) -> DecodeSmem {
        let vec = spec.weight_format().elems_per_16b();
        DecodeSmem {
            routing_fixed: 4 * (spec.experts() + 1),
            routing_per_pair: 4 * 4,
            routing_per_unique: 4 * 5,
            x_token: (spec.hidden() / vec).div_ceil(32) * vec * 32 * 4,
            x_exp: 4,
            x_max: X_STAGE_MAX_BYTES,
            down_per_pair: 4 + 4,
            mid_row_floats: (spec.intermediate() / vec).div_ceil(32) * 32 * vec,
        }
    }

    fn routing(&self, spec: &MoeSpec, m: u32) -> u32 {
        let pairs = m * spec.top_k();
        self.routing_fixed + self.routing_per_pair * pairs + self.routing_per_unique * pairs.min(spec.experts())
    }
}

/// Dynamic shared memory of a warp-decode step of `m` tokens: the routing tables, then, when they
/// fit in [`X_STAGE_MAX_BYTES`] as fp32, the staged activations (fp32, or fp16 pairs in half of
/// that space for formats with a packed-half decode) after a slot of `m` per-token scale
/// exponents. `warp_decode.cu` checks its layout (`x_stage_smem`, `stage_x`) against it.
pub fn decode_smem_bytes(spec: &MoeSpec, m: u32) -> u32 {
    let t = DecodeSmem::new(spec);
    let routing = t.routing(spec, m).next_multiple_of(16);
    let xs = m as u64 * t.x_token as u64;
    // The staged tokens follow a 16-byte slot of m ints (the packed-half path's scale exponents).
    routing + if xs <= t.x_max as u64 { (t.x_exp * m).next_multiple_of(16) + xs as u32 } else { 0 }
}

/// Bytes of one bulk gate_up tile (a gate and an up row per consumer warp) and one bulk down tile
/// (a row of w2 per consumer warp and slot).
fn bulk_tile_bytes(spec: &MoeSpec, tiles: &DecodeTiles) -> (u32, u32) {
    let vec = spec.weight_format().elems_per_16b();
    let (row13, row2) = (spec.hidden() / vec * 16, spec.intermediate() / vec * 16);
    (2 * tiles.bulk_gu_warps * row13, spec.top_k() * tiles.bulk_dn_warps * row2)
}

/// Dynamic shared memory of the bulk one-token kernels `(gate_up, down)`: each ring's mbarriers
/// (gate_up: one full barrier per consumer warp and an empty one per stage; down: one of each per
/// stage), then gate_up's staged token (a 16-byte slot, then the fp32 layout of `stage_x`) and its
/// stages; down's ids, weights and the intermediate's exponents, the intermediate (fp32 rows, or
/// fp16 pairs in half of them) and its stages. `decode_bulk.cuh` asserts that its layout takes
/// exactly these.
pub fn bulk_smem_bytes(spec: &MoeSpec, tiles: &DecodeTiles) -> (u32, u32) {
    let t = DecodeSmem::new(spec);
    let (gu_tile, dn_tile) = bulk_tile_bytes(spec, tiles);
    let bars = |stages: u32, q: u32| (8 * stages * (q + 1)).next_multiple_of(128);
    let (gs, ds) = (tiles.bulk_gu_stages, tiles.bulk_dn_stages);
    let gu = bars(gs, tiles.bulk_gu_warps) + (16 + t.x_token).next_multiple_of(128) + gs * gu_tile;
    let mid = spec.top_k() * t.mid_row_floats * 4;
    let dn = bars(ds, 1) + (12 * spec.top_k()).next_multiple_of(128) + mid + ds * dn_tile;
    (gu, dn)
}

/// Dynamic shared memory of warp decode's down kernel for a step of `m` tokens: the step's ids and
/// routing weights (`moe_down` in `warp_decode.cu`, which checks the per-pair bytes).
pub fn decode_down_smem_bytes(spec: &MoeSpec, m: u32) -> u32 {
    (m * spec.top_k() * DecodeSmem::new(spec).down_per_pair).next_multiple_of(16)
}

/// fp32 elements of warp decode's intermediate for a step of `m` tokens: one row per (token,
/// slot) pair, padded to whole 32-vector chunks (`warp_decode.cu` asserts that its `MID_ROW` is
/// this row).
pub fn decode_mid_floats(spec: &MoeSpec, m: u32) -> usize {
    m as usize * spec.top_k() as usize * DecodeSmem::new(spec).mid_row_floats as usize
}

/// Shared-memory bytes the routing tables of a step of `m` tokens need (`warp_decode.cu` asserts
/// that `routing.cuh`'s tables take exactly these).
pub fn routing_smem_bytes(spec: &MoeSpec, m: u32) -> u32 {
    DecodeSmem::new(spec).routing(spec, m)
}

/// Every (family, format) a geometry accepts, as specs with the format's default dequant variant
/// (used by `moe-jit check` and tests). Formats whose vectors, groups or blocks do not divide the
/// geometry are left out.
pub fn variants(hidden: u32, intermediate: u32, experts: u32, top_k: u32) -> Vec<(MoeSpec, KernelFamily)> {
    let mut out = Vec::new();
    for format in WeightFormat::ALL {
        let spec = MoeSpec::builder(hidden, intermediate, experts, top_k).weight_format(format).build();
        if let Ok(spec) = spec {
            out.extend(KernelFamily::ALL.into_iter().filter(|&f| family_supports(f, &spec)).map(|f| (spec, f)));
        }
    }
    out
}

/// Whether `family` can be rendered for `spec` at all (on some arch).
pub fn family_supports(family: KernelFamily, spec: &MoeSpec) -> bool {
    match family {
        KernelFamily::WarpDecode => true,
        KernelFamily::GroupedGemm => grouped::grouped_support(spec).is_ok(),
        KernelFamily::Fused => crate::fused::fused_support(spec).is_ok(),
    }
}

/// Every (family, format, dequant variant) a geometry accepts, as specs naming their variant.
/// Some are unavailable on some archs: [`render`] refuses those with
/// [`CodegenError::DequantUnavailable`].
pub fn dequant_variants(hidden: u32, intermediate: u32, experts: u32, top_k: u32) -> Vec<(MoeSpec, KernelFamily)> {
    let mut out = Vec::new();
    for format in WeightFormat::ALL {
        for &d in format.dequant_variants() {
            let spec = MoeSpec::builder(hidden, intermediate, experts, top_k).weight_format(format).dequant(d).build();
            if let Ok(spec) = spec {
                // Warp decode in every variant; the grouped family's loader runs the same include,
                // checked with each format's default variant (`variants`).
                out.push((spec, KernelFamily::WarpDecode));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
