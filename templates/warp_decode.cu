// moeforge warp decode: {{ spec_id }}
// Output-centric MoE for small steps. gate_up: a warp owns one intermediate neuron of one routed
// expert and serves every token routed to that expert; down: a warp owns one hidden output of a
// group of tokens and folds every routed expert, weighted, into one fp32 accumulator.
{% include "common.cuh" %}
{% include "activation.cuh" %}
{% include "dequant.cuh" %}
{% include "routing.cuh" %}

typedef {{ act_type }} act_t;
constexpr int HIDDEN = {{ hidden }};
constexpr int INTER = {{ intermediate }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
constexpr int WARPS = {{ warps }};        // warps per block
constexpr int GU_CHUNK = {{ gu_chunk }};  // 16-byte vectors per lane per row in flight (gate_up)
constexpr int DN_CHUNK = {{ dn_chunk }};  // ... per expert row (down)
constexpr int DN_EXPERTS = {{ dn_experts }};  // expert rows per unit (down), at one token per tile
// Fewer experts per unit for larger token tiles: the per-(expert, token) weights live in registers.
__host__ __device__ constexpr int dn_experts(int mt) { return DN_EXPERTS < 16 / mt ? DN_EXPERTS : (16 / mt > 0 ? 16 / mt : 1); }

using W13 = WMat<HIDDEN, 2 * INTER, EXPERTS>;  // w13 [E, 2I, H]
using W2 = WMat<INTER, HIDDEN, EXPERTS>;        // w2 [E, H, I]

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

// W_VEC fp32 intermediate activations starting at vector v. COHERENT: written by this grid, so
// a plain weak ld.global (never the read-only .nc path); the gpu-scope acquire that precedes it
// makes the released values visible, and the lines may still be shared in L1 across warps.
template <bool COHERENT>
__device__ __forceinline__ void load_mid(const float* __restrict__ row, int v, float (&a)[W_VEC]) {
    const float4* p = reinterpret_cast<const float4*>(row) + v * (W_VEC / 4);
#pragma unroll
    for (int h = 0; h < W_VEC / 4; ++h) {
        const float4 f = COHERENT ? ld_weak(p + h) : __ldg(p + h);
        a[4 * h] = f.x;
        a[4 * h + 1] = f.y;
        a[4 * h + 2] = f.z;
        a[4 * h + 3] = f.w;
    }
}

// dot(w, a) with the format's per-group scales applied to the partial dots of their groups
// (W_GROUPS per vector), not to every element.
__device__ __forceinline__ float dot(const float (&w)[W_VEC], const float (&a)[W_VEC], const WScale& ws) {
    constexpr int G = W_VEC / W_GROUPS;
    float t = 0.0f;
#pragma unroll
    for (int g = 0; g < W_GROUPS; ++g) {
        float d = 0.0f;
        if constexpr (G > 16) {
            // 4-bit vectors hold 32 elements: two independent FMA chains halve the latency.
            float e = 0.0f;
#pragma unroll
            for (int i = g * G; i < (g + 1) * G; i += 2) {
                d = fmaf(w[i], a[i], d);
                e = fmaf(w[i + 1], a[i + 1], e);
            }
            d += e;
        } else {
#pragma unroll
            for (int i = g * G; i < (g + 1) * G; ++i) d = fmaf(w[i], a[i], d);
        }
        if constexpr (W_GROUP_SCALED) {
            t = fmaf(group_scale(ws, g), d, t);
        } else {
            t += d;
        }
    }
    return t;
}

// mid[p][n] = act(gate_n . x_t) * (up_n . x_t) for every pair p = (t, slot) routed to expert e.
// A warp walks a flat sequence of units (item = (expert, neuron), pass over MT tokens, chunk of
// the row) and always has the next unit's weight loads in flight while it does the current math.
// FUSED: each finished pass is counted in done[u] (shared memory); the block publishes the
// counts once, after its whole phase, so no warp fences per item.
template <int MT, bool FUSED>
__device__ __forceinline__ void gate_up_phase(const Routing& r, const act_t* __restrict__ x,
                                              const uint4* __restrict__ w13, const void* __restrict__ w13_scales,
                                              float* __restrict__ mid, int* __restrict__ done) {
    const int lane = threadIdx.x & 31;
    const long items = (long)r.num_unique * INTER;
    const long stride = (long)gridDim.x * WARPS;
    long item = (long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (item >= items) return;

    // Unit state: (item, base token of the pass, first vector-per-lane of the chunk).
    int base = 0, c0 = 0;
    uint4 gv[GU_CHUNK], uv[GU_CHUNK];
    WScale gsc[GU_CHUNK], usc[GU_CHUNK];  // group scales travel with their weights
    auto rows = [&](long it, long& grow) {
        grow = (long)r.uexp[it / INTER] * 2 * INTER + it % INTER;
    };
    auto load = [&](long it, int c, uint4 (&g)[GU_CHUNK], uint4 (&u)[GU_CHUNK], WScale (&gs)[GU_CHUNK],
                    WScale (&us)[GU_CHUNK]) {
        long grow;
        rows(it, grow);
        const uint4* gp = w13 + grow * NV_H;
        const uint4* up = gp + (long)INTER * NV_H;
#pragma unroll
        for (int i = 0; i < GU_CHUNK; ++i) {
            const int v = (c + i) * 32 + lane;
            if (c + i < VPL_H && v < NV_H) {
                g[i] = ldg_stream(gp + v);
                u[i] = ldg_stream(up + v);
                gs[i] = load_wscale<W13>(w13_scales, grow, v);
                us[i] = load_wscale<W13>(w13_scales, grow + INTER, v);
            }
        }
    };
    int nt = 0;
    int pair[MT];
    const act_t* xr[MT];
    float ag[MT], au[MT];
    auto setup = [&](long it, int b) {
        const int u = (int)(it / INTER);
        const int* ent = r.entries + r.uoff[u];
        nt = min(MT, r.ucnt[u] - b);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            pair[j] = j < nt ? ent[b + j] : 0;
            xr[j] = x + (long)(pair[j] / TOP_K) * HIDDEN;
            ag[j] = 0.0f;
            au[j] = 0.0f;
        }
    };
    load(item, 0, gv, uv, gsc, usc);
    setup(item, 0);
    while (true) {
        long nitem = item;
        int nbase = base, nc0 = c0 + GU_CHUNK;
        if (nc0 >= VPL_H) {
            nc0 = 0;
            nbase = base + MT;
            if (nbase >= r.ucnt[item / INTER]) {
                nbase = 0;
                nitem = item + stride;
            }
        }
        const bool more = nitem < items;
        uint4 gn[GU_CHUNK], un[GU_CHUNK];
        WScale gsn[GU_CHUNK], usn[GU_CHUNK];
        if (more) load(nitem, nc0, gn, un, gsn, usn);  // in flight during this unit's math
#pragma unroll
        for (int i = 0; i < GU_CHUNK; ++i) {
            const int v = (c0 + i) * 32 + lane;
            if (c0 + i < VPL_H && v < NV_H) {
                float g[W_VEC], w[W_VEC];
                dequant_vec(gv[i], gsc[i], g);
                dequant_vec(uv[i], usc[i], w);
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    if (j < nt) {
                        float a[W_VEC];
                        load_x(xr[j], v, a);
                        ag[j] += dot(g, a, gsc[i]);
                        au[j] += dot(w, a, usc[i]);
                    }
                }
            }
        }
        if (nc0 == 0) {  // the pass is complete: reduce, activate, store
            long grow;
            rows(item, grow);
            const float gs = row_scale<W13>(w13_scales, grow);
            const float us = row_scale<W13>(w13_scales, grow + INTER);
            const int n = (int)(item % INTER);
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                if (j < nt) {
                    const float g = warp_sum(ag[j]) * gs;
                    const float v = warp_sum(au[j]) * us;
                    if (lane == 0) mid[(long)pair[j] * INTER + n] = moe_act(g) * v;
                }
            }
            if (FUSED && lane == 0) atomicAdd(done + item / INTER, 1);
            if (!more) break;
            setup(nitem, nbase);
        }
        item = nitem;
        base = nbase;
        c0 = nc0;
#pragma unroll
        for (int i = 0; i < GU_CHUNK; ++i) {
            gv[i] = gn[i];
            uv[i] = un[i];
            gsc[i] = gsn[i];
            usc[i] = usn[i];
        }
    }
}

