// moeforge fused three-phase MoE: {{ name }}
// One cooperative launch for a step of up to MAX_TOKENS tokens, on tensor cores, for every weight
// format (decoded in registers on the way to the MMAs):
//   up   items (expert u, BI intermediate neurons j): the expert's gate and up rows of the slice
//        times every token routed to it, the activation, the intermediate rounded to act_t and
//        written once (mid [pairs, I], read back from L2 by down);
//   down items (16 hidden rows): every routed expert's w2 rows times its tokens' intermediate,
//        weighted, summed per token in a fixed order, stored to y. A down item waits for an
//        expert's up items (a per-expert counter) before it reads that expert's intermediate.
// Every block takes its items in increasing order over one index space, up items first, so no block
// waits while it still owns up work; the launch is cooperative (every block resident), so every
// wait ends. The last block to finish resets the counters for the next step.
//
// The MMAs take the weights as their A operand (m16: 16 weight rows) and the tokens as B (n8), so
// a handful of tokens per expert fills a fragment. Lane (g, c) of a warp holds row g and g + 8 of
// its fragment; per chunk of CK codes along K it loads the LE codes [c LE, (c + 1) LE) of each row
// (one or two 16-byte vectors: coalesced 64-byte runs per row), and the same K positions of each
// token. The sum over K does not care in which order the MMA visits it, so k16 step s takes the
// lane's codes 4s..4s+3 as its K slots 2c, 2c + 1, 2c + 8, 2c + 9: a lane's weights and
// activations load straight into its fragments, in the documented layout.
{% include "common.cuh" %}
{% include "activation.cuh" %}
{% include "dequant.cuh" %}
{% include "routing.cuh" %}

