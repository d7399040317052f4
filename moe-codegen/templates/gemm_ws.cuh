// Warp-specialised, persistent GEMM tiles for sm_90a. One producer warpgroup fills a ring of
// STAGES shared-memory stages: B (the expert's weight rows) by TMA, A (rows gathered through the
// alignment's permutation) by cp.async. Two consumer warpgroups run wgmma on them, each owning 64
// of the tile's BM = 128 rows and all BN columns. Per stage a `full` mbarrier (129 arrivals: the
// producer threads' cp.async completions and the TMA's bytes) and an `empty` one (8 arrivals: the
// consumer warps, once their MMAs have read it) replace the block barrier per k-tile, and the
// producer runs ahead across tiles, so a tile's epilogue overlaps the next tile's loads.
// Named barrier 1 syncs the producer warpgroup, 2 and 3 each consumer warpgroup (stage_cols), 4
// sets the consumers' lag (WG_LAG).
// Clusters (CLUSTER = 2): the two blocks take two row tiles of one expert and column block and
// each TMA-multicasts half of the weight k-tile into both blocks' stages, so a weight tile leaves
// L2 once per two row tiles (an expert's odd tile goes to both blocks, one column block each,
// without multicast: see work_item). A stage is refilled only when both blocks' consumers
// released it (they arrive on both `empty` barriers), and rank 0 takes each work item from the
// counter and hands it to both producers (item_full / item_free mbarriers).
// Extended items (EXT rows: GEMM1's TAIL, and GEMM2's TAIL2 where the producer decodes the
// weights): an expert whose last tile would hold no more than EXT pairs for each tile before it
// has them computed with those tiles, EXT rows each (Work), whose stages then carry BM + EXT rows
// of A: the weight k-tile, the item's cost, is loaded once for both. The extra rows ride the
// warpgroups' own wgmma with the operands swapped (ext_mma): the weight rows are the M side (64 at a time)
// and the EXT rows the N side, so they cost EXT / BN of the tile's MMAs rather than a tile.
// Stages use the layout of gemm_tile.cuh: 128 bytes of K per row, 128-byte swizzle (what TMA's
// CU_TENSOR_MAP_SWIZZLE_128B writes, on 1024-byte aligned stages).
// Registers per thread after setmaxnreg (128 x 56 + 256 x 224 = 168 x 384). 40 / 232 measured slower
// for bf16 (H100, Qwen3-30B-A3B at M = 4096: 681-691 against 672-680 us uniform) and gave
// per-channel fp8 nothing, with or without extended items (docs/prefill-notes.md).
// A producer that decodes the weights (WS_DECODE, gemm_wsq.cuh) takes 88 from the consumers'
// (fewer made the decode spill, and the consumers spill below 208).
constexpr int PRODUCER_REGS = WS_DECODE ? 88 : 56, CONSUMER_REGS = WS_DECODE ? 208 : 224;
static_assert(BM == 128 && GEMM_THREADS == 384, "a producer and two 64-row consumer warpgroups");
// setmaxnreg moves registers within what the block was launched with (168 a thread, the launch
// bounds' share): more would leave the consumers' setmaxnreg.inc waiting forever.
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 168 * GEMM_THREADS, "the block's registers");
static_assert(!WS_DECODE || CLUSTER == 1, "decoded weights: no clusters (each block decodes its own)");
// Decoded weights (WS_DECODE): who decodes a k-tile's BN * WSQ_CH 16-byte vectors (gemm_wsq.cuh).
// Where there are enough to halve and the codes are 4-bit (ON), the consumer warpgroups decode
// the second half (thread c of 256: vectors 128 NP + c + 256 j, j < NC) of the k-tile after their
// current one, between issuing a k-tile's MMAs and waiting for them, in issue slots the wgmma
// leaves idle; the producer decodes the first half (thread t: t + 128 j, j < NP), and all of each
// item's first WSQ_LEAD k-tiles (the consumers load their scales a k-tile ahead, within the item).
template <int BN>
struct WsqSplit {
    static constexpr int N = BN * (PACK_BITS / 2) / 128;  // a producer thread's when it decodes all
    static_assert(!WS_DECODE || N * 128 == BN * (PACK_BITS / 2), "whole vectors per producer thread");
    // A consumer thread's: 1 of 4 (256 columns) or of 3 (192), the producer keeping 2 or 1.
    static constexpr int NC = (N + 1) / 4;
    // 8-bit codes stay with the producer: int8 ran 4-6% slower split (H100, Qwen3-30B-A3B).
    static constexpr bool ON = WS_DECODE && PACK_BITS == 4 && NC > 0;
    static constexpr int NP = ON ? N - 2 * NC : N;         // a producer thread's share
    static_assert(!WS_DECODE || N % NP == 0, "the producer decodes all in passes of its share");
};
constexpr int WSQ_LEAD = 2;
// Whether the consumers decode their share of an item's k-tile kt.
template <int BN>
__device__ __forceinline__ bool wsq_shared(int kt) { return WsqSplit<BN>::ON && kt >= WSQ_LEAD; }
// Arrivals that fill a stage: each producer thread's cp.async of A, and thread 0's arming of the
// weights' TMA bytes or (WS_DECODE) each producer thread once its decoded weights are stored, and
// each consumer warp once its share is (thread 0 arrives for them where the producer decodes all).
template <int BN>
__host__ __device__ constexpr int ws_full_arrivals() { return WS_DECODE ? 256 + (WsqSplit<BN>::ON ? 8 : 0) : 129; }

template <int BN, bool PROMOTE = FP8, int EXT = 0>
struct WsShape {
    static constexpr int A_BYTES = (BM + EXT) * BK_BYTES;
    static constexpr int B_BYTES = BN * BK_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int NF = BN / 8;  // n8 fragments of a consumer's m64nBN accumulator
    static constexpr int ACC = NF * 4;
    // PROMOTE (fp8 with scales that change along K) reduces each k-tile into a partial
    // accumulator before scaling it into acc; past 128
    // columns the two would not fit in registers, so it takes the columns in two halves. (Parts
    // of 64 columns with two partials, one part's MMAs in flight while the previous one is
    // scaled, ran slower on the H100: Qwen3-30B-A3B fp8 at M = 4096 690-704 -> 780-793 us.)
    static constexpr int HALVES = (PROMOTE && BN > 128) ? 2 : 1;
    static constexpr int NFH = NF / HALVES;  // fragments per half
    static constexpr int A_ROWS = BM / 16;  // rows each producer thread gathers per stage (8 chunks of 16 B per row)
    static constexpr int EXT_ROWS = EXT / 16;  // of the extended rows each producer thread gathers
    static constexpr int EXT_ACC = EXT;  // ext_mma: two m64nEXT accumulators per consumer thread
    static_assert(EXT % 16 == 0 && (EXT == 0 || (BN == 256 && !PROMOTE)), "extended rows: 256 columns, unscaled along K");
    static_assert(A_BYTES % 1024 == 0, "the B stage 1024-aligned (its TMA swizzle)");
};

