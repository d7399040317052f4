// Alignment: the (token, slot) pairs `p = t * TOP_K + s` regrouped by expert into tiles of BM
// rows, each expert's rows padded to whole clusters of CLUSTER tiles (gemm_ws.cuh), by
// moe_prepare (prepare.cuh) with no host synchronisation; the host sizes every buffer from upper
// bounds (max_tiles).
//   sorted_rows[tile * BM + r]  pair in that row, -1 for padding
//   pair_pos[p]                 the row holding pair p (the combine's inverse map), -1 if its id was bad
//   tile_expert[tile]           the expert of a tile; *num_tiles tiles are used
//   tile_span[tile]             (first tile, tiles, expert, 0) of that expert, for the GEMMs' work
//                               order (one load resolves a work item)
//   num_tiles[1]                the hot experts' tiles, which come first (align_layout)
// Out-of-range ids are skipped and counted in *errors.
constexpr int ALIGN_THREADS = 1024;
static_assert(EXPERTS <= ALIGN_THREADS, "one thread scans one expert");

// Exclusive prefix of v over the block's threads, and the block's total (every thread calls it).
__device__ __forceinline__ int block_exclusive_scan(int v, int& total) {
    __shared__ int warp_total[ALIGN_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(MOE_FULL_MASK, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = warp_total[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(MOE_FULL_MASK, w, o);
            if (lane >= o) w += u;
        }
        warp_total[lane] = w;  // inclusive
    }
    __syncthreads();
    const int excl = incl - v + (warp > 0 ? warp_total[warp - 1] : 0);
    total = warp_total[ALIGN_THREADS / 32 - 1];
    __syncthreads();  // the next scan reuses warp_total
    return excl;
}

// One block, from thread e's count of expert e: tiles per expert and their layout: the hot
// experts (HOT_TILES tiles or more) first, then the others, each group in expert order (work_item
// interleaves their items); each expert's first row (cursor); then with every thread the tile ->
// expert map and spans and the padding rows (-1) that close each expert's last tile. num_tiles =
// (tiles, hot tiles).
__device__ void align_layout(int count, int* __restrict__ cursor, int* __restrict__ sorted_rows,
                             int* __restrict__ tile_expert, int4* __restrict__ tile_span, int* __restrict__ num_tiles) {
    __shared__ int first_of[EXPERTS], tiles_of[EXPERTS], count_of[EXPERTS];
    __shared__ int first_ord[EXPERTS], expert_ord[EXPERTS];  // in layout order
    const int tid = threadIdx.x;
    const int tiles = (count + BM * CLUSTER - 1) / (BM * CLUSTER) * CLUSTER;  // whole clusters of tiles
    const bool hot = tiles >= HOT_TILES;
    int total, hot_total, hot_experts;
    const int before = block_exclusive_scan(tiles, total);
    const int hot_before = block_exclusive_scan(hot ? tiles : 0, hot_total);
    const int hot_rank = block_exclusive_scan(hot ? 1 : 0, hot_experts);
    const int first_tile = hot ? hot_before : hot_total + (before - hot_before);
    if (tid == 0) {
        num_tiles[0] = total;
        num_tiles[1] = hot_total;
    }
    if (tid < EXPERTS) {
        first_of[tid] = first_tile;
        tiles_of[tid] = tiles;
        count_of[tid] = count;
        const int ord = hot ? hot_rank : hot_experts + (tid - hot_rank);
        first_ord[ord] = first_tile;
        expert_ord[ord] = tid;
        cursor[tid] = first_tile * BM;
    }
    __syncthreads();
    // Tile j belongs to the last expert in layout order with first_ord <= j (one without tiles
    // shares its first_ord with the next, or is the last, with first_ord = total > j).
    for (int j = tid; j < total; j += ALIGN_THREADS) {
        int lo = 0, hi = EXPERTS - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first_ord[mid] <= j) lo = mid;
            else hi = mid - 1;
        }
        const int e = expert_ord[lo];
        tile_expert[j] = e;
        tile_span[j] = make_int4(first_of[e], tiles_of[e], e, 0);
    }
    // Padding: the last tiles * BM - count rows of each expert, fewer than BM * CLUSTER.
    for (int i = tid; i < EXPERTS * BM * CLUSTER; i += ALIGN_THREADS) {
        const int e = i / (BM * CLUSTER), r = i % (BM * CLUSTER);
        if (r < tiles_of[e] * BM - count_of[e]) sorted_rows[(first_of[e] + tiles_of[e]) * BM - 1 - r] = -1;
    }
}

// Each pair takes the next row of its expert; lanes of a warp with the same expert take
// consecutive rows with one atomic. Pairs first, first + stride, .. of this thread; every lane of
// a warp runs each round (the match). X_PER_ROW: the pair's row takes its token's x scale.
__device__ __forceinline__ void scatter_pairs(const int* __restrict__ ids, int pairs, int first, int stride,
                                              int* __restrict__ cursor, int* __restrict__ sorted_rows,
                                              int* __restrict__ pair_pos, const float* __restrict__ xs_token,
                                              float* __restrict__ xs_row) {
    const int lane = threadIdx.x % 32;
    const int rounds = (pairs + stride - 1) / stride;
    for (int r = 0; r < rounds; ++r) {
        const int p = r * stride + first;
        const int e = p < pairs ? __ldcg(ids + p) : -1;
        const bool ok = e >= 0 && e < EXPERTS;
        const unsigned peers = __match_any_sync(MOE_FULL_MASK, ok ? e : -1);
        const int leader = __ffs(peers) - 1;
        int base = 0;
        if (ok && lane == leader) base = atomicAdd(&cursor[e], __popc(peers));
        base = __shfl_sync(MOE_FULL_MASK, base, leader);
        if (ok) {
            const int pos = base + __popc(peers & ((1u << lane) - 1u));
            sorted_rows[pos] = p;
            pair_pos[p] = pos;
            if (X_PER_ROW) xs_row[pos] = __ldcg(xs_token + p / TOP_K);
        } else if (p < pairs) {
            pair_pos[p] = -1;
        }
    }
}
