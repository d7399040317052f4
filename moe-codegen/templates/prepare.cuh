// The step's front in one cooperative launch (every block resident), with one grid barrier:
//   1. a warp per token: its choices (routed here when logits are given, else the ids given),
//      each pair's rank among the block's pairs of its expert (a shared-memory atomic) and, for
//      fp8, x's row in e4m3 (weights decoded in registers: x's row paired); then each block reserves its pairs' rows within each expert's with
//      one global atomic per expert, whose old value is the block's offset there;
//   2. after the barrier every block builds the tiles' layout from the totals (align.cuh), writes
//      its share of the tile map and padding, and each pair takes row first_row(expert) + the
//      block's offset + its rank: no atomics.
// Separate kernels for these spent most of their time on launch, ramp and one memory round trip
// each while moving almost nothing. Blocks of ALIGN_THREADS threads; dynamic shared memory holds
// each warp's router scores (EXPERTS floats).
//   sync[0]   the barrier's arrival counter, zero on entry
//   counts    per-expert pair counts, zero on entry (the host clears both with the GEMMs' work
//             counters)
//   pair_pos  also holds each pair's rank across the barrier (read back by the thread that wrote it)
//   xs_token  fp8: x's scales by token (quant_token); X_PER_ROW: each then copied to the rows of
//             the token's pairs (xs_row), where GEMM1 reads it
//   xq        fp8: x in e4m3; X_PAIRED: x in act_t, paired (x_pair_col)
// A step of no more tokens than one block's warps (the host then launches one block and passes
// gemm_counters) takes no global atomics and no barrier: the block's counts are the totals, its
// offsets zero, each warp keeps its token's ids and ranks in registers, and the GEMMs' work
// counters are zeroed here instead of by a memset node before the launch. At a few tokens the
// step's front is a chain of memory round trips that GEMM1 waits behind. Where the device
// dispatches such a step, this block also makes the dispatcher's choice (choose_into). Where its
// ids are given (no logits), the host launches `moe_prepare_solo`: the same block without the
// router and the multi-block path.
constexpr int PREPARE_WARPS = ALIGN_THREADS / 32;
static_assert(PREPARE_WARPS * EXPERTS * sizeof(float) == HOST_PREPARE_SMEM, "each warp's scores (prepare_smem_bytes)");

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

// Token t's row of x as GEMM1 reads it: e4m3 with its scale (FP8), or paired (X_PAIRED); by a
// whole warp.
__device__ __forceinline__ void copy_x(const act_t* __restrict__ x, int t, unsigned char* __restrict__ xq,
                                       float* __restrict__ xs_token) {
    if constexpr (FP8) quant_token(x, t, xq, xs_token);
    if constexpr (X_PAIRED) {
        // x's row in GEMM1's paired order (x_pair_col), into xq (act_t).
        const uint4* src = reinterpret_cast<const uint4*>(x + (long)t * HIDDEN);
        uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<act_t*>(xq) + (long)t * HIDDEN);
#pragma unroll 4
        for (int c = threadIdx.x % 32; c < HIDDEN / 8; c += 32) dst[c] = x_pair_chunk(src[c]);
    }
}