// A box of the 2-D tensor map at (k element, row) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap& map, int k, int row, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], [%4];" ::"r"(
            dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(k), "r"(row), "r"(bar)
        : "memory");
}
// The same box multicast to the blocks of `mask`: each receives it at dst and completes it on its
// own barrier at offset `bar`.
__device__ __forceinline__ void tma_load_2d_mc(unsigned dst, const TmaMap& map, int k, int row, unsigned bar,
                                               unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, { %2, "
        "%3 }], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(k), "r"(row), "r"(bar), "h"(mask)
        : "memory");
}
// cp_async16 with an L2 policy that keeps the line ahead of others (evict_last): GEMM1's
// activation rows, gathered again by every column block and every expert their tokens chose,
// would otherwise leave L2 under the stream of weight tiles and come back from DRAM.
__device__ __forceinline__ void cp_async16_keep(unsigned dst, const void* src, bool valid, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ unsigned long long l2_evict_last() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}
// TMA the box to every block of the cluster (multicast) or to this block only.
__device__ __forceinline__ void tma_load_tile(unsigned dst, const TmaMap& map, int k, int row, unsigned bar,
                                              bool multicast) {
    if (CLUSTER > 1 && multicast) tma_load_2d_mc(dst, map, k, row, bar, (1u << CLUSTER) - 1);
    else tma_load_2d(dst, map, k, row, bar);
}
__device__ __forceinline__ int cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// A shared::cta address of this block -> the same offset in block `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_addr(unsigned a, int rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
// Arrive on a barrier of a block of the cluster. The release at cluster scope makes this
// thread's earlier writes (the item hand-over) visible there; a consumer's release of a stage
// publishes no data (its MMAs have read the stage), so it arrives at the default .cta scope and
// skips that cluster-wide fence on every k-tile.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned cluster_bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_n(unsigned bar, int n) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(unsigned cluster_bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar) : "memory");
}
__device__ __forceinline__ void st_cluster(unsigned cluster_addr, int v) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(cluster_addr), "r"(v) : "memory");
}
// Every thread of every block of the cluster (barriers initialised; no block exits while the
// other may still write its shared memory or arrive on its barriers).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Where the consumer warpgroups' per-column floats start: past the barriers and item slots (bars
// is 1024-aligned: the stages' end).
__host__ __device__ constexpr unsigned ws_cols_off() { return (32 * STAGES + 32 + 8 + 15) & ~15u; }
__device__ __forceinline__ unsigned ws_cols_addr(unsigned bars) {
    return bars + ws_cols_off();
}
// The cols of both consumer warpgroups; none where decoded weights scale every column alike
// (COLS false: the epilogue takes the decode's unit as a constant).
template <int BN>
__host__ __device__ constexpr unsigned ws_cols_bytes() { return WS_DECODE && !COLS ? 0 : 2 * BN * 4; }
// Each consumer warp's 2 KiB for staging its output rows (store_warp_rows), past the cols.
template <int BN>
__device__ __forceinline__ unsigned ws_out_addr(unsigned bars) {
    return ws_cols_addr(bars) + ws_cols_bytes<BN>() + (threadIdx.x / 32 - 4) * 2048;
}
// Past the staging: an extended item's EXT rows x BN / 2 activations (act_t), between ext_act
// and ext_store (extended items only).
template <int BN>
__host__ __device__ constexpr unsigned ws_ext_off() { return ws_cols_off() + ws_cols_bytes<BN>() + 8 * 2048; }
// The dynamic shared memory ws_gemm<BN, .., EXT> takes: 1 KiB of alignment slack, the stages,
// then from bars up to the end of the extended rows (checked against the host's in grouped_gemm.cu).
// WS_DECODE: past the staging, the packed weights' ring: its 2 PACK_RING mbarriers (64 bytes),
// then from the next 128 bytes PACK_RING slots of a k-tile's packed rows (BN x 8 PACK_BITS bytes).
template <int BN>
__host__ __device__ constexpr unsigned ws_ring_off() { return ws_ext_off<BN>(); }
template <int BN>
__host__ __device__ constexpr unsigned ws_slots_off() { return (ws_ring_off<BN>() + 64 + 127) & ~127u; }
template <int BN>
__host__ __device__ constexpr int ws_pack_bytes() { return BN * 8 * PACK_BITS; }
// Past the ring's slots: two items' A row offsets (BM u32 each), written when the producer takes
// an item and read at each of its k-tiles, then (extended items) two items' EXT more.
constexpr int WS_ROW_BUF = 2 * BM * 4;
template <int BN>
__host__ __device__ constexpr unsigned ws_row_buf_off() { return ws_slots_off<BN>() + PACK_RING * ws_pack_bytes<BN>(); }
// Where the extended rows' activations lie: past the staging, or with decoded weights (whose
// ring lies there) in the staging itself, which the consumer warps take for their epilogue only
// once the activations are stored (ext_store's barriers): so that the tiles' shared memory stays
// within the carve-out that keeps 60 KB of L1 for the scale loads (GemmTiles::pack_ring).
template <int BN, int EXT>
__host__ __device__ constexpr unsigned ws_ext_buf_off() {
    return WS_DECODE ? ws_cols_off() + ws_cols_bytes<BN>() : ws_ext_off<BN>();
}
template <int BN, int EXT>
__device__ __forceinline__ unsigned ws_ext_addr(unsigned bars) {
    return bars + ws_ext_buf_off<BN, EXT>();
}
template <int BN, int EXT>
__host__ __device__ constexpr int ws_smem_bytes() {
    if constexpr (WS_DECODE) {
        static_assert(EXT * BN * (int)sizeof(act_t) <= 8 * 2048, "the extended rows within the staging");
        return 1024 + STAGES * WsShape<BN, false, EXT>::STAGE_BYTES + ws_row_buf_off<BN>() + WS_ROW_BUF + 2 * EXT * 4;
    } else {
        return 1024 + STAGES * WsShape<BN, false, EXT>::STAGE_BYTES + ws_ext_buf_off<BN, EXT>() +
               EXT * (BN / 2) * (int)sizeof(act_t);
    }
}
// An extended item's rows BM .. BM + EXT of stage (sa, sb) against consumer warpgroup wg's 64
// of each half of the BN = 256 weight rows (the gate neurons 64 wg .. and their up rows), as
// D^T = B . A^T: weight rows as wgmma's M (A operand), the extended rows as its N (B operand), both
// K-major in the stage as they are. eacc: the gate's m64nEXT accumulator, then the up's: element
// (nf, i) of each is neuron 64 wg + row (the accumulator's row, lane / 4 + 8 (i / 2) of the warp's
// 16) and extended row 8 nf + 2 (lane % 4) + i % 2. Part of the k-tile's commit group.
template <int EXT>
__device__ __forceinline__ void ext_mma(unsigned sa, unsigned sb, int wg, float* eacc, bool fresh) {
    constexpr int BN = 256;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            Wgmma<EXT>::mma(eacc + half * (EXT / 2), wgmma_desc(sb + (half * (BN / 2) + 64 * wg) * BK_BYTES + 32 * ks),
                            wgmma_desc(sa + BM * BK_BYTES + 32 * ks), !(fresh && ks == 0));
}
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4 };" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}
__device__ __forceinline__ uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
// store_warp_rows' fragments 0 .. NQ (even) through the staging, 8 at a time (a 64-column
// chunk of 128-byte rows; the last chunk may hold fewer): fragment q is the rows' 16-byte piece q.
template <int NQ, bool PAIRED, class Val>
__device__ __forceinline__ void store_warp_chunks(unsigned buf, Val val, act_t* const (&rows)[4]) {
    static_assert(NQ % 2 == 0, "stmatrix takes fragments two at a time");
    const int lane = threadIdx.x % 32;
    const int mrow = (lane / 8 % 2) * 8 + lane % 8;  // stmatrix: lanes 8 m .. address matrix m's rows
#pragma unroll
    for (int ch = 0; ch < (NQ + 7) / 8; ++ch) {
        constexpr int FULL = 8;
        const int in_chunk = NQ - 8 * ch < FULL ? NQ - 8 * ch : FULL;  // (a constant once unrolled)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (2 * j >= in_chunk) break;
            // Matrices (q, rows 0-7), (q, rows 8-15), (q + 1, rows 0-7), (q + 1, rows 8-15).
            unsigned r[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float2 v = val(8 * ch + 2 * j + m / 2, m % 2);
                const act_t pair[2] = {(act_t)v.x, (act_t)v.y};
                r[m] = *reinterpret_cast<const unsigned*>(pair);
            }
            const int chunk = 2 * j + lane / 16;
            stmatrix_x4(buf + mrow * 128 + ((chunk ^ (mrow & 7)) << 4), r);
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int row = lane / 8 + 4 * k, c = lane % 8;
            if (c >= in_chunk) continue;
            const uint4 v = lds128(buf + row * 128 + ((c ^ (row & 7)) << 4));
            if (rows[k]) *reinterpret_cast<uint4*>(rows[k] + 64 * ch + 8 * c) = PAIRED ? x_pair_chunk(v) : v;
        }
        __syncwarp();
    }
}
// A warp's 16 rows x 8 NQ columns in the accumulator layout (val(q, h): columns 8 q + 2 (lane % 4)
// + 0, 1 of row lane / 4 + 8 h), rounded to act_t and written to global memory 16 bytes at a time:
// 64 columns at once go through the warp's 2 KiB at `buf` (stmatrix, rows 128 bytes apart with
// their 16-byte chunks swizzled by the row), then each lane stores 4 rows' chunks. dst(r): where
// row r's first column goes, null to skip it (called once per row by every lane). Four times
// fewer stores than the 4-byte pairs of the fragments, which held the store queue.
// PAIRED: each 16-byte chunk stored in x_pair_col order (the intermediate of decoded weights).
template <int NQ, bool PAIRED = false, class Val, class Dst>
__device__ __forceinline__ void store_warp_rows(unsigned buf, Val val, Dst dst) {
    static_assert(sizeof(act_t) == 2, "16-bit values");
    const int lane = threadIdx.x % 32;
    static_assert(!PAIRED || NQ % 2 == 0, "paired rows go out in whole chunks");
    // An odd last fragment (widths of 16 q + 8 columns: 240 = 15 x 16), its pairs as they are.
    if constexpr (NQ % 2 != 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            act_t* row = dst(lane / 4 + 8 * h);
            const float2 v = val(NQ - 1, h);
            if (row) store_pair(row + 8 * (NQ - 1) + 2 * (lane % 4), v.x, v.y);
        }
    }
    if constexpr (NQ >= 2) {
        act_t* rows[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) rows[k] = dst(lane / 8 + 4 * k);
        store_warp_chunks<NQ / 2 * 2, PAIRED>(buf, val, rows);
    }
}
// A consumer warpgroup copies an item's BN per-column floats (src(j): columns j .. j + 3, 16-byte
// aligned) into its `cols` by cp.async, in flight until cols_ready. Its warps first agree that
// the previous item's epilogue is done reading them (named barriers 2 and 3, one per warpgroup).
template <int BN, class Src>
__device__ __forceinline__ void stage_cols(float* cols, Src src) {
    static_assert(BN / 4 <= 128, "one 16-byte copy per thread");
    const int t = threadIdx.x % 128;
    asm volatile("bar.sync %0, 128;" ::"r"(threadIdx.x / 128 + 1) : "memory");
    if (t < BN / 4) cp_async16(smem_u32(cols + 4 * t), src(4 * t), true);
    cp_async_commit();
}
__device__ __forceinline__ void cols_ready() {
    cp_async_wait<0>();
    asm volatile("bar.sync %0, 128;" ::"r"(threadIdx.x / 128 + 1) : "memory");
}

