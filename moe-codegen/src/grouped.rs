//! The grouped-GEMM (prefill) family: tile configuration, support checks and rendering.

use crate::format::WeightFormat;
use crate::heuristics::GROUP_TILES;
pub use crate::heuristics::{ext_spread, EXT_SPREAD, HOT_TILES};
use crate::render::{CodegenError, KernelSource};
use crate::spec::{Activation, Arch, KernelFamily, MoeSpec};
use askama::Template;

/// Which tensor-core instruction the tiles are computed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mma {
    /// Hopper's asynchronous warpgroup MMA, operands straight from shared memory (`sm_90a` only).
    Wgmma,
    /// Warp-level `mma.sync` fed by `ldmatrix` (every arch; the path sm_100a and sm_120a use).
    MmaSync,
}

/// Tile shape and pipeline depth of the grouped GEMMs: template constants, so part of the source
/// and of the JIT cache key. The defaults come from [`crate::heuristics::gemm_tiles`], which says
/// why each is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmTiles {
    /// Rows (token, slot pairs) per tile; each expert's rows are padded to a multiple of it.
    pub bm: u32,
    /// GEMM1 columns per tile (half gate, half up rows of w13).
    pub bn1: u32,
    /// GEMM2 columns per tile (hidden outputs).
    pub bn2: u32,
    /// Shared-memory stages (k-tiles of 128 bytes in flight).
    pub stages: u32,
    /// GEMM blocks meant to be resident per SM (their `__launch_bounds__`): two blocks hide each
    /// other's barriers, epilogues and pipeline fills, at half the registers and shared memory.
    pub blocks_per_sm: u32,
    /// The tensor-core instruction the tiles are computed with.
    pub mma: Mma,
    /// wgmma only: a producer warpgroup (TMA for the weights, cp.async for the gathered rows)
    /// feeds two consumer warpgroups through mbarriers, persistently across tiles. Otherwise
    /// every thread loads and computes, with a block barrier per k-tile.
    pub warp_specialized: bool,
    /// Blocks per cluster (warp-specialised only): 2 pairs row tiles of one expert, and each
    /// block multicasts half of the shared weight tile to both (TMA), so every weight byte
    /// leaves L2 once per pair of row tiles; an expert's odd tile runs on both blocks, one column
    /// block each (so both GEMMs need an even number of column blocks). Each stage then waits for
    /// both blocks' consumers, and every work item is handed over between them.
    pub cluster: u32,
    /// Warp-specialised only: consumer warpgroup 1 starts this many k-tiles behind warpgroup 0
    /// and stays behind (each stage waits for both), so that each one's epilogue falls under the
    /// other's MMAs rather than both idling the tensor cores at once. At most `stages - 2`.
    pub lag: u32,
    /// 0 or 16: an expert whose last GEMM1 tile would hold no more than `tail` pairs for each
    /// tile before it (up to [`ext_spread`] of them) has them computed with those tiles, `tail`
    /// rows each (extended items: their stages carry `bm + tail` rows of A, which ride the tile's
    /// wgmma with the operands swapped: the weight rows as M, the extra rows as N), so the weight
    /// column is not read once more for a few dozen rows. Applies where the pipeline allows it
    /// (`extended_rows`):
    /// warp-specialised, no clusters, 256-wide GEMM1 tiles whose scales do not change along K
    /// (bf16 / fp16, per-channel fp8, and the weights the producer decodes, whose stages hold
    /// them scaled; there GEMM2 takes the same items: [`GemmTiles::gemm2_extended_rows`]).
    pub tail: u32,
}

/// Whether `f` is an e4m3 format (the grouped family multiplies it as e4m3 where the geometry
/// allows: [`quantizes_activations`]).
pub(crate) fn is_fp8(f: WeightFormat) -> bool {
    matches!(f, WeightFormat::Fp8E4m3 | WeightFormat::Fp8E4m3B128)
}

/// Whether `f` is a format the tensor cores never take as stored: every format but bf16, fp16
/// and the fp8 ones. The grouped family decodes such weights in registers ([`decodes_weights`]).
pub fn dequantizes_weights(f: WeightFormat) -> bool {
    !matches!(f, WeightFormat::Bf16 | WeightFormat::Fp16) && !is_fp8(f)
}

/// Whether the grouped family multiplies `spec`'s weights as e4m3 on the tensor cores, x and the
/// intermediate quantized to e4m3 first: fp8 weights whose hidden and intermediate sizes hold
/// whole 128-byte k-tiles.
pub fn quantizes_activations(spec: &MoeSpec) -> bool {
    is_fp8(spec.weight_format()) && !decodes_weights(spec)
}

/// Whether the grouped family decodes `spec`'s weights in registers into the activation dtype
/// (the mixed-input GEMMs of `gemm_wq.cuh`): every [`dequantizes_weights`] format, and
/// per-channel fp8 whose hidden or intermediate size is not a whole number of 128-byte e4m3
/// k-tiles (gpt-oss's 2880 = 22.5 x 128), which those GEMMs take in 64-code stages.
pub fn decodes_weights(spec: &MoeSpec) -> bool {
    let f = spec.weight_format();
    let whole_k_tiles = spec.hidden() % BK_BYTES == 0 && spec.intermediate() % BK_BYTES == 0;
    dequantizes_weights(f) || (f == WeightFormat::Fp8E4m3 && !whole_k_tiles)
}

/// The code width of weights the grouped family decodes in registers ([`decodes_weights`]),
/// else `None`.
pub(crate) fn wq_bits(spec: &MoeSpec) -> Option<u32> {
    decodes_weights(spec).then(|| spec.weight_format().elem_bits())
}

/// Whether decoded weights scale the columns of a tile differently in the warp-specialised
/// epilogue (per-channel scales, a per-row zero-point record applied there, NVFP4's per-expert
/// global): the consumers' per-column floats (`COLS` in `grouped_gemm.cu`). Otherwise every
/// column takes the decode's one unit, a constant, and the floats take no shared memory.
pub(crate) fn decoded_cols(spec: &MoeSpec) -> bool {
    use crate::format::ScaleLayout;
    matches!(
        spec.weight_format().scale_layout(),
        ScaleLayout::RowF32 | ScaleLayout::GroupF16Zero { group: 0 } | ScaleLayout::Nvfp4
    )
}

/// One pipeline stage of a mixed-input GEMM (`WqShape::STAGE_BYTES` in `gemm_wq.cuh`): four
/// 16-byte vectors of each of `bn` weight rows of `bits`-bit codes, as stored, and the same
/// codes' activations (16-bit) of each of `bm` token rows.
pub(crate) fn wq_stage_bytes(bm: u32, bn: u32, bits: u32) -> u32 {
    bn * 64 + bm * 4 * (128 / bits) * 2
}

/// Whether the grouped family quantizes x to e4m3 with one scale per token (over all of the
/// hidden size) rather than one per 128 along K: with per-channel weights, so that GEMM1's scales
/// do not change along K and its tensor cores accumulate the whole of K before one scaling in the
/// epilogue (the fast-accumulation choice of inference fp8 GEMMs), rather than waiting on every
/// k-tile's MMAs to scale them.
pub fn x_per_token(spec: &MoeSpec) -> bool {
    spec.weight_format() == WeightFormat::Fp8E4m3 && quantizes_activations(spec)
}

/// Threads per block of the router (one warp per token).
pub const ROUTE_THREADS: u32 = 128;
/// Threads of `moe_choose` (one block; the template's `CHOOSE_THREADS`).
pub const CHOOSE_THREADS: u32 = 256;
/// Threads per block of `moe_prepare` (routing, alignment and x's quantization in one cooperative
/// launch), a warp per token.
pub const ALIGN_THREADS: u32 = 1024;

/// Dynamic shared memory of a `moe_prepare` block: each warp's router scores (f32 per expert).
/// `prepare.cuh` asserts that its scores take exactly these.
pub fn prepare_smem_bytes(spec: &MoeSpec) -> u32 {
    ALIGN_THREADS / 32 * spec.experts() * 4
}
/// Threads per block of the element-wise kernels (quantize, combine, convert).
pub const ELEMWISE_THREADS: u32 = 256;
/// Bytes of K per pipeline stage and row.
const BK_BYTES: u32 = 128;

