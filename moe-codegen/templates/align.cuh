// Alignment: the (token, slot) pairs `p = t * TOP_K + s` regrouped by expert into tiles of BM
// rows, each expert's rows padded to a whole tile, by
// moe_prepare (prepare.cuh) with no host synchronisation; the host sizes every buffer from upper
// bounds (max_tiles).
//   sorted_rows[tile * BM + r]  pair in that row, -1 for padding
//   pair_pos[p]                 the row holding pair p (the combine's inverse map), -1 if its id was bad
//   tile_expert[tile]           the expert of a tile; *num_tiles tiles are used
//   tile_span[tile]             (first tile, tiles, expert, pairs) of that expert, for the GEMMs'
//                               work order (one load resolves a work item)
//   num_tiles[1]                the hot experts' tiles, which come first (Layout)
//   tile_span1, num_tiles[2, 3] TAIL: the same for GEMM1's tiles, where an expert's last tile
//                               of no more than TAIL pairs for each tile before it (up to
//                               EXT_SPREAD of them) joins them (Work)
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

// The tiles' layout from the experts' pair counts, in shared memory: tiles per expert, the hot
// experts (HOT_TILES tiles or more) first, then the others, each group in expert order (work_item
// interleaves their items). Every block of moe_prepare builds it (a few block scans) rather than
// one block building it for the others behind a second grid barrier.
struct Layout {
    int first_of[EXPERTS], tiles_of[EXPERTS], count_of[EXPERTS];
    int first_ord[EXPERTS], expert_ord[EXPERTS];  // in layout order
    int total, hot_total;
    // GEMM1's tiles (TAIL): the same order, an expert's short last tile not counted.
    int first1_of[TAIL > 0 ? EXPERTS : 1], tiles1_of[TAIL > 0 ? EXPERTS : 1], first1_ord[TAIL > 0 ? EXPERTS : 1];
    int total1, hot_total1;

    // Every thread of the block; thread e holds expert e's count.
    __device__ __forceinline__ void build(int count) {
        const int tid = threadIdx.x;
        const int tiles = (count + BM - 1) / BM;
        const bool hot = tiles >= HOT_TILES;
        int all, hot_all, hot_experts;
        const int before = block_exclusive_scan(tiles, all);
        const int hot_before = block_exclusive_scan(hot ? tiles : 0, hot_all);
        const int hot_rank = block_exclusive_scan(hot ? 1 : 0, hot_experts);
        if (tid < EXPERTS) {
            const int first_tile = hot ? hot_before : hot_all + (before - hot_before);
            first_of[tid] = first_tile;
            tiles_of[tid] = tiles;
            count_of[tid] = count;
            const int ord = hot ? hot_rank : hot_experts + (tid - hot_rank);
            first_ord[ord] = first_tile;
            expert_ord[ord] = tid;
        }
        if (tid == 0) {
            total = all;
            hot_total = hot_all;
        }
        if constexpr (TAIL > 0) {
            // A short last tile of r pairs joins the n tiles before it where r <= TAIL min(n,
            // EXT_SPREAD) (Work).
            const int tiles1 = tiles - (tiles >= 2 && count - (tiles - 1) * BM <= TAIL * min(tiles - 1, EXT_SPREAD));
            int all1, hot_all1;
            const int before1 = block_exclusive_scan(tiles1, all1);
            const int hot_before1 = block_exclusive_scan(hot ? tiles1 : 0, hot_all1);
            if (tid < EXPERTS) {
                const int first1 = hot ? hot_before1 : hot_all1 + (before1 - hot_before1);
                first1_of[tid] = first1;
                tiles1_of[tid] = tiles1;
                first1_ord[hot ? hot_rank : hot_experts + (tid - hot_rank)] = first1;
            }
            if (tid == 0) {
                total1 = all1;
                hot_total1 = hot_all1;
            }
        } else if (tid == 0) {
            total1 = all;
            hot_total1 = hot_all;
        }
        __syncthreads();
    }

    // The expert of tile j in layout order, given each expert's first tile in that order: the
    // last with first <= j (one without tiles shares its first with the next, or is the last,
    // with first = the total > j).
    __device__ __forceinline__ int expert_at(const int* first, int j) const {
        int lo = 0, hi = EXPERTS - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= j) lo = mid;
            else hi = mid - 1;
        }
        return expert_ord[lo];
    }

    // The tile -> expert map and spans and the padding rows (-1) that close each expert's last
    // tile, split over the grid's threads (global thread g of `threads`); num_tiles = (tiles, hot
    // tiles) from thread 0.
    __device__ __forceinline__ void write(int g, int threads, int* __restrict__ sorted_rows,
                                          int* __restrict__ tile_expert, int4* __restrict__ tile_span,
                                          int4* __restrict__ tile_span1, int* __restrict__ num_tiles) const {
        if (g == 0) {
            num_tiles[0] = total;
            num_tiles[1] = hot_total;
            num_tiles[2] = total1;
            num_tiles[3] = hot_total1;
        }
        for (int j = g; j < total; j += threads) {
            const int e = expert_at(first_ord, j);
            tile_expert[j] = e;
            tile_span[j] = make_int4(first_of[e], tiles_of[e], e, count_of[e]);
        }
        if constexpr (TAIL > 0)
            for (int j = g; j < total1; j += threads) {
                const int e = expert_at(first1_ord, j);
                tile_span1[j] = make_int4(first1_of[e], tiles1_of[e], e | (first_of[e] - first1_of[e]) << 16, count_of[e]);
            }
        // Padding: the last tiles * BM - count rows of each expert, fewer than BM; a warp per
        // expert (threads is whole warps), so that the experts a small step leaves empty cost
        // a test each.
        for (int e = g / 32; e < EXPERTS; e += threads / 32) {
            const int end = (first_of[e] + tiles_of[e]) * BM;
            for (int i = first_of[e] * BM + count_of[e] + g % 32; i < end; i += 32) sorted_rows[i] = -1;
        }
    }
};
