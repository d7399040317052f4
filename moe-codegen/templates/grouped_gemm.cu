// moeforge grouped GEMM (prefill): {{ name }}
// route -> align -> [quantize x] -> GEMM1 (w13, SwiGLU in the epilogue) -> [quantize mid]
//       -> GEMM2 (w2; combine by atomics, routing weight in the epilogue, or by rows, weight in
//          the gather-reduce) -> y.
// Tokens are regrouped by expert into tiles of BM rows (align.cuh); a tile never mixes experts,
// so each block's B operand is one expert's weights.
#define MOE_WGMMA {{ wgmma }}
#define MOE_WS {{ ws }}  // warp-specialised GEMMs (gemm_ws.cuh)
{% include "common.cuh" %}
{% include "activation.cuh" %}

typedef {{ act_type }} act_t;
constexpr int HIDDEN = {{ hidden }};
constexpr int INTER = {{ intermediate }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
// Per-expert biases (f32): w13_bias [E, 2I] added to GEMM1's gate / up columns before the
// activation; w2_bias [E, H] added by the combine (moe_combine_rows / moe_convert) under each
// pair's routing weight, since sum_s w_s (W2_e mid + b_e) = GEMM2's sum + sum_s w_s b_e.
constexpr bool HAS_BIAS = {{ bias }};
constexpr int BM = {{ bm }};           // rows (token, slot pairs) per tile
constexpr int BN1 = {{ bn1 }};         // GEMM1 columns per tile: BN1 / 2 gate and BN1 / 2 up rows
constexpr int BN2 = {{ bn2 }};         // GEMM2 columns (hidden outputs) per tile
constexpr int STAGES = {{ stages }};   // shared-memory pipeline depth
constexpr int MIN_BLOCKS = {{ blocks_per_sm }};  // GEMM blocks resident per SM (launch bounds)
constexpr int ELEM_BYTES = {{ elem_bytes }};  // GEMM operand bytes: 2 (bf16 / fp16) or 1 (e4m3)
constexpr bool FP8 = ELEM_BYTES == 1;
// Weight scales: 0 none, 1 one f32 per output row, 2 one f32 per 128 x 128 block.
constexpr int WSCALE = {{ wscale }};
constexpr int KT1 = HIDDEN * ELEM_BYTES / 128;  // k-tiles of GEMM1 (K = hidden)
constexpr int KT2 = INTER * ELEM_BYTES / 128;   // k-tiles of GEMM2 (K = intermediate)
static_assert(HIDDEN * ELEM_BYTES % 128 == 0 && INTER * ELEM_BYTES % 128 == 0, "whole k-tiles");
// fp8 on the warp-specialised pipeline with 128 intermediate columns per GEMM1 tile: GEMM1's
// epilogue quantizes them itself (one 128-column block per row), so mid is written once, in e4m3.
constexpr bool MID_FP8 = {{ mid_fp8 }};
// fp8 with per-channel weight scales: x takes one scale per token (over all of K), written per
// sorted row; GEMM1's scales then do not change along K, so it accumulates the whole of K in
// the MMAs' accumulator and scales the sums once, in its epilogue (no per-k-tile promotion).
constexpr bool X_PER_ROW = {{ x_per_row }};
static_assert(!X_PER_ROW || (FP8 && WSCALE == 1), "per-token activation scales go with per-channel weights");
// Weights decoded in registers (gemm_wq.cuh) pair each 32-bit word's codes p and p + G / 2: GEMM1
// reads x, and GEMM2 the intermediate, stored in that order within each G columns (moe_prepare
// copies x so), so that a thread's activations load straight into its B fragments.
constexpr int X_PAIR_GROUP = {{ x_pair_group }};  // G, or 0: x as given
constexpr bool X_PAIRED = X_PAIR_GROUP > 0;
// GEMM2's last column tile may hold fewer rows on the mixed-input mma.sync GEMM (gemm_wq.cuh).
static_assert(INTER % (BN1 / 2) == 0 && (HIDDEN % BN2 == 0 || (X_PAIRED && !MOE_WS)), "whole column tiles");
// Weights decoded on the warp-specialised pipeline (gemm_wsq.cuh): the producer warpgroup's
// ring of PACK_RING slots of packed k-tiles, PACK_BITS-bit codes; 0 where the TMA loads B as is.
#define MOE_WS_DECODE ({{ pack_ring }} > 0)
constexpr int PACK_RING = {{ pack_ring }};
constexpr int PACK_BITS = {{ pack_bits }};
constexpr bool WS_DECODE = MOE_WS_DECODE;
// A B k-tile's bytes per weight row in the stage's source (packed, or 128 of K) and its step in
// the tensor map's K coordinate (bytes, or elements).
constexpr int B_ROW_BYTES = WS_DECODE ? 8 * PACK_BITS : 128;
constexpr int B_KT_STEP = WS_DECODE ? 8 * PACK_BITS : 128 / ELEM_BYTES;
// The warp-specialised epilogues scale columns from the consumers' `cols`: per-channel fp8 and
// the decoded formats with per-row scales (the scale times the decode's unit; for the others the
// unit alone, a constant: MOE_COL_UNIT).
constexpr bool WQ_COLS = {{ wq_cols }};
constexpr bool COLS = WSCALE == 1 || (WS_DECODE && WQ_COLS);
static_assert(!X_PAIRED || (HIDDEN % 8 == 0 && 8 % X_PAIR_GROUP == 0), "whole groups per 16-byte chunk of x");
// Where column n is stored in a paired row.
__device__ __forceinline__ int x_pair_col(int n) {
    constexpr int G = X_PAIRED ? X_PAIR_GROUP : 2;  // (G = 2 leaves n in place)
    const int e = n % G;
    return n - e + 2 * (e % (G / 2)) + e / (G / 2);
}
// Eight 16-bit columns (a 16-byte chunk, whole groups) in paired order.
__device__ __forceinline__ uint4 x_pair_chunk(uint4 v) {
    if constexpr (X_PAIR_GROUP == 8)  // (0, 4), (1, 5), (2, 6), (3, 7)
        return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                          __byte_perm(v.y, v.w, 0x7632));
    else  // groups of 4: (0, 2), (1, 3)
        return make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410),
                          __byte_perm(v.z, v.w, 0x7632));
}
static_assert(!MID_FP8 || (FP8 && MOE_WS && BN1 == 256), "a whole 128-column block per GEMM1 tile");
constexpr int NT1 = INTER / (BN1 / 2);
constexpr int NT2 = (HIDDEN + BN2 - 1) / BN2;
constexpr int ELEMWISE_THREADS = 256;
constexpr int GEMM_THREADS = MOE_WS ? 384 : 256;
constexpr int CLUSTER = {{ cluster }};  // blocks per cluster: its row tiles share the weight tile (gemm_ws.cuh)
constexpr int WG_LAG = {{ lag }};  // k-tiles consumer warpgroup 1 trails warpgroup 0 by (gemm_ws.cuh)
constexpr int GROUP_TILES = {{ group_tiles }};  // tiles of an expert side by side (work_item)
constexpr int HOT_TILES = {{ hot_tiles }};  // experts with this many tiles or more lead the layout (align.cuh)
// GEMM1 computes an expert's short last tile with the tiles before it (extended items, Work and
// gemm_ws.cuh): that tile would cost a whole weight column for a few pairs.
constexpr int TAIL = {{ tail }};
constexpr int EXT_SPREAD = {{ ext_spread }};  // the most tiles a short tile's rows spread over (Work)
static_assert(TAIL == 0 || (MOE_WS && CLUSTER == 1), "extended items on the warp-specialised pipeline, no clusters");
// GEMM2's deterministic kernel takes the same extended items where the producer decodes its
// weights (GemmTiles::gemm2_extended_rows), numbered as GEMM1's tiles (tile_span1).
constexpr int TAIL2 = {{ tail2 }};
static_assert(TAIL2 == 0 || (TAIL2 == TAIL && WS_DECODE && BN2 == 256), "GEMM2's extended items are GEMM1's");
// The host's dynamic shared memory per block, computed once by the renderer (GemmTiles::
// gemm1_smem_bytes / gemm2_smem_bytes, prepare_smem_bytes): checked against the layouts below.
constexpr int HOST_GEMM1_SMEM = {{ gemm1_smem }};
constexpr int HOST_GEMM2_SMEM = {{ gemm2_smem }};
constexpr int HOST_PREPARE_SMEM = {{ prepare_smem }};
// A CUtensorMap (cuTensorMapEncodeTiled on the host), passed inside a kernel's __grid_constant__
// parameter struct and read in place there.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};
// The dispatcher's cost planes (moe_codegen::params::DispatchPlanes), read by moe_choose and by a
// one-block moe_prepare.
struct DispatchPlanes {
    float decode[3], grouped[3], fused[3];  // c0, per distinct expert, per pair (us)
    int fused_on, decode_on;
};

