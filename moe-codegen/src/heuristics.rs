//! Tile heuristics: every default tile choice of the kernel families, in one place.
//!
//! [`decode_tiles`] picks the warp-decode family's [`DecodeTiles`] and [`gemm_tiles`] the
//! grouped-GEMM family's [`GemmTiles`]; the constants here are the choices both families bake into
//! their sources. Each item says what it chooses and why. The measurements behind the choices are
//! in `docs/design.md`, "Tile choices: the measurements behind them".
//!
//! Every choice is a template constant, so it is part of the rendered source and of the JIT cache
//! key: changing one here renders (and compiles) new kernels.

use crate::format::Codec;
use crate::grouped::{quantizes_activations, GemmTiles, Mma};
use crate::render::{bulk_smem_bytes, DecodeTiles, BULK_SMEM_MAX};
use crate::spec::{Arch, MoeSpec};

/// Token tiles (tokens served per pass over a weight row) the warp-decode family renders as
/// separate entry points; a step takes the smallest that covers it ([`token_tile`]). Each tile
/// is its own kernel because the tokens' accumulators live in registers: a larger tile reads each
/// row once for more tokens at the cost of registers, and so of resident warps: past 4 the cost
/// wins (an 8-token tile needs about 150 registers and halves the resident warps), and with many
/// experts an expert rarely serves more than 4 tokens of a decode step.
pub const TOKEN_TILES: [u32; 3] = [1, 2, 4];

/// Dynamic shared memory each bulk decode kernel may take when [`fit_bulk_stages`] deepens its
/// ring: two of them (gate_up's and down's blocks) fit on one SM of 228 KiB beside the 1 KiB each
/// block reserves, so down's blocks stream their weights while gate_up's still run.
pub const BULK_SMEM_BUDGET: u32 = 112 * 1024;

/// Largest activation block (fp32) warp decode stages in shared memory; larger steps read the
/// activations from global memory. Staged, a lane reads its vector's activations as
/// conflict-free float4s instead of re-loading and widening them from global memory for every row
/// it serves; the cap bounds the shared memory a block asks for.
pub const X_STAGE_MAX_BYTES: u32 = 64 * 1024;

/// Experts with this many tiles or more ("hot") lead the grouped family's alignment layout, and
/// the GEMMs deal their work items and the other experts' evenly into each other (`work_item` in
/// `grouped_gemm.cu`): a cold expert's item reads a whole weight column for a tile or two
/// (DRAM-bound), a hot one's mostly computes, so a wave mixes both.
pub const HOT_TILES: u32 = 4;

/// The most tiles an expert's short last tile spreads over as extended items (`GemmTiles::tail`
/// rows each, `Work` in `grouped_gemm.cu`). An extended item costs part of a tile (its MMAs with
/// the operands swapped, its rows' epilogue): on an H200 (Qwen3-30B-A3B, 4096 tokens) 2 and 3
/// were 1-3% faster than 1 under uniform routing, and 8 was 1-3% slower under skewed routing,
/// whose hot experts end their many tiles anywhere. See [`ext_spread`] for the exceptions.
pub const EXT_SPREAD: u32 = 2;

/// [`EXT_SPREAD`], or 1 (the short tile joins only the tile before it) for 8-bit codes with
/// 32-code group scales (mxfp8, int8_g32), whose decoding producer sits at its register limit:
/// the spread's bookkeeping moved its spills, and both ran 2-5% slower under skewed routing on an
/// H200 (Qwen3-30B-A3B and OLMoE, 2048 and 4096 tokens) where int8_g64 and int8_g128 gained 3-7%
/// under uniform routing.
pub fn ext_spread(spec: &MoeSpec) -> u32 {
    let f = spec.weight_format();
    if f.elem_bits() == 8 && f.k_group() == 32 {
        1
    } else {
        EXT_SPREAD
    }
}

/// Row tiles of one expert the grouped GEMMs run side by side, column block by column block, so
/// that a wave reads each weight tile once through L2 (`work_item` in `grouped_gemm.cu`).
pub const GROUP_TILES: u32 = 8;

