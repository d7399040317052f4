// Router: logits [M, E] f32 -> topk_ids [M, K] i32, topk_weights [M, K] f32. One warp per token;
// the token's scores sit in shared memory. Choice is by score, ties to the lowest expert id;
// a chosen (or excluded) expert is marked NaN, which never compares greater.
constexpr int ROUTE_WARPS = 4;
#define MOE_INF __int_as_float(0x7f800000)
#define MOE_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL_MASK, v, o));
    return v;
}

// The best unmarked score of s[0, n) across the warp, ties to the lowest index; id = n if none.
__device__ __forceinline__ void warp_argmax(const float* s, int n, float& best, int& id) {
    best = -MOE_INF;
    id = n;
    for (int e = threadIdx.x % 32; e < n; e += 32) {
        const float v = s[e];
        if (!isnan(v) && (id == n || v > best)) {
            best = v;
            id = e;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(MOE_FULL_MASK, best, o);
        const int oid = __shfl_xor_sync(MOE_FULL_MASK, id, o);
        if (oid != n && (id == n || ov > best || (ov == best && oid < id))) {
            best = ov;
            id = oid;
        }
    }
}

// The TOP_K best of the scores s (each marked taken as it is chosen), weighted by weight(id, score),
// written as token t's row: renormalised to sum 1 if asked, then times scale.
template <class Weight>
__device__ __forceinline__ void pick_topk(float* s, int t, Weight weight, bool renormalize, float scale,
                                          int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    const int lane = threadIdx.x % 32;
    float w[TOP_K];
    int ids[TOP_K];
    float picked = 0.f;
#pragma unroll
    for (int k = 0; k < TOP_K; ++k) {
        float best;
        int id;
        warp_argmax(s, EXPERTS, best, id);
        ids[k] = id;
        w[k] = id < EXPERTS ? weight(id, best) : 0.f;
        picked += w[k];
        if (lane == 0 && id < EXPERTS) s[id] = MOE_NAN;
        __syncwarp();
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            topk_ids[t * TOP_K + k] = ids[k];
            topk_weights[t * TOP_K + k] = (renormalize ? w[k] / picked : w[k]) * scale;
        }
    }
}

{%- if router.grouped %}
constexpr int GROUPS = {{ router.groups }};
constexpr int TOPK_GROUPS = {{ router.topk_groups }};
constexpr int GROUP_SIZE = EXPERTS / GROUPS;
constexpr bool RENORMALIZE = {{ router.renormalize }};
constexpr float SCALING = {{ router.scaling }};
static_assert(GROUPS <= 32, "one lane scores one group");

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int m,
          int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    __shared__ float scores[ROUTE_WARPS][EXPERTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTE_WARPS + warp;
    if (t >= m) return;
    float* s = scores[warp];
    const float* row = logits + (long)t * EXPERTS;
    // Choice is by sigmoid + correction bias; the weights are the plain sigmoid.
    for (int e = lane; e < EXPERTS; e += 32) s[e] = 1.f / (1.f + expf(-row[e])) + bias[e];
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
    for (int e = lane; e < EXPERTS; e += 32)
        if (!((kept >> (e / GROUP_SIZE)) & 1u)) s[e] = MOE_NAN;
    __syncwarp();
    pick_topk(s, t, [&](int id, float) { return 1.f / (1.f + expf(-row[id])); }, RENORMALIZE, SCALING, topk_ids,
              topk_weights);
}
{%- else %}
constexpr bool RENORMALIZE = {{ router.renormalize }};

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route(const float* __restrict__ logits, const float* __restrict__ /*bias*/, int m,
          int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    __shared__ float scores[ROUTE_WARPS][EXPERTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTE_WARPS + warp;
    if (t >= m) return;
    float* s = scores[warp];
    const float* row = logits + (long)t * EXPERTS;
    float mx = -MOE_INF;
    for (int e = lane; e < EXPERTS; e += 32) {
        s[e] = row[e];
        mx = fmaxf(mx, s[e]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < EXPERTS; e += 32) sum += expf(s[e] - mx);
    sum = warp_sum(sum);
    __syncwarp();
    pick_topk(s, t, [&](int, float best) { return expf(best - mx) / sum; }, RENORMALIZE, 1.f, topk_ids, topk_weights);
}
{%- endif %}