// The tiles of `work` items (cluster tiles), each a BM x BN tile per block over KT k-tiles, taken
// in order from a global counter (zero before launch) by whichever cluster is free: blocks that
// share a weight tile (consecutive items, see work_item) then stream it at the same time, so it
// comes from DRAM once; a static split drifts apart over the waves and re-reads it.
//   item(w, rank)              the work item's row tile for this block, column block, expert
//   a_row(item, r)             global address of row r of A (K-major), null for a padding row
//   a_any                      any readable address (the source of zero-filled padding rows)
//   b_load(item, kt, dst, bar, rank)  one thread: TMA this block's share of the item's B k-tile
//                              (BN x 128 bytes; with clusters multicast, see tma_load_tile)
// KEEP_A: A's rows stay in L2 ahead of the weights (cp_async16_keep).
// PROMOTE: the scales change along K (fp8 with 128-wide activation or weight blocks), so each
// k-tile's MMAs start a partial sum that is scaled into acc; otherwise (bf16, or fp8 with one
// scale per row and per column) acc accumulates the whole of K and the epilogue scales it.
//   kscale(item, kt, row0)     PROMOTE: the k-tile's scales (loaded before its MMAs, which hide
//                              their latency)
//   promote(sc, half, part, acc)  PROMOTE: fold the partial sums of half `half` of the k-tile's
//                              columns (fragments half * NFH ..) into acc with the scales sc
//   prepare(item, row0, cols)  consumer, at the item's start: issue what the epilogue reads
//                              (row indices; per-column data into cols by stage_cols), so that
//                              it arrives under the MMAs; returns it as an object for epilogue
//   epilogue(item, acc, row0, ep, cols, buf)  consumer: the accumulator, rows row0 + lane / 4
//                              (+ 8) of the tile; buf: the warp's staging (store_warp_rows)
//   ext_act(item, eacc, cols, buf)  EXT, an extended item (item.ext), before epilogue: the rows
//                              past BM from ext_mma's accumulators, activated, into buf
//                              (ws_ext_addr); nothing of them stays in registers over the
//                              epilogue, which otherwise spilled
//   ext_store(item, buf)       after ext_act, before epilogue: stores them from buf
// EARLY_B: the kernel is a programmatic dependent (griddepcontrol) of one that writes A, not B or
// the layout: the producer puts the first item's weight k-tiles in flight before it waits for
// that kernel, so they load under its tail; otherwise every thread waits before ws_gemm.
// A consumer warpgroup whose 64 rows are all padding (an expert's last tile holding <= 64 pairs:
// padding rows close a tile; with clusters, also a whole padding tile) keeps the barrier
// protocol but skips its MMAs and its epilogue.
// Consumer accumulators are the wgmma m64nBN layout: fragment nf, element i holds row
// row0 + lane / 4 + 8 (i / 2) and column 8 nf + 2 (lane % 4) + i % 2.
// Shared memory: STAGES stages (1024-aligned), full[STAGES] and empty[STAGES] mbarriers,
// item_full[2] and item_free[2] mbarriers, the item of each stage (16 bytes), the
// producer's two item slots, each consumer warpgroup's BN per-column floats (`cols`) and each
// consumer warp's 2 KiB of output staging.
// ext_act / ext_store of a GEMM without extended items.
struct NoExt {
    template <class It>
    __device__ void operator()(const It&, const float*, const float*, unsigned) const {}
    template <class It>
    __device__ void operator()(const It&, unsigned) const {}
};
// b_scales / b_decode / c_scales of a GEMM whose weights the TMA loads as they are. With decoded
// weights (WS_DECODE, gemm_wsq.cuh): b_scales(item, kt, all) the producer thread's scales of
// k-tile kt (all: its share and the consumers'), c_scales(item, kt) a consumer thread's, and
// b_decode(scales, all, slot, stage) either's vectors of a packed slot into a B stage.
struct NoDecode {
    template <class It>
    __device__ int operator()(const It&, int, bool) const { return 0; }
    template <class It>
    __device__ int operator()(const It&, int) const { return 0; }
    __device__ void operator()(int, bool, unsigned, unsigned) const {}
};
// a_load of a GEMM whose A rows the producer threads gather (cp.async), or (any other type)
// a_load(item, kt, stage, bar): thread 0 loads the item's A k-tile by TMA (rows in tile order).
struct GatherA {};
template <class T>
struct IsGatherA {
    static constexpr bool value = false;
};
template <>
struct IsGatherA<GatherA> {
    static constexpr bool value = true;
};