/// The warp-decode family's default tiles for a spec (what `DecodeTiles::for_spec` returns).
///
/// Eight warps per block and gate_up units of at most 4 vectors per lane per row: enough bytes in
/// flight per warp to cover DRAM latency without spilling. The activations are staged (see
/// [`X_STAGE_MAX_BYTES`]); the one-token down stashes 4 more vectors per lane of its first item
/// (under the 40 KiB static budget for 8 warps). The other fields: [`down_chunk`],
/// [`down_rows`], [`gate_up_lanes`], [`gate_up_early`] and [`bulk_kernels`], whose rings
/// [`fit_bulk_stages`] deepens (the bulk pair is turned off where one stage does not fit).
pub fn decode_tiles(spec: &MoeSpec) -> DecodeTiles {
    let (bulk_gu, bulk_dn) = bulk_kernels(spec);
    let mut t = DecodeTiles {
        warps: 8,
        gu_chunk: 4,
        gu_lanes: gate_up_lanes(spec),
        gu_early: gate_up_early(spec),
        dn_chunk: down_chunk(spec),
        dn_rows: down_rows(spec),
        stage_x: true,
        dn_stash: 4,
        bulk_gu,
        bulk_dn,
        bulk_dn_h2: true,
        bulk_gu_warps: bulk_warps(spec.intermediate()),
        bulk_dn_warps: bulk_warps(spec.hidden()),
        bulk_gu_stages: 1,
        bulk_dn_stages: 1,
    };
    if !fit_bulk_stages(&mut t, spec) {
        (t.bulk_gu, t.bulk_dn) = (false, false);
    }
    t
}

/// Consumer warps of a bulk ring: 16, or the most under it that divide the rows the ring tiles
/// (`n`), so that every spec the builder accepts renders (the bulk kernels may still be off).
fn bulk_warps(n: u32) -> u32 {
    (1..=16).rev().find(|w| n % w == 0).unwrap_or(1)
}

/// down's vectors per lane loaded before any math (`dn_chunk`): the largest count of at most the
/// cap (8 for 4-bit formats, whose 16-byte vectors hold 32 weights; else 4) that divides the
/// vectors each lane owns per item and is over half the cap, so that no unit runs with idle slots;
/// else the cap (or the whole item, if shorter).
///
/// Why: 4-bit items are short (6 vectors per lane for Qwen3-30B-A3B) and loading a whole one is
/// faster than units of 3-4; wider formats run the same with 4 as with 6-8, at fewer registers.
pub fn down_chunk(spec: &MoeSpec) -> u32 {
    let vec = spec.weight_format().elems_per_16b();
    let dn_vpl = (spec.top_k() * spec.intermediate() / vec).div_ceil(32);
    let cap = if vec >= 32 { 8 } else { 4 };
    (1..=cap).rev().find(|c| dn_vpl % c == 0 && 2 * c > cap).unwrap_or(dn_vpl.min(cap))
}

/// Hidden outputs per down item (`dn_rows`): 2 where the hidden size is even, else 1.
///
/// Why: every down warp reads its token's whole intermediate, and each read then serves two rows
/// of w2, halving those reads (faster at M >= 2); four rows were no better than two. The one-token
/// `moe_down_stash` keeps one row per item whatever this says.
pub fn down_rows(spec: &MoeSpec) -> u32 {
    if spec.hidden() % 2 == 0 {
        2
    } else {
        1
    }
}

/// Lanes sharing a w13 row in the multi-token gate_up kernels (`gu_lanes`): 16 for the 4-bit
/// formats, 32 for the others.
///
/// Why: a 4-bit row has few vectors per lane, so half a warp per row doubles the loads in flight
/// per lane (a warp serves two neurons of one expert at once); wider formats have enough per lane
/// already and gain nothing. The one-token kernel always gives a row the whole warp (16 lanes
/// were slower there for every format).
pub fn gate_up_lanes(spec: &MoeSpec) -> u32 {
    if spec.weight_format().elems_per_16b() >= 32 {
        16
    } else {
        32
    }
}

/// Whether the one-token gate_up loads each warp's first unit before the block has built its
/// routing tables (`gu_early`): for the e4m3 codes only.
///
/// Why: the warp's first weights are then in flight while the block builds the tables and stages
/// the activations. That was faster for the e4m3 codes (per-channel fp8 most) and slightly slower
/// for the integer codes.
pub fn gate_up_early(spec: &MoeSpec) -> bool {
    spec.weight_format().codec() == Codec::E4m3
}

