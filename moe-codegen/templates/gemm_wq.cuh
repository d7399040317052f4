// Weights the tensor cores do not take (WQ: int8, int4, mxfp8, nvfp4, mxfp4, and per-channel fp8
// whose K is not whole 128-byte e4m3 tiles, as gpt-oss's 2880): a mixed-input
// grouped GEMM with the operands swapped. The packed weight rows are the MMA's A (its M side: the
// output features), a tile's token rows its B (N side), so a handful of tokens per expert fills an
// n8 fragment rather than a 128-row one. Each stage holds one subtile of K, four 16-byte vectors
// (64 bytes) of every weight row exactly as stored (cp.async, with a 128-byte L2 prefetch), and
// the same codes' activations of every live token row. A thread decodes its own vector of a row
// (W_VEC codes) straight into A fragment registers (LUT-free, group scale applied, in act_t) and
// never writes them back: each weight code is decoded once per tile of BM tokens.
//
// The sum over K does not care in which order the MMA visits it, so the fragment slots a thread
// fills follow the codes' order in the packed word (pair p of a word: codes p and p + WQ_PAIRS),
// and the activations are stored in the same order (x_pair_col: moe_prepare copies x so, GEMM1
// writes the intermediate so), so a thread's W_VEC activations load straight into its B
// fragments. That keeps the weights' documented layout: no repacking at load.
//
// Warps: WM along the weight rows (MF fragments of 16 each), WN along the tile's tokens (NF
// fragments of 8). A fragment of tokens past the tile's live rows is skipped, and so is a warp
// with none. Every token fragment sums K in the same order: the aligner places a tile's pairs in
// any order, and a pair's result must not depend on its row (a captured step replays bit for bit).
{% include "wq_decode.cuh" %}

template <int BN>
struct WqShape {
    static constexpr int MF = BN >= 256 ? BN / 128 : 1;  // 16-row fragments per warp
    static constexpr int WM = BN / (16 * MF);
    static constexpr int WN = 8 / WM;
    static constexpr int NF = BM / (8 * WN);  // 8-token fragments per warp
    static_assert(WM * WN == 8 && BM % (8 * WN) == 0, "eight warps over the tile");
    static constexpr int W_BYTES = BN * 64;  // one stage of weights
    static constexpr int X_BYTES = BM * WQ_X_ROW;
    static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
    // + alignment slack, then each stage's full and empty mbarriers
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 128 + 16 * STAGES;
    static_assert(BN * 4 % 32 == 0, "whole weight chunks per lane");
};
// Where 16-byte chunk j of token row n lies in its stage row: swizzled so that the threads of one
// shared-memory phase (two rows, each thread its W_VEC activations) hit different banks.
__device__ __forceinline__ int wq_x_chunk(int n, int j) {
    if constexpr (WQ_X_ROW == 128) return j ^ (n & 7);
    else return j ^ ((j >> 3) & 1) ^ ((n & 1) << 1);
}

// 8-bit codes with one scale per row multiply the fragments after the first two at a time.
// Measured on an H200: int8 4% faster at the median, per-channel fp8 2-7% at 16-256 tokens. The
// 4-bit codes, and 8-bit codes with group scales (their registers near the limit), were neutral to
// slower (docs/prefill-notes.md).
constexpr bool WQ_PAIR_REST = WQ_BITS == 8 && !W_GROUP_SCALED;

using WqShape1 = WqShape<BN1>;
using WqShape2 = WqShape<BN2>;
static_assert(WqShape1::SMEM_BYTES == HOST_GEMM1_SMEM && WqShape2::SMEM_BYTES == HOST_GEMM2_SMEM,
              "the GEMMs' dynamic shared memory (GemmTiles::gemm1_smem_bytes, gemm2_smem_bytes)");

// cp_async16 with the L2 fetching the whole 128-byte line: a weight row's next stage comes from L2.
__device__ __forceinline__ void cp_async16_l2(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ uint4 wq_lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 { %0, %1, %2, %3 }, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}


