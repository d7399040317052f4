// moeforge warp decode: {{ spec_id }}
// Output-centric MoE for small steps. gate_up: a warp owns one intermediate neuron of one routed
// expert and serves every token routed to that expert; down: a warp owns one hidden output of a
// group of tokens and folds every routed expert, weighted, into one fp32 accumulator.
{% include "common.cuh" %}
{% include "activation.cuh" %}
{%- match format %}
{%- when WeightFormat::Bf16 %}
{% include "dequant_bf16.cuh" %}
{%- when WeightFormat::Fp16 %}
{% include "dequant_fp16.cuh" %}
{%- when WeightFormat::Fp8E4m3 %}
{% include "dequant_fp8_e4m3.cuh" %}
{%- endmatch %}
{% include "routing.cuh" %}

typedef {{ act_type }} act_t;
constexpr int HIDDEN = {{ hidden }};
constexpr int INTER = {{ intermediate }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
constexpr int WARPS = {{ warps }};        // warps per block
constexpr int GU_CHUNK = {{ gu_chunk }};  // 16-byte vectors per lane per row in flight (gate_up)
constexpr int DN_CHUNK = {{ dn_chunk }};  // ... per expert row (down)
constexpr int DN_EXPERTS = {{ dn_experts }};  // expert rows streamed together (down)

constexpr int NV_H = HIDDEN / W_VEC;      // 16-byte vectors per w13 row
constexpr int NV_I = INTER / W_VEC;       // 16-byte vectors per w2 row
constexpr int VPL_H = (NV_H + 31) / 32;   // vectors per lane per w13 row (the last may be partial)
constexpr int VPL_I = (NV_I + 31) / 32;

// W_VEC activations (16-bit) starting at vector v, widened to fp32.
__device__ __forceinline__ void load_x(const act_t* __restrict__ row, int v, float (&a)[W_VEC]) {
    const uint4* p = reinterpret_cast<const uint4*>(row) + v * (W_VEC / 8);
#pragma unroll
    for (int h = 0; h < W_VEC / 8; ++h) {
        float t[8];
        widen8(__ldg(p + h), (const act_t*)nullptr, t);
#pragma unroll
        for (int i = 0; i < 8; ++i) a[8 * h + i] = t[i];
    }
}

// W_VEC fp32 intermediate activations starting at vector v.
__device__ __forceinline__ void load_mid(const float* __restrict__ row, int v, float (&a)[W_VEC]) {
    const float4* p = reinterpret_cast<const float4*>(row) + v * (W_VEC / 4);
#pragma unroll
    for (int h = 0; h < W_VEC / 4; ++h) {
        const float4 f = __ldg(p + h);
        a[4 * h] = f.x;
        a[4 * h + 1] = f.y;
        a[4 * h + 2] = f.z;
        a[4 * h + 3] = f.w;
    }
}

__device__ __forceinline__ float dot(const float (&w)[W_VEC], const float (&a)[W_VEC]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < W_VEC; ++i) s = fmaf(w[i], a[i], s);
    return s;
}

