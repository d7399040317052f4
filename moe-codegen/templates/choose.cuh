// The dispatcher: which family runs this step, decided on the device from its live routing, so
// that a step needs no host synchronisation and can be captured in a graph. Each candidate's time
// is modelled as c0 + cd * D + cp * P, D the distinct experts the step touches and P its valid
// (token, expert) pairs (the models come from a profile, or the host's analytic fallback). The
// candidates: warp decode, the grouped GEMMs and, where the layer has it (fused_on), the fused
// family; the least prediction wins, ties to the first of them. Every candidate family's kernels
// are launched after this one and all but the chosen one return at once (family_skipped). One
// block. out: {choice, D, P, 0, f32 bits of the decode, grouped and fused predictions}. The
// arithmetic is unfused round-to-nearest, as the host evaluates the models.
constexpr int CHOOSE_THREADS = 256;
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_choose)
extern "C" __global__ void __launch_bounds__(CHOOSE_THREADS)
moe_choose(const __grid_constant__ ChooseParams params) {
    MOE_UNPACK_ChooseParams(params);
    constexpr int WORDS = (EXPERTS + 31) / 32;
    __shared__ unsigned seen[WORDS];
    __shared__ int totals[2];  // valid pairs, distinct experts
    for (int i = threadIdx.x; i < WORDS; i += CHOOSE_THREADS) seen[i] = 0u;
    if (threadIdx.x < 2) totals[threadIdx.x] = 0;
    pdl_wait();  // the routing belongs to earlier kernels
    pdl_launch_dependents();
    __syncthreads();
    int pairs = 0;
    for (int i = threadIdx.x; i < m * TOP_K; i += CHOOSE_THREADS) {
        const int e = topk_ids[i];
        if (e >= 0 && e < EXPERTS) {
            atomicOr(&seen[e / 32], 1u << (e % 32));
            ++pairs;
        }
    }
    if (pairs) atomicAdd(&totals[0], pairs);
    __syncthreads();
    int distinct = 0;
    for (int i = threadIdx.x; i < WORDS; i += CHOOSE_THREADS) distinct += __popc(seen[i]);
    if (distinct) atomicAdd(&totals[1], distinct);
    __syncthreads();
    if (threadIdx.x == 0) {
        const float p = (float)totals[0], d = (float)totals[1];
        const float td = __fadd_rn(__fadd_rn(decode_c0, __fmul_rn(decode_cd, d)), __fmul_rn(decode_cp, p));
        const float tg = __fadd_rn(__fadd_rn(grouped_c0, __fmul_rn(grouped_cd, d)), __fmul_rn(grouped_cp, p));
        const float tf = __fadd_rn(__fadd_rn(fused_c0, __fmul_rn(fused_cd, d)), __fmul_rn(fused_cp, p));
        int family = FAMILY_WARP_DECODE;
        float best = td;
        if (tg < best) family = FAMILY_GROUPED, best = tg;
        if (fused_on && tf < best) family = FAMILY_FUSED, best = tf;
        out[0] = family;
        out[1] = totals[1];
        out[2] = totals[0];
        out[3] = 0;
        out[4] = __float_as_int(td);
        out[5] = __float_as_int(tg);
        out[6] = fused_on ? __float_as_int(tf) : 0;
    }
}
#endif  // entry moe_choose