/// Whether one-token steps take the bulk kernels `(gate_up, down)` by default: the bulk down for
/// every quantized format (8 bits or fewer: 16 or more weights per 16-byte vector), the bulk
/// gate_up beside it for the 4-bit formats; neither for 16-bit weights, which keep the
/// register-fed pair.
///
/// Why: a one-token step's share of the weights per SM is small enough for one producer warp to
/// put most of it in flight at once through bulk copies, where register-fed warps stall on every
/// refill, and the bulk down loads its w2 before gate_up has finished. Those were the
/// combinations that ran faster: the bulk gate_up made the 8-bit formats slower.
pub fn bulk_kernels(spec: &MoeSpec) -> (bool, bool) {
    let vec = spec.weight_format().elems_per_16b();
    (vec >= 32, vec >= 16)
}

/// Sets each bulk ring of `tiles` to as many stages (up to 8) as fit [`BULK_SMEM_BUDGET`] with
/// its consumer warps, else to one; false if one stage needs more than [`BULK_SMEM_MAX`] (or the
/// tiles do not divide the spec). Deeper rings keep more of a block's share of the step in flight.
pub fn fit_bulk_stages(tiles: &mut DecodeTiles, spec: &MoeSpec) -> bool {
    if !tiles.bulk_tiles_divide(spec) {
        return false;
    }
    let fit = |t: &mut DecodeTiles, gu: bool| {
        for n in (1..=8).rev() {
            if gu {
                t.bulk_gu_stages = n;
            } else {
                t.bulk_dn_stages = n;
            }
            let (g, d) = bulk_smem_bytes(spec, t);
            let bytes = if gu { g } else { d };
            if bytes <= BULK_SMEM_BUDGET || (n == 1 && bytes <= BULK_SMEM_MAX) {
                return true;
            }
        }
        false
    };
    fit(tiles, true) & fit(tiles, false)
}

/// The token tile a step of `m` tokens takes: the smallest of [`TOKEN_TILES`] that covers it (the
/// largest past it). Covering the step in one pass reads each row once; a larger tile than needed
/// would only hold idle accumulators.
pub fn token_tile(m: u32) -> u32 {
    TOKEN_TILES.into_iter().find(|&t| t >= m).unwrap_or(TOKEN_TILES[TOKEN_TILES.len() - 1])
}

/// The grouped-GEMM family's default tiles for a spec on an arch (what `GemmTiles::for_spec`
/// returns). Rows per tile are always 128 (`bm`) and one block runs per SM.
///
/// sm_90a (wgmma): the warp-specialised pipeline with 4 stages. GEMM1 takes 256 columns (128
/// neurons, gate and up) where the intermediate size divides, GEMM2 256 hidden outputs where the
/// hidden size does, else the next power of two down: wide tiles move the fewest bytes from L2
/// per FLOP (for bf16 / fp16, 128 x 256 beat 128 x 128 already on the block-barrier pipeline).
/// fp8 reduces each k-tile into a second accumulator to scale it, so its 256-wide tiles are
/// multiplied in two halves of 128 (`gemm_ws.cuh`): 128 x 128 tiles would move as many bytes from
/// L2 per FLOP as bf16's 128 x 256, at twice the rate. [`gemm_cluster`] and [`gemm_tail`] pick the
/// cluster size and the extended items.
///
/// Other archs (mma.sync, block barrier per k-tile): 128 by 128 tiles (64 where the geometry
/// does not divide), 4 stages, 3 on sm_120a (99 KiB of shared memory per block).
pub fn gemm_tiles(spec: &MoeSpec, arch: Arch) -> GemmTiles {
    let (h, i) = (spec.hidden(), spec.intermediate());
    // Weights decoded by the loader take the mma.sync pipeline on every arch.
    if arch == Arch::Sm90a && !crate::grouped::decodes_weights(spec) {
        let (bn1, bn2) = if quantizes_activations(spec) {
            (2 * widest(i, &[128, 64, 32]), widest(h, &[256, 128, 64]))
        } else {
            (2 * widest_step(i, 8, 32, 128), widest_step(h, 16, 64, 256))
        };
        return GemmTiles {
            bm: 128,
            bn1,
            bn2,
            stages: 4,
            blocks_per_sm: 1,
            mma: Mma::Wgmma,
            warp_specialized: true,
            cluster: gemm_cluster(spec, bn1, bn2),
            lag: 0,
            tail: gemm_tail(spec),
        };
    }
    if let Some(bits) = crate::grouped::wq_bits(spec) {
        return wq_tiles(bits, arch);
    }
    GemmTiles {
        bm: 128,
        bn1: 2 * widest(i, &[64, 32]),
        bn2: widest(h, &[128, 64]),
        stages: if arch == Arch::Sm120a { 3 } else { 4 },
        blocks_per_sm: 1,
        mma: Mma::MmaSync,
        warp_specialized: false,
        cluster: 1,
        lag: 0,
        tail: 0,
    }
}