// A stage's A fragments of a thread: its vector of each of its rows (row + 16 mf + 8 h, in the
// stage's weight tile at sw), decoded word by word; slot pair q of row h in a[mf][h][q]. The first
// token fragment's MMAs (b0: its W_VEC / 2 activation pairs) run as each word is decoded, so
// their dependent chain overlaps the decode rather than waiting at the end of the stage.
template <bool BIG, int MF, int NWORDS>
__device__ __forceinline__ void wq_decode_stage(unsigned sw, int row, int c, const WScale (&ws)[MF][2],
                                                unsigned (&a)[MF][2][NWORDS], const unsigned (&b0)[NWORDS],
                                                float (&acc0)[MF][4]) {
    uint4 v[MF][2];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int h = 0; h < 2; ++h) v[mf][h] = wq_lds128(sw + (row + 16 * mf + 8 * h) * 64 + 16 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned word = i == 0 ? v[mf][h].x : i == 1 ? v[mf][h].y : i == 2 ? v[mf][h].z : v[mf][h].w;
                unsigned pr[WQ_PAIRS];
                wq_decode<!WQ_STAGE_SCALE>(BIG, word, ws[mf][h], group_scale(ws[mf][h], i * W_GROUPS / 4), pr);
#pragma unroll
                for (int p = 0; p < WQ_PAIRS; ++p) a[mf][h][i * WQ_PAIRS + p] = pr[p];
            }
        // The k16 steps this word completes: pairs 2 st and 2 st + 1 of both rows.
#pragma unroll
        for (int st = i * WQ_PAIRS / 2; st < (i + 1) * WQ_PAIRS / 2; ++st)
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) {
                const unsigned af[4] = {a[mf][0][2 * st], a[mf][1][2 * st], a[mf][0][2 * st + 1], a[mf][1][2 * st + 1]};
                mma_16x8(acc0[mf], af, b0[2 * st], b0[2 * st + 1]);
            }
    }
}

// Token fragments nf .. nf + NB - 1's MMAs over a stage's decoded A, alternating between them so
// that each chain's latency hides under the other's (each still sums K in the same order). With
// WQ_STAGE_SCALE the stage's sums take the rows' scales sc[mf][h] in fp32.
template <int NB, int MF, int NF, int NWORDS, int NX>
__device__ __forceinline__ void wq_mma_rest(const unsigned (&a)[MF][2][NWORDS], const unsigned (&x)[2][NX],
                                            float (&acc)[MF][NF][4], int nf, const float (&sc)[MF][2]) {
    float t[NB][MF][4];
#pragma unroll
    for (int f = 0; f < NB; ++f)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int i = 0; i < 4; ++i) t[f][mf][i] = WQ_STAGE_SCALE ? 0.f : acc[mf][nf + f][i];
#pragma unroll
    for (int st = 0; st < NWORDS / 2; ++st)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
            const unsigned af[4] = {a[mf][0][2 * st], a[mf][1][2 * st], a[mf][0][2 * st + 1], a[mf][1][2 * st + 1]};
#pragma unroll
            for (int f = 0; f < NB; ++f) mma_16x8(t[f][mf], af, x[f][2 * st], x[f][2 * st + 1]);
        }
#pragma unroll
    for (int f = 0; f < NB; ++f)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc[mf][nf + f][i] = WQ_STAGE_SCALE ? fmaf(sc[mf][i / 2], t[f][mf][i], acc[mf][nf + f][i]) : t[f][mf][i];
}