// Every kernel's parameter struct (moe_codegen::params: one declaration for Rust and C).
{{ params }}

// One activation into shared memory (the extended rows' staging).
__device__ __forceinline__ void sts_act(unsigned addr, act_t v) {
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(*reinterpret_cast<const unsigned short*>(&v)) : "memory");
}
// Two adjacent activations, rounded to act_t, in one 4-byte store.
__device__ __forceinline__ void store_pair(act_t* dst, float a, float b) {
    const act_t pair[2] = {(act_t)a, (act_t)b};
    *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(pair);
}

{% include "router.cuh" %}
{% include "align.cuh" %}
{% include "gemm_tile.cuh" %}
{%- if let Some(fmt) = fmt %}
{% include "dequant.cuh" %}
using W13M = WMat<HIDDEN, 2 * INTER, EXPERTS>;  // w13 [E, 2I, H]
using W2M = WMat<INTER, HIDDEN, EXPERTS>;        // w2 [E, H, I]
{%- endif %}
{% if ws == 1 %}{% include "mbarrier.cuh" %}{% include "gemm_ws.cuh" %}{% endif %}
{%- if ws == 1 %}{% if let Some(fmt) = fmt %}
{% include "wq_decode.cuh" %}
{% include "gemm_wsq.cuh" %}
static_assert(WQ_COLS == (WQ_SCALE_IN_EPILOGUE || {{ fmt.scales == "row" || fmt.scales == "nvfp4" }}),
              "cols wherever wq_row_scale is not one constant");
{%- endif %}{% endif %}

extern __shared__ char smem[];  // the GEMM stages (TileShape::SMEM_BYTES)
#if MOE_WS
static_assert(ws_smem_bytes<BN1, TAIL>() == HOST_GEMM1_SMEM && ws_smem_bytes<BN2, TAIL2>() == HOST_GEMM2_SMEM,
              "the GEMMs' dynamic shared memory (GemmTiles::gemm1_smem_bytes, gemm2_smem_bytes)");
#elif !{{ fmt.is_some() }}
static_assert(TileShape<BN1>::SMEM_BYTES == HOST_GEMM1_SMEM && TileShape<BN2>::SMEM_BYTES == HOST_GEMM2_SMEM,
              "the GEMMs' dynamic shared memory (GemmTiles::gemm1_smem_bytes, gemm2_smem_bytes)");
#endif

{% include "quant.cuh" %}

{% include "choose.cuh" %}
{% include "prepare.cuh" %}