/// The grouped family's tiles for large steps, where they are not [`gemm_tiles`]'s: weights the
/// grouped family decodes, on sm_90a, take the warp-specialised wgmma pipeline whose producer
/// warpgroup decodes them into the stages (`gemm_wsq.cuh`) from [`large_step_tokens`] on: 128
/// rows per tile, 128 neurons (256 columns of w13) and 256 hidden outputs where they divide, else
/// 96 and 192 (gpt-oss-20b's 2880: 21-29% faster at 1024 and 4096 tokens than 64-wide GEMM2
/// tiles on an H200, docs/prefill-notes.md), three stages (the most that leave room for the ring
/// of packed k-tiles at 256 columns), and GEMM1's extended items where its tiles are 256 wide
/// (an expert's last tile of up to 16 pairs computed with the tile before it: each such tile
/// would cost a whole decode of the expert's weights; Qwen3-30B-A3B under uniform routing on an
/// H200, 4-10% faster at 2048 tokens and 4-7% at 4096, docs/prefill-notes.md).
///
/// Why: there every expert fills most of a 128-row tile, and each weight decoded once per tile
/// feeds wgmma rather than the decoding warps' own `mma.sync`. Qwen3-30B-A3B at M = 1024, 2048
/// and 4096 (H100, one run, us, these tiles against the mma.sync ones): mxfp4 467 / 685 / 1191
/// against 498 / 855 / 1491, int8 406 / 613 / 1017 against 615 / 988 / 1688 (docs/prefill-notes.md).
pub fn large_step_tiles(spec: &MoeSpec, arch: Arch) -> Option<GemmTiles> {
    if arch != Arch::Sm90a || !crate::grouped::decodes_weights(spec) {
        return None;
    }
    let (h, i) = (spec.hidden(), spec.intermediate());
    let bn1 = 2 * widest(i, &[128, 96, 64]);
    let t = GemmTiles {
        bm: 128,
        bn1,
        bn2: widest(h, &[256, 192, 128, 64]),
        stages: 3,
        blocks_per_sm: 1,
        mma: Mma::Wgmma,
        warp_specialized: true,
        cluster: 1,
        lag: 0,
        // Extended items where GEMM1's tiles are 256 wide (the pipeline's condition).
        tail: if bn1 == 256 { 16 } else { 0 },
    };
    (t.check(spec, arch).is_ok() && t.fits(spec, arch)).then_some(t)
}

/// The step size from which [`large_step_tiles`] run: 64 (token, slot) pairs per expert on
/// average, half a 128-row tile (Qwen3-30B-A3B: 1024 tokens).
///
/// Why: with fewer, most of each tile is padding, and the 64-token mma.sync tiles are faster
/// (mxfp4, Qwen3-30B-A3B at M = 256 on an H100: 508 us with these tiles in their first build,
/// 217 us for the mma.sync ones in the last prefill report); at 1024 the large tiles led for
/// every format measured.
pub fn large_step_tokens(spec: &MoeSpec) -> usize {
    (64 * spec.experts() as usize).div_ceil(spec.top_k() as usize)
}

/// The mixed-input GEMMs' tiles (weights decoded in registers, `gemm_wq.cuh`): 64 tokens per
/// tile, 128 weight rows (64 neurons' gate and up rows; 128 hidden outputs, the last block 64
/// where the hidden size is an odd multiple of 64), and as many stages as leave two blocks per SM
/// (one on sm_120a, whose 99 KiB hold one), at most 8.
///
/// Why: at serving batch sizes these GEMMs stream packed weights and are bound by the issue of
/// their decode and bookkeeping; 64-token tiles leave room for two blocks per SM (16 warps to
/// hide each other's latencies) with stages of 64 bytes per weight row. 128 rows put each of the
/// eight warps on its own 16 rows: 64-row tiles split a tile's tokens over two warps, which then
/// both decode the same weights, or one of them idles at 32 tokens or fewer.
fn wq_tiles(bits: u32, arch: Arch) -> GemmTiles {
    let (bm, bn1, bn2) = (64, 128, 128);
    let (block, sm) = crate::grouped::smem_limits(arch);
    let blocks_per_sm = if arch == Arch::Sm120a { 1 } else { 2 };
    let stage = crate::grouped::wq_stage_bytes(bm, bn1.max(bn2), bits);
    // The runtime reserves 1 KiB per resident block.
    let stages = (2..=8).rev().find(|s| {
        let need = s * (stage + 16) + 128;
        need <= block && (need + 1024) * blocks_per_sm <= sm
    });
    GemmTiles {
        bm,
        bn1,
        bn2,
        stages: stages.unwrap_or(2),
        blocks_per_sm,
        mma: Mma::MmaSync,
        warp_specialized: false,
        cluster: 1,
        lag: 0,
        tail: 0,
    }
}