// The mainloop and epilogue call of one GEMM over its work items (grid-stride). wrow(it, R): the
// global weight row of the item's stage row R; xrow(it, r): token row r (< it.rows) of the tile;
// epi(it, acc, row0, tok0): acc[mf][nf][i] of this thread, fragment rows row0 + 16 mf, tokens
// tok0 + 8 nf (the mma C layout).
//
// The pipeline runs through mbarriers, not block barriers: the block's stages form one stream
// across its work items (fill f: item f / KT, k-subtile f % KT), and warp f % 8 copies fill f
// (cp.async, every lane then arriving on the stage's full barrier) once every warp has arrived on
// its empty barrier after the fill that used the stage before. So the copies' bookkeeping is
// spread over the warps, one in eight stages each; no warp waits for the others except for a
// stage they have yet to release, and an item's first stages load under the last one's epilogue.
//
// WStep::at(d): how far weight row r + d lies from row r, for d a multiple of 8 and r < 8, or d a
// multiple of 32 and r < 32, so that a lane resolves wrow once per fill and reaches its other rows
// by constant offsets.
//
// LAST: the weight rows of an item in the last of the nt column blocks (BN where BN divides the
// rows; else whole warps' rows, 16 MF each): its rows past LAST are neither copied nor computed,
// and the warps holding them sit the item out.
template <int BN, int LAST, int KDIM, class M, class WStep, class WRow, class XRow, class Epi>
__device__ __forceinline__ void wq_gemm(char* smem, int nt, const int4* __restrict__ tile_span,
                                        const int* __restrict__ num_tiles, const unsigned char* __restrict__ w,
                                        const void* __restrict__ scales, WRow wrow, XRow xrow, Epi epi) {
    using S = WqShape<BN>;
    static_assert(LAST > 0 && LAST <= BN && LAST % (16 * S::MF) == 0, "whole warps' rows in the last column block");
    constexpr int KT = (KDIM + WQ_SUB - 1) / WQ_SUB;  // stages per item
    constexpr int TAIL = KDIM % WQ_SUB;               // codes of a half last stage, or 0
    constexpr long PITCH = (long)KDIM * WQ_BITS / 8;  // bytes per packed row
    // Fills in flight ahead of the one computed: two stages short of the ring, so that the warp
    // refilling a stage finds it released by the others (they only had to finish the fill before
    // last) rather than waiting for the slowest.
    constexpr int AHEAD = STAGES > 2 ? STAGES - 2 : 1;
    constexpr int WARPS = GEMM_THREADS / 32;
    constexpr int NWORDS = 4 * WQ_PAIRS;  // pairs a thread's vector decodes to
    constexpr int XCH = WQ_X_ROW / 16;    // 16-byte chunks of a token row per stage
    const unsigned base = (smem_u32(smem) + 127u) & ~127u;
    const unsigned bars = base + STAGES * S::STAGE_BYTES;  // full[s] at bars + 8 s, empty[s] after them
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = lane % 4, g = lane / 4;
    const int wm = warp % S::WM, wn = warp / S::WM;
    const int row0 = wm * S::MF * 16, tok0 = wn * (BM / S::WN);
    const int2 counts = tile_counts(num_tiles);
    const int work = counts.x * nt;
    const int items = (int)blockIdx.x < work ? (work - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int fills = items * KT;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 32);              // the copying warp's lanes (cp.async arrivals)
            mbar_init(bars + 8 * (STAGES + s), WARPS);  // every warp, done reading the stage
        }
        mbar_init_fence();
    }
    __syncthreads();
    // Fill f, by the whole calling warp: its stage freed, then this lane's share of the weight
    // rows' and the live token rows' chunks, then one arrival once they land.
    // cur: the item the warp computes (number cur_n), which most fills belong to: they take it
    // as it is rather than each waiting on a load of the layout to resolve their own.
    auto load = [&](int f, int cur_n, const Work& cur) {
        const int s = f % STAGES, kt = f % KT;
        if (f >= STAGES) mbar_wait(bars + 8 * (STAGES + s), ((f / STAGES) & 1) ^ 1);
        const Work it = f / KT == cur_n ? cur : work_item((int)blockIdx.x + (f / KT) * (int)gridDim.x, nt, tile_span, counts);
        const unsigned sw = base + s * S::STAGE_BYTES, sx = sw + S::W_BYTES;
        // Lane l copies chunk l % 4 of rows l / 4 + 8 j: one row resolved, the rest at constant
        // offsets. A half last stage zero-fills its missing vectors (from a valid address).
        const int ch = lane % 4;
        const bool in = TAIL == 0 || kt < KT - 1 || ch * W_VEC < TAIL;
        const unsigned char* src = w + wrow(it, lane / 4) * PITCH + ch * 16 + (in ? kt * 64 : 0);
        const int rows = it.nblk == nt - 1 ? LAST : BN;
#pragma unroll
        for (int j = 0; j < BN * 4 / 32; ++j)
            // Row lane / 4 + 8 j, in the item where 8 j < rows (a multiple of 16); the rows past
            // them are left as they are, since only warps without rows would read them.
            if (LAST == BN || 8 * j < rows) cp_async16_l2(sw + (lane + 32 * j) * 16, src + WStep::at(8 * j) * PITCH, in);
        for (int q = lane; q < it.rows * XCH; q += 32) {
            const int r = q / XCH, ch = q % XCH;
            const bool in = TAIL == 0 || kt < KT - 1 || ch * 8 < TAIL;
            const act_t* src = xrow(it, r) + 8 * ch;
            cp_async16(sx + r * WQ_X_ROW + (wq_x_chunk(r, ch) << 4), in ? src + kt * WQ_SUB : src, in);
        }
        // The scale lines of the stage's rows, brought into L2 as far ahead as the weights (the
        // registers below take the scales one stage ahead).
        if constexpr (W_GROUP_SCALED) {
            const long r0 = wrow(it, lane);
#pragma unroll
            for (int j = 0; j < BN / 32; ++j)
                if (LAST == BN || 32 * j + lane < rows)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(
                        wscale_ptr<M>(scales, r0 + WStep::at(32 * j), min(kt * 4, KDIM / W_VEC - 1))));
        }
        cp_async_arrive_noinc(bars + 8 * s);
    };
    struct Scales {
        WScale s[S::MF][2];
    };
    auto compute = [&](int stage, const Scales& ws, float (&acc)[S::MF][S::NF][4], int live) {
        const unsigned sw = base + stage * S::STAGE_BYTES, sx = sw + S::W_BYTES;
        // A: the thread's vector of each of its rows, decoded; slot pair q of row h.
        unsigned a[S::MF][2][NWORDS];
        // One branch per warp and stage (not per word) for the rare scales past one multiply.
        bool big = false;
        if constexpr (WQ_BIG_SCALES) {
#pragma unroll
            for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
                for (int h = 0; h < 2; ++h) big |= wq_big(ws.s[mf][h]);
        }
        // B: the same W_VEC activations of each live token, stored paired as the slots are.
        auto load_b = [&](int nf, unsigned (&x)[W_VEC / 2]) {
            const int r = tok0 + 8 * nf + g;
#pragma unroll
            for (int i = 0; i < W_VEC / 8; ++i) {
                const uint4 v = wq_lds128(sx + r * WQ_X_ROW + (wq_x_chunk(r, (W_VEC / 8) * c + i) << 4));
                x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
            }
        };
        // The rows' scales of a stage-wide group (WQ_STAGE_SCALE), for the stage's sums.
        float sc[S::MF][2];
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) sc[mf][h] = WQ_STAGE_SCALE ? group_scale(ws.s[mf][h], 0) : 1.f;
        // The first fragment (live whenever the warp is busy) with the decode; the others after.
        unsigned x0[W_VEC / 2];
        load_b(0, x0);
        float acc0[S::MF][4];
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc0[mf][i] = WQ_STAGE_SCALE ? 0.f : acc[mf][0][i];
        if (WQ_BIG_SCALES && __any_sync(0xffffffffu, big)) wq_decode_stage<true>(sw, row0 + g, c, ws.s, a, x0, acc0);
        else wq_decode_stage<false>(sw, row0 + g, c, ws.s, a, x0, acc0);
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc[mf][0][i] = WQ_STAGE_SCALE ? fmaf(sc[mf][i / 2], acc0[mf][i], acc[mf][0][i]) : acc0[mf][i];
        // Fragment nf's MMAs over the stage's decoded A, or with fragment nf + 1's (pair).
        auto rest = [&](int nf, bool pair) {
            unsigned x[2][W_VEC / 2] = {};
            load_b(nf, x[0]);
            if (pair) {
                load_b(nf + 1, x[1]);
                wq_mma_rest<2>(a, x, acc, nf, sc);
            } else {
                wq_mma_rest<1>(a, x, acc, nf, sc);
            }
        };
        if constexpr (WQ_PAIR_REST) {
#pragma unroll
            for (int nf = 1; nf < S::NF; nf += 2) {
                if (nf >= live) break;
                if (nf + 1 < S::NF && nf + 1 < live) rest(nf, true);
                else rest(nf, false);
            }
        } else {
#pragma unroll
            for (int nf = 1; nf < S::NF; ++nf) {
                if (nf >= live) break;
                rest(nf, false);
            }
        }
    };
    for (int f = warp; f < min(AHEAD, fills); f += WARPS) load(f, -1, Work{});
    int done = 0;  // fills computed
    // The stage of fill `done`, its full barrier's phase, and the next fill this warp copies (the
    // first from AHEAD on that is this warp's, f % WARPS): kept as counters, not divided per stage.
    int stage = 0, phase = 0, my_fill = warp + WARPS * ((max(AHEAD - warp, 0) + WARPS - 1) / WARPS);
