// Alignment: the (token, slot) pairs `p = t * TOP_K + s` regrouped by expert into tiles of BM
// rows, each expert's rows padded to a whole tile. One block, no host synchronisation; buffers
// are sized by the host from upper bounds (max_tiles(pairs)).
//   sorted_rows[tile * BM + r]  pair in that row, -1 for padding
//   pair_pos[p]                 the row holding pair p (the combine's inverse map), -1 if its id was bad
//   tile_expert[tile]           the expert of a tile; *num_tiles tiles are used
// Out-of-range ids are skipped and counted in *errors.
constexpr int ALIGN_THREADS = 1024;
static_assert(EXPERTS <= ALIGN_THREADS, "one thread scans one expert");

extern "C" __global__ void __launch_bounds__(ALIGN_THREADS)
moe_align(const int* __restrict__ ids, int pairs, int* __restrict__ sorted_rows, int* __restrict__ pair_pos,
          int* __restrict__ tile_expert, int* __restrict__ num_tiles, int* __restrict__ errors) {
    __shared__ int count[EXPERTS];
    __shared__ int cursor[EXPERTS];
    __shared__ int warp_total[ALIGN_THREADS / 32];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    for (int e = tid; e < EXPERTS; e += ALIGN_THREADS) count[e] = 0;
    __syncthreads();
    int bad = 0;
    for (int p = tid; p < pairs; p += ALIGN_THREADS) {
        const int e = ids[p];
        if (e >= 0 && e < EXPERTS) atomicAdd(&count[e], 1);
        else ++bad;
    }
    if (bad) atomicAdd(errors, bad);
    __syncthreads();
    // Exclusive scan of tiles per expert: one thread per expert, warp scans, then the warp totals.
    const int tiles = tid < EXPERTS ? (count[tid] + BM - 1) / BM : 0;
    int incl = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(MOE_FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = warp_total[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(MOE_FULL_MASK, w, o);
            if (lane >= o) w += v;
        }
        warp_total[lane] = w;  // inclusive
    }
    __syncthreads();
    const int first_tile = incl - tiles + (warp > 0 ? warp_total[warp - 1] : 0);
    if (tid == ALIGN_THREADS - 1) *num_tiles = warp_total[31];
    if (tid < EXPERTS) {
        for (int j = 0; j < tiles; ++j) tile_expert[first_tile + j] = tid;
        cursor[tid] = first_tile * BM;
    }
    __syncthreads();
    // Scatter with warp-aggregated atomics: lanes with the same expert take consecutive rows.
    const int rounds = (pairs + ALIGN_THREADS - 1) / ALIGN_THREADS;
    for (int r = 0; r < rounds; ++r) {
        const int p = r * ALIGN_THREADS + tid;
        const int e = p < pairs ? ids[p] : -1;
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
        } else if (p < pairs) {
            pair_pos[p] = -1;
        }
    }
    __syncthreads();
    if (tid < EXPERTS)
        for (int pos = cursor[tid]; pos < (first_tile + tiles) * BM; ++pos) sorted_rows[pos] = -1;
}