typedef {{ act_type }} act_t;
// Every kernel's parameter struct (moe_codegen::params: one declaration for Rust and C).
{{ params }}
constexpr int HIDDEN = {{ hidden }};
constexpr int INTER = {{ intermediate }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
constexpr bool HAS_BIAS = {{ bias }};
constexpr int WARPS = {{ warps }};
constexpr int THREADS = WARPS * 32;
constexpr int BI = {{ bi }};                  // intermediate neurons per up item
constexpr int NTOK = {{ ntok }};              // tokens of an expert an MMA pass covers (8 per fragment)
constexpr int MAX_TOKENS = {{ max_tokens }};  // tokens per launch (the host splits larger steps)
constexpr int DEPTH = {{ depth }};            // chunks of weights in flight per warp (registers)
constexpr bool PREFETCH = {{ prefetch }};     // down items bring their next expert's rows into L2
constexpr bool W_RAW = {{ w_raw }};           // the weights are act_t themselves: no decode
// e4m3 codes straight to act_t pairs by bit operations (bf16) or cvt (fp16), their scales exact in
// act_t (powers of two) or applied per row; else every code through dequant_vec's floats.
constexpr bool W_E4M3_PAIRS = {{ e4m3_pairs }};
constexpr bool ACT_BF16 = {{ act_bf16 }};
constexpr int LE = {{ lane_codes }};          // codes a lane takes per row and chunk
constexpr int VPL = LE / W_VEC;              // 16-byte vectors per lane, row and chunk
constexpr int CK = 4 * LE;                   // codes per chunk (a quad of lanes)
constexpr int STEPS = LE / 4;                // k16 MMAs per chunk
constexpr int NPAIRS = MAX_TOKENS * TOP_K;
constexpr int UP_FRAGS = 2 * BI / 16;        // 16-row fragments of an up item: gate, then up
// Fragments per warp; with fewer fragments than warps, each fragment's K is split over KSPLIT
// warps (their partial sums meet in shared memory).
constexpr int UP_RF = UP_FRAGS >= WARPS ? UP_FRAGS / WARPS : 1;
constexpr int KSPLIT = UP_FRAGS >= WARPS ? 1 : WARPS / UP_FRAGS;
constexpr int J_ITEMS = INTER / BI;          // up items per expert
constexpr int DN_SPLIT = {{ down_split }};     // most blocks a down item's experts are split over
constexpr int DN_ROWS = HIDDEN / 16;          // 16-row blocks of the output
static_assert(DN_SPLIT == 1 || DN_SPLIT == 2, "a down item's experts in one or two blocks");
static_assert(HIDDEN % CK == 0 && INTER % CK == 0 && INTER % BI == 0 && BI % 16 == 0, "whole chunks and items");
static_assert((UP_FRAGS % WARPS == 0 || WARPS % UP_FRAGS == 0) && NTOK % 8 == 0 && NTOK <= 32,
              "the up item's fragments over the warps");
static_assert(HIDDEN % 16 == 0 && MAX_TOKENS % 8 == 0, "whole fragments");
static_assert(!W_RAW || W_VEC == 8, "raw weights are 16-bit");
static_assert(LE % W_VEC == 0 && (LE == 16 || LE == 32), "whole vectors a lane");
using W13 = WMat<HIDDEN, 2 * INTER, EXPERTS>;  // w13 [E, 2I, H]
using W2 = WMat<INTER, HIDDEN, EXPERTS>;        // w2 [E, H, I]

// Dynamic shared memory (the host's fused_smem_bytes, asserted below): the routing tables, then
// the up items' gate / up sums (f32 [2 BI][NTOK]) or the down items' per-warp token sums (f32
// [WARPS][16][MAX_TOKENS]), whichever is larger, then the last-block flag.
constexpr int ROUTING_BYTES = ((routing_smem_ints(NPAIRS, EXPERTS) * 4 + 15) / 16) * 16;
constexpr int UP_BYTES = KSPLIT * 2 * BI * NTOK * 4;
constexpr int DN_BYTES = WARPS * 16 * MAX_TOKENS * 4;
constexpr int WORK_BYTES = UP_BYTES > DN_BYTES ? UP_BYTES : DN_BYTES;
constexpr int SMEM_BYTES = ROUTING_BYTES + WORK_BYTES + 16;
static_assert(SMEM_BYTES == {{ smem_bytes }}, "the host's fused_smem_bytes");

__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.{{ mma_type }}.{{ mma_type }}.f32 "
        "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_act2(float lo, float hi) {
    const act_t l = narrow(lo, (const act_t*)nullptr), h = narrow(hi, (const act_t*)nullptr);
    return (unsigned)*reinterpret_cast<const unsigned short*>(&l) |
           ((unsigned)*reinterpret_cast<const unsigned short*>(&h) << 16);
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One row's chunk as it is stored: its vectors and their group scales.
struct RowChunk {
    uint4 v[VPL];
    WScale s[VPL];
};
template <class M>
__device__ __forceinline__ void load_chunk(RowChunk& r, const uint4* __restrict__ w, const void* __restrict__ scales,
                                           long row, int chunk, int c) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        const int vec = (chunk * CK + c * LE) / W_VEC + i;
        r.v[i] = ldg_stream(w + row * (M::K / W_VEC) + vec);
        r.s[i] = load_wscale<M>(scales, row, vec);
    }
}
// The chunk's LE codes as act_t pairs in order: word 2s + h holds codes 4s + 2h, 4s + 2h + 1.
__device__ __forceinline__ void decode_chunk(const RowChunk& r, unsigned (&a)[2 * STEPS]) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        if constexpr (W_RAW) {
            a[4 * i] = r.v[i].x;
            a[4 * i + 1] = r.v[i].y;
            a[4 * i + 2] = r.v[i].z;
            a[4 * i + 3] = r.v[i].w;
        } else if constexpr (W_E4M3_PAIRS) {
            const unsigned words[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float sc = W_GROUP_SCALED ? group_scale(r.s[i], 4 * q / (W_VEC / W_GROUPS)) : 1.0f;
                unsigned pr[2];
                if constexpr (ACT_BF16) {
                    // Codes 0, 1 (then 2, 3) into the two halves' bytes 0 and 2; each code's sign to
                    // bit 15 and its exponent and mantissa to bits 4-10: a bf16 of the value times
                    // 2^-120 (subnormals too), times 2^120 exactly, then the power-of-two scale.
                    const unsigned y = __byte_perm(words[q], 0u, 0x3120u);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const unsigned t = y >> (8 * h);
                        const unsigned bits = ((t << 8) & 0x80008000u) | ((t << 4) & 0x07f007f0u);
                        __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                                   __floats2bfloat162_rn(0x1p120f, 0x1p120f));
                        if constexpr (W_GROUP_SCALED) v = __hmul2(v, __floats2bfloat162_rn(sc, sc));
                        pr[h] = *reinterpret_cast<const unsigned*>(&v);
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const __half2_raw c = __nv_cvt_fp8x2_to_halfraw2(
                            (__nv_fp8x2_storage_t)((words[q] >> (16 * h)) & 0xffffu), __NV_E4M3);
                        const float2 f = h2_to_f2((unsigned)c.x | ((unsigned)c.y << 16));
                        pr[h] = W_GROUP_SCALED ? pack_act2(f.x * sc, f.y * sc) : ((unsigned)c.x | ((unsigned)c.y << 16));
                    }
                }
                a[(i * W_VEC + 4 * q) / 2] = pr[0];
                a[(i * W_VEC + 4 * q) / 2 + 1] = pr[1];
            }
        } else {
            float w[W_VEC];
            dequant_vec(r.v[i], r.s[i], w);
#pragma unroll
            for (int e = 0; e < W_VEC; e += 2) {
                const float s = W_GROUP_SCALED ? group_scale(r.s[i], e / (W_VEC / W_GROUPS)) : 1.0f;
                a[(i * W_VEC + e) / 2] = pack_act2(w[e] * s, w[e + 1] * s);
            }
        }
    }
}