// The packed weights' ring (WS_DECODE) past `bars`: stream position pos's full and free mbarriers
// and its slot.
template <int BN>
__device__ __forceinline__ unsigned ws_pfull(unsigned bars, int pos) { return bars + ws_ring_off<BN>() + 8 * (pos % PACK_RING); }
template <int BN>
__device__ __forceinline__ unsigned ws_pfree(unsigned bars, int pos) {
    return bars + ws_ring_off<BN>() + 8 * (PACK_RING + pos % PACK_RING);
}
template <int BN>
__device__ __forceinline__ unsigned ws_pslot(unsigned bars, int pos) {
    return bars + ws_slots_off<BN>() + (pos % PACK_RING) * ws_pack_bytes<BN>();
}
// The producer warpgroup of a GEMM whose weights it decodes (WS_DECODE): thread 0 TMAs each
// k-tile's packed weight rows as stored (b_load, boxes of 8 PACK_BITS bytes per row) into a ring
// of PACK_RING slots, AHEAD k-tiles ahead of the one decoded; every producer thread gathers its A
// rows into the stage (cp.async, as ws_gemm's producer does, first, so that they land under the
// decode) and decodes its vectors of the slot into the stage's B rows (b_decode, in the 128-byte
// swizzle wgmma reads) with the scales b_scales loaded a k-tile earlier. Each producer warp
// releases a slot once decoded (its `pfree` mbarrier), which thread 0 waits for before refilling
// it. The k-tiles form one stream across the block's work items: the next item is taken when the
// loads reach it (AHEAD k-tiles before the decode does; named barrier 1 hands it to every
// producer thread), so its first weights are in flight under the current item's last k-tiles.
// A's rows: each producer thread resolves one row of an item when the item is taken (one load of
// the layout rather than eight at the item's start, where the first gathers waited on them), into
// the row buffer, which every thread reads at each k-tile (16-byte loads of its 8 rows) rather
// than holding them in registers the decode needs.
// Ring header (64 bytes): pfull[PACK_RING] (the TMA bytes), then pfree[PACK_RING] (the decoding warps).
template <int BN, int KT, bool KEEP_A, bool EARLY_B, int EXT, class SI, class Item, class ARow, class BLoad,
          class BScales, class BDecode, class ALoad>