impl GemmTiles {
    /// The default tiles of a spec on an arch ([`crate::heuristics::gemm_tiles`]).
    pub fn for_spec(spec: &MoeSpec, arch: Arch) -> GemmTiles {
        crate::heuristics::gemm_tiles(&spec.kernel_spec(), arch)
    }

    /// Parse `bn1,bn2,stages,blocks_per_sm[,ws[,cluster[,lag[,tail]]]][,bmN]` (e.g. `128,128,4,1`,
    /// `256,256,4,1,0`, `256,256,4,1,1,1,1,16` or `128,128,6,3,bm16`) over these defaults; `ws` is 1 for the
    /// warp-specialised pipeline, 0 for the block-barrier one (which implies cluster 1, lag 0,
    /// tail 0).
    pub fn parse(self, s: &str) -> Option<GemmTiles> {
        // An optional last field `bmN` sets the token rows per tile.
        let (s, bm) = match s.rsplit_once(',') {
            Some((head, last)) if last.trim().starts_with("bm") => (head, last.trim()[2..].parse().ok()?),
            _ => (s, self.bm),
        };
        let v: Vec<u32> = s.split(',').map(|x| x.trim().parse().ok()).collect::<Option<_>>()?;
        let (bn1, bn2, stages, blocks_per_sm, ws, cluster, lag, tail) = match v[..] {
            [a, b, c, d] => (a, b, c, d, self.warp_specialized, self.cluster, self.lag, self.tail),
            [a, b, c, d, 0] => (a, b, c, d, false, 1, 0, 0),
            [a, b, c, d, 1] => (a, b, c, d, true, self.cluster.max(1), self.lag, self.tail),
            [a, b, c, d, w @ (0 | 1), cl] => (a, b, c, d, w == 1, cl, self.lag, self.tail),
            [a, b, c, d, w @ (0 | 1), cl, l] => (a, b, c, d, w == 1, cl, l, self.tail),
            [a, b, c, d, w @ (0 | 1), cl, l, t] => (a, b, c, d, w == 1, cl, l, t),
            _ => return None,
        };
        // The warp-specialised pipeline runs on wgmma.
        let mma = if ws { Mma::Wgmma } else { self.mma };
        Some(GemmTiles { bm, bn1, bn2, stages, blocks_per_sm, mma, warp_specialized: ws, cluster, lag, tail })
    }

    /// The rows GEMM1's extended items add (`tail` where the pipeline allows it, else 0).
    pub fn extended_rows(&self, spec: &MoeSpec) -> u32 {
        let unscaled = !quantizes_activations(spec) || x_per_token(spec);
        let fits = self.warp_specialized && self.cluster == 1 && self.bn1 == 256 && unscaled;
        if fits {
            self.tail
        } else {
            0
        }
    }

    /// The rows GEMM2's extended items add: GEMM1's where the producer decodes the weights and
    /// GEMM2's tiles are 256 wide (its decode is what a short tile would repeat; bf16 / fp16 and
    /// fp8 GEMM2 tiles cost a TMA of weights from L2 and take none), else 0. Its deterministic
    /// kernel only (`moe_gemm2_rows`): the atomic one keeps the layout's tiles.
    pub fn gemm2_extended_rows(&self, spec: &MoeSpec) -> u32 {
        if decodes_weights(spec) && self.bn2 == 256 {
            self.extended_rows(spec)
        } else {
            0
        }
    }

    /// Dynamic shared memory of GEMM1 (with its extended rows).
    pub fn gemm1_smem_bytes(&self, spec: &MoeSpec) -> u32 {
        match wq_bits(spec) {
            Some(bits) if self.warp_specialized => self.ws_decode_smem_bytes(
                self.bn1,
                bits,
                self.pack_ring(spec),
                decoded_cols(spec),
                self.extended_rows(spec),
            ),
            Some(bits) => self.wq_smem_bytes(self.bn1, bits),
            None => self.smem_bytes(self.bn1, self.extended_rows(spec)),
        }
    }

    /// Dynamic shared memory of GEMM2.
    pub fn gemm2_smem_bytes(&self, spec: &MoeSpec) -> u32 {
        match wq_bits(spec) {
            Some(bits) if self.warp_specialized => self.ws_decode_smem_bytes(
                self.bn2,
                bits,
                self.pack_ring(spec),
                decoded_cols(spec),
                self.gemm2_extended_rows(spec),
            ),
            Some(bits) => self.wq_smem_bytes(self.bn2, bits),
            None => self.smem_bytes(self.bn2, 0),
        }
    }

    /// Weights decoded on the warp-specialised pipeline (`gemm_wsq.cuh`): the slots of packed
    /// k-tiles the producer keeps in flight (2 to 4), as many as keep both GEMMs' shared memory
    /// within [`L1_KEEPING_SMEM`] where any does, else as many as fit; 0 for other weights or
    /// pipelines.
    pub fn pack_ring(&self, spec: &MoeSpec) -> u32 {
        let spec = &spec.kernel_spec();
        match wq_bits(spec) {
            Some(bits) if self.warp_specialized => {
                let (block, _) = smem_limits(Arch::Sm90a);
                let cols = decoded_cols(spec);
                let (ext1, ext2) = (self.extended_rows(spec), self.gemm2_extended_rows(spec));
                let need = |r| {
                    self.ws_decode_smem_bytes(self.bn1, bits, r, cols, ext1)
                        .max(self.ws_decode_smem_bytes(self.bn2, bits, r, cols, ext2))
                };
                (2..=4)
                    .rev()
                    .find(|&r| need(r) <= L1_KEEPING_SMEM)
                    .or_else(|| (2..=4).rev().find(|&r| need(r) <= block))
                    .unwrap_or(2)
            }
            _ => 0,
        }
    }

    /// Dynamic shared memory of a warp-specialised GEMM whose producer decodes `bits`-bit weights
    /// (`ws_smem_bytes` with `WS_DECODE` in `gemm_ws.cuh`): the stages and the warp-specialised
    /// bookkeeping of [`Self::smem_bytes`] (the per-column floats only with `cols`:
    /// [`decoded_cols`]), the ring's mbarriers (64 bytes), then from the next 128-byte boundary
    /// `ring` slots of `bn` rows x 64 codes, two items' A row offsets and (`ext` extended rows)
    /// their activations.
    fn ws_decode_smem_bytes(&self, bn: u32, bits: u32, ring: u32, cols: bool, ext: u32) -> u32 {
        let floats = if cols { 2 * bn * 4 } else { 0 };
        let slots = ((32 * self.stages + 32 + 8).next_multiple_of(16) + floats + 8 * 2048 + 64).next_multiple_of(128);
        // Two items' row offsets (bm, then ext each); the extended rows' activations take the
        // staging.
        let rows = 2 * (self.bm + ext) * 4;
        self.stages * (self.bm + ext + bn) * BK_BYTES + 1024 + slots + ring * bn * 8 * bits + rows
    }

    /// Dynamic shared memory of a mixed-input GEMM (`gemm_wq.cuh`: `WqShape::SMEM_BYTES`) with
    /// `bn` weight rows of `bits`-bit codes per tile: its stages ([`wq_stage_bytes`]), 128 bytes
    /// of alignment slack and each stage's two 8-byte mbarriers.
    fn wq_smem_bytes(&self, bn: u32, bits: u32) -> u32 {
        self.stages * (wq_stage_bytes(self.bm, bn, bits) + 16) + 128
    }

