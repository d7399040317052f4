// The dispatcher: which family runs this step, decided on the device from its live routing, so
// that a step needs no host synchronisation and can be captured in a graph. Each candidate's time
// is modelled as c0 + cd * D + cp * P, D the distinct experts the step touches and P its valid
// (token, expert) pairs (the planes come from a profile, or the host's analytic fallback). The
// candidates: warp decode and the fused family where the planes have them (decode_on, fused_on),
// and the grouped GEMMs; the least prediction wins, ties to the first of warp decode, grouped,
// fused. Every candidate family's kernels are launched after the choice and all but the chosen
// one return at once (family_skipped).
// out: {choice, D, P, 0, f32 bits of the decode, grouped and fused predictions}. The arithmetic
// is unfused round-to-nearest, as the host evaluates the models. The planes: DispatchPlanes (the
// module's head).
__device__ __forceinline__ float plane_at(const float (&c)[3], float d, float p) {
    return __fadd_rn(__fadd_rn(c[0], __fmul_rn(c[1], d)), __fmul_rn(c[2], p));
}

// The least of the predictions for P valid pairs on D distinct experts; writes `out` (one thread).
__device__ __forceinline__ int decide_family(int pairs, int distinct, const DispatchPlanes& planes, int* out) {
    const float p = (float)pairs, d = (float)distinct;
    const float td = plane_at(planes.decode, d, p);
    const float tg = plane_at(planes.grouped, d, p);
    const float tf = plane_at(planes.fused, d, p);
    int family = FAMILY_GROUPED;
    float best = tg;
    if (planes.decode_on && !(tg < td)) family = FAMILY_WARP_DECODE, best = td;
    if (planes.fused_on && tf < best) family = FAMILY_FUSED, best = tf;
    out[0] = family;
    out[1] = distinct;
    out[2] = pairs;
    out[3] = 0;
    out[4] = __float_as_int(td);
    out[5] = __float_as_int(tg);
    out[6] = planes.fused_on ? __float_as_int(tf) : 0;
    return family;
}

// The choice for the m * TOP_K ids, by every thread of a block of THREADS (each calls it once,
// no thread may have returned); thread 0 writes `out`. Returns the family to every thread.
template <int THREADS>
__device__ int choose_family(const int* ids, int m, const DispatchPlanes& planes, int* out) {
    constexpr int WORDS = (EXPERTS + 31) / 32;
    __shared__ unsigned seen[WORDS];
    __shared__ int totals[3];  // valid pairs, distinct experts, the family
    for (int i = threadIdx.x; i < WORDS; i += THREADS) seen[i] = 0u;
    if (threadIdx.x < 2) totals[threadIdx.x] = 0;
    __syncthreads();
    int pairs = 0;
    for (int i = threadIdx.x; i < m * TOP_K; i += THREADS) {
        const int e = __ldcg(ids + i);
        if (e >= 0 && e < EXPERTS) {
            atomicOr(&seen[e / 32], 1u << (e % 32));
            ++pairs;
        }
    }
    if (pairs) atomicAdd(&totals[0], pairs);
    __syncthreads();
    int distinct = 0;
    for (int i = threadIdx.x; i < WORDS; i += THREADS) distinct += __popc(seen[i]);
    if (distinct) atomicAdd(&totals[1], distinct);
    __syncthreads();
    if (threadIdx.x == 0) totals[2] = decide_family(totals[0], totals[1], planes, out);
    __syncthreads();
    return totals[2];
}

// The same choice from a block's per-expert pair counts (moe_prepare's one block, which has
// counted them), by one warp; every lane gets the family.
__device__ __forceinline__ int choose_from_counts(const int* counts, const DispatchPlanes& planes, int* out) {
    int pairs = 0, distinct = 0;
    for (int e = threadIdx.x % 32; e < EXPERTS; e += 32) {
        pairs += counts[e];
        distinct += counts[e] > 0;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        pairs += __shfl_xor_sync(MOE_FULL_MASK, pairs, o);
        distinct += __shfl_xor_sync(MOE_FULL_MASK, distinct, o);
    }
    int family = 0;
    if (threadIdx.x % 32 == 0) family = decide_family(pairs, distinct, planes, out);
    return __shfl_sync(MOE_FULL_MASK, family, 0);
}

// The choice as a kernel of its own (one block), where moe_prepare runs more than one block.
constexpr int CHOOSE_THREADS = 256;
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_choose)
extern "C" __global__ void __launch_bounds__(CHOOSE_THREADS)
moe_choose(const __grid_constant__ ChooseParams params) {
    MOE_UNPACK_ChooseParams(params);
    pdl_wait();  // the routing belongs to earlier kernels
    pdl_launch_dependents();
    choose_family<CHOOSE_THREADS>(topk_ids, m, planes, out);
}
#endif  // entry moe_choose