__device__ __forceinline__ void ws_produce_decoded(unsigned base, unsigned bars, SI* stage_item, volatile int* next_item,
                                                   int work, int* work_counter, Item item, ARow a_row, const char* a_any,
                                                   BLoad b_load, BScales b_scales, BDecode b_decode, ALoad a_load) {
    using S = WsShape<BN, false, EXT>;
    constexpr bool GATHER = IsGatherA<ALoad>::value;
    constexpr int AHEAD = PACK_RING - 1 < KT ? PACK_RING - 1 : KT;
    static_assert(PACK_RING >= 2 && 16 * PACK_RING <= 64, "a slot decoded while the next loads; the ring's header");
    const int t = threadIdx.x, c = t % 8;
    auto pfull = [&](int pos) { return ws_pfull<BN>(bars, pos); };
    auto pfree = [&](int pos) { return ws_pfree<BN>(bars, pos); };
    auto pslot = [&](int pos) { return ws_pslot<BN>(bars, pos); };
    auto full = [&](int st) { return bars + 8 * st; };
    auto empty = [&](int st) { return bars + 8 * (STAGES + st); };
    using It = decltype(item(0, 0));
    // Stream position pos (its k-tile of item it) into its ring slot, once every warp has
    // decoded the slot's previous k-tile: thread 0.
    auto issue = [&](const It& it, int kt, int pos) {
        if (pos >= PACK_RING) mbar_wait(pfree(pos), ((pos / PACK_RING) & 1) ^ 1);
        mbar_arrive_expect_tx(pfull(pos), ws_pack_bytes<BN>());
        b_load(it, kt, pslot(pos), pfull(pos), 0);
    };
    // The next work item, by every producer thread: thread 0 takes it before barrier 1, the others
    // read it after (slot: alternately 0 and 1, so that thread 0's next write to a slot follows a
    // barrier after every lane's read of it).
    int slot = 0;
    auto take = [&]() {
        if (t == 0) next_item[slot] = atomicAdd(work_counter, 1);
        asm volatile("bar.sync 1, 128;" ::: "memory");
        int w = 0;
        if (t % 32 == 0) w = next_item[slot];
        slot ^= 1;
        return __shfl_sync(0xffffffffu, w, 0);
    };
    // Row r of an item goes to entry (r % 16) * 8 + r / 16 of its half of the row buffer, so that
    // thread t's rows t / 8 + 16 j are its group's 8 consecutive entries; an extended item's row
    // BM + r to entry r of its half of the EXT entries past them.
    const unsigned row_buf = bars + ws_row_buf_off<BN>(), ext_buf = row_buf + WS_ROW_BUF;
    auto offset_of = [&](const char* p) { return p ? (unsigned)((p - a_any) / 16) : ~0u; };
    auto put_row = [&](const It& x, int half) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(row_buf + half * BM * 4 + ((t % 16) * 8 + t / 16) * 4),
                     "r"(offset_of(a_row(x, t)))
                     : "memory");
        if (EXT > 0 && t < EXT && x.ext)
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(ext_buf + (half * EXT + t) * 4), "r"(offset_of(a_row(x, BM + t)))
                         : "memory");
    };
    int w = take();
    It it = item(w < work ? w : 0, 0), nit = it;
    bool have_next = w < work;
    if (t == 0 && have_next)
        for (int kt = 0; kt < AHEAD; ++kt) issue(it, kt, kt);
    if (GATHER && have_next) put_row(it, 0);
    if (EARLY_B) pdl_wait();
    int s = 0;                  // stream position: k-tiles decoded so far (stage s % STAGES)
    int half = 0;               // the row buffer's half that holds the current item's rows
    auto sc = b_scales(it, 0, true);  // this position's scales
    while (have_next) {
        it = nit;
        // Every thread's row of the item is in the buffer (and every thread is done with the
        // half the next item's rows go to).
        asm volatile("bar.sync 1, 128;" ::: "memory");
        const unsigned my_rows = row_buf + half * BM * 4 + (t / 8) * 32;
        // An extended item's rows past BM of this thread (rows BM + t / 8 + 16 j), read once: their
        // offsets (gathered A), or their addresses (A in tile order, where they follow the tile's).
        const bool ext = EXT > 0 && it.ext;
        unsigned ext_rows[S::EXT_ROWS > 0 ? S::EXT_ROWS : 1];
#pragma unroll
        for (int j = 0; j < S::EXT_ROWS; ++j)
            if (ext) {
                if constexpr (GATHER)
                    asm volatile("ld.shared.u32 %0, [%1];"
                                 : "=r"(ext_rows[j])
                                 : "r"(ext_buf + (half * EXT + t / 8 + 16 * j) * 4)
                                 : "memory");
                else
                    ext_rows[j] = (unsigned)((a_row(it, BM + t / 8 + 16 * j) - a_any) / 16);
            }
        have_next = false;
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt, ++s) {
            if (kt + AHEAD == KT) {  // the loads enter the next item
                const int wn = take();
                have_next = wn < work;
                if (have_next) {
                    nit = item(wn, 0);
                    if (GATHER) put_row(nit, half ^ 1);
                }
            }
            if (t == 0) {
                if (kt + AHEAD < KT) issue(it, kt + AHEAD, s + AHEAD);
                else if (have_next) issue(nit, kt + AHEAD - KT, s + AHEAD);
            }
            const int st = s % STAGES;
            const unsigned sa = base + st * S::STAGE_BYTES;
            mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
            // Which of the tile's 64-row halves hold pairs (the consumer warpgroups that compute).
            int live_halves;
            if constexpr (GATHER) {
                const uint4 r0 = lds128(my_rows), r1 = lds128(my_rows + 16);
                const unsigned rows[S::A_ROWS] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
                static_assert(S::A_ROWS == 8, "8 rows a thread");
#pragma unroll
                for (int j = 0; j < S::A_ROWS; ++j) {
                    // Without the L2 hint: with it, ptxas 13.0 built some formats' gathers with a
                    // corrupt address (reads at 0x3000000000 under memcheck, H100; int8 g64).
                    const bool live = rows[j] != ~0u;
                    cp_async16(sa + swz(t / 8 + 16 * j, c),
                               a_any + (live ? (size_t)rows[j] * 16 + kt * BK_BYTES : 0) + c * 16, live);
                }
                if (ext)
#pragma unroll
                    for (int j = 0; j < S::EXT_ROWS; ++j) {
                        const bool live = ext_rows[j] != ~0u;
                        cp_async16(sa + swz(BM + t / 8 + 16 * j, c),
                                   a_any + (live ? (size_t)ext_rows[j] * 16 + kt * BK_BYTES : 0) + c * 16, live);
                    }
                cp_async_arrive_noinc(full(st));
                live_halves = (rows[0] != ~0u) | (rows[4] != ~0u) << 1;
            } else {
                // One box by TMA (its bytes complete the stage's phase), an arrival from each of
                // the other threads in place of their copies'. An extended item's rows past the box:
                // a 16-byte chunk each by cp.async, every thread arriving once they land.
                if (ext) {
                    if (t == 0) {
                        mbar_expect_tx(full(st), BM * BK_BYTES);
                        a_load(it, kt, sa, full(st));
                    }
#pragma unroll
                    for (int j = 0; j < S::EXT_ROWS; ++j)
                        cp_async16(sa + swz(BM + t / 8 + 16 * j, c), a_any + (size_t)ext_rows[j] * 16 + kt * BK_BYTES + c * 16,
                                   true);
                    cp_async_arrive_noinc(full(st));
                } else if (t == 0) {
                    mbar_arrive_expect_tx(full(st), BM * BK_BYTES);
                    a_load(it, kt, sa, full(st));
                } else {
                    mbar_arrive(full(st));
                }
                live_halves = (it.rows > 0) | (it.rows > 64) << 1;
            }
            mbar_wait(pfull(s), (s / PACK_RING) & 1);
            // Where the consumers take no share, thread 0 also arrives for their 8 warps.
            const bool all = !wsq_shared<BN>(kt);
            const int arrivals = 1 + (WsqSplit<BN>::ON && all && t == 0 ? 8 : 0);
            b_decode(sc, all, pslot(s), sa + S::A_BYTES);
            __syncwarp();
            if (t % 32 == 0) mbar_arrive_n(pfree(s), arrivals);
            fence_async_smem();  // the stores reach wgmma's async proxy
            if (t == 0 && kt == 0) stage_item[st] = SI{live_halves, it};
            mbar_arrive_n(full(st), arrivals);
            // The next position's scales, loaded after this stage's fence and arrival: loaded a
            // k-tile ahead, before the decode, they stalled the fence and held registers across the
            // decode (H100, Qwen3-30B-A3B at M = 4096: int8 g64 1431 -> 1282 us, 4-bit 2-5%).
            if (kt + 1 < KT) sc = b_scales(it, kt + 1, !wsq_shared<BN>(kt + 1));
            else if (have_next) sc = b_scales(nit, 0, true);
        }
        half ^= 1;
    }
    // No more work: a stage with no data and live = -1 tells the consumers.
    const int st = s % STAGES;
    mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
    if (t == 0) stage_item[st].live = -1;
    mbar_arrive(full(st));
    mbar_arrive_n(full(st), 1 + (WsqSplit<BN>::ON && t == 0 ? 8 : 0));
    cp_async_wait<0>();
}