// Work item w of a GEMM with nt column blocks -> the row tile of cluster rank `rank`, its column
// block and expert. Each row tile holds nt / CLUSTER items. An expert's items run
// column-block-major over groups of up to GROUP_TILES of its tiles, so the blocks of a wave share
// each weight tile (and each row tile) through L2 rather than streaming the expert's weights once
// per row tile. In clusters of two, a pair of the group's tiles shares each column block's weight
// tile (multicast: it leaves L2 once per pair); a group's odd last tile is split by column blocks
// instead (each block loads its own weights), so experts pad to whole tiles, not to pairs.
// The layout puts the hot experts' tiles (HOT_TILES or more) first; the counter's order deals
// their items and the cold experts' evenly into each other, so that the cold items (a tile or two
// against a whole weight column: DRAM-bound) run beside hot ones (tensor-bound) rather than all
// together. tile_span[tile] = (first tile, tiles, expert, pairs) of its expert; counts = num_tiles =
// (tiles, hot tiles), loaded once per kernel: an item resolves with one dependent load, which
// also gives the rows of its tile that hold pairs (the rest close the expert's last tile). With
// TAIL, GEMM1 numbers its own tiles (tile_span1, num_tiles[2, 3]: an extended tile counts once)
// and the spans' expert carries the layout's tile minus GEMM1's in its high 16 bits.
//
// Extended items: an expert's short last tile of r pairs joins the n tiles before it where
// r <= TAIL min(n, EXT_SPREAD), TAIL rows each. The d-th tile before the short one takes its rows
// TAIL d .. TAIL d + TAIL - 1 (those past r are padding, which no store reaches), so that uniform
// routing, whose experts end a few dozen pairs past a tile as often as a few, pays a whole weight
// pass (one decode, where the producer decodes) for a short tile less often.
struct Work {
    int tile;  // in the layout (sorted_rows)
    short nblk, e;
    unsigned char rows;  // rows 0 .. rows - 1 of the tile hold pairs
    bool multicast;      // the cluster's blocks take two row tiles of one column block
    bool ext;            // extended (TAIL): also rows of its expert's short last tile
    unsigned char ext_d;  // and which: the tiles between it and the short one (d)
};
static_assert(sizeof(Work) == 12, "a stage's item and its flag in one 16-byte slot (StageItem)");
// The layout row of an item's row r: its tile's, or past BM an extended item's rows of its
// expert's short tile (in int: in long, the decoding producers of 8-bit codes spilled more).
// A spread of one keeps the arithmetic the kernels had before there were spreads (ext_spread).
__device__ __forceinline__ int layout_row(const Work& it, int r) {
    // Past BM: (tile + 1 + d) BM + TAIL d + (r - BM).
    if constexpr (EXT_SPREAD == 1) return it.tile * BM + r;
    else return it.tile * BM + r + (r < BM ? 0 : it.ext_d * (BM + TAIL));
}
// The layout row of an extended item's first row past BM.
__device__ __forceinline__ long ext_row0(const Work& it) {
    if constexpr (EXT_SPREAD == 1) return (long)(it.tile + 1) * BM;
    else return (long)(it.tile + 1 + it.ext_d) * BM + TAIL * it.ext_d;
}
static_assert(GROUP_TILES % CLUSTER == 0, "only an expert's last group may hold an odd tile");
static_assert(BM <= 255, "a tile's live rows in Work::rows");
static_assert(EXT_SPREAD >= 1 && EXT_SPREAD <= 256, "an extended item's d in Work::ext_d");
__device__ __forceinline__ Work work_item(int w, int nt, const int4* __restrict__ tile_span, int2 counts, int rank = 0) {
    const int per_tile = nt / CLUSTER;
    const long long hot = (long long)counts.y * per_tile, all = (long long)counts.x * per_tile;
    if (hot > 0 && hot < all) {
        // Of the first w items, hot_before are hot; item w is hot if the count steps past it.
        const long long hot_before = w * hot / all;
        w = (w + 1) * hot / all > hot_before ? (int)hot_before : (int)(hot + w - hot_before);
    }
    const int4 sp = tile_span[w / per_tile];
    const int l = w - sp.x * per_tile;
    const int g = l / (GROUP_TILES * per_tile);
    const int gs = min(GROUP_TILES, sp.y - g * GROUP_TILES);
    const int r = l - g * GROUP_TILES * per_tile;
    const int t0 = sp.x + g * GROUP_TILES;
    auto at = [&](int tile, int nblk, bool multicast) {
        const int rest = sp.w - (tile - sp.x) * BM;  // pairs from this tile on
        // Extended: the expert's pairs past its counted tiles (only GEMM1's numbering leaves any)
        // reach this tile's TAIL rows of them, d tiles before the short one.
        const int d = sp.x + sp.y - 1 - tile;
        const bool ext = TAIL > 0 && (EXT_SPREAD == 1 ? d == 0 && rest > BM : rest > BM + d * (BM + TAIL));
        return Work{tile + (sp.z >> 16), (short)nblk, (short)(sp.z & 0xffff), (unsigned char)max(0, min(BM, rest)),
                    multicast, ext, (unsigned char)(EXT_SPREAD > 1 ? d : 0)};
    };
    if (CLUSTER == 1) return at(t0 + r % gs, r / gs, false);
    // Per pair of column blocks r / gs: the gs / 2 tile pairs of the first, then of the second,
    // then the odd tile (if any) with one column block per block.
    const int j = r % gs, pairs = gs / 2;
    if (j < 2 * pairs) return at(t0 + 2 * (j % pairs) + rank, 2 * (r / gs) + j / pairs, true);
    return at(t0 + gs - 1, 2 * (r / gs) + rank, false);
}
__device__ __forceinline__ int2 tile_counts(const int* __restrict__ num_tiles) {
    return make_int2(num_tiles[0], num_tiles[1]);
}

// SwiGLU of one thread's pair of adjacent neurons n, n + 1 in row `row` of mid.
__device__ __forceinline__ void store_mid(act_t* __restrict__ mid, int row, int n, int e, const float* g, const float* u,
                                          const float* __restrict__ w13_scales, const float* __restrict__ w13_bias) {
    float sg0 = 1.f, sg1 = 1.f, su0 = 1.f, su1 = 1.f;
    if (WSCALE == 1) {
        const float* s = w13_scales + (long)e * 2 * INTER;
        sg0 = s[n], sg1 = s[n + 1], su0 = s[INTER + n], su1 = s[INTER + n + 1];
    }
    float bg0 = 0.f, bg1 = 0.f, bu0 = 0.f, bu1 = 0.f;
    if constexpr (HAS_BIAS) {
        const float* b = w13_bias + (long)e * 2 * INTER;
        bg0 = b[n], bg1 = b[n + 1], bu0 = b[INTER + n], bu1 = b[INTER + n + 1];
    }
    store_pair(mid + (long)row * INTER + n, moe_glu(g[0] * sg0 + bg0, u[0] * su0 + bu0),
               moe_glu(g[1] * sg1 + bg1, u[1] * su1 + bu1));
}

// A consumer thread's per-channel scales (cols, WSCALE 1) of its columns 8 q + 2 (lane % 4) + 0, 1
// of the tile (fragment q); 1 without them.
#if MOE_WS_DECODE
#define MOE_COL_UNIT WQ_UNIT
#else
#define MOE_COL_UNIT 1.f
#endif
__device__ __forceinline__ float2 col_scale(const float* cols, int lane, int q) {
    return COLS ? *reinterpret_cast<const float2*>(cols + 8 * q + 2 * (lane % 4)) : make_float2(MOE_COL_UNIT, MOE_COL_UNIT);
}
// col_scale of fragments 0 .. N - 1, in registers before an epilogue's shared-memory stores, behind
// which each load would otherwise wait (the stores' asm clobbers memory) and stall its multiplies.
template <int N>
struct ThreadCols {
    float2 v[N];
};
template <int N>
__device__ __forceinline__ ThreadCols<N> thread_cols(const float* cols, int lane) {
    ThreadCols<N> c;
#pragma unroll
    for (int q = 0; q < N; ++q) c.v[q] = col_scale(cols, lane, q);
    return c;
}

// The SwiGLU of a thread's neurons n, n + 1 of the tile's gate columns (gate in fragment q, up
// in q + NQ) in row h, rounded to act_t; g and u: the gate and up column scales (col_scale), xs
// the row's activation scale (X_PER_ROW).
// FTZ: through moe_glu_ftz (the same values). bcol: the biases of the tile's gate neurons (its
// up neurons' INTER further), read where HAS_BIAS.
template <int NQ, bool FTZ = false>
__device__ __forceinline__ float2 swiglu_pair(const float* acc, int q, int h, float2 g, float2 u, float xs,
                                              const float* __restrict__ bcol) {
    const float2 sg = make_float2(g.x * xs, g.y * xs), su = make_float2(u.x * xs, u.y * xs);
    float2 bg = make_float2(0.f, 0.f), bu = bg;
    if constexpr (HAS_BIAS) {
        const int c = 8 * q + 2 * (threadIdx.x % 4);  // the columns of col_scale(cols, lane, q)
        bg = __ldg(reinterpret_cast<const float2*>(bcol + c));
        bu = __ldg(reinterpret_cast<const float2*>(bcol + INTER + c));
    }
    auto glu = [](float gv, float uv) { return FTZ ? moe_glu_ftz(gv, uv) : moe_glu(gv, uv); };
    return make_float2((float)(act_t)(glu(acc[q * 4 + 2 * h] * sg.x + bg.x, acc[(q + NQ) * 4 + 2 * h] * su.x + bu.x)),
                       (float)(act_t)(glu(acc[q * 4 + 2 * h + 1] * sg.y + bg.y,
                                          acc[(q + NQ) * 4 + 2 * h + 1] * su.y + bu.y)));
}

