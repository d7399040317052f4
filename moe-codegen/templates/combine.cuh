// The grouped family's last kernels: the rows' gather-reduce into y, or y32's conversion after
// the atomic GEMM2.
// The gather-reduce combine (deterministic): y[t] = sum over slots s, in slot order and in f32,
// of topk_weights[t * K + s] * rows[pair_pos[t * K + s]]; with `peers`, other ranks' partials
// are then added in rank order. A thread sums 8 adjacent columns (16-byte loads). A group of up
// to COMBINE_SLOTS slots loads its positions, weights and rows first (row 0 standing in for a
// skipped slot, not added) so that the loads are in flight together: behind a branch each, the
// compiler issued them one round trip at a time.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_combine_rows)
extern "C" __global__ void __launch_bounds__(ELEMWISE_THREADS)
moe_combine_rows(const __grid_constant__ CombineRowsParams params) {
    MOE_UNPACK_CombineRowsParams(params);
    static_assert(HIDDEN % 8 == 0 && sizeof(act_t) == 2, "8 columns per 16-byte vector");
    pdl_wait();  // a programmatic dependent of GEMM2
    if (family_skipped(choice, FAMILY_GROUPED)) return;
    constexpr int COMBINE_SLOTS = TOP_K < 8 ? TOP_K : 8;
    const long n = (long)m * HIDDEN / 8;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long t = i / (HIDDEN / 8), c = 8 * (i % (HIDDEN / 8));
        float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s0 = 0; s0 < TOP_K; s0 += COMBINE_SLOTS) {
            int pos[COMBINE_SLOTS];
            float wt[COMBINE_SLOTS];
            uint4 v[COMBINE_SLOTS];
#pragma unroll
            for (int g = 0; g < COMBINE_SLOTS; ++g) {
                pos[g] = s0 + g < TOP_K ? pair_pos[t * TOP_K + s0 + g] : -1;
                wt[g] = s0 + g < TOP_K ? topk_weights[t * TOP_K + s0 + g] : 0.f;
            }
#pragma unroll
            for (int g = 0; g < COMBINE_SLOTS; ++g)
                v[g] = *reinterpret_cast<const uint4*>(rows + (long)max(pos[g], 0) * HIDDEN + c);
#pragma unroll
            for (int g = 0; g < COMBINE_SLOTS; ++g) {
                const int s = s0 + g;
                if (pos[g] < 0) continue;
                const float w = wt[g];
                const act_t* e = reinterpret_cast<const act_t*>(&v[g]);
#pragma unroll
                for (int j = 0; j < 8; ++j) sum[j] += w * (float)e[j];
                if constexpr (HAS_BIAS) {
                    const float* b = w2_bias + (long)topk_ids[t * TOP_K + s] * HIDDEN + c;
                    const float4 b0 = __ldg(reinterpret_cast<const float4*>(b)), b1 = __ldg(reinterpret_cast<const float4*>(b + 4));
                    const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) sum[j] += w * bv[j];
                }
            }
        }
        act_t out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = (act_t)sum[j];
        if (peers) {
            // An expert-parallel rank's own tokens: every rank's partial, this one's rounded as
            // if stored, summed in rank order in f32 (moe_ep_combine's bits).
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int p = 0; p < ranks; ++p) {
                const int j = (p - rank + ranks) % ranks;
                const int row = j == 0 ? 0 : __ldg(peer_pos + t * ranks + j);
                if (row < 0) continue;
                const uint4 u = j == 0 ? *reinterpret_cast<const uint4*>(out)
                                       : __ldg(reinterpret_cast<const uint4*>(peers + ((long)p * peer_rows + row) * HIDDEN + c));
                const act_t* e = reinterpret_cast<const act_t*>(&u);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += (float)e[i];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = (act_t)acc[i];
        }
        *reinterpret_cast<uint4*>(y + t * HIDDEN + c) = *reinterpret_cast<const uint4*>(out);
    }
}
#endif  // entry moe_combine_rows

// y = y32 in the activation dtype (after the atomic combine).
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_convert)
extern "C" __global__ void __launch_bounds__(ELEMWISE_THREADS)
moe_convert(const __grid_constant__ ConvertParams params) {
    MOE_UNPACK_ConvertParams(params);
    pdl_wait();  // a programmatic dependent of GEMM2
    if (family_skipped(choice, FAMILY_GROUPED)) return;
    const long n = (long)m * HIDDEN;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = y32[i];
        if constexpr (HAS_BIAS) {
            const long t = i / HIDDEN, c = i % HIDDEN;
#pragma unroll
            for (int s = 0; s < TOP_K; ++s) {
                const int e = topk_ids[t * TOP_K + s];
                if (e >= 0 && e < EXPERTS) v += topk_weights[t * TOP_K + s] * __ldg(w2_bias + (long)e * HIDDEN + c);
            }
        }
        y[i] = (act_t)v;
    }
}
#endif  // entry moe_convert