// The kernel's body. SOLO_IDS: one block and the ids given (`moe_prepare_solo`), so neither the
// router nor the multi-block path is compiled in. That entry is a third of `moe_prepare`'s code,
// and the code of the kernels a step launches is what its GEMMs' speed was found to depend on:
// with the full entry's 57 KB (Qwen3-30B-A3B bf16) a dispatched step's GEMM1 ran up to a fifth
// slower (docs/dispatch.md, "The code a step launches").
template <bool SOLO_IDS>
__device__ __forceinline__ void prepare_step(const PrepareParams& params) {
    MOE_UNPACK_PrepareParams(params);
    __shared__ int block_pairs[EXPERTS];  // this block's pairs per expert, then its offset in each
    __shared__ Layout layout;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    pdl_launch_dependents();  // GEMM1 may take the SMs this grid leaves free and wait there
    const bool solo = SOLO_IDS || gemm_counters != nullptr;  // one block, a token per warp at most
    if (solo && threadIdx.x < 2) gemm_counters[threadIdx.x] = 0;
    // A step the device dispatches whose front is one block chooses here, from the pair counts
    // this block makes anyway: a launch fewer than moe_choose ahead of this kernel, and no
    // second read of the ids (the host passes ids, not logits, and no `choice`).
    const bool choose_here = choose_into != nullptr;
    if (!choose_here && family_skipped(choice, FAMILY_GROUPED)) {
        // No tiles: the GEMMs that follow find no work.
        if (blockIdx.x == 0 && threadIdx.x < 4) num_tiles[threadIdx.x] = 0;
        return;
    }
    for (int e = threadIdx.x; e < EXPERTS; e += ALIGN_THREADS) block_pairs[e] = 0;
    __syncthreads();
    // 1. Each token's choices, their ranks in the block, and x.
    float* scores = reinterpret_cast<float*>(smem) + warp * EXPERTS;
    int bad = 0;
    int solo_id = -1, solo_rank = -1;  // solo: this lane's pair of the warp's token
    for (int t = blockIdx.x * PREPARE_WARPS + warp; t < m; t += gridDim.x * PREPARE_WARPS) {
        // x's row heads for L2 while the router works (its loads then wait on L2, not DRAM).
        if ((FP8 || X_PAIRED) && lane == 0)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + (long)t * HIDDEN),
                         "r"((int)(HIDDEN * sizeof(act_t)))
                         : "memory");
        int id = -1;
        if (!SOLO_IDS && logits) id = route_token(logits, bias, t, scores, topk_ids, topk_weights);
        else if (lane < TOP_K) id = topk_ids[t * TOP_K + lane];
        if (lane < TOP_K) {
            const bool ok = id >= 0 && id < EXPERTS;
            const int rank = ok ? atomicAdd(&block_pairs[id], 1) : -1;
            if (solo) {
                solo_id = id;
                solo_rank = rank;
                if (!ok) pair_pos[t * TOP_K + lane] = -1;
            } else {
                pair_pos[t * TOP_K + lane] = rank;
            }
            bad += !ok;
        }
        if (!solo) copy_x(x, t, xq, xs_token);
        __syncwarp();  // the next token's scores overwrite this one's
    }
    __syncthreads();
    if (choose_here) {
        __shared__ int chosen;
        if (warp == 0) {
            const int family = choose_from_counts(block_pairs, planes, choose_into);
            if (lane == 0) chosen = family;
        }
        __syncthreads();
        if (chosen != FAMILY_GROUPED) {
            // No tiles, and no errors counted: the chosen family counts the step's bad ids.
            if (threadIdx.x < 4) num_tiles[threadIdx.x] = 0;
            return;
        }
    }
    // One block copies x once the grouped GEMMs are known to run, a token a warp (one call site:
    // fp8's quantizer is large code).
    if (solo && warp < m) copy_x(x, warp, xq, xs_token);
    if (bad) atomicAdd(errors, bad);
    if (solo) {
        // 2. as below, from this block's counts.
        layout.build(threadIdx.x < EXPERTS ? block_pairs[threadIdx.x] : 0);
        layout.write(threadIdx.x, ALIGN_THREADS, sorted_rows, tile_expert, tile_span, tile_span1, num_tiles);
        const int t = warp;
        if (t < m && lane < TOP_K && solo_rank >= 0) {
            const int p = t * TOP_K + lane;
            const int pos = layout.first_of[solo_id] * BM + solo_rank;
            sorted_rows[pos] = p;
            pair_pos[p] = pos;
            if (X_PER_ROW) xs_row[pos] = xs_token[t];  // this warp's own write (quant_token)
        }
        return;
    }
    if constexpr (!SOLO_IDS) {
        for (int e = threadIdx.x; e < EXPERTS; e += ALIGN_THREADS)
            if (block_pairs[e]) block_pairs[e] = atomicAdd(&counts[e], block_pairs[e]);
        grid_barrier(sync, gridDim.x);
        // 2. The layout, this block's share of its map and padding, and each pair's row.
        layout.build(threadIdx.x < EXPERTS ? __ldcg(counts + threadIdx.x) : 0);
        layout.write(blockIdx.x * ALIGN_THREADS + threadIdx.x, gridDim.x * ALIGN_THREADS, sorted_rows, tile_expert,
                     tile_span, tile_span1, num_tiles);
        for (int t = blockIdx.x * PREPARE_WARPS + warp; t < m; t += gridDim.x * PREPARE_WARPS) {
            if (lane >= TOP_K) continue;
            const int p = t * TOP_K + lane;
            const int rank = pair_pos[p];  // this thread's own write
            if (rank < 0) continue;
            const int e = __ldcg(topk_ids + p);
            const int pos = layout.first_of[e] * BM + block_pairs[e] + rank;
            sorted_rows[pos] = p;
            pair_pos[p] = pos;
            if (X_PER_ROW) xs_row[pos] = __ldcg(xs_token + t);
        }
    }
}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_prepare)
extern "C" __global__ void __launch_bounds__(ALIGN_THREADS)
moe_prepare(const __grid_constant__ PrepareParams params) {
    prepare_step<false>(params);
}
#endif  // entry moe_prepare
// A step of one block whose ids are given (gemm_counters set, logits null); no dynamic shared memory.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_prepare_solo)
extern "C" __global__ void __launch_bounds__(ALIGN_THREADS)
moe_prepare_solo(const __grid_constant__ PrepareParams params) {
    prepare_step<true>(params);
}
#endif  // entry moe_prepare_solo