/// The widest multiple of `step` from `least` to `most` that divides `n`, else 64 (which the
/// family's check then refuses where it does not divide).
///
/// Why: 16-bit weights on the warp-specialised pipeline take any multiple of 16 columns
/// (`GemmTiles::takes_any_width`), and wide tiles move the fewest bytes from L2 per FLOP where the
/// sizes are not powers of two: gpt-oss-20b (hidden and intermediate 2880) took 128 x 64 tiles
/// before, 240 x 240 now (docs/prefill-notes.md, "Column tiles that are not powers of two").
fn widest_step(n: u32, step: u32, least: u32, most: u32) -> u32 {
    (least / step..=most / step).rev().map(|w| step * w).find(|&w| n % w == 0).unwrap_or(64)
}

/// The first of `options` that divides `n`, else 64.
fn widest(n: u32, options: &[u32]) -> u32 {
    options.iter().copied().find(|&w| n % w == 0).unwrap_or(64)
}

/// Blocks per cluster of the warp-specialised pipeline with column tiles `bn1` / `bn2`: 2 where
/// every work item is long (at least 32 k-tiles of 128 bytes in both GEMMs) and both GEMMs have an
/// even number of column blocks (a cluster splits an expert's odd tile by column blocks), else 1.
///
/// Why: a pair of blocks reads each weight tile from L2 once for two row tiles, but each stage
/// then waits for both blocks' consumers and every item is handed over between them; long items
/// amortise that lockstep (Mixtral-8x7B gains), short ones do not (Qwen3-30B-A3B, 6-32 k-tiles
/// per item, loses).
pub fn gemm_cluster(spec: &MoeSpec, bn1: u32, bn2: u32) -> u32 {
    let (h, i) = (spec.hidden(), spec.intermediate());
    let elem = if quantizes_activations(spec) { 1 } else { 2 };
    let long_items = h * elem / 128 >= 32 && i * elem / 128 >= 32;
    let even = (i / (bn1 / 2)) % 2 == 0 && (h / bn2) % 2 == 0;
    if long_items && even {
        2
    } else {
        1
    }
}