// acc[f] += rows(g, g + 8) . tokens(8 f + g)^T over chunks [kb, ke) of K, for RF row fragments at
// once (rows row[rf], row[rf] + 8) and NF token fragments whose activations start at b[f] (act_t,
// K-major, lane c's codes of chunk k at b[f] + k CK + c LE). Weights come through a ring of DEPTH
// chunks in registers.
template <class M, int RF, int NF>
__device__ __forceinline__ void mma_rows(const uint4* __restrict__ w, const void* __restrict__ scales,
                                         const long (&row)[RF], const act_t* const (&b)[NF], bool cached_b,
                                         int kb, int ke, float (&acc)[RF][NF][4]) {
    const int c = threadIdx.x % 4;
    RowChunk ring[DEPTH][RF][2];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (kb + d < ke)
#pragma unroll
            for (int rf = 0; rf < RF; ++rf)
#pragma unroll
                for (int h = 0; h < 2; ++h) load_chunk<M>(ring[d][rf][h], w, scales, row[rf] + 8 * h, kb + d, c);
    for (int k0 = kb; k0 < ke; k0 += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int k = k0 + d;
            if (k < ke) {
                unsigned a[RF][2][2 * STEPS];
#pragma unroll
                for (int rf = 0; rf < RF; ++rf)
#pragma unroll
                    for (int h = 0; h < 2; ++h) decode_chunk(ring[d][rf][h], a[rf][h]);
                if (k + DEPTH < ke)
#pragma unroll
                    for (int rf = 0; rf < RF; ++rf)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            load_chunk<M>(ring[d][rf][h], w, scales, row[rf] + 8 * h, k + DEPTH, c);
#pragma unroll
                for (int s = 0; s < STEPS; ++s)
#pragma unroll
                    for (int f = 0; f < NF; ++f) {
                        const act_t* p = b[f] + (long)k * CK + c * LE + 4 * s;
                        // x is read-only for the launch; the intermediate is written by it (L2).
                        const uint2 bv = cached_b ? __ldg(reinterpret_cast<const uint2*>(p))
                                                  : __ldcg(reinterpret_cast<const uint2*>(p));
#pragma unroll
                        for (int rf = 0; rf < RF; ++rf) {
                            const unsigned fa[4] = {a[rf][0][2 * s], a[rf][1][2 * s], a[rf][0][2 * s + 1],
                                                    a[rf][1][2 * s + 1]};
                            mma_16816(acc[rf][f], fa, bv.x, bv.y);
                        }
                    }
            }
        }
    }
}