// Row r of a warp's 16 (lane / 4 + 8 h) from the lane that holds it: that lane's value x[h].
__device__ __forceinline__ int from_row_owner(const int (&x)[2], int r) {
    const int v0 = __shfl_sync(MOE_FULL_MASK, x[0], 4 * (r % 8)), v1 = __shfl_sync(MOE_FULL_MASK, x[1], 4 * (r % 8));
    return r < 8 ? v0 : v1;
}

// GEMM2's outputs n, n + 1 of row pos (pair p), with the per-channel scale: added, times the
// routing weight, into the f32 token rows y32[t, n] (ATOMIC; zeroed before) or stored to the pair
// rows rows[pos, n] in the activation dtype, which moe_combine_rows weighs and sums per token.
template <bool ATOMIC>
__device__ __forceinline__ void store_out(void* __restrict__ out, int pos, int p, int e, int n, float a0, float a1,
                                          const float* __restrict__ topk_weights, const float* __restrict__ w2_scales) {
    const float rw = ATOMIC ? topk_weights[p] : 1.f;
    float2 v = make_float2(a0 * rw, a1 * rw);
    if (WSCALE == 1) {
        v.x *= w2_scales[(long)e * HIDDEN + n];
        v.y *= w2_scales[(long)e * HIDDEN + n + 1];
    }
    if (ATOMIC) {
        float* dst = static_cast<float*>(out) + (long)(p / TOP_K) * HIDDEN + n;
        asm volatile("red.global.add.v2.f32 [%0], { %1, %2 };" ::"l"(dst), "f"(v.x), "f"(v.y) : "memory");
    } else {
        store_pair(static_cast<act_t*>(out) + (long)pos * HIDDEN + n, v.x, v.y);
    }
}

#if MOE_WS
// The pairs of a consumer thread's two rows of a tile, row0 + lane / 4 + 8 h (-1: padding), and
// (GEMM1 with X_PER_ROW) the rows' activation scales, else 1.
struct RowPairs {
    int p[2];
    float xs[2];
};
__device__ __forceinline__ RowPairs row_pairs(const int* __restrict__ sorted_rows, int tile, int row0, int lane) {
    RowPairs r;
#pragma unroll
    for (int h = 0; h < 2; ++h) r.p[h] = sorted_rows[tile * BM + row0 + lane / 4 + 8 * h], r.xs[h] = 1.f;
    return r;
}
// FP8: a k-tile's activation x weight scales for a consumer thread's two rows and two column blocks.
struct KScales {
    float s[2][2];
};
// acc += part p's partial sums (fragments p * NFH ..) scaled by s[row][column block], the blocks
// BLOCK_COLS columns wide.
template <int NFH, int BLOCK_COLS>
__device__ __forceinline__ void promote_part(const KScales& k, int p, const float* pt, float* acc) {
#pragma unroll
    for (int nf = 0; nf < NFH; ++nf) {
        const int g = p * NFH + nf;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g * 4 + i] += pt[nf * 4 + i] * k.s[i / 2][8 * g / BLOCK_COLS];
    }
}