#pragma unroll 1
    for (int n = 0; n < items; ++n) {
        const Work it = work_item((int)blockIdx.x + n * (int)gridDim.x, nt, tile_span, counts);
        const int rows = it.nblk == nt - 1 ? LAST : BN;
        // The group scales (and zero points) of the thread's rows, one stage ahead in registers;
        // a half last stage's missing vectors take the row's last scale (their codes meet zeros).
        // A warp past the item's rows reads its first row's (and computes nothing).
        const int my_row0 = row0 < rows ? row0 : 0;
        long srow[S::MF][2];
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) srow[mf][h] = wrow(it, my_row0 + 16 * mf + g + 8 * h);
        auto scales_at = [&](int kt) {
            Scales r;
            const int vec = min(kt * 4 + c, KDIM / W_VEC - 1);
#pragma unroll
            for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
                for (int h = 0; h < 2; ++h) r.s[mf][h] = load_wscale<M>(scales, srow[mf][h], vec);
            return r;
        };
        const bool busy = tok0 < it.rows && row0 < rows;        // the warp has live tokens and rows
        const int live = min(S::NF, (it.rows - tok0 + 7) / 8);  // its live token fragments
        float acc[S::MF][S::NF][4];
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf)
#pragma unroll
            for (int nf = 0; nf < S::NF; ++nf)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mf][nf][i] = 0.f;
        Scales cur = scales_at(0), nxt = scales_at(min(1, KT - 1));
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt, ++done) {
            if (done + AHEAD == my_fill) {
                if (my_fill < fills) load(my_fill, n, it);
                my_fill += WARPS;
            }
            const Scales later = scales_at(min(kt + 2, KT - 1));
            mbar_wait(bars + 8 * stage, phase);
            if (busy) compute(stage, cur, acc, live);
            __syncwarp();
            if (lane == 0) mbar_arrive(bars + 8 * (STAGES + stage));
            if (++stage == STAGES) stage = 0, phase ^= 1;
            cur = nxt;
            nxt = later;
        }
        if (busy) epi(it, acc, row0, tok0);
    }
}