// Up item (u, j) of expert e: the pass of its pairs from `pass` (at most NTOK, in NF token
// fragments); mid rows of the pairs.
template <int NF>
__device__ __forceinline__ void up_pass(const FusedParams& p, const Routing& rt, int u, int j, int pass, float* gu) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
    const int e = rt.uexp[u], cnt = rt.ucnt[u];
    const int* list = rt.entries + rt.uoff[u];
    const act_t* xb[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        const int q = pass + 8 * f + g;
        const int pair = list[q < cnt ? q : pass];
        xb[f] = p.x + (long)(pair / TOP_K) * HIDDEN;
    }
    // This warp's fragments (gate fragments, then up fragments) and its share of K.
    const int ks = KSPLIT > 1 ? warp / UP_FRAGS : 0;
    long row[UP_RF];
    int frag[UP_RF];
#pragma unroll
    for (int rf = 0; rf < UP_RF; ++rf) {
        frag[rf] = KSPLIT > 1 ? warp % UP_FRAGS : warp + WARPS * rf;
        const int n = frag[rf] < BI / 16 ? j * BI + 16 * frag[rf] : INTER + j * BI + 16 * (frag[rf] - BI / 16);
        row[rf] = (long)e * 2 * INTER + n + g;
    }
    constexpr int NCH = HIDDEN / CK;
    float acc[UP_RF][NF][4] = {};
    mma_rows<W13, UP_RF, NF>(reinterpret_cast<const uint4*>(p.w13), p.w13_scales, row, xb, true,
                             ks * NCH / KSPLIT, (ks + 1) * NCH / KSPLIT, acc);
    float* part = gu + ks * 2 * BI * NTOK;  // this share's sums
#pragma unroll
    for (int rf = 0; rf < UP_RF; ++rf) {
        const int r0 = 16 * frag[rf] + g;  // row of gu: gate 0..BI, up BI..2BI
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long wrow = row[rf] + 8 * h;
            const float rs = row_scale<W13>(p.w13_scales, wrow);
            const float bias = HAS_BIAS && ks == 0 ? __ldg(p.w13_bias + wrow) : 0.0f;
#pragma unroll
            for (int f = 0; f < NF; ++f)
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    part[(r0 + 8 * h) * NTOK + 8 * f + 2 * c + i] = acc[rf][f][2 * h + i] * rs + bias;
        }
    }
    __syncthreads();
    // The shares of K summed in order, the activation, rounded to act_t, two neurons per thread:
    // a pair's BI values in one run.
    auto sum = [&](int r, int t) {
        float v = gu[r * NTOK + t];
#pragma unroll
        for (int k = 1; k < KSPLIT; ++k) v += gu[k * 2 * BI * NTOK + r * NTOK + t];
        return v;
    };
    const int n = min(NTOK, cnt - pass);
    for (int q = threadIdx.x; q < n * (BI / 2); q += THREADS) {
        const int t = q / (BI / 2), i = 2 * (q % (BI / 2));
        const float h0 = moe_glu(sum(i, t), sum(BI + i, t));
        const float h1 = moe_glu(sum(i + 1, t), sum(BI + i + 1, t));
        *reinterpret_cast<unsigned*>(p.mid + (long)list[pass + t] * INTER + j * BI + i) = pack_act2(h0, h1);
    }
    __syncthreads();
}