// y[t][h] = sum over t's slots s of weight[t][s] * (w2[e_s][h] . mid[t, s]) for the MT tokens of
// one group; the per-expert products never leave registers. Units are (item = (h, group),
// DE experts that serve the group, chunk of their rows); the next unit's loads are issued
// before the current unit's math.
// FUSED: mid is produced by this same grid; wait on ready[u] before reading an expert's rows,
// and read them through L2 (other SMs wrote them).
template <int MT, int DE, bool FUSED>
__device__ __forceinline__ void down_phase(const Routing& r, int* smem, const float* __restrict__ mid,
                                           const float* __restrict__ topk_weights, const uint4* __restrict__ w2,
                                           const void* __restrict__ w2_scales, act_t* __restrict__ y, int m,
                                           const int* __restrict__ ready) {
    const int groups = (m + MT - 1) / MT;
    // Which token groups each expert serves (groups > 32: every expert is tried, and skipped
    // at run time when it serves none of the group).
    unsigned* gmask = reinterpret_cast<unsigned*>(routing_scratch(smem, m * TOP_K, EXPERTS, 0));
    for (int u = threadIdx.x; u < r.num_unique; u += blockDim.x) {
        unsigned mk = 0;
        for (int c = 0; c < r.ucnt[u]; ++c) {
            const int g = r.entries[r.uoff[u] + c] / TOP_K / MT;
            mk |= g < 32 ? 1u << g : 0xffffffffu;
        }
        gmask[u] = groups > 32 ? 0xffffffffu : mk;
    }
    __syncthreads();
    if (!FUSED) pdl_wait();  // mid is gate_up's output
    const int lane = threadIdx.x & 31;
    const long items = (long)HIDDEN * groups;
    const long stride = (long)gridDim.x * WARPS;
    long item = (long)blockIdx.x * WARPS + (threadIdx.x >> 5);

    // The next up-to-DE experts at or after `from` that serve group g (-1: none).
    auto next_experts = [&](int g, int from, int (&us)[DE]) {
        int u = from;
#pragma unroll
        for (int q = 0; q < DE; ++q) {
            while (u < r.num_unique && !((gmask[u] >> (g & 31)) & 1u)) ++u;
            us[q] = u < r.num_unique ? u : -1;
            ++u;
        }
    };
    auto load = [&](long it, const int (&us)[DE], int c, uint4 (&wv)[DE][DN_CHUNK], WScale (&ws)[DE][DN_CHUNK]) {
        const int h = (int)(it / groups);
#pragma unroll
        for (int q = 0; q < DE; ++q) {
            if (us[q] >= 0) {
                const long rw = (long)r.uexp[us[q]] * HIDDEN + h;
                const uint4* row = w2 + rw * NV_I;
#pragma unroll
                for (int i = 0; i < DN_CHUNK; ++i) {
                    const int v = (c + i) * 32 + lane;
                    if (c + i < VPL_I && v < NV_I) {
                        wv[q][i] = ldg_stream(row + v);
                        ws[q][i] = load_wscale<W2>(w2_scales, rw, v);
                    }
                }
            }
        }
    };

    float acc[MT];
    float wgt[DE][MT];
    int pr[DE][MT];
    int us[DE];
    int c0 = 0;
    // Per-expert routing weights (times the row scale) and pair indices for the group's tokens.
    auto setup = [&](long it) {
        const int h = (int)(it / groups);
        const int t0 = (int)(it % groups) * MT;
        if (FUSED) {
            // Every pass of gate_up over these experts must have landed.
#pragma unroll
            for (int q = 0; q < DE; ++q) {
                if (us[q] >= 0) {
                    const int need = INTER * ((r.ucnt[us[q]] + MT - 1) / MT);
                    if (lane == 0) {
                        unsigned ns = 32;
                        while (ld_acquire(ready + us[q]) < need) {
                            __nanosleep(ns);
                            ns = ns < 1024 ? 2 * ns : ns;
                        }
                    }
                    __syncwarp();  // orders the other lanes' reads of mid after lane 0's acquire
                }
            }
        }
#pragma unroll
        for (int q = 0; q < DE; ++q) {
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                wgt[q][j] = 0.0f;
                pr[q][j] = -1;
            }
            if (us[q] >= 0) {
                const int* ent = r.entries + r.uoff[us[q]];
                const int cnt = r.ucnt[us[q]];
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
                        }
                    }
                }
                const float s = row_scale<W2>(w2_scales, (long)r.uexp[us[q]] * HIDDEN + h);
