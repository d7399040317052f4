// The step's front in one cooperative launch (every block resident): routing (from logits, or
// the ids given), the expert histogram and, for fp8, x in e4m3; then the tiles' layout (align.cuh)
// and each pair's row. Separate kernels for these spent most of their time on launch, ramp and
// one memory round trip each while moving almost nothing; here two grid barriers stand between
// the phases. Blocks of ALIGN_THREADS threads, a warp per token; dynamic shared memory holds each
// warp's router scores (EXPERTS floats).
//   sync[0]   the barriers' arrival counter, zero on entry (the host clears it with the GEMMs'
//             work counters)
//   counts    per-expert pair counts, zero on entry and left zero
//   xs_token  fp8: x's scales by token (quant_token); X_PER_ROW: each then copied to the rows of
//             the token's pairs (xs_row), where GEMM1 reads it
constexpr int PREPARE_WARPS = ALIGN_THREADS / 32;

// Every thread of every block: this block's writes before, the others' after (the launch is
// cooperative, so all blocks are resident and the spin ends). target: arrivals expected so far.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        } while (seen < target);
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(ALIGN_THREADS)
moe_prepare(const float* __restrict__ logits, const float* __restrict__ bias, int m, int* __restrict__ topk_ids,
            float* __restrict__ topk_weights, const act_t* __restrict__ x, unsigned char* __restrict__ xq,
            float* __restrict__ xs_token, float* __restrict__ xs_row, int* __restrict__ counts,
            int* __restrict__ errors, unsigned* __restrict__ sync, int* __restrict__ cursor,
            int* __restrict__ sorted_rows, int* __restrict__ pair_pos, int* __restrict__ tile_expert,
            int4* __restrict__ tile_span, int* __restrict__ num_tiles) {
    __shared__ int hist[EXPERTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int e = threadIdx.x; e < EXPERTS; e += ALIGN_THREADS) hist[e] = 0;
    __syncthreads();
    // 1. Each token's choices (routed here when logits are given) into the block's histogram; x.
    float* scores = reinterpret_cast<float*>(smem) + warp * EXPERTS;
    int bad = 0;
    for (int t = blockIdx.x * PREPARE_WARPS + warp; t < m; t += gridDim.x * PREPARE_WARPS) {
        int id = -1;
        if (logits) id = route_token(logits, bias, t, scores, topk_ids, topk_weights);
        else if (lane < TOP_K) id = topk_ids[t * TOP_K + lane];
        if (lane < TOP_K) {
            if (id >= 0 && id < EXPERTS) atomicAdd(&hist[id], 1);
            else ++bad;
        }
        if constexpr (FP8) quant_token(x, t, xq, xs_token);
        __syncwarp();  // the next token's scores overwrite this one's
    }
    if (bad) atomicAdd(errors, bad);
    __syncthreads();
    for (int e = threadIdx.x; e < EXPERTS; e += ALIGN_THREADS)
        if (hist[e]) atomicAdd(&counts[e], hist[e]);
    grid_barrier(sync, gridDim.x);
    // 2. One block lays the tiles out and leaves the counts zero for the next step.
    if (blockIdx.x == 0) {
        const int count = threadIdx.x < EXPERTS ? __ldcg(counts + threadIdx.x) : 0;
        if (threadIdx.x < EXPERTS) counts[threadIdx.x] = 0;
        align_layout(count, cursor, sorted_rows, tile_expert, tile_span, num_tiles);
    }
    grid_barrier(sync, 2 * gridDim.x);
    // 3. Each pair takes its row.
    scatter_pairs(topk_ids, m * TOP_K, blockIdx.x * ALIGN_THREADS + threadIdx.x, gridDim.x * ALIGN_THREADS, cursor,
                  sorted_rows, pair_pos, xs_token, xs_row);
}
