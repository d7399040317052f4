// Router: logits [M, E] f32 -> topk_ids [M, K] i32, topk_weights [M, K] f32. One warp per token;
// the token's scores sit in shared memory. Choice is by score, ties to the lowest expert id; an
// excluded expert is marked NaN, and the choice runs on keys in registers (pick_topk).
constexpr int ROUTE_WARPS = 4;
// The routed experts and choices: the module's EXPERTS / TOP_K less its shared experts, which
// every token uses without being routed (moe_expand_routing appends them).
constexpr int R_EXPERTS = {{ router.experts }};
constexpr int R_TOP_K = {{ router.top_k }};
#define MOE_INF __int_as_float(0x7f800000)
#define MOE_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL_MASK, v, o));
    return v;
}

// Scores as unsigned keys that order like the floats (-0 taken as +0, so equal scores tie); 0 for
// a marked (NaN) or absent score, below every real one.
__device__ __forceinline__ unsigned score_key(float v) {
    if (isnan(v)) return 0u;
    const unsigned u = __float_as_uint(v == 0.f ? 0.f : v);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float key_score(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// The R_TOP_K best of the scores s (NaN: excluded), weighted by weight(id, score), written as token
// t's row: renormalised to sum 1 if asked, then times scale. Each lane keeps experts lane + 32 j as
// keys; a round is one warp max (redux.sync) and a ballot per j for the lowest id that holds it.
// Returns choice `lane` to lanes < R_TOP_K (R_EXPERTS where none was left), -1 to the others.
template <class Weight>
__device__ __forceinline__ int pick_topk(const float* s, int t, Weight weight, bool renormalize, float scale,
                                          int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    constexpr int J = (R_EXPERTS + 31) / 32;
    const int lane = threadIdx.x % 32;
    unsigned key[J];
#pragma unroll
    for (int j = 0; j < J; ++j) key[j] = lane + 32 * j < R_EXPERTS ? score_key(s[lane + 32 * j]) : 0u;
    float w[R_TOP_K];
    int ids[R_TOP_K];
    float picked = 0.f;
#pragma unroll
    for (int k = 0; k < R_TOP_K; ++k) {
        unsigned mine = 0u;
#pragma unroll
        for (int j = 0; j < J; ++j) mine = max(mine, key[j]);
        const unsigned best = __reduce_max_sync(MOE_FULL_MASK, mine);
        int id = R_EXPERTS;
        if (best != 0u) {
#pragma unroll
            for (int j = J - 1; j >= 0; --j) {  // the lowest j that holds it wins
                const unsigned b = __ballot_sync(MOE_FULL_MASK, key[j] == best);
                if (b) id = 32 * j + __ffs(b) - 1;
            }
#pragma unroll
            for (int j = 0; j < J; ++j)
                if (id == lane + 32 * j) key[j] = 0u;
        }
        ids[k] = id;
        w[k] = id < R_EXPERTS ? weight(id, key_score(best)) : 0.f;
        picked += w[k];
    }
    int mine = -1;
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < R_TOP_K; ++k) {
            topk_ids[t * R_TOP_K + k] = ids[k];
            topk_weights[t * R_TOP_K + k] = (renormalize ? w[k] / picked : w[k]) * scale;
        }
    }
#pragma unroll
    for (int k = 0; k < R_TOP_K; ++k)
        if (lane == k) mine = ids[k];
    return mine;
}
static_assert(R_TOP_K <= 32, "a lane per choice");

{%- if router.grouped %}
constexpr int GROUPS = {{ router.groups }};
constexpr int TOPK_GROUPS = {{ router.topk_groups }};
constexpr int GROUP_SIZE = R_EXPERTS / GROUPS;
constexpr bool RENORMALIZE = {{ router.renormalize }};
constexpr float SCALING = {{ router.scaling }};
static_assert(GROUPS <= 32, "one lane scores one group");

// Token t's routing by one warp, its scores staged in s (R_EXPERTS floats of shared memory): its row
// of topk_ids / topk_weights, and the choices as pick_topk returns them.
__device__ __forceinline__ int route_token(const float* __restrict__ logits, const float* __restrict__ bias, int t,
                                           float* s, int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    const int lane = threadIdx.x % 32;
    const float* row = logits + (long)t * R_EXPERTS;
    // Choice is by sigmoid + correction bias; the weights are the plain sigmoid.
    for (int e = lane; e < R_EXPERTS; e += 32) s[e] = 1.f / (1.f + expf(-row[e])) + bias[e];
    __syncwarp();
    // A group scores the sum of its two best experts.
    float gs = -MOE_INF;
    if (lane < GROUPS) {
        float a = -MOE_INF, b = -MOE_INF;
        for (int j = 0; j < GROUP_SIZE; ++j) {
            const float v = s[lane * GROUP_SIZE + j];
            if (v > a) {
                b = a;
                a = v;
            } else if (v > b) {
                b = v;
            }
        }
        gs = a + b;
    }
    unsigned kept = 0;
    for (int k = 0; k < TOPK_GROUPS; ++k) {
        float best = (lane < GROUPS && !((kept >> lane) & 1u)) ? gs : MOE_NAN;
        int id = isnan(best) ? 32 : lane;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(MOE_FULL_MASK, best, o);
            const int oid = __shfl_xor_sync(MOE_FULL_MASK, id, o);
            if (oid != 32 && (id == 32 || ov > best || (ov == best && oid < id))) {
                best = ov;
                id = oid;
            }
        }
        if (id < 32) kept |= 1u << id;
    }
    for (int e = lane; e < R_EXPERTS; e += 32)
        if (!((kept >> (e / GROUP_SIZE)) & 1u)) s[e] = MOE_NAN;
    __syncwarp();
    return pick_topk(s, t, [&](int id, float) { return 1.f / (1.f + expf(-row[id])); }, RENORMALIZE, SCALING,
                     topk_ids, topk_weights);
}
{%- else %}
constexpr bool RENORMALIZE = {{ router.renormalize }};

// Token t's routing by one warp, its scores staged in s (R_EXPERTS floats of shared memory): its row
// of topk_ids / topk_weights, and the choices as pick_topk returns them.
__device__ __forceinline__ int route_token(const float* __restrict__ logits, const float* __restrict__ /*bias*/, int t,
                                           float* s, int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    const int lane = threadIdx.x % 32;
    const float* row = logits + (long)t * R_EXPERTS;
    float mx = -MOE_INF;
    for (int e = lane; e < R_EXPERTS; e += 32) {
        s[e] = row[e];
        mx = fmaxf(mx, s[e]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < R_EXPERTS; e += 32) sum += expf(s[e] - mx);
    sum = warp_sum(sum);
    __syncwarp();
    return pick_topk(s, t, [&](int, float best) { return expf(best - mx) / sum; }, RENORMALIZE, 1.f, topk_ids,
                     topk_weights);
}
{%- endif %}

// Routing alone (the decode family's steps from logits; the grouped family's run in moe_prepare).
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_route)
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route(const __grid_constant__ RouteParams params) {
    MOE_UNPACK_RouteParams(params);
    __shared__ float scores[ROUTE_WARPS][R_EXPERTS];
    const int warp = threadIdx.x / 32;
    const int t = blockIdx.x * ROUTE_WARPS + warp;
    if (t < m) route_token(logits, bias, t, scores[warp], topk_ids, topk_weights);
}
#endif  // entry moe_route