#pragma unroll
                for (int j = 0; j < MT; ++j) wgt[q][j] *= s;
            }
        }
    };
    auto write_zeros = [&](long it) {
        const int h = (int)(it / groups);
        const int t0 = (int)(it % groups) * MT;
        if (lane < MT && t0 + lane < m) y[(long)(t0 + lane) * HIDDEN + h] = narrow(0.0f, (const act_t*)nullptr);
    };
    auto finish = [&](long it) {
        const int h = (int)(it / groups);
        const int t0 = (int)(it % groups) * MT;
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            if (t0 + j < m) {
                const float v = warp_sum(acc[j]);
                if (lane == 0) y[(long)(t0 + j) * HIDDEN + h] = narrow(v, (const act_t*)nullptr);
            }
            acc[j] = 0.0f;
        }
    };
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[j] = 0.0f;
    // First unit: skip (writing zeros) any item no expert serves (only with skipped bad ids).
    while (item < items) {
        next_experts((int)(item % groups), 0, us);
        if (us[0] >= 0) break;
        write_zeros(item);
        item += stride;
    }
    if (item >= items) return;
    uint4 wv[DE][DN_CHUNK];
    WScale wsc[DE][DN_CHUNK];
    load(item, us, 0, wv, wsc);
    setup(item);
    while (true) {
        long nitem = item;
        int nus[DE];
        int nc0 = c0 + DN_CHUNK;
        bool new_experts = false;
        if (nc0 < VPL_I) {
#pragma unroll
            for (int q = 0; q < DE; ++q) nus[q] = us[q];
        } else {
            nc0 = 0;
            new_experts = true;
            int last = us[0];
#pragma unroll
            for (int q = 1; q < DE; ++q) last = us[q] >= 0 ? us[q] : last;
            next_experts((int)(nitem % groups), last + 1, nus);
            while (nus[0] < 0) {  // item done: move to the next one that has work
                nitem += stride;
                if (nitem >= items) break;
                next_experts((int)(nitem % groups), 0, nus);
                if (nus[0] < 0) write_zeros(nitem);  // nothing routed here
            }
        }
        const bool more = nitem < items;
        uint4 wn[DE][DN_CHUNK];
        WScale wsn[DE][DN_CHUNK];
        if (more) load(nitem, nus, nc0, wn, wsn);  // in flight during this unit's math
#pragma unroll
        for (int q = 0; q < DE; ++q) {
            if (us[q] >= 0) {
#pragma unroll
                for (int i = 0; i < DN_CHUNK; ++i) {
                    const int v = (c0 + i) * 32 + lane;
                    if (c0 + i < VPL_I && v < NV_I) {
                        float w[W_VEC];
                        dequant_vec(wv[q][i], wsc[q][i], w);
#pragma unroll
                        for (int j = 0; j < MT; ++j) {
                            if (pr[q][j] >= 0) {
                                float a[W_VEC];
                                load_mid<FUSED>(mid + (long)pr[q][j] * INTER, v, a);
                                acc[j] = fmaf(wgt[q][j], dot(w, a, wsc[q][i]), acc[j]);
                            }
                        }
                    }
                }
            }
        }
        if (nitem != item) finish(item);
        if (!more) break;
        item = nitem;
        c0 = nc0;
#pragma unroll
        for (int q = 0; q < DE; ++q) us[q] = nus[q];
        if (new_experts) setup(item);
#pragma unroll
        for (int q = 0; q < DE; ++q) {
#pragma unroll
            for (int i = 0; i < DN_CHUNK; ++i) {
                wv[q][i] = wn[q][i];
                wsc[q][i] = wsn[q][i];
            }
        }
    }
}