// GEMM1: mid[pos, n] = act(x_t . gate_n) * (x_t . up_n) for the pair in row pos. B stages hold
// BN1 / 2 gate rows, then the same neurons' up rows (two TMA boxes), so a consumer thread holds
// neuron n's gate in fragment q and its up in fragment q + NF / 2. With TAIL, tile_span is
// tile_span1 (GEMM1's own tiles) and num_tiles[2, 3] count them.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gemm1)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
moe_gemm1(const __grid_constant__ Gemm1Params params) {
    MOE_UNPACK_Gemm1Params(params);
    constexpr bool PROMOTE = FP8 && !X_PER_ROW;
    using S = WsShape<BN1, PROMOTE, TAIL>;
    const int lane = threadIdx.x % 32;
    pdl_wait();  // moe_prepare's layout, x's e4m3 copy
    pdl_launch_dependents();
    const int2 counts = tile_counts(num_tiles + (TAIL > 0 ? 2 : 0));
    auto item = [&](int w, int rank) { return work_item(w, NT1, tile_span, counts, rank); };
    auto a_row = [&](const Work& it, int r) -> const char* {
        const int p = sorted_rows[layout_row(it, r)];
        return p < 0 ? nullptr : (const char*)a + (long)(p / TOP_K) * HIDDEN * ELEM_BYTES;
    };
    // Two boxes, the gate rows then the up rows; a cluster of two sharing the tile multicasts one each.
    auto b_load = [&](const Work& it, int kt, unsigned dst, unsigned bar, int rank) {
        const int row = it.e * 2 * INTER + it.nblk * (BN1 / 2);
        static_assert(2 % CLUSTER == 0, "the two boxes split evenly over the cluster");
        const int step = it.multicast ? CLUSTER : 1;
#pragma unroll
        for (int b = it.multicast ? rank : 0; b < 2; b += step)
            tma_load_tile(dst + b * (BN1 / 2) * B_ROW_BYTES, b_map, kt * B_KT_STEP, row + b * INTER, bar, it.multicast);
    };
    // The global w13 row of the tile's column j: gate rows, then the same neurons' up rows.
    auto w13_row = [&](const Work& it, int j) -> long {
        return (long)it.e * 2 * INTER + it.nblk * (BN1 / 2) + (j < BN1 / 2 ? j : INTER + j - BN1 / 2);
    };
    // k-tile scales: s[h][b] for the thread's row h and the gate (b = 0) or up (1) columns.
    auto kscale = [&](const Work& it, int kt, int row0) {
        KScales k{};
        if constexpr (PROMOTE) {
            const long n = (long)it.e * 2 * INTER + it.nblk * (BN1 / 2);
            const float bg = WSCALE == 2 ? w13_scales[n / 128 * KT1 + kt] : 1.f;
            const float bu = WSCALE == 2 ? w13_scales[(n + INTER) / 128 * KT1 + kt] : 1.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = sorted_rows[it.tile * BM + row0 + lane / 4 + 8 * h];
                const float sa = a_scales[(long)(p < 0 ? 0 : p / TOP_K) * KT1 + kt];
                k.s[h][0] = sa * bg;
                k.s[h][1] = sa * bu;
            }
        }
        return k;
    };
    auto promote = [&](const KScales& k, int p, const float* pt, float* acc) {
        promote_part<S::NFH, BN1 / 2>(k, p, pt, acc);  // the gate columns, then the up ones
    };
    // The thread's rows' pairs (and activation scales), and the tile's gate then up column scales.
    auto prepare = [&](const Work& it, int row0, float* cols) {
        RowPairs ep = row_pairs(sorted_rows, it.tile, row0, lane);
        if constexpr (X_PER_ROW)
#pragma unroll
            for (int h = 0; h < 2; ++h) ep.xs[h] = a_scales[it.tile * BM + row0 + lane / 4 + 8 * h];
#if MOE_WS_DECODE
        if constexpr (COLS) fill_cols<BN1>(cols, [&](int j) { return wq_row_scale<W13M>(w13_scales, w13_row(it, j)); });
#else
        if constexpr (WSCALE == 1)
            stage_cols<BN1>(cols, [&](int j) { return w13_scales + w13_row(it, j); });
#endif
        return ep;
    };
    // Padding rows are not stored: GEMM2 zero-fills its A rows there rather than reading them.
    auto epilogue = [&](const Work& it, const float* acc, int row0, const RowPairs& ep, const float* cols, unsigned buf) {
        constexpr int NQ = S::NF / 2;
        if constexpr (COLS) cols_ready();
        const float* bcol = w13_bias + (long)it.e * 2 * INTER + it.nblk * (BN1 / 2);
        if constexpr (MID_FP8) {
            // Both rows' activations first, each column's scales loaded once (ahead of the
            // staging stores) and the accumulator consumed as they fill.
            float vh[2][NQ][2];
#pragma unroll
            for (int q = 0; q < NQ; ++q) {
                const float2 sg = col_scale(cols, lane, q), su = col_scale(cols, lane, q + NQ);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 g = swiglu_pair<NQ, true>(acc, q, h, sg, su, ep.xs[h], bcol);
                    vh[h][q][0] = g.x, vh[h][q][1] = g.y;
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const auto& v = vh[h];
                // A row's 128 columns of the tile lie in the four lanes of a quad: its amax in two shuffles.
                float amax = 0.f;
#pragma unroll
                for (int q = 0; q < NQ; ++q) amax = fmaxf(amax, fmaxf(fabsf(v[q][0]), fabsf(v[q][1])));
                amax = fmaxf(amax, __shfl_xor_sync(MOE_FULL_MASK, amax, 1));
                amax = fmaxf(amax, __shfl_xor_sync(MOE_FULL_MASK, amax, 2));
                const float scale = amax > 0.f ? amax / 448.f : 1.f;
                const float inv = 1.f / scale;
                // The row's 128 bytes into the warp's staging (16-byte chunks swizzled by the row).
                const int r = lane / 4 + 8 * h;
#pragma unroll
                for (int q = 0; q < NQ; ++q) {
                    const unsigned short b = __nv_cvt_float2_to_fp8x2(make_float2(v[q][0] * inv, v[q][1] * inv),
                                                                      __NV_SATFINITE, __NV_E4M3);
                    const unsigned a = buf + r * 128 + (((q / 2) ^ (r & 7)) << 4) + (q % 2) * 8 + 2 * (lane % 4);
                    asm volatile("st.shared.u16 [%0], %1;" ::"r"(a), "h"(b) : "memory");
                }
                if (lane % 4 == 0 && ep.p[h] >= 0)
                    mid_scales[(long)(it.tile * BM + r + row0) * (INTER / 128) + it.nblk] = scale;
            }
            // Then each lane stores 16-byte chunks of 4 of the warp's 16 rows.
            __syncwarp();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int r = lane / 8 + 4 * k, c = lane % 8;
                const uint4 v = lds128(buf + r * 128 + ((c ^ (r & 7)) << 4));
                if (from_row_owner(ep.p, r) >= 0)
                    *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(mid) + (long)(it.tile * BM + row0 + r) * INTER +
                                              it.nblk * 128 + 16 * c) = v;
            }
            __syncwarp();
        } else {
            // Decoded weights' consumers have 16 registers fewer: there the column scales are
            // loaded as the fragments are stored (held up front beside the extended rows, int8 and
            // nvfp4 spilled 300-600 B).
            constexpr int HELD = WS_DECODE ? 1 : S::NF;
            const ThreadCols<HELD> sc = thread_cols<HELD>(cols, lane);
            auto col = [&](int q) { return WS_DECODE ? col_scale(cols, lane, q) : sc.v[q]; };
            // Decoded weights' GEMM2 reads the intermediate paired as its weight codes (x_pair_col).
            store_warp_rows<NQ, X_PAIRED>(
                buf, [&](int q, int h) { return swiglu_pair<NQ>(acc, q, h, col(q), col(q + NQ), ep.xs[h], bcol); },
                [&](int r) -> act_t* {
                    return from_row_owner(ep.p, r) < 0 ? nullptr
                                                       : mid + (long)(it.tile * BM + row0 + r) * INTER + it.nblk * (BN1 / 2);
                });
        }
    };
    // An extended item's rows past BM (its expert's short tile's): ext_act takes the thread's part of
    // ext_mma's transposed accumulators (neurons nl and nl + 8 of the tile's BN1 / 2, gate and up
    // alike, in TAIL / 4 rows) through SwiGLU into buf as [row][BN1 / 2] act_t; then, before the
    // main epilogue, ext_store writes them from there 16 bytes a thread (fp8: a row's amax over
    // half a warp, as in moe_quant_mid).
    static_assert(TAIL == 0 || TAIL * BN1 / 2 == 256 * 8, "ext_store: 8 activations per consumer thread");
    auto ext_act = [&](const Work& it, const float* eacc, const float* cols, unsigned buf) {
        constexpr int EK = TAIL > 0 ? TAIL / 4 : 1;  // the thread's rows
        const int cw = threadIdx.x / 32 - 4;
        const int nl = 64 * (cw / 4) + 16 * (cw % 4) + lane / 4;
        const long row0 = ext_row0(it);
        float xs[EK];
#pragma unroll
        for (int k = 0; k < EK; ++k) xs[k] = X_PER_ROW ? a_scales[row0 + 8 * (k / 2) + 2 * (lane % 4) + k % 2] : 1.f;
        float2 sg = make_float2(MOE_COL_UNIT, MOE_COL_UNIT), su = sg;
        if constexpr (COLS) {
            cols_ready();
            sg = make_float2(cols[nl], cols[nl + 8]);
            su = make_float2(cols[BN1 / 2 + nl], cols[BN1 / 2 + nl + 8]);
        }
        float2 bg = make_float2(0.f, 0.f), bu = bg;
        if constexpr (HAS_BIAS) {
            const float* bcol = w13_bias + (long)it.e * 2 * INTER + it.nblk * (BN1 / 2);
            bg = make_float2(__ldg(bcol + nl), __ldg(bcol + nl + 8));
            bu = make_float2(__ldg(bcol + INTER + nl), __ldg(bcol + INTER + nl + 8));
        }
#pragma unroll
        for (int k = 0; k < EK; ++k) {
            const int r = 8 * (k / 2) + 2 * (lane % 4) + k % 2;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int i = 2 * j + k % 2, nf = k / 2;  // the accumulator element of (row k, neuron j)
                const float g = eacc[nf * 4 + i] * (j ? sg.y : sg.x) * xs[k] + (j ? bg.y : bg.x);
                const float u = eacc[TAIL / 2 + nf * 4 + i] * (j ? su.y : su.x) * xs[k] + (j ? bu.y : bu.x);
                sts_act(buf + (r * (BN1 / 2) + nl + 8 * j) * 2, (act_t)moe_glu(g, u));
            }
        }
    };
    auto ext_store = [&](const Work& it, unsigned buf) {
        const int t = threadIdx.x - 128, r = t / 16, c = t % 16;  // row r, neurons 8 c ..
        const long pos = ext_row0(it) + r;
        const int p = sorted_rows[pos];
        asm volatile("bar.sync 5, 256;" ::: "memory");  // every consumer warp's ext_act
        const uint4 raw = lds128(buf + r * (BN1 / 2) * 2 + c * 16);
        asm volatile("bar.sync 5, 256;" ::: "memory");  // read before the next extended item writes
        if constexpr (MID_FP8) {
            float v[8];
            const act_t* e = reinterpret_cast<const act_t*>(&raw);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = (float)e[i];
            const float scale = half_warp_scale(v, true);
            if (p >= 0) {
                *reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(mid) + pos * INTER + it.nblk * 128 + 8 * c) =
                    pack_e4m3x8(v, 1.f / scale);
                if (c == 0) mid_scales[pos * (INTER / 128) + it.nblk] = scale;
            }
        } else if (p >= 0) {
            // Decoded weights' GEMM2 reads the intermediate paired as its weight codes (x_pair_col).
            *reinterpret_cast<uint4*>(mid + pos * INTER + it.nblk * (BN1 / 2) + 8 * c) = X_PAIRED ? x_pair_chunk(raw) : raw;
        }
    };