template <int BN, int KT, bool PROMOTE, bool KEEP_A, bool EARLY_B, int EXT, class Item, class ARow, class BLoad,
          class KScale, class Promote, class Prepare, class Epilogue, class ExtAct, class ExtStore,
          class BScales = NoDecode, class BDecode = NoDecode, class CScales = NoDecode, class ALoad = GatherA>
__device__ __forceinline__ void ws_gemm(char* smem_raw, int work, int* work_counter, Item item, ARow a_row,
                                        const char* a_any, BLoad b_load, KScale kscale, Promote promote,
                                        Prepare prepare, Epilogue epilogue, ExtAct ext_act, ExtStore ext_store,
                                        BScales b_scales = {}, BDecode b_decode = {}, CScales c_scales = {},
                                        ALoad a_load = {}) {
    using S = WsShape<BN, PROMOTE, EXT>;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned bars = base + STAGES * S::STAGE_BYTES;
    auto full = [&](int st) { return bars + 8 * st; };
    auto empty = [&](int st) { return bars + 8 * (STAGES + st); };
    auto item_full = [&](int slot) { return bars + 16 * STAGES + 8 * slot; };
    auto item_free = [&](int slot) { return bars + 16 * STAGES + 16 + 8 * slot; };
    // Each stage's work item as the producer resolved it, so that consumers start an item without
    // global loads: live bit h = rows 64 h .. of the tile hold pairs; live = -1: no more work.
    using It = decltype(item(0, 0));
    struct alignas(16) StageItem {
        int live;
        It it;
    };
    static_assert(sizeof(StageItem) == 16, "a 16-byte slot per stage, read as one int4");
    StageItem* stage_item = reinterpret_cast<StageItem*>(smem_raw + (bars + 16 * STAGES + 32 - smem_u32(smem_raw)));
    volatile int* next_item = reinterpret_cast<volatile int*>(smem_raw + (bars + 32 * STAGES + 32 - smem_u32(smem_raw)));
    const int rank = CLUSTER > 1 ? cluster_rank() : 0;
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(full(st), ws_full_arrivals<BN>());
            mbar_init(empty(st), 8 * CLUSTER);
        }
        for (int slot = 0; slot < 2; ++slot) {
            mbar_init(item_full(slot), 1);
            mbar_init(item_free(slot), 4 * CLUSTER);  // every producer warp of the cluster
        }
        if constexpr (WS_DECODE)
            for (int j = 0; j < PACK_RING; ++j) {
                mbar_init(bars + ws_ring_off<BN>() + 8 * j, 1);                 // pfull: the TMA's bytes
                // pfree: each producer warp, and each consumer warp where they decode a share
                mbar_init(bars + ws_ring_off<BN>() + 8 * (PACK_RING + j), 4 + (WsqSplit<BN>::ON ? 8 : 0));
            }
        mbar_init_fence();
    }
    if (CLUSTER > 1) cluster_sync();
    else __syncthreads();
    bool produced = false;
    if constexpr (WS_DECODE) {
        if (threadIdx.x < 128) {
            set_max_regs_dec<PRODUCER_REGS>();
            ws_produce_decoded<BN, KT, KEEP_A, EARLY_B, EXT>(base, bars, stage_item, next_item, work, work_counter, item,
                                                        a_row, a_any, b_load, b_scales, b_decode, a_load);
            produced = true;
        }
    }
    if (produced) {
    } else if (threadIdx.x < 128) {
        set_max_regs_dec<PRODUCER_REGS>();
        const int t = threadIdx.x, c = t % 8;
        const unsigned long long keep = KEEP_A ? l2_evict_last() : 0ull;
        int s = 0;  // k-tiles produced so far: stage s % STAGES, its use number s / STAGES
        // Thread 0 (of rank 0) takes each next item from the counter while it loads the current
        // item's last k-tile (w_next), so the atomic's round trip overlaps that stage's wait
        // rather than stalling the producer between items, and the item is taken no more than a
        // k-tile early (the tail's balance holds).
        int w_next = 0;
        for (int i = 0;; ++i) {
            // Two slots: thread 0 refills one while the others may still read the other.
            const int slot = i & 1;
            const unsigned slot_addr = smem_u32(const_cast<int*>(next_item + slot));
            if (t == 0) {
                if (CLUSTER == 1) {
                    next_item[slot] = i == 0 ? atomicAdd(work_counter, 1) : w_next;
                } else {
                    // Rank 0 takes the item for the cluster once both producers have read the
                    // slot's previous one, and hands it to each.
                    if (rank == 0) {
                        if (i >= 2) mbar_wait_cluster(item_free(slot), ((i >> 1) - 1) & 1);
                        const int w = i == 0 ? atomicAdd(work_counter, 1) : w_next;
                        for (int r = 0; r < CLUSTER; ++r) {
                            st_cluster(cluster_addr(slot_addr, r), w);
                            mbar_arrive_cluster(cluster_addr(item_full(slot), r));
                        }
                    }
                }
            }
            // Each producer warp's lane 0 reads the slot (with clusters, once it has acquired the
            // hand-over itself) and the warp takes it by a shuffle; that lane then tells rank 0
            // that its warp is done with the previous slot. The reader being the thread that
            // synchronises keeps the hand-over free of cross-thread (and cross-block) ordering.
            if (CLUSTER > 1 && t % 32 == 0) mbar_wait_cluster(item_full(slot), (i >> 1) & 1);
            asm volatile("bar.sync 1, 128;" ::: "memory");
            int w = 0;
            if (t % 32 == 0) w = next_item[slot];
            w = __shfl_sync(0xffffffffu, w, 0);
            if (CLUSTER > 1 && t % 32 == 0 && i > 0) mbar_arrive_cluster(cluster_addr(item_free(slot ^ 1), 0));
            if (w >= work) {  // tell the consumers: a stage with no data and live = -1
                const int st = s % STAGES;
                mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
                if (t == 0) {
                    stage_item[st].live = -1;
                    mbar_arrive(full(st));
                }
                mbar_arrive(full(st));
                break;
            }
            const auto it = item(w, rank);
            // (As 32-bit offsets from a_any, half the registers of these pointers, the rows made
            // Mixtral-8x7B 4-7% slower: docs/prefill-notes.md.)
            const char* rows[S::A_ROWS];
#pragma unroll
            for (int j = 0; j < S::A_ROWS; ++j) rows[j] = a_row(it, t / 8 + 16 * j);
            const bool ext = EXT > 0 && it.ext;
            const char* erows[S::EXT_ROWS > 0 ? S::EXT_ROWS : 1];
#pragma unroll
            for (int j = 0; j < S::EXT_ROWS; ++j) erows[j] = ext ? a_row(it, BM + t / 8 + 16 * j) : nullptr;
            // EARLY_B: the first item's first k-tiles of B go out before the wait for A's writer.
            constexpr int EARLY = EARLY_B ? (STAGES < KT ? STAGES : KT) : 0;
            if (EARLY > 0 && i == 0) {
                if (t == 0)
                    for (int kt = 0; kt < EARLY; ++kt) {
                        const unsigned sa = base + kt * S::STAGE_BYTES;
                        if (kt == 0) stage_item[0] = StageItem{(rows[0] != nullptr) | (rows[4] != nullptr) << 1, it};
                        mbar_arrive_expect_tx(full(kt), S::B_BYTES);
                        b_load(it, kt, sa + S::A_BYTES, full(kt), rank);
                    }
                pdl_wait();
            }
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++s) {
                const int st = s % STAGES;
                if (t == 0 && rank == 0 && kt == KT - 1) w_next = atomicAdd(work_counter, 1);
                mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
                const unsigned sa = base + st * S::STAGE_BYTES;
                if (t == 0 && !(i == 0 && kt < EARLY)) {
                    // Thread 0 holds rows 0 and 64 (padding rows close a tile).
                    if (kt == 0) stage_item[st] = StageItem{(rows[0] != nullptr) | (rows[4] != nullptr) << 1, it};
                    mbar_arrive_expect_tx(full(st), S::B_BYTES);  // both blocks' shares land here
                    b_load(it, kt, sa + S::A_BYTES, full(st), rank);
                }
#pragma unroll
                for (int j = 0; j < S::A_ROWS; ++j) {
                    const unsigned dst = sa + swz(t / 8 + 16 * j, c);
                    const char* src = (rows[j] ? rows[j] + kt * BK_BYTES : a_any) + c * 16;
                    if (KEEP_A) cp_async16_keep(dst, src, rows[j] != nullptr, keep);
                    else cp_async16(dst, src, rows[j] != nullptr);
                }
                // Without the L2 hint: with it, ptxas 13.0 gave this copy an odd uniform register
                // pair for the policy (illegal instruction on the H100).
                if (ext)
#pragma unroll
                    for (int j = 0; j < S::EXT_ROWS; ++j)
                        cp_async16(sa + swz(BM + t / 8 + 16 * j, c), (erows[j] ? erows[j] + kt * BK_BYTES : a_any) + c * 16,
                                   erows[j] != nullptr);
                cp_async_arrive_noinc(full(st));
            }
        }
        cp_async_wait<0>();
    } else {
        set_max_regs_inc<CONSUMER_REGS>();
        if (EARLY_B) pdl_wait();  // the epilogue reads what A's writer wrote (scales)
        const int cw = threadIdx.x / 32 - 4;  // consumer warp 0..7
        // This warpgroup's per-column floats (recomputed where used rather than held over the MMAs).
        auto cols = [&] {
            return reinterpret_cast<float*>(smem_raw + (ws_cols_addr(bars) - smem_u32(smem_raw))) + (cw / 4) * BN;
        };
        const int row0 = (cw / 4) * 64 + (cw % 4) * 16;
        const unsigned a_off = (cw / 4) * 64 * BK_BYTES;
        // The stage may be refilled once every block's consumers are done with it (the blocks of
        // a cluster write each other's stages).
        auto release = [&](int st) {
            __syncwarp();
            if (threadIdx.x % 32 == 0) {
                if (CLUSTER == 1) mbar_arrive(empty(st));
                else
#pragma unroll
                    for (int r = 0; r < CLUSTER; ++r) mbar_arrive_remote(cluster_addr(empty(st), r));
            }
        };
        // WG_LAG: warpgroup 1 starts once warpgroup 0 has taken WG_LAG k-tiles (named barrier 4:
        // warpgroup 0 arrives, 1 waits) and stays that far behind, so that each one's epilogue
        // runs under the other's MMAs. Warpgroup 0 arrives exactly once: at the top of its k-tile
        // number WG_LAG, or on leaving with no more than WG_LAG k-tiles taken.
        const int wg = cw / 4;
        auto lag_arrive = [&](int taken) {
            if (WG_LAG > 0 && wg == 0 && taken == WG_LAG) asm volatile("bar.arrive 4, 256;" ::: "memory");
        };
        if (WG_LAG > 0 && wg == 1) asm volatile("bar.sync 4, 256;" ::: "memory");
        // Decoded weights (WsqSplit::ON): at an item's k-tile kt (stream position s), this thread's
        // share of k-tile kt + 1 into its stage (once every consumer released the stage's previous
        // use and the packed k-tile is in its ring slot) with the scales loaded a k-tile earlier,
        // then the scales of k-tile kt + 2. Needs 3 stages or more: the stage after this one was
        // released at the previous k-tile.
        constexpr bool CDEC = WsqSplit<BN>::ON;
        static_assert(!CDEC || (STAGES >= 3 && !PROMOTE), "the consumers' decode runs a stage ahead");
        using CSc = decltype(c_scales(item(0, 0), 0));
        CSc csc{};
        auto cshare = [&](const It& it, int kt, int s) {
            if (kt + 1 < KT && wsq_shared<BN>(kt + 1)) {
                const int s1 = s + 1, st1 = s1 % STAGES;
                mbar_wait(empty(st1), ((s1 / STAGES) & 1) ^ 1);
                mbar_wait(ws_pfull<BN>(bars, s1), (s1 / PACK_RING) & 1);
                b_decode(csc, false, ws_pslot<BN>(bars, s1), base + st1 * S::STAGE_BYTES + S::A_BYTES);
                fence_async_smem();  // the stores reach wgmma's async proxy
                __syncwarp();
                if (threadIdx.x % 32 == 0) {
                    mbar_arrive(ws_pfree<BN>(bars, s1));
                    mbar_arrive(full(st1));
                }
            }
            if (kt + 2 < KT && wsq_shared<BN>(kt + 2)) csc = c_scales(it, kt + 2);
        };
        int s = 0;
        for (;;) {
            mbar_wait(full(s % STAGES), (s / STAGES) & 1);
            // Lane 0 reads the item and the warp takes it by shuffles: the lane that will release
            // the stage has then itself made the only read the producer's next write must follow.
            StageItem si;
            {
                int4 v = make_int4(0, 0, 0, 0);
                if (threadIdx.x % 32 == 0) v = *reinterpret_cast<const int4*>(&stage_item[s % STAGES]);
                v.x = __shfl_sync(0xffffffffu, v.x, 0);
                v.y = __shfl_sync(0xffffffffu, v.y, 0);
                v.z = __shfl_sync(0xffffffffu, v.z, 0);
                v.w = __shfl_sync(0xffffffffu, v.w, 0);
                memcpy(&si, &v, sizeof(si));
            }
            if (si.live < 0) {
                if (s <= WG_LAG) lag_arrive(WG_LAG);
                break;
            }
            const It it = si.it;
            if (!((si.live >> wg) & 1)) {
#pragma unroll 1
                for (int kt = 0; kt < KT; ++kt, ++s) {
                    lag_arrive(s);
                    if (kt > 0) mbar_wait(full(s % STAGES), (s / STAGES) & 1);
                    release(s % STAGES);
                    if constexpr (CDEC) cshare(it, kt, s);
                }
                continue;
            }
            const auto ep = prepare(it, row0, cols());
            const bool ext = EXT > 0 && it.ext;  // (then both warpgroups' rows are live)
            float eacc[S::EXT_ACC > 0 ? S::EXT_ACC : 1];
            float acc[S::ACC];
            float part[PROMOTE ? S::NFH * 4 : 1];
            if (PROMOTE)
#pragma unroll
                for (int j = 0; j < S::ACC; ++j) acc[j] = 0.f;
            // The k-loop in two copies, with and without the extended rows' MMAs: a branch between
            // a k-tile's wgmma and its commit makes ptxas close the group early, and each k-tile
            // then waits for its own MMAs rather than the previous one's.
            auto kloop = [&](const bool with_ext) {
#pragma unroll 1
                for (int kt = 0; kt < KT; ++kt, ++s) {
                    lag_arrive(s);
                    const int st = s % STAGES;
                    const auto sc = kscale(it, kt, row0);  // (a no-op without PROMOTE)
                    if (kt > 0) mbar_wait(full(st), (s / STAGES) & 1);
                    fence_async_smem();  // A arrived through the generic proxy (cp.async); wgmma reads via the async one
                    const unsigned sa = base + st * S::STAGE_BYTES, sb = sa + S::A_BYTES;
                    if constexpr (PROMOTE) {
                        // Each half afresh, then scaled into acc while the other warpgroup's MMAs run.
#pragma unroll
                        for (int half = 0; half < S::HALVES; ++half) {
                            wgmma_fence();
#pragma unroll
                            for (int ks = 0; ks < 4; ++ks)
                                Wgmma<BN / S::HALVES>::mma(part, wgmma_desc(sa + a_off + 32 * ks),
                                                           wgmma_desc(sb + half * (BN / S::HALVES) * BK_BYTES + 32 * ks), ks > 0);
                            wgmma_commit();
                            wgmma_wait0();
                            if (half == S::HALVES - 1) release(st);
                            promote(sc, half, part, acc);
                        }
                    } else {
                        wgmma_fence();
#pragma unroll
                        for (int ks = 0; ks < 4; ++ks)  // the item's first MMA starts acc afresh
                            Wgmma<BN>::mma(acc, wgmma_desc(sa + a_off + 32 * ks), wgmma_desc(sb + 32 * ks), ks > 0 || kt > 0);
                        if constexpr (EXT > 0)
                            if (with_ext) ext_mma<EXT>(sa, sb, wg, eacc, kt == 0);
                        wgmma_commit();
                        if constexpr (CDEC) cshare(it, kt, s);
                        // Keep this k-tile's MMAs in flight; the previous one's are done with its stage.
                        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                        if (kt > 0) release((s - 1) % STAGES);
                    }
                }
            };
            if (ext) kloop(true);  // (the call sites' constants fold into two copies)
            else kloop(false);
            if (!PROMOTE) {
                wgmma_wait0();
                release((s - 1) % STAGES);
            }
            // The extended rows are stored before the main epilogue rather than after it: bf16
            // Qwen3-30B-A3B at M = 4096 on an H200, two rounds, 588-596 against 601-603 us
            // uniform, 607-610 against 610-614 skewed (on an H100 within the spread).
            if (ext) {
                // Decoded weights: the buffer is the staging, free once every consumer warp is
                // past its previous epilogue.
                if constexpr (WS_DECODE) asm volatile("bar.sync 5, 256;" ::: "memory");
                ext_act(it, static_cast<const float*>(eacc), cols(), ws_ext_addr<BN, EXT>(bars));
                ext_store(it, ws_ext_addr<BN, EXT>(bars));
            }
            epilogue(it, acc, row0, ep, cols(), ws_out_addr<BN>(bars));
        }
    }
    if (CLUSTER > 1) cluster_sync();
}