// Entry points, one set per token tile; the host picks the smallest tile that covers the step.
// split: two kernels, down launched as a programmatic dependent of gate_up.
// fused: one persistent kernel, gate_up phase then down phase; its grid must be co-resident
// (the host sizes it from the occupancy), since down waits on counters other blocks bump.
// ready[0..EXPERTS) counts finished gate_up passes per unique expert, ready[EXPERTS] finished
// blocks; the last block clears them for the next step.
{%- for mt in token_tiles %}
extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gate_up_t{{ mt }}(
    const act_t* __restrict__ x, const int* __restrict__ topk_ids, const uint4* __restrict__ w13,
    const void* __restrict__ w13_scales, float* __restrict__ mid, int m, int* __restrict__ err) {
    extern __shared__ int smem[];
    dequant_setup();
    pdl_wait();  // x, the routing and mid's previous readers belong to earlier kernels
    pdl_launch_dependents();  // the down kernel may launch and build its routing now
    const Routing r = build_routing(topk_ids, m * TOP_K, EXPERTS, smem, err);
    gate_up_phase<{{ mt }}, false>(r, x, w13, w13_scales, mid, nullptr);
}
extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_down_t{{ mt }}(
    const float* __restrict__ mid, const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
    const uint4* __restrict__ w2, const void* __restrict__ w2_scales, act_t* __restrict__ y, int m) {
    extern __shared__ int smem[];
    dequant_setup();
    // Routing reads only the step's inputs, so it overlaps the tail of gate_up.
    const Routing r = build_routing(topk_ids, m * TOP_K, EXPERTS, smem, nullptr);
    down_phase<{{ mt }}, dn_experts({{ mt }}), false>(r, smem, mid, topk_weights, w2, w2_scales, y, m, nullptr);
}
extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_fused_t{{ mt }}(
    const act_t* __restrict__ x, const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
    const uint4* __restrict__ w13, const void* __restrict__ w13_scales, const uint4* __restrict__ w2,
    const void* __restrict__ w2_scales, float* __restrict__ mid, act_t* __restrict__ y, int m,
    int* __restrict__ err, int* __restrict__ ready) {
    extern __shared__ int smem[];
    dequant_setup();
    pdl_wait();
    const Routing r = build_routing(topk_ids, m * TOP_K, EXPERTS, smem, err);
    int* done = routing_scratch(smem, m * TOP_K, EXPERTS, 1);
    for (int u = threadIdx.x; u < r.num_unique; u += blockDim.x) done[u] = 0;
    __syncthreads();
    gate_up_phase<{{ mt }}, true>(r, x, w13, w13_scales, mid, done);
    // Publish this block's finished passes: one fence for the whole phase.
    __threadfence();
    __syncthreads();
    for (int u = threadIdx.x; u < r.num_unique; u += blockDim.x) {
        if (done[u]) red_release_add(ready + u, done[u]);
    }
    down_phase<{{ mt }}, dn_experts({{ mt }}), true>(r, smem, mid, topk_weights, w2, w2_scales, y, m, ready);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ready + EXPERTS, 1) == (int)gridDim.x - 1) {
            for (int u = 0; u <= EXPERTS; ++u) ready[u] = 0;
            __threadfence();
        }
    }
    // Launched last so a dependent can never take the SM slots this grid still waits for.
    pdl_launch_dependents();
}
{%- endfor %}