// GEMM1: w13's rows as A, interleaved by 8 within each 16-row fragment (rows 0-7: gate neurons
// nb + 8 f .. + 7, rows 8-15: the same neurons' up rows), so a thread holds a neuron's gate and
// up sums for two tokens and applies the activation in registers.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gemm1)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MIN_BLOCKS)
moe_gemm1(const __grid_constant__ Gemm1Params params) {
    MOE_UNPACK_Gemm1Params(params);
    (void)a_scales, (void)tile_expert, (void)mid_scales, (void)work_counter, (void)b_map;
    pdl_wait();  // a programmatic dependent of moe_prepare
    pdl_launch_dependents();
    using S = WqShape1;
    const int lane = threadIdx.x % 32;
    auto wrow = [&](const Work& it, int R) -> long {
        const int neuron = it.nblk * (BN1 / 2) + (R / 16) * 8 + R % 8;
        return (long)it.e * 2 * INTER + (R % 16 < 8 ? neuron : INTER + neuron);
    };
    auto xrow = [&](const Work& it, int r) -> const act_t* {
        return static_cast<const act_t*>(a) + (long)(sorted_rows[it.tile * BM + r] / TOP_K) * HIDDEN;
    };
    auto epi = [&](const Work& it, const float (&acc)[S::MF][S::NF][4], int row0, int tok0) {
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf) {
            const int neuron = it.nblk * (BN1 / 2) + (row0 / 16 + mf) * 8 + lane / 4;
            const long gr = (long)it.e * 2 * INTER + neuron;
            const float sg = wq_row_scale<W13M>(w13_scales, gr), su = wq_row_scale<W13M>(w13_scales, gr + INTER);
            const float bg = HAS_BIAS ? w13_bias[gr] : 0.f, bu = HAS_BIAS ? w13_bias[gr + INTER] : 0.f;
#pragma unroll
            for (int nf = 0; nf < S::NF; ++nf)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int t = tok0 + 8 * nf + 2 * (lane % 4) + j;
                    if (t >= it.rows) continue;
                    const float v = moe_glu(acc[mf][nf][j] * sg + bg, acc[mf][nf][2 + j] * su + bu);
                    mid[(long)(it.tile * BM + t) * INTER + x_pair_col(neuron)] = (act_t)v;
                }
        }
    };
    // Rows r and r + d (d a multiple of 8): d / 16 fragments of 8 neurons on, and the other half
    // (gate or up) for an odd d / 8.
    struct Step {
        __device__ static constexpr long at(int d) { return (d / 16) * 8 + (d / 8 % 2) * INTER; }
    };
    wq_gemm<BN1, BN1, HIDDEN, W13M, Step>(smem, NT1, tile_span, num_tiles, static_cast<const unsigned char*>(w13), w13_scales, wrow,
                               xrow, epi);
}
#endif  // entry moe_gemm1