#if MOE_WS_DECODE
    auto b_scales = [&](const Work& it, int kt, bool all) {
        return wsq_scales<BN1, false, W13M>(w13_scales, [&](int r) { return w13_row(it, r); }, kt, all);
    };
    auto c_scales = [&](const Work& it, int kt) {
        return wsq_scales<BN1, true, W13M>(w13_scales, [&](int r) { return w13_row(it, r); }, kt, false);
    };
    const WsqDecoder<BN1> b_decode;
    ws_gemm<BN1, KT1, PROMOTE, true, false, TAIL>(smem, counts.x * NT1 / CLUSTER, work_counter, item, a_row,
                                                  (const char*)a, b_load, kscale, promote, prepare, epilogue, ext_act,
                                                  ext_store, b_scales, b_decode, c_scales);
#else
    ws_gemm<BN1, KT1, PROMOTE, true, false, TAIL>(smem, counts.x * NT1 / CLUSTER, work_counter, item, a_row,
                                                  (const char*)a, b_load, kscale, promote, prepare, epilogue, ext_act,
                                                  ext_store);
#endif
}
#endif  // entry moe_gemm1

template <bool ATOMIC>
__device__ __forceinline__ void gemm2(const void* __restrict__ a, const float* __restrict__ a_scales,
                                      const int* __restrict__ sorted_rows, const int* __restrict__ tile_expert,
                                      const int4* __restrict__ tile_span, const int* __restrict__ num_tiles,
                                      const float* __restrict__ w2_scales, const float* __restrict__ topk_weights,
                                      void* __restrict__ out, int* __restrict__ work_counter, const TmaMap& b_map,
                                      const TmaMap& a_map) {
    // The deterministic kernel's extended items (then tile_span is tile_span1).
    constexpr int EXT2 = ATOMIC ? 0 : TAIL2;
    using S = WsShape<BN2, FP8, EXT2>;
    const int lane = threadIdx.x % 32;
    // The layout is moe_prepare's, complete before GEMM1 (this kernel's predecessor) let this one
    // launch: GEMM1 signals its dependents only after its own wait on moe_prepare. What GEMM1
    // writes (mid, its scales) is read after the wait in ws_gemm (EARLY_B).
    pdl_launch_dependents();
    const int2 counts = tile_counts(num_tiles + (EXT2 > 0 ? 2 : 0));
    auto item = [&](int w, int rank) { return work_item(w, NT2, tile_span, counts, rank); };
    // mid is in tile order; padding rows are zero-filled rather than read (GEMM1 skipped them).
    // The item's span tells them apart: the producer's rows need no load of their own. An
    // extended item's rows past BM (its expert's short tile's) are read as they are: a padding row there
    // reaches only its own outputs, which are never stored.
    auto a_row = [&](const Work& it, int r) -> const char* {
        const long row = r < BM ? (long)it.tile * BM + r : ext_row0(it) + (r - BM);
        return r < it.rows || r >= BM ? (const char*)a + row * INTER * ELEM_BYTES : nullptr;
    };
    // The map's boxes are BN2 / CLUSTER rows: a cluster sharing the tile multicasts one each.
    auto b_load = [&](const Work& it, int kt, unsigned dst, unsigned bar, int rank) {
        constexpr int ROWS = BN2 / CLUSTER;
        const int step = it.multicast ? CLUSTER : 1;
#pragma unroll
        for (int b = it.multicast ? rank : 0; b < CLUSTER; b += step)
            tma_load_tile(dst + b * ROWS * B_ROW_BYTES, b_map, kt * B_KT_STEP, it.e * HIDDEN + it.nblk * BN2 + b * ROWS, bar,
                          it.multicast);
    };
    // k-tile scales: s[h][b] for the thread's row h and the 128-column block b of the tile.
    auto kscale = [&](const Work& it, int kt, int row0) {
        KScales k{};
        if constexpr (FP8) {
            float b[2];
#pragma unroll
            for (int j = 0; j < 2; ++j)  // a tile of 128 columns or fewer lies in one weight block
                b[j] = WSCALE == 2 ? w2_scales[((long)it.e * HIDDEN + it.nblk * BN2 + (BN2 > 128 ? 128 * j : 0)) / 128 * KT2 + kt]
                                   : 1.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sa = a_scales[(long)(it.tile * BM + row0 + lane / 4 + 8 * h) * KT2 + kt];
                k.s[h][0] = sa * b[0];
                k.s[h][1] = sa * b[1];
            }
        }
        return k;
    };
    auto promote = [&](const KScales& k, int p, const float* pt, float* acc) {
        promote_part<S::NFH, 128>(k, p, pt, acc);  // the weights' 128-row blocks
    };
    // The thread's rows' pairs and the tile's per-channel scales.
    auto prepare = [&](const Work& it, int row0, float* cols) {
        const RowPairs ep = row_pairs(sorted_rows, it.tile, row0, lane);
#if MOE_WS_DECODE
        if constexpr (COLS)
            fill_cols<BN2>(cols, [&](int j) { return wq_row_scale<W2M>(w2_scales, (long)it.e * HIDDEN + it.nblk * BN2 + j); });
#else
        if constexpr (WSCALE == 1)
            stage_cols<BN2>(cols, [&](int j) { return w2_scales + (long)it.e * HIDDEN + it.nblk * BN2 + j; });
#endif
        return ep;
    };
    auto epilogue = [&](const Work& it, const float* acc, int row0, const RowPairs& ep, const float* cols, unsigned buf) {
        if constexpr (COLS) cols_ready();
        const ThreadCols<S::NF> sc = thread_cols<S::NF>(cols, lane);
        if (!ATOMIC) {
            // The routing weight is applied by the combine (moe_combine_rows). Decoded weights'
            // consumers load the column scales as the fragments are stored (as GEMM1's).
            auto col = [&](int q) { return WS_DECODE ? col_scale(cols, lane, q) : sc.v[q]; };
            store_warp_rows<S::NF>(
                buf,
                [&](int q, int h) {
                    const float2 c = col(q);
                    return make_float2(acc[q * 4 + 2 * h] * c.x, acc[q * 4 + 2 * h + 1] * c.y);
                },
                [&](int r) -> act_t* {
                    return from_row_owner(ep.p, r) < 0
                               ? nullptr
                               : static_cast<act_t*>(out) + (long)(it.tile * BM + row0 + r) * HIDDEN + it.nblk * BN2;
                });
            return;
        }
        float rw[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) rw[h] = ep.p[h] < 0 ? 0.f : topk_weights[ep.p[h]];
        // Lanes 2j and 2j + 1 trade halves so that each adds four adjacent columns of one row
        // (the even lane row h = 0, the odd one row h = 1) with one red.v4: half the atomics.
        const int odd = lane & 1;
        const int po = odd ? ep.p[1] : ep.p[0];  // selects, not an indexed (local-memory) array
#pragma unroll
        for (int nf = 0; nf < S::NF; ++nf) {
            const int n = 8 * nf + 2 * (lane % 4);
            float v[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                v[h][0] = acc[nf * 4 + 2 * h] * rw[h] * sc.v[nf].x;
                v[h][1] = acc[nf * 4 + 2 * h + 1] * rw[h] * sc.v[nf].y;
            }
            const float r0 = __shfl_xor_sync(MOE_FULL_MASK, odd ? v[0][0] : v[1][0], 1);
            const float r1 = __shfl_xor_sync(MOE_FULL_MASK, odd ? v[0][1] : v[1][1], 1);
            if (po < 0) continue;
            const float4 q = odd ? make_float4(r0, r1, v[1][0], v[1][1]) : make_float4(v[0][0], v[0][1], r0, r1);
            float* dst = static_cast<float*>(out) + (long)(po / TOP_K) * HIDDEN + it.nblk * BN2 + n - 2 * odd;
            asm volatile("red.global.add.v4.f32 [%0], { %1, %2, %3, %4 };" ::"l"(dst), "f"(q.x), "f"(q.y), "f"(q.z),
                         "f"(q.w)
                         : "memory");
        }
    };