    /// Dynamic shared memory of a GEMM kernel with `bn` columns and `ext` extended rows: the
    /// stages, 1 KiB of alignment slack and (warp-specialised) a full and an empty mbarrier and a
    /// 16-byte item slot per stage, the producer's two item slots and their two pairs of
    /// mbarriers (the cluster's hand-over), and from the next 16 bytes each consumer warpgroup's
    /// `bn` per-column f32 scales, each consumer warp's 2 KiB of output staging and (extended
    /// items) `ext` rows of `bn / 2` 16-bit activations between the two halves of their epilogue.
    /// `grouped_gemm.cu` asserts that its layout (`ws_smem_bytes` in `gemm_ws.cuh`, else
    /// `TileShape::SMEM_BYTES`) takes exactly these.
    fn smem_bytes(&self, bn: u32, ext: u32) -> u32 {
        let ws = if self.warp_specialized {
            (32 * self.stages + 32 + 8).next_multiple_of(16) + 2 * bn * 4 + 8 * 2048 + ext * bn / 2 * 2
        } else {
            0
        };
        self.stages * (self.bm + ext + bn) * BK_BYTES + 1024 + ws
    }

    /// Whether these tiles take column widths other than 64, 128 and 256 (any multiple of 16 up
    /// to 256): 16-bit weights on the warp-specialised wgmma pipeline, whose MMAs, boxes and
    /// epilogues take any multiple of 8 columns. fp8's 128-column scale blocks keep the powers of
    /// two; weights the producer decodes add only 192 (whole 16-byte vectors per producer thread).
    pub fn takes_any_width(&self, spec: &MoeSpec) -> bool {
        let spec = &spec.kernel_spec();
        self.warp_specialized && self.mma == Mma::Wgmma && !quantizes_activations(spec) && !decodes_weights(spec)
    }

    /// GEMM2's column blocks for `hidden` outputs: the last holds fewer rows where `bn2` does
    /// not divide it ([`GemmTiles::partial_gemm2`]).
    pub fn gemm2_col_blocks(&self, hidden: u32) -> u32 {
        hidden.div_ceil(self.bn2)
    }

    /// Whether GEMM2 may end on a narrower column block for `spec`: the mixed-input `mma.sync`
    /// GEMM (`gemm_wq.cuh`) skips the rows past the outputs, whole warps' rows (16 per fragment a
    /// warp holds) at a time. gpt-oss-20b's 2880 outputs then take 22 blocks of 128 and one of 64
    /// rather than 45 of 64, whose warps split each tile's tokens and decoded every weight twice.
    pub fn partial_gemm2(&self, spec: &MoeSpec) -> bool {
        let spec = &spec.kernel_spec();
        let warp_rows = 16 * if self.bn2 >= 256 { self.bn2 / 128 } else { 1 };
        decodes_weights(spec)
            && !self.warp_specialized
            && self.mma == Mma::MmaSync
            && spec.hidden() % self.bn2 % warp_rows == 0
    }

    /// Whether GEMM1 quantizes the intermediate to e4m3 itself (fp8, warp-specialised, 128
    /// intermediate columns per tile: one scale block per row), so no separate quantizer runs.
    pub fn quantizes_mid(&self, spec: &MoeSpec) -> bool {
        quantizes_activations(spec) && self.warp_specialized && self.bn1 == 256
    }

    /// Threads per GEMM block: warp-specialised, a producer warpgroup and two consumer
    /// warpgroups; otherwise eight warps that all load and all compute.
    pub fn gemm_threads(&self) -> u32 {
        if self.warp_specialized {
            384
        } else {
            256
        }
    }

    /// The most tiles `pairs` routed (token, slot) pairs can fill: every expert pads to a whole
    /// tile, so at most `pairs / bm` full ones plus one per non-empty expert.
    pub fn max_tiles(&self, pairs: usize, experts: u32) -> usize {
        pairs.min(pairs / self.bm as usize + pairs.min(experts as usize))
    }
}

/// Why a spec cannot use the grouped family, if it cannot.
pub fn grouped_support(spec: &MoeSpec) -> Result<(), String> {
    let spec = &spec.kernel_spec();
    let f = spec.weight_format();
    let elem = if quantizes_activations(spec) { 1 } else { 2 };
    if decodes_weights(spec) && spec.dequant() == Some(crate::DequantVariant::Lut) {
        // The table lives in shared memory the GEMM's stages take.
        return Err(format!("{f} weights with the lut dequant variant (bits and hardware are supported)"));
    }
    // The 16-bit GEMMs multiply x and the weights in one tensor-core type: bf16 weights need bf16
    // activations (fp8 quantizes x from either dtype).
    if f == WeightFormat::Bf16 && spec.act_dtype() != crate::spec::ActDtype::Bf16 {
        return Err(format!(
            "bf16 weights with {} activations (the tensor cores take one 16-bit type)",
            spec.act_dtype()
        ));
    }
    let (h, i) = (spec.hidden(), spec.intermediate());
    if h * elem % BK_BYTES != 0 || i * elem % BK_BYTES != 0 {
        return Err(format!("hidden = {h} and intermediate = {i} must hold whole {BK_BYTES}-byte k-tiles"));
    }
    if i % 32 != 0 || h % 64 != 0 {
        return Err(format!("intermediate = {i} must be a multiple of 32 and hidden = {h} of 64 (column tiles)"));
    }
    if spec.experts() > ALIGN_THREADS {
        return Err(format!("experts = {} exceeds the aligner's {ALIGN_THREADS}", spec.experts()));
    }
    Ok(())
}

struct WgmmaN {
    n: u32,
    regs: u32,
}

use crate::router::RouterCtx;

#[derive(Template)]
#[template(path = "grouped_gemm.cu", escape = "none")]
struct GroupedGemmCu {
    name: String,
    wgmma: u32,
    ws: u32,
    group_tiles: u32,
    hot_tiles: u32,
    ext_spread: u32,
    act_type: &'static str,
    /// bf16 activations (else fp16): the mixed-input GEMMs' MMA type.
    act_bf16: bool,
    hidden: u32,
    intermediate: u32,
    experts: u32,
    top_k: u32,
    activation: Activation,
    /// Per-expert biases ([`MoeSpec::has_bias`]).
    bias: bool,
    /// The weights' format include, where the loader decodes them ([`dequantizes_weights`]).
    fmt: Option<crate::render::FormatCtx>,
    bm: u32,
    bn1: u32,
    bn2: u32,
    stages: u32,
    blocks_per_sm: u32,
    cluster: u32,
    lag: u32,
    tail: u32,
    /// GEMM2's extended rows ([`GemmTiles::gemm2_extended_rows`]).
    tail2: u32,
    mid_fp8: bool,
    x_per_row: bool,
    /// Weights decoded by the warp-specialised producer: its ring's slots
    /// ([`GemmTiles::pack_ring`]) and the codes' width, else 0 and 0.
    pack_ring: u32,
    pack_bits: u32,
    /// Weights decoded in registers: the codes per 32-bit word (8 or 4) within which x and the
    /// intermediate are stored paired (`x_pair_col`), else 0.
    x_pair_group: u32,
    /// Decoded weights whose epilogue scales each column by its own float ([`decoded_cols`]).
    wq_cols: bool,
    elem_bytes: u32,
    wscale: u32,
    mma_type: &'static str,
    mma_k: u32,
    wgmma_trans: &'static str,
    wgmma_ns: Vec<WgmmaN>,
    router: RouterCtx,
    /// The kernels' parameter structs ([`crate::params`]).
    params: String,
    /// The host's dynamic shared memory per block ([`GemmTiles::gemm1_smem_bytes`],
    /// [`GemmTiles::gemm2_smem_bytes`], [`prepare_smem_bytes`]), checked by the template's
    /// `static_assert`s against the kernels' layouts.
    gemm1_smem: u32,
    gemm2_smem: u32,
    prepare_smem: u32,
}

impl GemmTiles {
    /// Whether the grouped family can run these tiles for `spec` on `arch`: what
    /// [`render_grouped`] refuses, without rendering (the shared memory the arch allows is
    /// [`GemmTiles::fits`]).
    pub fn check(&self, spec: &MoeSpec, arch: Arch) -> Result<(), CodegenError> {
        self.check_kernel_spec(&spec.kernel_spec(), arch)
    }