// GEMM2: w2's rows as A, fragment row r holding hidden output nb + 16 f + 2 (r % 8) + r / 8, so a
// thread holds two adjacent outputs of two tokens.
template <bool ATOMIC>
__device__ __forceinline__ void gemm2(const void* __restrict__ a, const float* __restrict__ a_scales,
                                      const int* __restrict__ sorted_rows, const int* __restrict__ tile_expert,
                                      const int4* __restrict__ tile_span, const int* __restrict__ num_tiles,
                                      const void* __restrict__ w2, const float* __restrict__ w2_scales,
                                      const float* __restrict__ topk_weights, void* __restrict__ out) {
    (void)a_scales, (void)tile_expert;
    pdl_wait();  // a programmatic dependent of GEMM1
    pdl_launch_dependents();
    using S = WqShape2;
    const int lane = threadIdx.x % 32;
    auto wrow = [&](const Work& it, int R) -> long {
        return (long)it.e * HIDDEN + it.nblk * BN2 + (R / 16) * 16 + 2 * (R % 8) + (R % 16) / 8;
    };
    auto xrow = [&](const Work& it, int r) -> const act_t* {
        return static_cast<const act_t*>(a) + (long)(it.tile * BM + r) * INTER;
    };
    auto epi = [&](const Work& it, const float (&acc)[S::MF][S::NF][4], int row0, int tok0) {
#pragma unroll
        for (int mf = 0; mf < S::MF; ++mf) {
            const int n = it.nblk * BN2 + row0 + 16 * mf + 2 * (lane / 4);
            const long gr = (long)it.e * HIDDEN + n;
            const float s0 = wq_row_scale<W2M>(w2_scales, gr), s1 = wq_row_scale<W2M>(w2_scales, gr + 1);
#pragma unroll
            for (int nf = 0; nf < S::NF; ++nf)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int t = tok0 + 8 * nf + 2 * (lane % 4) + j;
                    if (t >= it.rows) continue;
                    const int pos = it.tile * BM + t;
                    store_out<ATOMIC>(out, pos, sorted_rows[pos], it.e, n, acc[mf][nf][j] * s0, acc[mf][nf][2 + j] * s1,
                                      topk_weights, nullptr);
                }
        }
    };
    // Rows r and r + d (d a multiple of 8): d / 16 fragments of 16 outputs on, and the odd one
    // of a pair for an odd d / 8.
    struct Step {
        __device__ static constexpr long at(int d) { return (d / 16) * 16 + d / 8 % 2; }
    };
    wq_gemm<BN2, HIDDEN - (NT2 - 1) * BN2, INTER, W2M, Step>(smem, NT2, tile_span, num_tiles, static_cast<const unsigned char*>(w2), w2_scales, wrow, xrow,
                             epi);
}
