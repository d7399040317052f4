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
/// alignment (any step, and a one-block step whose ids are given), intermediate quantizer, GEMM1,
/// GEMM2 (atomic and row-store), row combine, convert, and the dispatcher's family choice.
pub const ENTRY_POINTS: [&str; 10] = [
    "moe_route",
    "moe_prepare",
    "moe_prepare_solo",
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
mod tests;