    fn check_kernel_spec(&self, spec: &MoeSpec, arch: Arch) -> Result<(), CodegenError> {
        let family = KernelFamily::GroupedGemm;
        let tiles = *self;
        let unsupported = |what: String| CodegenError::Unsupported { family, arch, what };
        grouped_support(spec).map_err(unsupported)?;
        if tiles.mma == Mma::Wgmma && arch != Arch::Sm90a {
            return Err(unsupported("wgmma (it needs sm_90a)".into()));
        }
        if tiles.warp_specialized && (tiles.mma != Mma::Wgmma || tiles.blocks_per_sm != 1) {
            return Err(unsupported("the warp-specialised pipeline without wgmma or with 2 blocks per SM".into()));
        }
        if !matches!(tiles.cluster, 1 | 2) || (tiles.cluster > 1 && !tiles.warp_specialized) {
            return Err(unsupported(format!(
                "clusters of {} blocks (1, or 2 with the warp-specialised pipeline)",
                tiles.cluster
            )));
        }
        if tiles.lag > 0 && (!tiles.warp_specialized || tiles.lag + 2 > tiles.stages) {
            return Err(unsupported(format!(
                "a warpgroup lag of {} k-tiles (warp-specialised only, at most stages - 2 = {})",
                tiles.lag,
                tiles.stages.saturating_sub(2)
            )));
        }
        let (h, i) = (spec.hidden(), spec.intermediate());
        let fp8 = quantizes_activations(spec);
        // wgmma keeps a k-tile's MMAs in flight (one more stage held) where it need not scale them.
        let unscaled = !fp8 || (x_per_token(spec) && tiles.warp_specialized);
        if !matches!(tiles.tail, 0 | 16) {
            return Err(unsupported(format!("extended items of {} rows (0 or 16)", tiles.tail)));
        }
        let inflight = (tiles.mma == Mma::Wgmma && unscaled) as u32;
        let wq = decodes_weights(spec);
        // The mixed-input GEMMs (gemm_wq.cuh) take 64-, 32- and 16-row token tiles too (whole
        // token fragments of 8 per warp), and up to 4 blocks per SM.
        let bm_ok = tiles.bm == 128 || (wq && !tiles.warp_specialized && matches!(tiles.bm, 16 | 32 | 64));
        let least = if wq { 2 } else { 2 + inflight };
        let most = 16;
        let most_blocks = if wq { 4 } else { 2 };
        // Widths past the powers of two: any multiple of 16 (takes_any_width); for weights the
        // producer decodes, 192 (whole 16-byte vectors per producer thread).
        let any_width = tiles.takes_any_width(spec);
        let decoded_ws = wq && tiles.warp_specialized && tiles.mma == Mma::Wgmma;
        let width_ok = |bn: u32| {
            matches!(bn, 64 | 128 | 256)
                || (any_width && bn % 16 == 0 && (64..=256).contains(&bn))
                || (decoded_ws && bn == 192)
        };
        if !bm_ok
            || tiles.stages < least
            || tiles.stages > most
            || !width_ok(tiles.bn1)
            || !width_ok(tiles.bn2)
            || !(1..=most_blocks).contains(&tiles.blocks_per_sm)
        {
            return Err(unsupported(format!(
                "tiles {tiles:?} (bm 128, or 64 / 32 / 16 for weights decoded in registers; bn 64/128/256, or any multiple of 16 from 64 to 256 for 16-bit weights on the warp-specialised pipeline, 192 for weights it decodes; stages {least} to {most}, 1 to {most_blocks} blocks per SM)"
            )));
        }
        if i % (tiles.bn1 / 2) != 0 || (h % tiles.bn2 != 0 && !tiles.partial_gemm2(spec)) {
            return Err(unsupported(format!("tiles {tiles:?} for hidden {h}, intermediate {i}")));
        }
        // A cluster splits an expert's odd tile by column blocks.
        if (i / (tiles.bn1 / 2)) % tiles.cluster != 0 || (h / tiles.bn2) % tiles.cluster != 0 {
            return Err(unsupported(format!(
                "clusters of {} with {} and {} column blocks (hidden {h}, intermediate {i}, tiles {tiles:?})",
                tiles.cluster,
                i / (tiles.bn1 / 2),
                h / tiles.bn2
            )));
        }
        let f = spec.weight_format();
        // Decoded weights take the mma.sync pipeline, or the warp-specialised one whose producer
        // decodes them (gemm_wsq.cuh): one block per cluster, and GEMM1 tiles of whole 16-byte
        // chunks of paired intermediate per consumer warp (bn1 >= 128).
        if wq && tiles.mma == Mma::Wgmma && (!tiles.warp_specialized || tiles.cluster != 1 || tiles.bn1 < 128) {
            return Err(unsupported(format!(
                "{f} weights on tiles {tiles:?} (they take the mma.sync pipeline, or the warp-specialised one without clusters and with bn1 >= 128)"
            )));
        }
        if wq {
            crate::render::resolve_dequant(spec, arch)?;
        }
        Ok(())
    }

    /// Whether both GEMMs' shared memory fits `arch`: each block within its opt-in limit and
    /// `blocks_per_sm` of them within one SM's.
    pub fn fits(&self, spec: &MoeSpec, arch: Arch) -> bool {
        let (block, sm) = smem_limits(arch);
        let spec = &spec.kernel_spec();
        let need = self.gemm1_smem_bytes(spec).max(self.gemm2_smem_bytes(spec));
        need <= block && need * self.blocks_per_sm <= sm
    }