#if MOE_WS_DECODE
    auto w2_row = [&](const Work& it, int r) -> long { return (long)it.e * HIDDEN + it.nblk * BN2 + r; };
    auto b_scales = [&](const Work& it, int kt, bool all) {
        return wsq_scales<BN2, false, W2M>(w2_scales, [&](int r) { return w2_row(it, r); }, kt, all);
    };
    auto c_scales = [&](const Work& it, int kt) {
        return wsq_scales<BN2, true, W2M>(w2_scales, [&](int r) { return w2_row(it, r); }, kt, false);
    };
    const WsqDecoder<BN2> b_decode;
    // mid is in tile order: a k-tile of a tile's rows is one box (padding rows come along, and
    // reach only outputs that are never stored), so the decoding threads issue no gathers.
    auto a_load = [&](const Work& it, int kt, unsigned dst, unsigned bar) {
        tma_load_2d(dst, a_map, kt * (BK_BYTES / ELEM_BYTES), it.tile * BM, bar);
    };
    // An extended item's rows (transposed in ext_mma's accumulators: the outputs as M, the rows
    // as N), scaled per output into buf as [row][BN2] act_t, then stored 32 bytes a thread.
    static_assert(EXT2 == 0 || EXT2 * BN2 == 256 * 16, "ext_store: 16 outputs per consumer thread");
    auto ext_act = [&](const Work&, const float* eacc, const float* cols, unsigned buf) {
        if constexpr (COLS) cols_ready();
        const int cw = threadIdx.x / 32 - 4;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nf = 0; nf < EXT2 / 8; ++nf)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int n = half * (BN2 / 2) + 64 * (cw / 4) + 16 * (cw % 4) + lane / 4 + 8 * (i / 2);
                    const int r = 8 * nf + 2 * (lane % 4) + i % 2;
                    sts_act(buf + (r * BN2 + n) * 2, (act_t)(eacc[half * (EXT2 / 2) + nf * 4 + i] * (COLS ? cols[n] : MOE_COL_UNIT)));
                }
    };
    auto ext_store = [&](const Work& it, unsigned buf) {
        const int t = threadIdx.x - 128, r = t / 16, c = t % 16;  // row r, outputs 16 c ..
        const long pos = ext_row0(it) + r;
        const int p = sorted_rows[pos];
        asm volatile("bar.sync 5, 256;" ::: "memory");  // every consumer warp's ext_act
        const uint4 v0 = lds128(buf + (r * BN2 + 16 * c) * 2), v1 = lds128(buf + (r * BN2 + 16 * c + 8) * 2);
        asm volatile("bar.sync 5, 256;" ::: "memory");  // read before the staging is written again
        if (p >= 0) {
            uint4* dst = reinterpret_cast<uint4*>(static_cast<act_t*>(out) + pos * HIDDEN + it.nblk * BN2 + 16 * c);
            dst[0] = v0;
            dst[1] = v1;
        }
    };
    ws_gemm<BN2, KT2, FP8, false, true, EXT2>(smem, counts.x * NT2 / CLUSTER, work_counter, item, a_row, (const char*)a,
                                              b_load, kscale, promote, prepare, epilogue, ext_act, ext_store, b_scales,
                                              b_decode, c_scales, a_load);
#else
    ws_gemm<BN2, KT2, FP8, false, true, 0>(smem, counts.x * NT2 / CLUSTER, work_counter, item, a_row, (const char*)a,
                                           b_load, kscale, promote, prepare, epilogue,
                                           NoExt{}, NoExt{});