// Expert u's rows of a down item into L2 (16 rows of w2, all of K), ahead of their loads: the
// warp may still wait for the expert's up items, and the lines then land while it does.
__device__ __forceinline__ void prefetch_down(const FusedParams& p, const Routing& rt, int u, int r) {
    constexpr int ROW_BYTES = INTER / W_VEC * 16;
    constexpr int LINES = 16 * ROW_BYTES / 128;
    const int lane = threadIdx.x % 32;
    const unsigned char* base = p.w2 + ((long)rt.uexp[u] * HIDDEN + 16 * r) * ROW_BYTES;
    for (int l = lane; l < LINES; l += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + 128L * l));
}

// Down item: hidden rows [16 r, 16 r + 16). Warp w takes experts w, w + WARPS, ... in order and
// adds each pair's weighted sums (expert u's pass from `pass`, in NF token fragments) into its own
// token rows (ys [16][MAX_TOKENS]), one column of a fragment at a time (two pairs of one expert may
// share a token); the block then sums the warps in order: the result does not depend on timing.
template <int NF>
__device__ __forceinline__ void down_expert(const FusedParams& p, const Routing& rt, int u, int pass, int r, float* ys) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int e = rt.uexp[u], cnt = rt.ucnt[u];
    const int* list = rt.entries + rt.uoff[u];
    const act_t* mb[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        const int q = pass + 8 * f + g;
        mb[f] = p.mid + (long)list[q < cnt ? q : pass] * INTER;
    }
    const long row[1] = {(long)e * HIDDEN + 16 * r + g};
    float acc[1][NF][4] = {};
    mma_rows<W2, 1, NF>(reinterpret_cast<const uint4*>(p.w2), p.w2_scales, row, mb, false, 0, INTER / CK, acc);
    const float rs[2] = {row_scale<W2>(p.w2_scales, row[0]), row_scale<W2>(p.w2_scales, row[0] + 8)};
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int col = 0; col < 8; ++col) {
            const int q = pass + 8 * f + col;
            if (col / 2 == c && q < cnt) {
                const int pair = list[q];
                const float wt = __ldg(p.topk_weights + pair);
                float* dst = ys + pair / TOP_K;
#pragma unroll
                for (int h = 0; h < 2; ++h) dst[(g + 8 * h) * MAX_TOKENS] += wt * rs[h] * acc[0][f][2 * h + col % 2];
            }
            __syncwarp();
        }
}

