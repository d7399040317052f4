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
static_assert(EXPERTS <= ALIGN_THREADS, "thread e of a block holds expert e's count");

// The tiles' layout from the experts' pair counts, in shared memory: tiles per expert, the hot
// experts (HOT_TILES tiles or more) first, then the others, each group in expert order (work_item
// interleaves their items). Every block of moe_prepare builds it (one warp scans) rather than
// one block building it for the others behind a second grid barrier.
struct Layout {
    int first_of[EXPERTS], tiles_of[EXPERTS], count_of[EXPERTS];
    int first_ord[EXPERTS], expert_ord[EXPERTS];  // in layout order
    int total, hot_total;
    // GEMM1's tiles (TAIL): the same order, an expert's short last tile not counted.
    int first1_of[TAIL > 0 ? EXPERTS : 1], tiles1_of[TAIL > 0 ? EXPERTS : 1], first1_ord[TAIL > 0 ? EXPERTS : 1];
    int total1, hot_total1;

    // Every thread of the block; thread e holds expert e's count. One warp scans every expert
    // (EXPERTS / 32 a lane, in order): two block barriers, where block-wide scans took fifteen
    // on the step's critical path.
    __device__ __forceinline__ void build(int count) {
        constexpr int PER = (EXPERTS + 31) / 32;
        const int tid = threadIdx.x;
        if (tid < EXPERTS) count_of[tid] = count;
        __syncthreads();
        if (tid < 32) {
            const int e0 = tid * PER;
            // This lane's sums: tiles, hot tiles, hot experts, GEMM1's tiles and hot tiles.
            int sum[5] = {0, 0, 0, 0, 0};
            for (int e = e0; e < e0 + PER && e < EXPERTS; ++e) {
                const int c = count_of[e], t = (c + BM - 1) / BM, t1 = gemm1_tiles(c, t);
                const bool hot = t >= HOT_TILES;
                sum[0] += t;
                sum[1] += hot ? t : 0;
                sum[2] += hot;
                sum[3] += t1;
                sum[4] += hot ? t1 : 0;
            }
            int before[5], all[5];
#pragma unroll
            for (int v = 0; v < 5; ++v) {
                int incl = sum[v];
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int u = __shfl_up_sync(MOE_FULL_MASK, incl, o);
                    if (tid >= o) incl += u;
                }
                before[v] = incl - sum[v];
                all[v] = __shfl_sync(MOE_FULL_MASK, incl, 31);
            }
            for (int e = e0; e < e0 + PER && e < EXPERTS; ++e) {
                const int c = count_of[e], t = (c + BM - 1) / BM, t1 = gemm1_tiles(c, t);
                const bool hot = t >= HOT_TILES;
                const int first = hot ? before[1] : all[1] + (before[0] - before[1]);
                const int ord = hot ? before[2] : all[2] + (e - before[2]);
                first_of[e] = first;
                tiles_of[e] = t;
                first_ord[ord] = first;
                expert_ord[ord] = e;
                if constexpr (TAIL > 0) {
                    const int first1 = hot ? before[4] : all[4] + (before[3] - before[4]);
                    first1_of[e] = first1;
                    tiles1_of[e] = t1;
                    first1_ord[ord] = first1;
                }
                before[0] += t;
                before[1] += hot ? t : 0;
                before[2] += hot;
                before[3] += t1;
                before[4] += hot ? t1 : 0;
            }
            if (tid == 0) {
                total = all[0];
                hot_total = all[1];
                total1 = all[3];
                hot_total1 = all[4];
            }
        }
        __syncthreads();
    }

    // GEMM1's tiles of an expert with c pairs in t tiles (TAIL): a short last tile of r pairs
    // joins the n tiles before it where r <= TAIL min(n, EXT_SPREAD) (Work).
    __device__ __forceinline__ static int gemm1_tiles(int c, int t) {
        if constexpr (TAIL > 0) return t - (t >= 2 && c - (t - 1) * BM <= TAIL * min(t - 1, EXT_SPREAD));
        return t;
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