// mid[p][n] = act(gate_n . x_t) * (up_n . x_t) for every pair p = (t, slot) routed to expert e.
// MT: tokens served per pass over a row (a row is re-read, from L2, only past MT tokens).
template <int MT>
__device__ __forceinline__ void gate_up(const act_t* __restrict__ x, const int* __restrict__ topk_ids,
                                        const uint4* __restrict__ w13, const float* __restrict__ w13_scales,
                                        float* __restrict__ mid, int m, int* __restrict__ err) {
    extern __shared__ int smem[];
    // The down kernel may launch now and build its routing while this one streams.
    pdl_launch_dependents();
    const Routing r = build_routing(topk_ids, m * TOP_K, EXPERTS, smem, err);
    const int lane = threadIdx.x & 31;
    const long total = (long)r.num_unique * INTER;
    for (long item = (long)blockIdx.x * WARPS + (threadIdx.x >> 5); item < total; item += (long)gridDim.x * WARPS) {
        const int u = (int)(item / INTER);
        const int n = (int)(item % INTER);
        const long grow = (long)r.uexp[u] * 2 * INTER + n;
        const long urow = grow + INTER;
        const uint4* gp = w13 + grow * NV_H;
        const uint4* up = w13 + urow * NV_H;
        const int cnt = r.ucnt[u];
        const int* ent = r.entries + r.uoff[u];
        for (int base = 0; base < cnt; base += MT) {
            const int nt = min(MT, cnt - base);
            int pair[MT];
            const act_t* xr[MT];
            float ag[MT], au[MT];
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                pair[j] = j < nt ? ent[base + j] : 0;
                xr[j] = x + (long)(pair[j] / TOP_K) * HIDDEN;
                ag[j] = 0.0f;
                au[j] = 0.0f;
            }
            // Long rows loop over chunks; only the chunk itself is unrolled.
#pragma unroll 1
            for (int c0 = 0; c0 < VPL_H; c0 += GU_CHUNK) {
                // All of this chunk's weight loads are issued before any of its math.
                uint4 gv[GU_CHUNK], uv[GU_CHUNK];
#pragma unroll
                for (int i = 0; i < GU_CHUNK; ++i) {
                    const int v = (c0 + i) * 32 + lane;
                    if (c0 + i < VPL_H && v < NV_H) {
                        gv[i] = ldg_stream(gp + v);
                        uv[i] = ldg_stream(up + v);
                    }
                }
#pragma unroll
                for (int i = 0; i < GU_CHUNK; ++i) {
                    const int v = (c0 + i) * 32 + lane;
                    if (c0 + i < VPL_H && v < NV_H) {
                        float g[W_VEC], w[W_VEC];
                        dequant_vec(gv[i], g);
                        dequant_vec(uv[i], w);
#pragma unroll
                        for (int j = 0; j < MT; ++j) {
                            if (j < nt) {
                                float a[W_VEC];
                                load_x(xr[j], v, a);
                                ag[j] += dot(g, a);
                                au[j] += dot(w, a);
                            }
                        }
                    }
                }
            }
            const float gs = row_scale(w13_scales, grow);
            const float us = row_scale(w13_scales, urow);
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                if (j < nt) {
                    const float g = warp_sum(ag[j]) * gs;
                    const float v = warp_sum(au[j]) * us;
                    if (lane == 0) mid[(long)pair[j] * INTER + n] = moe_act(g) * v;
                }
            }
        }
    }
}