/// GEMM1's extended items on sm_90a (`tail`): 16 for the 16-bit formats, 0 (off) for fp8, where
/// they remain an option (`GemmTiles::parse`).
///
/// Why: folding an expert's short last tile into its previous one reads that weight column once
/// rather than twice, which is faster for bf16 / fp16; fp8 GEMM1's e4m3 epilogue already sits at
/// the register limit and spills with the extra accumulators.
pub fn gemm_tail(spec: &MoeSpec) -> u32 {
    if quantizes_activations(spec) {
        0
    } else {
        16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::WeightFormat;
    use crate::spec::REFERENCE_GEOMETRIES;

    /// Every decoded format on every reference geometry has large-step tiles on sm_90a that the
    /// family accepts, fit and render; formats the tensor cores take as stored, and the other
    /// archs, have none.
    #[test]
    fn large_step_tiles_exist_where_the_producer_decodes() {
        for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
            for f in WeightFormat::ALL {
                let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
                if crate::grouped_support(&s).is_err() {
                    continue;
                }
                let t = large_step_tiles(&s, Arch::Sm90a);
                assert_eq!(t.is_some(), crate::grouped::decodes_weights(&s), "{geo} {f}");
                if let Some(t) = t {
                    assert!(t.warp_specialized && t.mma == Mma::Wgmma && t.bm == 128, "{geo} {f}: {t:?}");
                    assert!(t.pack_ring(&s) >= 2 && t.fits(&s, Arch::Sm90a), "{geo} {f}: {t:?}");
                    // Extended items wherever GEMM1's tiles are 256 wide (not gpt-oss-20b's 192).
                    assert_eq!(t.extended_rows(&s), if t.bn1 == 256 { 16 } else { 0 }, "{geo} {f}: {t:?}");
                    let ext2 = if t.bn1 == 256 && t.bn2 == 256 { 16 } else { 0 };
                    assert_eq!(t.gemm2_extended_rows(&s), ext2, "{geo} {f}: GEMM2 extends GEMM1's items");
                    crate::render_grouped(&s, Arch::Sm90a, t).unwrap();
                }
                assert!(large_step_tiles(&s, Arch::Sm100a).is_none() && large_step_tiles(&s, Arch::Sm120a).is_none());
            }
        }
        let qwen3 = |f| MoeSpec::builder(2048, 768, 128, 8).weight_format(f).build().unwrap();
        assert_eq!(large_step_tokens(&qwen3(WeightFormat::Mxfp4)), 1024);
        // The ring: 8 KiB slots of 4-bit k-tiles at 256 columns, three, so that GEMM1's stages with
        // the extended rows stay within the carve-out that keeps L1 (four without them); three
        // of 16 KiB for 8-bit, past it either way.
        let tiles = |f| large_step_tiles(&qwen3(f), Arch::Sm90a).unwrap();
        let ring = |f| tiles(f).pack_ring(&qwen3(f));
        assert_eq!((ring(WeightFormat::Mxfp4), ring(WeightFormat::Nvfp4), ring(WeightFormat::Int8)), (3, 3, 3));
        for f in [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Int4G128] {
            let t = tiles(f);
            assert!(
                t.gemm1_smem_bytes(&qwen3(f)).max(t.gemm2_smem_bytes(&qwen3(f))) <= crate::grouped::L1_KEEPING_SMEM
            );
            assert_eq!(
                GemmTiles { tail: 0, ..t }.pack_ring(&qwen3(f)),
                if f == WeightFormat::Nvfp4 { 3 } else { 4 },
                "{f}"
            );
        }
        let int8 = tiles(WeightFormat::Int8);
        assert!(int8.gemm1_smem_bytes(&qwen3(WeightFormat::Int8)) > crate::grouped::L1_KEEPING_SMEM);
    }

    #[test]
    fn short_tiles_spread_over_two_but_for_8_bit_codes_in_32_code_groups() {
        for (f, want) in [
            (WeightFormat::Bf16, 2),
            (WeightFormat::Mxfp4, 2),
            (WeightFormat::Int8, 2),
            (WeightFormat::Int8G64, 2),
            (WeightFormat::Mxfp8, 1),
            (WeightFormat::Int8G32, 1),
        ] {
            let s = MoeSpec::builder(2048, 768, 128, 8).weight_format(f).build().unwrap();
            assert_eq!(ext_spread(&s), want, "{f}");
        }
    }

    /// 16-bit weights on sm_90a take the widest column tiles that divide (any multiple of 16),
    /// fp8 the powers of two; each of these defaults fits and passes the family's check.
    #[test]
    fn sixteen_bit_weights_take_the_widest_dividing_columns() {
        let tiles = |h, i, f| {
            let s = MoeSpec::builder(h, i, 32, 4).weight_format(f).build().unwrap();
            let t = gemm_tiles(&s, Arch::Sm90a);
            assert!(t.fits(&s, Arch::Sm90a), "{h} {i} {f}: {t:?}");
            t.check(&s, Arch::Sm90a).unwrap_or_else(|e| panic!("{h} {i} {f}: {t:?}: {e}"));
            (t.bn1, t.bn2)
        };
        assert_eq!(tiles(2880, 2880, WeightFormat::Bf16), (240, 240));
        assert_eq!(tiles(2880, 2880, WeightFormat::Fp16), (240, 240));
        assert_eq!(tiles(2048, 768, WeightFormat::Bf16), (256, 256));
        assert_eq!(tiles(960, 960, WeightFormat::Bf16), (240, 240));
        assert_eq!(tiles(2048, 1408, WeightFormat::Bf16), (256, 256));
        assert_eq!(tiles(2048, 768, WeightFormat::Fp8E4m3), (256, 256));
        assert_eq!((widest_step(2880, 16, 64, 256), widest_step(2880, 8, 32, 128)), (240, 120));
        assert_eq!(widest_step(1000, 16, 64, 256), 64, "none divides: the check refuses it");
    }
}