extern "C" __global__ void __launch_bounds__(THREADS)
moe_fused(const __grid_constant__ FusedParams params) {
    if (family_skipped(params.choice, FAMILY_FUSED)) return;
    // An expert's pairs in passes of NTOK tokens, each in as few token fragments as cover it (1, 2
    // or all NTOK / 8 of them): no pass reaches into the next one's pairs or past its NTOK columns.
    constexpr int PASS_NF = NTOK / 8;
    extern __shared__ __align__(16) int smem[];
    dequant_setup();
    const FusedParams& p = params;
    const Routing rt = build_routing(p.topk_ids, p.m * TOP_K, EXPERTS, smem, p.err);
    float* work = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + ROUTING_BYTES);
    int* last = reinterpret_cast<int*>(reinterpret_cast<char*>(smem) + ROUTING_BYTES + WORK_BYTES);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int up_items = rt.num_unique * J_ITEMS;
    // The down items' experts split over DN_SPLIT blocks where that takes SM slots the down rows
    // would leave idle (at least two blocks an SM) and every half still has an expert a warp.
    const int split = DN_SPLIT > 1 && (int)gridDim.x >= DN_SPLIT * DN_ROWS && rt.num_unique > WARPS ? DN_SPLIT : 1;
    for (int it = blockIdx.x; it < up_items + DN_ROWS * split; it += gridDim.x) {
        if (it < up_items) {
            const int u = it % rt.num_unique, j = it / rt.num_unique;
            for (int pass = 0; pass < rt.ucnt[u]; pass += NTOK) {
                const int n = min(NTOK, rt.ucnt[u] - pass);
                if (PASS_NF > 2 && n > 16) up_pass<PASS_NF>(p, rt, u, j, pass, work);
                else if (PASS_NF > 1 && n > 8) up_pass<PASS_NF < 2 ? PASS_NF : 2>(p, rt, u, j, pass, work);
                else up_pass<1>(p, rt, u, j, pass, work);
            }
            // Publish the slice: every thread's stores, then one count.
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) atomicAdd(p.done + rt.uexp[u], 1);
        } else {
            // Rows r, this block's share h of the experts (u = h, h + split, ..).
            const int r = (it - up_items) / split, h = (it - up_items) % split;
            float* ys = work + warp * 16 * MAX_TOKENS;
            for (int q = lane; q < 16 * MAX_TOKENS; q += 32) ys[q] = 0.0f;
            __syncwarp();
            if (PREFETCH && h + split * warp < rt.num_unique) prefetch_down(p, rt, h + split * warp, r);
            for (int u = h + split * warp; u < rt.num_unique; u += split * WARPS) {
                if (PREFETCH && u + split * WARPS < rt.num_unique) prefetch_down(p, rt, u + split * WARPS, r);
                if (lane == 0)
                    while (ld_acquire(p.done + rt.uexp[u]) < J_ITEMS) __nanosleep(64);
                __syncwarp();
                for (int pass = 0; pass < rt.ucnt[u]; pass += NTOK) {
                    const int n = min(NTOK, rt.ucnt[u] - pass);
                    if (PASS_NF > 2 && n > 16) down_expert<PASS_NF>(p, rt, u, pass, r, ys);
                    else if (PASS_NF > 1 && n > 8) down_expert<PASS_NF < 2 ? PASS_NF : 2>(p, rt, u, pass, r, ys);
                    else down_expert<1>(p, rt, u, pass, r, ys);
                }
            }
            __syncthreads();
            if (split > 1) {
                // This half's sums to dn_part [r][h][t][16]; the block that counts the row's
                // last half adds the halves in order (its own included, read back the same way).
                float* part = p.dn_part + (long)(r * DN_SPLIT + h) * MAX_TOKENS * 16;
                for (int q = threadIdx.x; q < 16 * p.m; q += THREADS) {
                    float v = 0.0f;
#pragma unroll
                    for (int w = 0; w < WARPS; ++w) v += work[(w * 16 + q % 16) * MAX_TOKENS + q / 16];
                    part[q] = v;
                }
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) last[1] = atomicAdd(p.dn_count + r, 1) == DN_SPLIT - 1;
                __syncthreads();
                if (!last[1]) continue;
                __threadfence();
                if (threadIdx.x == 0) p.dn_count[r] = 0;  // both halves are in: reset for the next launch
            }
            for (int q = threadIdx.x; q < 16 * p.m; q += THREADS) {
                const int t = q / 16, hr = 16 * r + q % 16;
                float v = 0.0f;
                if (split > 1) {
#pragma unroll
                    for (int hh = 0; hh < DN_SPLIT; ++hh) v += __ldcg(p.dn_part + (long)(r * DN_SPLIT + hh) * MAX_TOKENS * 16 + q);
                } else {
#pragma unroll
                    for (int w = 0; w < WARPS; ++w) v += work[(w * 16 + q % 16) * MAX_TOKENS + t];
                }
                if constexpr (HAS_BIAS) {
                    for (int s = 0; s < TOP_K; ++s) {
                        const int id = __ldg(p.topk_ids + t * TOP_K + s);
                        if (id >= 0 && id < EXPERTS)
                            v = fmaf(__ldg(p.topk_weights + t * TOP_K + s), __ldg(p.w2_bias + (long)id * HIDDEN + hr), v);
                    }
                }
                p.y[(long)t * HIDDEN + hr] = narrow(v, (const act_t*)nullptr);
            }
            __syncthreads();
        }
    }
    // The last block out resets the step's counters (every wait on them is over).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        *last = atomicAdd(p.finished, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (*last) {
        for (int u = threadIdx.x; u < rt.num_unique; u += THREADS) p.done[rt.uexp[u]] = 0;
        if (threadIdx.x == 0) *p.finished = 0;
    }
}