    /// Every tile configuration the grouped family runs for `spec` on `arch` (each passing
    /// [`GemmTiles::check`] and [`GemmTiles::fits`], extended items only where they apply): the
    /// space a profiler times and a cost-model dispatcher chooses from. The default
    /// ([`GemmTiles::for_spec`]) is one of them.
    pub fn space(spec: &MoeSpec, arch: Arch) -> Vec<GemmTiles> {
        let mut out = Vec::new();
        // The powers of two, and the other widths that divide this spec's column counts (taken
        // only where `takes_any_width`: check refuses them elsewhere).
        let (h, i) = (spec.hidden(), spec.intermediate());
        let widths = |divides: &dyn Fn(u32) -> bool| -> Vec<u32> {
            (4..=16u32).map(|w| 16 * w).filter(|&w| w.is_power_of_two() || divides(w)).collect()
        };
        let (w1, w2) = (widths(&|w| i % (w / 2) == 0), widths(&|w| h % w == 0));
        for (mma, bm) in [Mma::MmaSync, Mma::Wgmma].into_iter().flat_map(|m| [128, 64, 32, 16].map(|b| (m, b))) {
            for warp_specialized in [false, true] {
                for (bn1, bn2) in w1.iter().flat_map(|&a| w2.iter().map(move |&b| (a, b))) {
                    for stages in 2..=8 {
                        for (blocks_per_sm, cluster, lag, tail) in [1, 2].into_iter().flat_map(|b| {
                            [1, 2]
                                .into_iter()
                                .flat_map(move |c| (0..=2).flat_map(move |l| [0, 16].map(move |t| (b, c, l, t))))
                        }) {
                            let t = GemmTiles {
                                bm,
                                bn1,
                                bn2,
                                stages,
                                blocks_per_sm,
                                mma,
                                warp_specialized,
                                cluster,
                                lag,
                                tail,
                            };
                            let redundant_tail = tail > 0 && t.extended_rows(&spec.kernel_spec()) == 0;
                            if !redundant_tail && t.check(spec, arch).is_ok() && t.fits(spec, arch) {
                                out.push(t);
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Dynamic shared memory up to which an H100 / H200 block leaves 60 KiB of L1 (the 196 KiB
/// carve-out, less the 1 KiB the driver reserves per block); past it the SM takes the 228 KiB
/// carve-out and 28 KiB of L1. The decoded pipeline's scale loads go through L1: with GEMM1's
/// extended items on a ring of 4 slots, 4-bit formats were 2-3.5% slower under skewed routing
/// (Qwen3-30B-A3B at 2048 and 4096 tokens, H200) than without them, which a ring of 3 avoids.
pub const L1_KEEPING_SMEM: u32 = 195 * 1024;

/// Dynamic shared memory one block may opt into, and one SM holds, on `arch` (H100 / B200:
/// 227 / 228 KiB; RTX PRO 6000, sm_120: 99 / 100 KiB).
pub const fn smem_limits(arch: Arch) -> (u32, u32) {
    match arch {
        Arch::Sm120a => (99 * 1024, 100 * 1024),
        _ => (227 * 1024, 228 * 1024),
    }
}

/// Render the grouped-GEMM family with explicit tiles.
pub fn render_grouped(spec: &MoeSpec, arch: Arch, tiles: GemmTiles) -> Result<KernelSource, CodegenError> {
    crate::render::count_render();
    // As render_warp_decode: the GEMMs see the shared experts as experts, the router does not.
    let routed = *spec;
    let spec = &spec.kernel_spec();
    tiles.check_kernel_spec(spec, arch)?;
    let family = KernelFamily::GroupedGemm;
    let (h, i) = (spec.hidden(), spec.intermediate());
    let fp8 = quantizes_activations(spec);
    let f = spec.weight_format();
    let wq = decodes_weights(spec);
    let act16 = match spec.act_dtype() {
        crate::ActDtype::Bf16 => "bf16",
        crate::ActDtype::Fp16 => "f16",
    };
    let (elem_bytes, mma_type, wscale) = match f {
        // Decoded into the activation dtype by the mixed-input GEMMs, every scale applied there.
        _ if wq => (2, act16, 0),
        WeightFormat::Bf16 => (2, "bf16", 0),
        WeightFormat::Fp16 => (2, "f16", 0),
        WeightFormat::Fp8E4m3 => (1, "e4m3", 1),
        WeightFormat::Fp8E4m3B128 => (1, "e4m3", 2),
        _ => unreachable!("{f} weights are decoded in registers"),
    };
    let fmt = if wq {
        let variant = crate::render::resolve_dequant(spec, arch)?;
        Some(crate::render::FormatCtx::new(f, variant, arch))
    } else {
        None
    };
    // fp8 on the warp-specialised pipeline multiplies tiles over 128 columns in halves.
    let mut ns: Vec<u32> = [tiles.bn1, tiles.bn2]
        .into_iter()
        .flat_map(|n| [n, if fp8 && tiles.warp_specialized && n > 128 { n / 2 } else { n }])
        .collect();
    // Extended items multiply their rows as wgmma's N side (gemm_ws.cuh: ext_mma).
    ns.push(tiles.extended_rows(spec));
    ns.retain(|&n| n > 0);
    ns.sort_unstable();
    ns.dedup();
    let router = RouterCtx::new(&routed);
    let mma_name = match tiles.mma {
        Mma::Wgmma => "wgmma",
        Mma::MmaSync => "mma",
    };
    let t = tiles;
    let ws = if t.warp_specialized { "_ws" } else { "" };
    let cl = if t.cluster > 1 { format!("c{}", t.cluster) } else { String::new() };
    let lag = if t.lag > 0 { format!("l{}", t.lag) } else { String::new() };
    let ext = t.extended_rows(spec);
    let tail = if ext > 0 { format!("t{ext}") } else { String::new() };
    let name = format!(
        "{family}_{}_bm{}n{}n{}s{}b{}_{mma_name}{ws}{cl}{lag}{tail}",
        routed.id(),
        t.bm,
        t.bn1,
        t.bn2,
        t.stages,
        t.blocks_per_sm
    );
    let t = GroupedGemmCu {
        name: name.clone(),
        wgmma: (tiles.mma == Mma::Wgmma) as u32,
        ws: tiles.warp_specialized as u32,
        group_tiles: GROUP_TILES,
        hot_tiles: HOT_TILES,
        ext_spread: crate::heuristics::ext_spread(spec),
        act_type: spec.act_dtype().cuda_type(),
        act_bf16: spec.act_dtype() == crate::ActDtype::Bf16,
        hidden: h,
        intermediate: i,
        experts: spec.experts(),
        top_k: spec.top_k(),
        activation: spec.activation(),
        bias: spec.has_bias(),
        fmt,
        bm: tiles.bm,
        bn1: tiles.bn1,
        bn2: tiles.bn2,
        stages: tiles.stages,
        blocks_per_sm: tiles.blocks_per_sm,
        cluster: tiles.cluster,
        lag: tiles.lag,
        tail: ext,
        tail2: tiles.gemm2_extended_rows(spec),
        mid_fp8: tiles.quantizes_mid(spec),
        x_per_row: x_per_token(spec),
        pack_ring: tiles.pack_ring(spec),
        pack_bits: if tiles.warp_specialized { wq_bits(spec).unwrap_or(0) } else { 0 },
        x_pair_group: wq_bits(spec).map_or(0, |b| 32 / b),
        wq_cols: decodes_weights(spec) && decoded_cols(spec),
        elem_bytes,
        wscale,
        mma_type,
        mma_k: 32 / elem_bytes,
        wgmma_trans: if elem_bytes == 2 { ", 0, 0" } else { "" },
        wgmma_ns: ns.into_iter().map(|n| WgmmaN { n, regs: n / 2 }).collect(),
        router,
        params: crate::params::grouped_decls(),
        gemm1_smem: tiles.gemm1_smem_bytes(spec),
        gemm2_smem: tiles.gemm2_smem_bytes(spec),
        prepare_smem: prepare_smem_bytes(spec),
    };
    let source = t.render().map_err(|e| CodegenError::Template(e.to_string()))?;
    Ok(KernelSource {
        family,
        arch,
        name,
        source,
        entry_points: entry_points(),
        block_threads: tiles.gemm_threads(),
        decode_tiles: None,
        grouped_tiles: Some(tiles),
        fused_tiles: None,
    })
}

/// The entry points of a grouped module, in this order (the runtime loads them by it): router,
/// alignment, intermediate quantizer, GEMM1, GEMM2 (atomic and row-store), row combine, convert,
/// and the dispatcher's family choice.
pub const ENTRY_POINTS: [&str; 9] = [
    "moe_route",
    "moe_prepare",
    "moe_quant_mid",
    "moe_gemm1",
    "moe_gemm2_atomic",
    "moe_gemm2_rows",
    "moe_combine_rows",
    "moe_convert",
    "moe_choose",
];

/// [`ENTRY_POINTS`] as owned strings.
pub fn entry_points() -> Vec<String> {
    ENTRY_POINTS.map(String::from).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::{GroupLimited, Router};
    use crate::spec::REFERENCE_GEOMETRIES;

    fn spec(h: u32, i: u32, e: u32, k: u32, f: WeightFormat) -> MoeSpec {
        MoeSpec::builder(h, i, e, k).weight_format(f).build().unwrap()
    }

    #[test]
    fn renders_every_reference_geometry_and_arch() {
        for (_, h, i, e, k) in REFERENCE_GEOMETRIES {
            for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Fp8E4m3B128] {
                let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
                for arch in Arch::ALL {
                    let r = render_grouped(&s, arch, GemmTiles::for_spec(&s, arch));
                    // Per-channel fp8 whose k does not hold whole 128-byte tiles (gpt-oss's 2880)
                    // is decoded in registers; the block-scaled format refuses it at build.
                    let misfit = f != WeightFormat::Bf16 && (h % 128 != 0 || i % 128 != 0);
                    assert_eq!(decodes_weights(&s), misfit, "{f} {h}x{i}");
                    assert_eq!(quantizes_activations(&s), f != WeightFormat::Bf16 && !misfit, "{f} {h}x{i}");
                    let k = r.unwrap_or_else(|e| panic!("{f} {h}x{i} on {arch}: {e}"));
                    assert_eq!(k.source.contains("constexpr int ELEM_BYTES = 1;"), quantizes_activations(&s));
                    assert!(k.source.contains(&format!("constexpr int HIDDEN = {h};")));
                    assert_eq!(k.source.contains("#define MOE_WGMMA 1"), arch == Arch::Sm90a && !misfit);
                    assert!(!k.source.contains("{%"), "askama left a tag");
                }
            }
        }
    }

    #[test]
    fn wgmma_operands_match_the_tile_width() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let k = render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).unwrap();
        assert!(k.source.contains("m64n256k16.f32.bf16.bf16"));
        assert!(k.source.contains("\"+f\"(d[127])") && !k.source.contains("\"+f\"(d[128])"));
        let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
        let k = render_grouped(&s, Arch::Sm120a, GemmTiles::for_spec(&s, Arch::Sm120a)).unwrap();
        assert!(k.source.contains("m16n8k32.row.col.f32.e4m3.e4m3.f32"));
    }

    #[test]
    fn fp8_on_hopper_takes_wide_tiles_in_halves_and_quantizes_mid_in_gemm1() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
        let t = GemmTiles::for_spec(&s, Arch::Sm90a);
        assert_eq!((t.bn1, t.bn2, t.warp_specialized), (256, 256, true));
        assert!(t.quantizes_mid(&s));
        let k = render_grouped(&s, Arch::Sm90a, t).unwrap();
        // The 256-column accumulator and the 128-column partial it is built from.
        assert!(k.source.contains("m64n256k32.f32.e4m3.e4m3") && k.source.contains("m64n128k32.f32.e4m3.e4m3"));
        assert!(k.source.contains("constexpr bool MID_FP8 = true;"));
        // 128-column tiles, the block-barrier pipeline and bf16 leave mid to moe_quant_mid (or bf16).
        for t in [
            GemmTiles { bn1: 128, bn2: 128, stages: 6, ..t },
            GemmTiles { warp_specialized: false, bn1: 128, bn2: 128, ..t },
        ] {
            assert!(!t.quantizes_mid(&s));
            assert!(render_grouped(&s, Arch::Sm90a, t).unwrap().source.contains("constexpr bool MID_FP8 = false;"));
        }
        let b = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        assert!(!GemmTiles::for_spec(&b, Arch::Sm90a).quantizes_mid(&b));
    }

    #[test]
    fn per_channel_fp8_scales_x_per_token_and_keeps_mmas_in_flight() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
        let t = GemmTiles::for_spec(&s, Arch::Sm90a);
        assert!(x_per_token(&s));
        assert!(render_grouped(&s, Arch::Sm90a, t).unwrap().source.contains("constexpr bool X_PER_ROW = true;"));
        // GEMM1 then holds a k-tile's MMAs in flight: one more stage than a promoting pipeline.
        assert!(render_grouped(&s, Arch::Sm90a, GemmTiles { stages: 2, ..t }).is_err());
        assert!(render_grouped(&s, Arch::Sm90a, GemmTiles { stages: 3, ..t }).is_ok());
        // 128 x 128 blocks scale along K: x keeps a scale per 128, and two stages do.
        let b = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3B128);
        let tb = GemmTiles::for_spec(&b, Arch::Sm90a);
        assert!(!x_per_token(&b));
        assert!(render_grouped(&b, Arch::Sm90a, tb).unwrap().source.contains("constexpr bool X_PER_ROW = false;"));
        assert!(render_grouped(&b, Arch::Sm90a, GemmTiles { stages: 2, ..tb }).is_ok());
    }

    #[test]
    fn the_tile_space_holds_the_defaults_and_renders() {
        for (_, h, i, e, k) in crate::REFERENCE_GEOMETRIES {
            for f in WeightFormat::ALL {
                let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
                for arch in Arch::ALL {
                    let space = GemmTiles::space(&s, arch);
                    let default = GemmTiles::for_spec(&s, arch);
                    let renders = render_grouped(&s, arch, default).is_ok();
                    // The space lists a tail only where it applies (else it is tail 0's kernel).
                    let ext = default.extended_rows(&s.kernel_spec());
                    let default = GemmTiles { tail: if ext == 0 { 0 } else { default.tail }, ..default };
                    assert_eq!(space.contains(&default), renders, "{} {arch}: default {default:?}", s.id());
                    let mut seen = space.clone();
                    seen.dedup();
                    assert_eq!(seen.len(), space.len(), "{} {arch}: a configuration twice", s.id());
                }
            }
        }
        // Every member renders, and only the members among their neighbours do.
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let space = GemmTiles::space(&s, Arch::Sm90a);
        assert!(space.len() > 20, "{} configurations", space.len());
        for t in &space {
            render_grouped(&s, Arch::Sm90a, *t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        }
        let sm120 = GemmTiles::space(&s, Arch::Sm120a);
        assert!(sm120.iter().all(|t| t.mma == Mma::MmaSync && t.fits(&s, Arch::Sm120a)));
        assert!(sm120.len() < space.len());
    }

    #[test]
    fn default_tiles_fit_each_archs_shared_memory() {
        // Opt-in shared memory per block: H100 / B200 227 KiB, RTX PRO 6000 (sm_120) 99 KiB.
        for (arch, max) in Arch::ALL.map(|a| (a, smem_limits(a).0)) {
            for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
                let t = GemmTiles::for_spec(&spec(2048, 768, 128, 8, f), arch);
                let s = spec(2048, 768, 128, 8, f);
                assert!(t.gemm1_smem_bytes(&s).max(t.gemm2_smem_bytes(&s)) <= max, "{arch} {f}: {t:?}");
            }
        }
    }

    #[test]
    fn weights_decoded_in_registers_take_their_own_tiles_on_every_geometry_and_arch() {
        // gemm_wq.cuh: 64-token tiles, two blocks per SM where the shared memory holds them (one
        // on sm_120a), as many stages as fit; the source's static_asserts see the host's sizes.
        for (_, h, i, e, k) in crate::REFERENCE_GEOMETRIES {
            for f in [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Int8, WeightFormat::Mxfp8] {
                let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
                for arch in Arch::ALL {
                    let t = GemmTiles::for_spec(&s, arch);
                    assert_eq!((t.bm, t.mma, t.warp_specialized), (64, Mma::MmaSync, false), "{f} {arch}");
                    assert_eq!(t.blocks_per_sm, if arch == Arch::Sm120a { 1 } else { 2 }, "{f} {arch}");
                    assert!(t.check(&s, arch).is_ok() && t.fits(&s, arch), "{f} {arch}: {t:?}");
                    // One more stage would not fit the blocks per SM.
                    let deeper = GemmTiles { stages: t.stages + 1, ..t };
                    assert!(t.stages == 8 || !deeper.fits(&s, arch), "{f} {arch}: {t:?}");
                    let k = render_grouped(&s, arch, t).unwrap().source;
                    for (name, v) in
                        [("HOST_GEMM1_SMEM", t.gemm1_smem_bytes(&s)), ("HOST_GEMM2_SMEM", t.gemm2_smem_bytes(&s))]
                    {
                        assert!(k.contains(&format!("constexpr int {name} = {v};")), "{f} {arch}: {name} = {v}");
                    }
                }
            }
        }
        // 4-bit stages carry 128 codes (64 bytes) of each weight row and 256 bytes of each token
        // row, and two 8-byte mbarriers.
        let s = spec(2048, 768, 128, 8, WeightFormat::Mxfp4);
        let t = GemmTiles::for_spec(&s, Arch::Sm90a);
        assert_eq!(t.gemm1_smem_bytes(&s), t.stages * (128 * 64 + 64 * 256 + 16) + 128);
        // 16- and 32-token tiles as options, nothing else; up to 4 blocks per SM.
        for (bm, ok) in [(16, true), (32, true), (48, false), (96, false)] {
            assert_eq!(GemmTiles { bm, ..t }.check(&s, Arch::Sm90a).is_ok(), ok, "bm {bm}");
        }
        assert!(GemmTiles::space(&s, Arch::Sm90a).iter().any(|t| t.bm == 16));
        let b = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        assert!(GemmTiles { bm: 16, ..GemmTiles::for_spec(&b, Arch::Sm90a) }.check(&b, Arch::Sm90a).is_err());
        assert!(GemmTiles { blocks_per_sm: 4, ..t }.check(&s, Arch::Sm90a).is_ok());
        assert!(GemmTiles { blocks_per_sm: 5, ..t }.check(&s, Arch::Sm90a).is_err());
        // The tiles' text form takes the token rows last.
        assert_eq!(t.parse("128,128,6,3,bm16"), Some(GemmTiles { bm: 16, stages: 6, blocks_per_sm: 3, ..t }));
        assert_eq!(t.parse("128,128,6,3,bmx"), None);
    }

    #[test]
    fn the_hosts_smem_sizes_reach_the_source() {
        // grouped_gemm.cu and prepare.cuh static_assert their layouts against these.
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
            let s = spec(2048, 768, 128, 8, f);
            for arch in Arch::ALL {
                let t = GemmTiles::for_spec(&s, arch);
                let k = render_grouped(&s, arch, t).unwrap().source;
                for (name, v) in [
                    ("HOST_GEMM1_SMEM", t.gemm1_smem_bytes(&s)),
                    ("HOST_GEMM2_SMEM", t.gemm2_smem_bytes(&s)),
                    ("HOST_PREPARE_SMEM", prepare_smem_bytes(&s)),
                ] {
                    assert!(k.contains(&format!("constexpr int {name} = {v};")), "{f} {arch}: {name} = {v}");
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        // Decoded weights take the mma.sync pipeline, or the warp-specialised one whose producer
        // decodes them: without clusters, bn1 >= 128, 128-row tiles; not the block-barrier wgmma
        // one, nor the lut variant (its table would take the stages' shared memory).
        let s = spec(2048, 768, 128, 8, WeightFormat::Int4);
        let ws = GemmTiles::for_spec(&spec(2048, 768, 128, 8, WeightFormat::Bf16), Arch::Sm90a);
        let refused =
            |t: GemmTiles| matches!(render_grouped(&s, Arch::Sm90a, t), Err(CodegenError::Unsupported { .. }));
        assert!(refused(GemmTiles { cluster: 2, ..ws }));
        assert!(refused(GemmTiles { cluster: 1, bn1: 64, ..ws }));
        assert!(refused(GemmTiles { cluster: 1, bm: 64, ..ws }));
        assert!(refused(GemmTiles { cluster: 1, warp_specialized: false, lag: 0, tail: 0, ..ws }));
        let decoded = GemmTiles { cluster: 1, stages: 3, ..ws };
        let k = render_grouped(&s, Arch::Sm90a, decoded).unwrap();
        // Three slots of the ring (four would take the stages past L1_KEEPING_SMEM, with or
        // without extended items: per-channel int4's column scales take 2 KiB).
        assert!(k.source.contains("constexpr int PACK_RING = 3;") && k.source.contains("constexpr int PACK_BITS = 4;"));
        assert_eq!(decoded.extended_rows(&s), 16, "the producer's decoded stages take extended items too");
        assert_eq!(decoded.gemm2_extended_rows(&s), 16, "GEMM2's too");
        assert!(k.source.contains("constexpr int TAIL = 16;") && k.source.contains("constexpr int TAIL2 = 16;"));
        let k0 = render_grouped(&s, Arch::Sm90a, GemmTiles { tail: 0, ..decoded }).unwrap();
        assert!(k0.source.contains("constexpr int PACK_RING = 3;") && k0.source.contains("constexpr int TAIL = 0;"));
        assert!(render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).is_ok());
        let lut = MoeSpec::builder(2048, 768, 128, 8)
            .weight_format(WeightFormat::Int4)
            .dequant(crate::DequantVariant::Lut)
            .build()
            .unwrap();
        assert!(grouped_support(&lut).is_err());
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let wg = GemmTiles { mma: Mma::Wgmma, ..GemmTiles::for_spec(&s, Arch::Sm120a) };
        assert!(render_grouped(&s, Arch::Sm120a, wg).is_err());
        let odd = GemmTiles { bn2: 96, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
        assert!(render_grouped(&s, Arch::Sm90a, odd).is_err());
    }

    /// Only the mixed-input mma.sync GEMM2 ends on a narrower column block (gpt-oss-20b's 2880
    /// outputs: 22 blocks of 128 and one of 64); the other pipelines keep whole column tiles.
    #[test]
    fn only_decoded_weights_on_mma_sync_take_a_narrower_last_column_block() {
        for arch in [Arch::Sm90a, Arch::Sm100a, Arch::Sm120a] {
            for f in [WeightFormat::Mxfp4, WeightFormat::Int8, WeightFormat::Fp8E4m3] {
                let s = spec(2880, 2880, 32, 4, f);
                let t = GemmTiles::for_spec(&s, arch);
                assert_eq!((t.mma, t.bn2, t.gemm2_col_blocks(2880)), (Mma::MmaSync, 128, 23), "{f} {arch}");
                assert!(t.partial_gemm2(&s), "{f} {arch}");
                let k = render_grouped(&s, arch, t).unwrap_or_else(|e| panic!("{f} {arch}: {e}"));
                assert!(k.source.contains("constexpr int NT2 = (HIDDEN + BN2 - 1) / BN2;"));
                let wide = GemmTiles { bn2: 256, ..t };
                assert!(wide.partial_gemm2(&s) && wide.check(&s, arch).is_ok(), "{f} {arch}: 11 x 256 + 64");
            }
            // 16-bit weights on mma.sync, and decoded weights on the warp-specialised pipeline.
            let s = spec(2880, 2880, 32, 4, WeightFormat::Bf16);
            let t =
                GemmTiles { bm: 128, bn1: 128, bn2: 128, mma: Mma::MmaSync, ..GemmTiles::for_spec(&s, Arch::Sm100a) };
            assert!(!t.partial_gemm2(&s) && t.check(&s, arch).is_err(), "{arch}: {t:?}");
        }
        let s = spec(2880, 2880, 32, 4, WeightFormat::Mxfp4);
        let ws = crate::heuristics::large_step_tiles(&s, Arch::Sm90a).unwrap();
        assert!(ws.warp_specialized);
        let t = GemmTiles { bn2: 128, ..ws };
        assert!(!t.partial_gemm2(&s) && t.check(&s, Arch::Sm90a).is_err(), "{t:?}");
    }

    #[test]
    fn warp_specialised_pipeline_is_sm90a_wgmma_only() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let ws = GemmTiles::for_spec(&s, Arch::Sm90a);
        assert!(ws.warp_specialized && ws.gemm_threads() == 384);
        let k = render_grouped(&s, Arch::Sm90a, ws).unwrap();
        assert!(k.source.contains("#define MOE_WS 1") && k.source.contains("cp.async.bulk.tensor.2d"));
        assert!(k.name.ends_with("_wst16"), "{}", k.name);
        let plain = ws.parse("256,256,4,1,0").unwrap();
        assert!(!plain.warp_specialized && plain.gemm_threads() == 256);
        let k = render_grouped(&s, Arch::Sm90a, plain).unwrap();
        assert!(k.source.contains("#define MOE_WS 0") && !k.source.contains("cp.async.bulk.tensor"));
        assert_eq!(ws.parse("256,256,4,1"), Some(ws));
        assert_eq!(ws.parse("256,256,4,1,2"), None);
        assert_eq!(plain.cluster, 1, "the block-barrier pipeline has no clusters");
        assert_eq!(ws.parse("256,256,4,1,1,1").map(|t| t.cluster), Some(1));
        let on_120 = GemmTiles { warp_specialized: true, ..GemmTiles::for_spec(&s, Arch::Sm120a) };
        assert!(render_grouped(&s, Arch::Sm120a, on_120).is_err());
        let two_blocks = GemmTiles { blocks_per_sm: 2, ..ws };
        assert!(render_grouped(&s, Arch::Sm90a, two_blocks).is_err());
        // The barriers and item slots sit past the stages.
        assert_eq!(ws.gemm2_smem_bytes(&s), 4 * (128 + 256) * 128 + 1024 + 176 + 2 * 256 * 4 + 8 * 2048);
        // GEMM1's stages also carry the extended rows, and the tail epilogue its exchange.
        assert_eq!(
            ws.gemm1_smem_bytes(&s),
            4 * (128 + 16 + 256) * 128 + 1024 + 176 + 2 * 256 * 4 + 8 * 2048 + 16 * 128 * 2
        );
    }

    #[test]
    fn clusters_multicast_the_weight_tile_on_the_warp_specialised_pipeline_only() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let ws = GemmTiles { cluster: 2, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
        let k = render_grouped(&s, Arch::Sm90a, ws).unwrap();
        assert!(k.source.contains("constexpr int CLUSTER = 2;") && k.source.contains(".multicast::cluster"));
        assert!(k.name.ends_with("_wsc2"), "{}", k.name);
        let single = GemmTiles { cluster: 1, ..ws };
        let k1 = render_grouped(&s, Arch::Sm90a, single).unwrap();
        assert!(k1.source.contains("constexpr int CLUSTER = 1;") && k1.name != k.name);
        for bad in [
            GemmTiles { cluster: 3, ..ws },
            GemmTiles { cluster: 0, ..ws },
            GemmTiles { cluster: 2, ..ws.parse("256,256,4,1,0").unwrap() },
        ] {
            assert!(matches!(render_grouped(&s, Arch::Sm90a, bad), Err(CodegenError::Unsupported { .. })), "{bad:?}");
        }
        assert!(
            GemmTiles::for_spec(&s, Arch::Sm100a).cluster == 1 && GemmTiles::for_spec(&s, Arch::Sm120a).cluster == 1
        );
        assert_eq!(GemmTiles::for_spec(&s, Arch::Sm90a).cluster, 1, "off for short items");
        // Mixtral-8x7B: 32 or more k-tiles per item in both GEMMs, even column blocks.
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
            let m = spec(4096, 14336, 8, 2, f);
            assert_eq!(GemmTiles::for_spec(&m, Arch::Sm90a).cluster, 2, "{f}");
            assert_eq!(GemmTiles::for_spec(&m, Arch::Sm120a).cluster, 1, "{f}");
            assert!(render_grouped(&m, Arch::Sm90a, GemmTiles::for_spec(&m, Arch::Sm90a)).is_ok());
        }
        // gpt-oss-20b: long items, and 240-column tiles give even column blocks (24 and 12).
        assert_eq!(GemmTiles::for_spec(&spec(2880, 2880, 32, 4, WeightFormat::Bf16), Arch::Sm90a).cluster, 2);
    }

    #[test]
    fn a_warpgroup_lag_is_a_template_constant_of_the_warp_specialised_pipeline() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
        let ws = GemmTiles::for_spec(&s, Arch::Sm90a);
        assert_eq!(ws.lag, 0);
        let lagged = ws.parse("256,256,4,1,1,1,2").unwrap();
        assert_eq!((lagged.cluster, lagged.lag), (1, 2));
        let k = render_grouped(&s, Arch::Sm90a, lagged).unwrap();
        assert!(k.source.contains("constexpr int WG_LAG = 2;") && k.name.ends_with("_wsl2"), "{}", k.name);
        assert_ne!(k.name, render_grouped(&s, Arch::Sm90a, ws).unwrap().name, "part of the cache key");
        // At most stages - 2 (the first stage warpgroup 0 waits for must be free), and only
        // where there are warpgroups.
        for bad in [GemmTiles { lag: 3, ..ws }, GemmTiles { lag: 1, ..ws.parse("128,128,4,1,0").unwrap() }] {
            assert!(matches!(render_grouped(&s, Arch::Sm90a, bad), Err(CodegenError::Unsupported { .. })), "{bad:?}");
        }
        assert_eq!(ws.parse("256,256,4,1,0").map(|t| t.lag), Some(0));
    }

    #[test]
    fn short_last_tiles_extend_gemm1_items_where_the_scales_hold_along_k() {
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
            let s = spec(2048, 768, 128, 8, f);
            let default = GemmTiles::for_spec(&s, Arch::Sm90a);
            // On by default for 16-bit weights; per-channel fp8 takes them as an option.
            assert_eq!(default.tail, if f == WeightFormat::Bf16 { 16 } else { 0 }, "{f}");
            let t = GemmTiles { tail: 16, ..default };
            let k = render_grouped(&s, Arch::Sm90a, t).unwrap();
            assert!(k.source.contains("constexpr int TAIL = 16;") && k.name.ends_with("t16"), "{}", k.name);
            let off = render_grouped(&s, Arch::Sm90a, GemmTiles { tail: 0, ..t }).unwrap();
            assert!(off.source.contains("constexpr int TAIL = 0;") && off.name != k.name, "part of the cache key");
            assert_eq!(t.parse("256,256,4,1,1,1,0,0").map(|t| t.tail), Some(0));
            assert_eq!(GemmTiles { tail: 0, ..t }.parse("256,256,4,1,1,1,0,16"), Some(t));
            assert_eq!(GemmTiles::for_spec(&s, Arch::Sm120a).extended_rows(&s), 0, "{f}: mma.sync tiles");
            // GEMM2 extends them only where the producer decodes its weights.
            assert_eq!(t.gemm2_extended_rows(&s), 0, "{f}");
            assert!(k.source.contains("constexpr int TAIL2 = 0;"));
        }
        // Off where the scales change along K, in clusters (Mixtral-8x7B), on 128-wide tiles and
        // on the block-barrier pipeline.
        let b = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3B128);
        let tb = GemmTiles::for_spec(&b, Arch::Sm90a);
        let m = spec(4096, 14336, 8, 2, WeightFormat::Bf16);
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let t = GemmTiles::for_spec(&s, Arch::Sm90a);
        for (spec, off) in [
            (b, tb),
            (m, GemmTiles::for_spec(&m, Arch::Sm90a)),
            (s, GemmTiles { cluster: 2, ..t }),
            (s, GemmTiles { bn1: 128, ..t }),
            (s, GemmTiles { warp_specialized: false, ..t }),
        ] {
            assert_eq!(off.extended_rows(&spec), 0, "{off:?}");
            let k = render_grouped(&spec, Arch::Sm90a, off).unwrap();
            assert!(k.source.contains("constexpr int TAIL = 0;") && !k.name.contains("t16"), "{}", k.name);
        }
        assert_eq!(tb.gemm1_smem_bytes(&b), tb.smem_bytes(tb.bn1, 0));
        for bad in [GemmTiles { tail: 8, ..t }, GemmTiles { tail: 32, ..t }] {
            let err = render_grouped(&s, Arch::Sm90a, bad).unwrap_err();
            assert!(err.to_string().contains("extended items"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn router_is_baked_in() {
        let s = spec(2048, 768, 256, 8, WeightFormat::Bf16)
            .with_router(Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5)))
            .unwrap();
        let k = render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).unwrap();
        assert!(k.source.contains("constexpr int GROUPS = 8;"));
        assert!(k.source.contains("constexpr float SCALING = 2.5f;"));
        assert!(k.name.contains("grouped8x4s2.5"));
    }

    #[test]
    fn clusters_need_an_even_number_of_column_blocks() {
        let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
        let t = GemmTiles { cluster: 2, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
        assert!(render_grouped(&s, Arch::Sm90a, t).is_ok());
        // 640 / 128 = 5 column blocks in GEMM1.
        let odd = spec(2048, 640, 128, 8, WeightFormat::Bf16);
        let err = render_grouped(&odd, Arch::Sm90a, t).unwrap_err().to_string();
        assert!(err.contains("column blocks"), "{err}");
    }

    #[test]
    fn max_tiles_bounds_every_histogram() {
        let t = GemmTiles::for_spec(&spec(2048, 768, 128, 8, WeightFormat::Bf16), Arch::Sm90a);
        for cluster in [1u32, 2] {
            let t = GemmTiles { cluster, ..t };
            let tiles = |c: usize| c.div_ceil(128);
            for pairs in [1usize, 8, 127, 128, 129, 255, 257, 1000, 32768] {
                // Worst case: one pair on each of min(E, pairs) - 1 experts, the rest on one.
                let e = 128usize.min(pairs);
                let worst = (e - 1) * tiles(1) + tiles(pairs - (e - 1));
                assert!(t.max_tiles(pairs, 128) >= worst, "cluster {cluster} pairs {pairs}");
            }
        }
    }
}