// y[t][h] = sum over t's slots s of weight[t][s] * (w2[e_s][h] . mid[t, s]), for the MT tokens of
// one group; the per-expert products never leave registers.
template <int MT>
__device__ __forceinline__ void down(const float* __restrict__ mid, const int* __restrict__ topk_ids,
                                     const float* __restrict__ topk_weights, const uint4* __restrict__ w2,
                                     const float* __restrict__ w2_scales, act_t* __restrict__ y, int m) {
    extern __shared__ int smem[];
    // Routing reads only the step's inputs, so it overlaps the tail of gate_up.
    const Routing r = build_routing(topk_ids, m * TOP_K, EXPERTS, smem, nullptr);
    pdl_wait();  // mid is gate_up's output
    const int lane = threadIdx.x & 31;
    const int groups = (m + MT - 1) / MT;
    const long total = (long)HIDDEN * groups;
    for (long item = (long)blockIdx.x * WARPS + (threadIdx.x >> 5); item < total; item += (long)gridDim.x * WARPS) {
        const int h = (int)(item / groups);
        const int t0 = (int)(item % groups) * MT;
        float acc[MT];
#pragma unroll
        for (int j = 0; j < MT; ++j) acc[j] = 0.0f;
        for (int u0 = 0; u0 < r.num_unique; u0 += DN_EXPERTS) {
            // For each expert in flight: which of the group's tokens it serves, and with what weight.
            float wgt[DN_EXPERTS][MT];
            int pr[DN_EXPERTS][MT];
            long row[DN_EXPERTS];
            bool live[DN_EXPERTS];
#pragma unroll
            for (int q = 0; q < DN_EXPERTS; ++q) {
                const int u = u0 + q;
                live[q] = false;
                row[q] = 0;
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    wgt[q][j] = 0.0f;
                    pr[q][j] = -1;
                }
                if (u < r.num_unique) {
                    const int* ent = r.entries + r.uoff[u];
                    const int cnt = r.ucnt[u];
                    for (int c = 0; c < cnt; ++c) {
                        const int p = ent[c];
                        const int j = p / TOP_K - t0;
                        if (j >= MT) break;  // entries are in token order
                        if (j < 0) continue;
                        const float wt = __ldg(topk_weights + p);
#pragma unroll
                        for (int jj = 0; jj < MT; ++jj) {
                            // A token routed twice to one expert has identical mid rows: sum the weights.
                            if (jj == j) {
                                wgt[q][jj] += wt;
                                pr[q][jj] = p;
                                live[q] = true;
                            }
                        }
                    }
                    row[q] = (long)r.uexp[u] * HIDDEN + h;
                    const float s = row_scale(w2_scales, row[q]);
#pragma unroll
                    for (int jj = 0; jj < MT; ++jj) wgt[q][jj] *= s;
                }
            }
#pragma unroll 1
            for (int c0 = 0; c0 < VPL_I; c0 += DN_CHUNK) {
                uint4 wv[DN_EXPERTS][DN_CHUNK];
#pragma unroll
                for (int q = 0; q < DN_EXPERTS; ++q) {
#pragma unroll
                    for (int i = 0; i < DN_CHUNK; ++i) {
                        const int v = (c0 + i) * 32 + lane;
                        if (live[q] && c0 + i < VPL_I && v < NV_I) wv[q][i] = ldg_stream(w2 + row[q] * NV_I + v);
                    }
                }
#pragma unroll
                for (int q = 0; q < DN_EXPERTS; ++q) {
#pragma unroll
                    for (int i = 0; i < DN_CHUNK; ++i) {
                        const int v = (c0 + i) * 32 + lane;
                        if (live[q] && c0 + i < VPL_I && v < NV_I) {
                            float w[W_VEC];
                            dequant_vec(wv[q][i], w);
#pragma unroll
                            for (int j = 0; j < MT; ++j) {
                                if (pr[q][j] >= 0) {
                                    float a[W_VEC];
                                    load_mid(mid + (long)pr[q][j] * INTER, v, a);
                                    acc[j] = fmaf(wgt[q][j], dot(w, a), acc[j]);
                                }
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            if (t0 + j < m) {
                const float v = warp_sum(acc[j]);
                if (lane == 0) y[(long)(t0 + j) * HIDDEN + h] = narrow(v, (const act_t*)nullptr);
            }
        }
    }
}

// One entry point per token tile; the host picks the smallest tile that covers the step.
{%- for mt in token_tiles %}
extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gate_up_t{{ mt }}(
    const act_t* __restrict__ x, const int* __restrict__ topk_ids, const uint4* __restrict__ w13,
    const float* __restrict__ w13_scales, float* __restrict__ mid, int m, int* __restrict__ err) {
    gate_up<{{ mt }}>(x, topk_ids, w13, w13_scales, mid, m, err);
}
extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_down_t{{ mt }}(
    const float* __restrict__ mid, const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
    const uint4* __restrict__ w2, const float* __restrict__ w2_scales, act_t* __restrict__ y, int m) {
    down<{{ mt }}>(mid, topk_ids, topk_weights, w2, w2_scales, y, m);
}
{%- endfor %}