#endif
}
{%- if let Some(fmt) = fmt %}
#else
{% include "mbarrier.cuh" %}
{% include "gemm_wq.cuh" %}
{%- else %}
#else
// GEMM1: mid[pos, n] = act(x_t . gate_n) * (x_t . up_n) for the pair in row pos. Columns of a tile
// interleave by 8: 16 q + (0..7) are gate neurons nb + 8 q + (0..7), 16 q + (8..15) the up ones,
// so one thread holds a neuron's gate and up accumulators.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gemm1)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MIN_BLOCKS)
moe_gemm1(const __grid_constant__ Gemm1Params params) {
    MOE_UNPACK_Gemm1Params(params);
    using T = TileShape<BN1>;
    pdl_wait();  // a programmatic dependent of moe_prepare
    pdl_launch_dependents();
    const int work = *num_tiles * NT1;
    const int row0 = frag_row0(), col0 = frag_col0<BN1>();
    for (int w = blockIdx.x; w < work; w += gridDim.x) {
        const Work it = work_item(w, NT1, tile_span, tile_counts(num_tiles));
        const int tile = it.tile, nb = it.nblk * (BN1 / 2), e = it.e;
        const char* a_src[T::A_PER_THREAD];
        const char* b_src[T::B_PER_THREAD];
#pragma unroll
        for (int j = 0; j < T::A_PER_THREAD; ++j) {
            const int p = sorted_rows[tile * BM + threadIdx.x / 8 + 32 * j];
            a_src[j] = p < 0 ? nullptr : (const char*)a + (long)(p / TOP_K) * HIDDEN * ELEM_BYTES;
        }
#pragma unroll
        for (int j = 0; j < T::B_PER_THREAD; ++j) {
            const int col = threadIdx.x / 8 + 32 * j;
            const int n = nb + 8 * (col / 16) + col % 8 + (col % 16 >= 8 ? INTER : 0);
            b_src[j] = (const char*)w13 + ((long)e * 2 * INTER + n) * HIDDEN * ELEM_BYTES;
        }
        float acc[T::ACC];
        float part[FP8 ? T::ACC : 1];
#pragma unroll
        for (int j = 0; j < T::ACC; ++j) acc[j] = 0.f;
        // FP8: fold each k-tile in with its activation scale (per row) and block weight scale;
        // X_PER_ROW: the row's one scale (by sorted row), else the token's per k-tile.
        const float* as[T::MF * 2];
#pragma unroll
        for (int j = 0; j < T::MF * 2; ++j) {
            const int pos = tile * BM + frag_row(row0, j / 2, 2 * (j % 2)), p = sorted_rows[pos];
            as[j] = X_PER_ROW ? a_scales + pos : a_scales + (long)(p < 0 ? 0 : p / TOP_K) * KT1;
        }
        const float* gate_bs = w13_scales + ((long)e * 2 * INTER + nb) / 128 * KT1;
        const float* up_bs = w13_scales + ((long)e * 2 * INTER + INTER + nb) / 128 * KT1;
        gemm_tile<BN1, KT1>(smem, a_src, b_src, acc, part, [&](int kt, const float* pt) {
            const float bg = WSCALE == 2 ? gate_bs[kt] : 1.f, bu = WSCALE == 2 ? up_bs[kt] : 1.f;
#pragma unroll
            for (int mf = 0; mf < T::MF; ++mf)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float sa = as[2 * mf + h][X_PER_ROW ? 0 : kt];
#pragma unroll
                    for (int nf = 0; nf < T::NF; ++nf)
#pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            const int j = (mf * T::NF + nf) * 4 + 2 * h + i;
                            acc[j] += pt[j] * sa * ((nf % 2) ? bu : bg);
                        }
                }
        });
        // Padding rows are not stored (GEMM2 never uses what they hold: its outputs there are dropped).
#pragma unroll
        for (int mf = 0; mf < T::MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = tile * BM + frag_row(row0, mf, 2 * h);
                if (sorted_rows[row] < 0) continue;
#pragma unroll
                for (int q = 0; q < T::NF / 2; ++q)
                    store_mid(mid, row, nb + col0 / 2 + 8 * q + 2 * (threadIdx.x % 4), e,
                              acc + (mf * T::NF + 2 * q) * 4 + 2 * h, acc + (mf * T::NF + 2 * q + 1) * 4 + 2 * h,
                              w13_scales, w13_bias);
            }
    }
}
#endif  // entry moe_gemm1

// GEMM2: out = mid[pos] . w2_n for the pair p in row pos, times weight_p when added atomically
// (store_out).
template <bool ATOMIC>
__device__ __forceinline__ void gemm2(const void* __restrict__ a, const float* __restrict__ a_scales,
                                      const int* __restrict__ sorted_rows, const int* __restrict__ tile_expert,
                                      const int4* __restrict__ tile_span, const int* __restrict__ num_tiles,
                                      const void* __restrict__ w2, const float* __restrict__ w2_scales,
                                      const float* __restrict__ topk_weights, void* __restrict__ out) {
    using T = TileShape<BN2>;
    pdl_wait();  // a programmatic dependent of GEMM1 (or moe_quant_mid)
    pdl_launch_dependents();
    const int work = *num_tiles * NT2;
    const int row0 = frag_row0(), col0 = frag_col0<BN2>();
    for (int w = blockIdx.x; w < work; w += gridDim.x) {
        const Work it = work_item(w, NT2, tile_span, tile_counts(num_tiles));
        const int tile = it.tile, nb = it.nblk * BN2, e = it.e;
        const char* a_src[T::A_PER_THREAD];
        const char* b_src[T::B_PER_THREAD];
        // A reads mid's rows as they are: whatever a padding row holds reaches only that row's
        // outputs, which are never stored.
#pragma unroll
        for (int j = 0; j < T::A_PER_THREAD; ++j)
            a_src[j] = (const char*)a + (long)(tile * BM + threadIdx.x / 8 + 32 * j) * INTER * ELEM_BYTES;
#pragma unroll
        for (int j = 0; j < T::B_PER_THREAD; ++j)
            b_src[j] = (const char*)w2 + ((long)e * HIDDEN + nb + threadIdx.x / 8 + 32 * j) * INTER * ELEM_BYTES;
        float acc[T::ACC];
        float part[FP8 ? T::ACC : 1];
#pragma unroll
        for (int j = 0; j < T::ACC; ++j) acc[j] = 0.f;
        const float* bs = w2_scales + ((long)e * HIDDEN + nb) / 128 * KT2;
        gemm_tile<BN2, KT2>(smem, a_src, b_src, acc, part, [&](int kt, const float* pt) {
            const float b = WSCALE == 2 ? bs[kt] : 1.f;
#pragma unroll
            for (int mf = 0; mf < T::MF; ++mf)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float sa = a_scales[(long)(tile * BM + frag_row(row0, mf, 2 * h)) * KT2 + kt] * b;
#pragma unroll
                    for (int nf = 0; nf < T::NF; ++nf)
#pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            const int j = (mf * T::NF + nf) * 4 + 2 * h + i;
                            acc[j] += pt[j] * sa;
                        }
                }
        });
#pragma unroll
        for (int mf = 0; mf < T::MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pos = tile * BM + frag_row(row0, mf, 2 * h);
                const int p = sorted_rows[pos];
                if (p < 0) continue;
#pragma unroll
                for (int nf = 0; nf < T::NF; ++nf)
                    store_out<ATOMIC>(out, pos, p, e, nb + frag_col(col0, nf, 0), acc[(mf * T::NF + nf) * 4 + 2 * h],
                                      acc[(mf * T::NF + nf) * 4 + 2 * h + 1], topk_weights, w2_scales);
            }
    }
}
{%- endif %}
#endif

#if MOE_WS
#define MOE_GEMM2_ARGS a, a_scales, sorted_rows, tile_expert, tile_span, num_tiles, w2_scales, topk_weights, out, work_counter, b_map, a_map
#else
#define MOE_GEMM2_ARGS a, a_scales, sorted_rows, tile_expert, tile_span, num_tiles, w2, w2_scales, topk_weights, out
#endif
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gemm2_atomic)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MIN_BLOCKS)
moe_gemm2_atomic(const __grid_constant__ Gemm2Params params) {
    MOE_UNPACK_Gemm2Params(params);
    gemm2<true>(MOE_GEMM2_ARGS);
}
#endif  // entry moe_gemm2_atomic
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gemm2_rows)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MIN_BLOCKS)
moe_gemm2_rows(const __grid_constant__ Gemm2Params params) {
    MOE_UNPACK_Gemm2Params(params);
    gemm2<false>(MOE_GEMM2_ARGS);
}
#endif  // entry moe_gemm2_rows

{% include "combine.cuh" %}
