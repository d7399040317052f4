// moeforge warp decode: {{ spec_id }}
// Output-centric MoE for small steps. gate_up: a warp owns one intermediate neuron of one routed
// expert and serves every token routed to that expert; down: a warp owns one hidden output of a
// group of tokens and folds every routed expert, weighted, into one fp32 accumulator.
{% include "common.cuh" %}
{% include "activation.cuh" %}
{% include "dequant.cuh" %}
{% include "routing.cuh" %}
{% include "mbarrier.cuh" %}

typedef {{ act_type }} act_t;
// Every kernel's parameter struct (moe_codegen::params: one declaration for Rust and C).
{{ params }}
constexpr int HIDDEN = {{ hidden }};
constexpr int INTER = {{ intermediate }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
// Per-expert biases: w13_bias [E, 2I] on the gate / up projections before the activation,
// w2_bias [E, H] on each expert's output, under its routing weight (f32).
constexpr bool HAS_BIAS = {{ bias }};
constexpr int WARPS = {{ warps }};        // warps per block
constexpr int GU_CHUNK = {{ gu_chunk }};  // at most this many 16-byte vectors per lane per row in a gate_up unit
constexpr bool GU_EARLY = {{ gu_early }};  // the one-token gate_up loads its first unit before routing
constexpr int DN_CHUNK = {{ dn_chunk }};  // ... per lane of an item's flat vectors (down)

static_assert((long)EXPERTS * INTER < 2147483647L, "gate_up's work indices are 32-bit");
using W13 = WMat<HIDDEN, 2 * INTER, EXPERTS>;  // w13 [E, 2I, H]
using W2 = WMat<INTER, HIDDEN, EXPERTS>;        // w2 [E, H, I]

constexpr int NV_H = HIDDEN / W_VEC;      // 16-byte vectors per w13 row
constexpr int NV_I = INTER / W_VEC;       // 16-byte vectors per w2 row
constexpr int VPL_H = (NV_H + 31) / 32;   // 32-vector chunks per w13 row (the last may be partial)
// gate_up's lanes per token tile: the one-token kernel gives a w13 row a whole warp; the others
// give it {{ gu_lanes }} lanes (16: a warp serves two neighbouring neurons of one expert at once, with
// twice the vectors per lane in flight).
template <int MT>
struct GuShape {
    static constexpr int LANES = MT == 1 ? 32 : {{ gu_lanes }};
    static constexpr int ITEMS = 32 / LANES;                       // items a warp serves at once
    static constexpr int VPL = (NV_H + LANES - 1) / LANES;         // vectors per lane per w13 row
    static constexpr int CHUNK = VPL < GU_CHUNK ? VPL : GU_CHUNK;  // ... per lane per row in a unit
    static_assert((LANES == 32 || LANES == 16) && INTER % ITEMS == 0, "a warp's items share an expert");
};
constexpr int VPL_I = (NV_I + 31) / 32;

// The step's activations, staged once per block as fp32 when they fit (XS_MAX_BYTES): a lane then
// reads its vector's elements as W_VEC / 4 conflict-free float4s (lanes side by side) instead of
// re-loading and widening them from global memory for every row it serves.
// Layout: token t, vector v = 32 c + l, float4 k of the vector at ((t * VPL_H + c) * W_VEC / 4 + k) * 32 + l.
constexpr int XS_TOKEN_FLOATS = VPL_H * W_VEC * 32;
constexpr int XS_MAX_BYTES = {{ xs_max_bytes }};
__host__ __device__ constexpr bool x_staged(int m) { return (long)m * XS_TOKEN_FLOATS * 4 <= XS_MAX_BYTES; }

// The staged activations follow the routing tables, 16-byte aligned: one 16-byte-aligned slot of
// m ints (the per-token scale exponents of the packed-half path), then the tokens (the host's
// decode_smem_bytes is checked against it below).
__host__ __device__ constexpr int x_stage_ints(int m) { return (routing_smem_ints(m * TOP_K, EXPERTS) + 3) & ~3; }
__device__ __forceinline__ float4* x_stage_smem(int* smem, int m) {
    return reinterpret_cast<float4*>(smem + x_stage_ints(m));
}
// float4s of the exponent slot (W_H2), and the bytes the staging of m tokens takes from
// x_stage_smem on: fp32, the tokens; W_H2, the slot, then the tokens' fp16 pairs (half the bytes).
__host__ __device__ constexpr int x_exp_slot_f4(int m) { return (m + 3) / 4; }
__host__ __device__ constexpr long x_stage_bytes(int m) {
    return W_H2 ? 16L * x_exp_slot_f4(m) + (long)m * VPL_H * (W_VEC / 8) * 32 * 16 : (long)m * XS_TOKEN_FLOATS * 4;
}

// The host's sizing, computed once by the renderer (moe-codegen render.rs, DecodeSmem) and
// checked here against this module's layout: the routing tables exactly, the staging within the
// host's bytes for every step size (past the loop's last m both sides grow alike).
constexpr int HOST_ROUTING_FIXED = {{ smem.routing_fixed }};            // routing bytes: fixed,
constexpr int HOST_ROUTING_PER_PAIR = {{ smem.routing_per_pair }};      // per (token, slot) pair,
constexpr int HOST_ROUTING_PER_UNIQUE = {{ smem.routing_per_unique }};  // per possible unique expert
constexpr int HOST_X_TOKEN = {{ smem.x_token }};  // bytes of a token staged as fp32
constexpr int HOST_X_EXP = {{ smem.x_exp }};      // bytes per token of the exponent slot
constexpr int HOST_X_MAX = {{ smem.x_max }};      // the host sizes for staged tokens while their fp32 bytes fit
constexpr int HOST_DOWN_PER_PAIR = {{ smem.down_per_pair }};  // moe_down: bytes per pair (sid, swt)
constexpr int HOST_MID_ROW = {{ smem.mid_row_floats }};       // fp32 per intermediate row (MID_ROW)
constexpr int HOST_DN_STASH = {{ dn_stash_smem }};            // bytes the host allows down's stash
constexpr int HOST_STATIC_SMEM = {{ static_smem }};           // the dequant include's static bytes
__host__ __device__ constexpr long host_routing_bytes(int m) {
    const long p = (long)m * TOP_K;
    return HOST_ROUTING_FIXED + HOST_ROUTING_PER_PAIR * p + HOST_ROUTING_PER_UNIQUE * (p < EXPERTS ? p : EXPERTS);
}
__host__ __device__ constexpr long host_decode_smem(int m) {  // decode_smem_bytes
    const long xs = (long)m * HOST_X_TOKEN;
    return ((host_routing_bytes(m) + 15) & ~15L) + (xs <= HOST_X_MAX ? ((HOST_X_EXP * (long)m + 15) & ~15L) + xs : 0);
}
__host__ __device__ constexpr bool decode_smem_fits_host() {
    for (int m = 1; m <= EXPERTS + 2 + HOST_X_MAX / HOST_X_TOKEN; ++m) {
        const int p = m * TOP_K;
        if (4L * routing_smem_ints(p, EXPERTS) != host_routing_bytes(m)) return false;
        if (routing_scratch_ints(p, EXPERTS, 2) + 2 * p != routing_smem_ints(p, EXPERTS)) return false;
        if (4L * x_stage_ints(m) + (x_staged(m) ? x_stage_bytes(m) : 0) > host_decode_smem(m)) return false;
    }
    return true;
}
static_assert(HOST_X_TOKEN == XS_TOKEN_FLOATS * 4 && HOST_X_EXP == sizeof(int) && XS_MAX_BYTES <= HOST_X_MAX,
              "stage_x's token and exponent slot as the host sizes them (decode_smem_bytes)");
static_assert(decode_smem_fits_host(), "routing tables and staged tokens within decode_smem_bytes");
static_assert(HOST_DOWN_PER_PAIR == sizeof(int) + sizeof(float), "moe_down's ids and weights (decode_down_smem_bytes)");
{%- if fmt.variant == "lut" %}
static_assert(sizeof(w_lut) == HOST_STATIC_SMEM, "the LUT table's static shared memory (static_smem_bytes)");
{%- else %}
static_assert(HOST_STATIC_SMEM == 0, "no static shared memory in the dequant include (static_smem_bytes)");
{%- endif %}

// The step's activations as gate_up reads them: fp32 (f32, in the layout above), or, for formats
// with a packed-half decode (W_H2), fp16 pairs in the codec's pair order (h2), token t scaled by
// 2^-xexp[t] so that no chain of 8 pair-FMAs can leave fp16's range. Both null: read from x.
// h2 layout: token t, vector v = 32 c + l, quad q (pairs 4q..4q+3) at ((t * VPL_H + c) * W_VEC / 8 + q) * 32 + l.
struct XStage {
    const float4* f32;
    const uint4* h2;
    const int* xexp;
};

// Largest |x| the fp16 path admits: the H2_SUM_PRODUCTS products of W_ABS_MAX * |x| that dot_h2
// sums in fp16 (a group's) stay within 2^15.
constexpr int H2_SUM_PRODUCTS = W_VEC / W_GROUPS;
__host__ __device__ constexpr int x_h2_log2_limit() {
    int l = 0;
    while ((float)(2 << l) * W_ABS_MAX * (float)H2_SUM_PRODUCTS <= 32768.0f) ++l;
    return l;
}
constexpr int X_H2_LOG2_LIMIT = x_h2_log2_limit();  // max |x| * 2^-xexp <= 2^X_H2_LOG2_LIMIT
// Every codec's pairs come in quads that cover 8 consecutive elements, quad q the elements
// 8q..8q+7 in the same order: staging reads them from one uint4 of x.
__host__ __device__ constexpr bool h2_quads_repeat() {
    for (int p = 0; p < W_VEC / 2; ++p)
        for (int hi = 0; hi < 2; ++hi)
            if (h2_elem(p, hi) != 8 * (p / 4) + h2_elem(p % 4, hi)) return false;
    return true;
}
static_assert(h2_quads_repeat(), "pair order must repeat every 8 elements");

// The views of the staging area (xs: null when the step is not staged).
__device__ __forceinline__ XStage x_views(int m, float4* xs) {
    if (!xs) return XStage{ nullptr, nullptr, nullptr };
    if constexpr (W_H2) return XStage{ nullptr, reinterpret_cast<const uint4*>(xs + x_exp_slot_f4(m)), reinterpret_cast<const int*>(xs) };
    return XStage{ xs, nullptr, nullptr };
}

// Eight consecutive values (elements 8q..8q+7 of a vector), times sc, as the codec's four fp16
// pairs of that quad.
__device__ __forceinline__ uint4 h2_quad(const float (&f)[8], float sc) {
    unsigned h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = h2_as_u32(__floats2half2_rn(f[h2_elem(j, 0)] * sc, f[h2_elem(j, 1)] * sc));
    return make_uint4(h[0], h[1], h[2], h[3]);
}

// Stages the step's activations with the block's warps from w0 on, without a barrier: gate_up's
// warps run it while the first warp builds the routing tables, whose final barrier orders it.
__device__ __noinline__ void stage_x(const act_t* __restrict__ x, int m, float4* xs, int w0) {
    const int tid = threadIdx.x - 32 * w0;
    const int nthreads = blockDim.x - 32 * w0;
    constexpr int Q = HIDDEN / 8;  // eight activations (one uint4) per step
    if constexpr (W_H2) {
        int* xexp = reinterpret_cast<int*>(xs);
        uint4* xh = reinterpret_cast<uint4*>(xs + x_exp_slot_f4(m));
        for (int t = 0; t < m; ++t) {
            const uint4* xt = reinterpret_cast<const uint4*>(x + (long)t * HIDDEN);
            // Every warp finds the token's max |x| itself (float bits order like the floats when
            // non-negative), so that no barrier is needed; the re-reads hit L1.
            unsigned mx = 0;
            for (int i = threadIdx.x & 31; i < Q; i += 32) {
                float f[8];
                widen8(__ldg(xt + i), (const act_t*)nullptr, f);
#pragma unroll
                for (int k = 0; k < 8; ++k) mx = max(mx, __float_as_uint(fabsf(f[k])));
            }
            mx = __reduce_max_sync(MOE_FULL_MASK, mx);
            // max < 2^(e - 126): scale by 2^-k with k = e - 126 - limit, when positive.
            const int k = max((int)(mx >> 23) - 126 - X_H2_LOG2_LIMIT, 0);
            if (tid == 0) xexp[t] = k;
            const float sc = __uint_as_float((unsigned)(127 - k) << 23);
            for (int i = tid; i < Q; i += nthreads) {
                const int e0 = 8 * i;
                const int v = e0 / W_VEC;
                const int q = (e0 - v * W_VEC) / 8;
                float f[8];
                widen8(__ldg(xt + i), (const act_t*)nullptr, f);
                xh[((t * VPL_H + (v >> 5)) * (W_VEC / 8) + q) * 32 + (v & 31)] = h2_quad(f, sc);
            }
        }
    } else {
        for (int i = tid; i < m * Q * 2; i += nthreads) {
            const int t = i / (2 * Q);
            const int e = 4 * (i - t * 2 * Q);
            const int v = e / W_VEC;
            const int k = (e - v * W_VEC) / 4;
            const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x + (long)t * HIDDEN + e));
            uint4 wide = make_uint4(raw.x, raw.y, 0u, 0u);
            float f[8];
            widen8(wide, (const act_t*)nullptr, f);
            xs[((t * VPL_H + (v >> 5)) * (W_VEC / 4) + k) * 32 + (v & 31)] = make_float4(f[0], f[1], f[2], f[3]);
        }
    }
}

// The routing tables, with the activations staged by the other warps meanwhile.
__device__ __forceinline__ Routing route_and_stage(const act_t* __restrict__ x, const int* __restrict__ topk_ids,
                                                   int m, int* smem, int* __restrict__ err, XStage& xv) {
    float4* xs = x_staged(m) ? x_stage_smem(smem, m) : nullptr;
    xv = x_views(m, xs);
    if (WARPS == 1 && xs) stage_x(x, m, xs, 0);
    return build_routing(topk_ids, m * TOP_K, EXPERTS, smem, err, [&] {
        if (WARPS > 1 && xs) stage_x(x, m, xs, 1);
    });
}

// The W_VEC / 2 fp16 pairs of row r's vector v from a packed-half stage of rows of VPL 32-vector
// chunks (quad q of vector v = 32 c + l at ((r * VPL + c) * W_VEC / 8 + q) * 32 + l).
template <int VPL>
__device__ __forceinline__ void load_h2(const uint4* base, int r, int v, __half2 (&a)[W_VEC / 2]) {
    const uint4* p = base + (r * VPL + (v >> 5)) * (W_VEC / 8) * 32 + (v & 31);
#pragma unroll
    for (int q = 0; q < W_VEC / 8; ++q) {
        const uint4 u = p[32 * q];
        a[4 * q] = u32_as_h2(u.x);
        a[4 * q + 1] = u32_as_h2(u.y);
        a[4 * q + 2] = u32_as_h2(u.z);
        a[4 * q + 3] = u32_as_h2(u.w);
    }
}

// dot(w, a) on fp16 pairs: per group, chains of at most 8 pair-FMAs (two or more chains are
// independent, for latency), the chains and then the two halves added in fp16, widened to fp32
// once per group (not per chain and half: 4 ops fewer per 4-bit vector), the group scales applied
// in fp32. H2_SUM_PRODUCTS products meet in one fp16 sum: the bound X_H2_LOG2_LIMIT is set for.
__device__ __forceinline__ float dot_h2(const __half2 (&w)[W_VEC / 2], const __half2 (&a)[W_VEC / 2], const WScale& ws) {
    constexpr int PG = W_VEC / 2 / W_GROUPS;  // pairs per group
    constexpr int CH = PG > 8 ? 8 : PG;
    float t = 0.0f;
#pragma unroll
    for (int g = 0; g < W_GROUPS; ++g) {
        __half2 sum;
#pragma unroll
        for (int c = g * PG; c < (g + 1) * PG; c += CH) {
            __half2 acc = __hmul2(w[c], a[c]);
#pragma unroll
            for (int i = c + 1; i < c + CH; ++i) acc = __hfma2(w[i], a[i], acc);
            sum = c == g * PG ? acc : __hadd2(sum, acc);
        }
        const float d = __half2float(__hadd(__low2half(sum), __high2half(sum)));
        if constexpr (W_GROUP_SCALED) {
            t = fmaf(group_scale(ws, g), d, t);
        } else {
            t += d;
        }
    }
    return t * (1.0f / W_H2_UNIT);
}

// W_VEC activations of token t starting at vector v, as fp32: from the staged copy when there is
// one, else loaded and widened from x.
__device__ __forceinline__ void load_x(const act_t* __restrict__ x, const float4* xs, int t, int v, float (&a)[W_VEC]) {
    if (xs) {
        const float4* p = xs + (t * VPL_H + (v >> 5)) * (W_VEC / 4) * 32 + (v & 31);
#pragma unroll
        for (int k = 0; k < W_VEC / 4; ++k) {
            const float4 f = p[32 * k];
            a[4 * k] = f.x;
            a[4 * k + 1] = f.y;
            a[4 * k + 2] = f.z;
            a[4 * k + 3] = f.w;
        }
        return;
    }
    const uint4* p = reinterpret_cast<const uint4*>(x + (long)t * HIDDEN) + v * (W_VEC / 8);
#pragma unroll
    for (int h = 0; h < W_VEC / 8; ++h) {
        float f[8];
        widen8(__ldg(p + h), (const act_t*)nullptr, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) a[8 * h + i] = f[i];
    }
}

// The intermediate, fp32, one row of MID_ROW floats per pair, in the order down's lanes read it:
// vector v = 32 c + l of the row (W_VEC elements), float4 k of it, at (c * W_VEC / 4 + k) * 32 + l
// float4s into the row. A warp's float4 loads of 32 consecutive vectors are then 512 contiguous
// bytes, where the natural order would touch 32 lines per load. gate_up writes single floats
// anyway, so the order costs it nothing. Rows are padded to whole 32-vector chunks (the host's
// decode_mid_floats and the bulk down's shared memory take rows of HOST_MID_ROW).
constexpr int MID_ROW = VPL_I * 32 * W_VEC;
static_assert(MID_ROW == HOST_MID_ROW, "the intermediate's rows as the host sizes them (decode_mid_floats)");
__device__ __forceinline__ long mid_index(int p, int n) {
    const int v = n / W_VEC;
    const int e = n - v * W_VEC;
    return (long)p * MID_ROW + (((v >> 5) * (W_VEC / 4) + (e >> 2)) * 32 + (v & 31)) * 4 + (e & 3);
}

// The W_VEC fp32 intermediate activations of pair p's vector v (written by an earlier grid, so
// the read-only path). SMEM: mid is a copy in shared memory (the one-token bulk down).
template <bool SMEM = false>
__device__ __forceinline__ void load_mid(const float* __restrict__ mid, int p, int v, float (&a)[W_VEC]) {
    const float4* q = reinterpret_cast<const float4*>(mid + (long)p * MID_ROW) + (v >> 5) * (W_VEC / 4) * 32 + (v & 31);
#pragma unroll
    for (int k = 0; k < W_VEC / 4; ++k) {
        const float4 f = SMEM ? q[32 * k] : __ldg(q + 32 * k);
        a[4 * k] = f.x;
        a[4 * k + 1] = f.y;
        a[4 * k + 2] = f.z;
        a[4 * k + 3] = f.w;
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

// Adds vector v of a gate and an up row (codes gq / uq, group scales gs / us) dotted with the
// nt tokens' activations to their sums.
template <int MT>
__device__ __forceinline__ void gu_accumulate(const uint4& gq, const uint4& uq, const WScale& gs, const WScale& us,
                                              const act_t* __restrict__ x, const XStage& xs, const int (&tok)[MT],
                                              int nt, int v, float (&ag)[MT], float (&au)[MT]) {
    if (W_H2 && xs.h2) {
        // fp16 pairs: a pair-FMA per two weights instead of a widening and two FMAs.
        __half2 g[W_VEC / 2], w[W_VEC / 2];
        dequant_h2(gq, gs, g);
        dequant_h2(uq, us, w);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            if (j < nt) {
                __half2 a[W_VEC / 2];
                load_h2<VPL_H>(xs.h2, tok[j], v, a);
                ag[j] += dot_h2(g, a, gs);
                au[j] += dot_h2(w, a, us);
            }
        }
    } else {
        float g[W_VEC], w[W_VEC];
        dequant_vec(gq, gs, g);
        dequant_vec(uq, us, w);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            if (j < nt) {
                float a[W_VEC];
                load_x(x, xs.f32, tok[j], v, a);
                ag[j] += dot(g, a, gs);
                au[j] += dot(w, a, us);
            }
        }
    }
}

// The factor that undoes token t's fp16 scaling of the packed-half stage (a power of two: exact).
__device__ __forceinline__ float x_unscale(const XStage& xs, int t) {
    if constexpr (W_H2) {
        if (xs.xexp) return __uint_as_float((unsigned)(127 + xs.xexp[t]) << 23);
    }
    return 1.0f;
}

// A gate_up unit's weights (CHUNK vectors per lane of a gate and an up row) with the scales that
// go with them: group scales per vector and, in the one-token kernel, the rows' scales
// (per-channel formats). Loaded at the pass's end, row scales had their latency exposed once per
// item (H100, M = 1: fp8 per-channel 20.6 -> 20.0 us); longer passes hide it, and there the two
// registers made ptxas spill.
template <int MT>
struct GuUnit {
    static constexpr bool ROWS_AHEAD = MT == 1;
    using S = GuShape<MT>;
    uint4 g[S::CHUNK], u[S::CHUNK];
    WScale gs[S::CHUNK], us[S::CHUNK];
    float gr, ur;
    // Loads vectors c..c+CHUNK-1 (per lane) of the gate row grow and its up row.
    __device__ __forceinline__ void load(const uint4* __restrict__ w13, const void* __restrict__ w13_scales, long grow,
                                         int c, int lane) {
        if (ROWS_AHEAD) {
            gr = row_scale<W13>(w13_scales, grow);
            ur = row_scale<W13>(w13_scales, grow + INTER);
        }
        const uint4* gp = w13 + grow * NV_H;
        const uint4* up = gp + (long)INTER * NV_H;
#pragma unroll
        for (int i = 0; i < S::CHUNK; ++i) {
            const int v = (c + i) * S::LANES + lane % S::LANES;
            if (c + i < S::VPL && v < NV_H) {
                g[i] = ldg_stream(gp + v);
                u[i] = ldg_stream(up + v);
                gs[i] = load_wscale<W13>(w13_scales, grow, v);
                us[i] = load_wscale<W13>(w13_scales, grow + INTER, v);
            }
        }
    }
    __device__ __forceinline__ float gate_scale(const void* __restrict__ w13_scales, long grow) const {
        return ROWS_AHEAD ? gr : row_scale<W13>(w13_scales, grow);
    }
    __device__ __forceinline__ float up_scale(const void* __restrict__ w13_scales, long grow) const {
        return ROWS_AHEAD ? ur : row_scale<W13>(w13_scales, grow + INTER);
    }
};

// The gate row of gate_up's item `item`, given its unique expert's id.
__device__ __forceinline__ long gate_row(int expert, int item) { return (long)expert * 2 * INTER + item % INTER; }

// A warp's first unit, loaded before the routing tables exist: when the step has at most 32
// pairs, one warp can number the unique experts itself, in the order build_routing does (first
// appearance of a valid id), and find its first item's expert. Its weights are then in flight
// while the block builds the tables and stages the activations, instead of after.
// Only the one-token kernel does it (and only where GU_EARLY measured faster): in the others the
// unit's registers, live across the prologue, made ptxas spill or drop to one block per SM.
// Returns false (nothing loaded) for larger steps and for warps with no work.
template <int MT>
__device__ __forceinline__ bool load_first_unit(const int* __restrict__ topk_ids, int m, const uint4* __restrict__ w13,
                                                const void* __restrict__ w13_scales, GuUnit<MT>& first) {
    const int pairs = m * TOP_K;
    if (!GU_EARLY || MT > 1 || pairs > 32) return false;
    const int lane = threadIdx.x & 31;
    int e = lane < pairs ? __ldg(topk_ids + lane) : -1;
    if (e < 0 || e >= EXPERTS) e = -1;
    const unsigned peers = __match_any_sync(MOE_FULL_MASK, e);
    const unsigned fresh = __ballot_sync(MOE_FULL_MASK, e >= 0 && lane == __ffs(peers) - 1);
    using S = GuShape<MT>;
    const int item = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * S::ITEMS + lane / S::LANES;
    const int u = item / INTER;  // the same for the warp's items
    if (u >= __popc(fresh)) return false;
    const int e0 = __shfl_sync(MOE_FULL_MASK, e, __fns(fresh, 0, u + 1));
    first.load(w13, w13_scales, gate_row(e0, item), 0, lane);
    return true;
}

// mid[p][n] = act(gate_n . x_t) * (up_n . x_t) for every pair p = (t, slot) routed to expert e.
// A warp walks a flat sequence of units (item = (expert, neuron), pass over MT tokens, chunk of
// the row) and always has the next unit's weight loads in flight while it does the current math.
// cur: the warp's first unit, already loaded when `loaded`.
template <int MT>
__device__ __forceinline__ void gate_up_phase(const Routing& r, const act_t* __restrict__ x, const XStage& xs,
                                              const uint4* __restrict__ w13, const void* __restrict__ w13_scales,
                                              const float* __restrict__ w13_bias, float* __restrict__ mid,
                                              GuUnit<MT>& cur, bool loaded) {
    using S = GuShape<MT>;
    const int lane = threadIdx.x & 31;
    const int sub = lane % S::LANES;  // lane within the item's row
    // Work indices are 32-bit (the host bounds them): 64-bit division costs several times more.
    // The ITEMS items of a warp are valid or not together (items is a multiple of ITEMS).
    const int items = r.num_unique * INTER;
    const int stride = gridDim.x * WARPS * S::ITEMS;
    int item = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * S::ITEMS + lane / S::LANES;
    if (item >= items) return;

    // Unit state: (item, base token of the pass, first vector-per-lane of the chunk).
    int base = 0, c0 = 0;
    auto row = [&](int it) { return gate_row(r.uexp[it / INTER], it); };
    int nt = 0;
    int pair[MT];
    int tok[MT];
    float ag[MT], au[MT];
    auto setup = [&](int it, int b) {
        const int u = (int)(it / INTER);
        const int* ent = r.entries + r.uoff[u];
        nt = min(MT, r.ucnt[u] - b);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            pair[j] = j < nt ? ent[b + j] : 0;
            tok[j] = pair[j] / TOP_K;
            ag[j] = 0.0f;
            au[j] = 0.0f;
        }
    };
    if (!loaded) cur.load(w13, w13_scales, row(item), 0, lane);
    setup(item, 0);
    while (true) {
        int nitem = item;
        int nbase = base, nc0 = c0 + S::CHUNK;
        if (nc0 >= S::VPL) {
            nc0 = 0;
            nbase = base + MT;
            if (nbase >= r.ucnt[item / INTER]) {
                nbase = 0;
                nitem = item + stride;
            }
        }
        const bool more = nitem < items;
        GuUnit<MT> next;
        if (more) next.load(w13, w13_scales, row(nitem), nc0, lane);  // in flight during this unit's math
#pragma unroll
        for (int i = 0; i < S::CHUNK; ++i) {
            const int v = (c0 + i) * S::LANES + sub;
            if (c0 + i < S::VPL && v < NV_H) {
                gu_accumulate<MT>(cur.g[i], cur.u[i], cur.gs[i], cur.us[i], x, xs, tok, nt, v, ag, au);
            }
        }
        if (nc0 == 0) {  // the pass is complete: reduce, activate, store
            const long grow = row(item);
            const float gs = cur.gate_scale(w13_scales, grow);
            const float us = cur.up_scale(w13_scales, grow);
            const int n = (int)(item % INTER);
            float bg = 0.0f, bu = 0.0f;
            if constexpr (HAS_BIAS) bg = __ldg(w13_bias + grow), bu = __ldg(w13_bias + grow + INTER);
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                if (j < nt) {
                    const float xm = x_unscale(xs, tok[j]);
                    const float g = lanes_sum<S::LANES>(ag[j]) * (gs * xm);
                    const float v = lanes_sum<S::LANES>(au[j]) * (us * xm);
                    if (sub == 0) mid[mid_index(pair[j], n)] = moe_glu(g + bg, v + bu);
                }
            }
            if (!more) break;
            setup(nitem, nbase);
        }
        item = nitem;
        base = nbase;
        c0 = nc0;
        cur = next;
    }
}

// y[t][h] = sum over t's slots s of weight[t][s] * (w2[e_s][h] . mid[t * TOP_K + s]). A warp owns
// ROWS consecutive outputs h of one token t and spreads the TOP_K rows' vectors over its lanes
// as one flat index f = s * NV_I + v, so that rows shorter than a warp (4-bit w2 rows) still keep
// every lane loading and no lane walks a per-expert loop. Every warp reads its token's whole
// intermediate (24 KB of fp32 for Qwen3): with ROWS = 2 each read serves two rows, halving that
// traffic (H100, Qwen3 fp8, M = 8: 112 -> 103 us). moe_down_stash (M = 1, each warp one item)
// keeps one row: two measured the same or slower there. Consecutive warps take consecutive tokens of one h: a row that several of them read is
// fetched from DRAM once and then hit in L2. The next unit's weights are in flight during the
// current unit's math.
// sid/swt: the step's expert ids (-1 where out of range) and routing weights, in shared memory.
constexpr int DN_ROWS = {{ dn_rows }};  // rows per item of moe_down
constexpr int DN_FLAT = TOP_K * NV_I;        // vectors per item and row
constexpr int DN_VPL = (DN_FLAT + 31) / 32;  // ... per lane
// Vectors per lane of a warp's first item that go to shared memory (cp.async) before the wait, on
// top of the DN_CHUNK in registers: the wait on gate_up then finds them landed. Only
// moe_down_stash (M = 1) has the stash, for one row per item; at M >= 2 it measured slower.
constexpr int DN_STASH_VECS = DN_VPL - DN_CHUNK < {{ dn_stash }} ? DN_VPL - DN_CHUNK : {{ dn_stash }};
// sum over a token's slots of weight * w2_bias[e][h] (slots sid / swt, -1 ids skipped).
__device__ __forceinline__ float w2_bias_sum(const int* sid, const float* swt, const float* __restrict__ w2_bias, int h) {
    float b = 0.0f;
#pragma unroll
    for (int s = 0; s < TOP_K; ++s) {
        if (sid[s] >= 0) b = fmaf(swt[s], __ldg(w2_bias + (long)sid[s] * HIDDEN + h), b);
    }
    return b;
}
template <int ROWS, int DN_STASH = 0>
__device__ __forceinline__ void down_phase(const int* sid, const float* swt, const float* __restrict__ mid,
                                           const uint4* __restrict__ w2, const void* __restrict__ w2_scales,
                                           const float* __restrict__ w2_bias, act_t* __restrict__ y, int m) {
    static_assert(HIDDEN % ROWS == 0 && (DN_STASH == 0 || ROWS == 1), "the stash holds one row per item");
    const int lane = threadIdx.x & 31;
    const int items = HIDDEN / ROWS * m;  // 32-bit: the host bounds it
    const int stride = gridDim.x * WARPS;
    int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (item >= items) {
        pdl_wait();
        return;
    }

    // An item's weights: unit vectors c..c+DN_CHUNK-1 per lane of each of its ROWS rows.
    auto load = [&](int it, int c, uint4 (&wv)[DN_CHUNK][ROWS], WScale (&ws)[DN_CHUNK][ROWS],
                    float (&rs)[DN_CHUNK][ROWS]) {
        const int hr = it / m;
        const int t = it - hr * m;
#pragma unroll
        for (int i = 0; i < DN_CHUNK; ++i) {
            const int f = (c + i) * 32 + lane;
            if (c + i < DN_VPL && f < DN_FLAT) {
                const int s = f / NV_I;
                const int v = f - s * NV_I;
                const int e = sid[t * TOP_K + s];
                if (e >= 0) {
#pragma unroll
                    for (int q = 0; q < ROWS; ++q) {
                        const long rw = (long)e * HIDDEN + hr * ROWS + q;
                        wv[i][q] = ldg_stream(w2 + rw * NV_I + v);
                        ws[i][q] = load_wscale<W2>(w2_scales, rw, v);
                        rs[i][q] = row_scale<W2>(w2_scales, rw);
                    }
                }
            }
        }
    };
    uint4 wv[DN_CHUNK][ROWS];
    WScale wsc[DN_CHUNK][ROWS];
    float rsc[DN_CHUNK][ROWS];
    // The weights and the step's routing do not depend on gate_up: the first unit's loads go out
    // before waiting for it, and so does the stash (the next DN_STASH vectors per lane of the
    // first item, with their scales), so that they overlap gate_up's tail.
    load(item, 0, wv, wsc, rsc);
    const int first = item;
    __shared__ uint4 stash[DN_STASH > 0 ? WARPS : 1][DN_STASH > 0 ? DN_STASH : 1][32];
    static_assert(DN_STASH <= 0 || sizeof(stash) <= HOST_DN_STASH, "the stash within what the host allows it");
    WScale ssc[DN_STASH > 0 ? DN_STASH : 1];
    float srs[DN_STASH > 0 ? DN_STASH : 1];
    uint4(&mine)[DN_STASH > 0 ? DN_STASH : 1][32] = stash[DN_STASH > 0 ? threadIdx.x >> 5 : 0];
    if constexpr (DN_STASH > 0) {
        const int h = item / m;
        const int t = item - h * m;
#pragma unroll
        for (int i = 0; i < DN_STASH; ++i) {
            const int f = (DN_CHUNK + i) * 32 + lane;
            const int s = f / NV_I;
            const int v = f - s * NV_I;
            const int e = f < DN_FLAT ? sid[t * TOP_K + s] : -1;
            const long rw = (long)(e < 0 ? 0 : e) * HIDDEN + h;
            cp_async16(smem_u32(&mine[i][lane]), w2 + rw * NV_I + v, e >= 0);
            if (e >= 0) {
                ssc[i] = load_wscale<W2>(w2_scales, rw, v);
                srs[i] = row_scale<W2>(w2_scales, rw);
            }
        }
        cp_async_commit();
    }
    pdl_wait();  // mid is gate_up's output
    int c0 = 0;
    float acc[ROWS];
#pragma unroll
    for (int q = 0; q < ROWS; ++q) acc[q] = 0.0f;
    if constexpr (DN_STASH > 0) {
        const int h = item / m;
        const int t = item - h * m;
        cp_async_wait<0>();  // each lane reads only what it copied itself
#pragma unroll
        for (int i = 0; i < DN_STASH; ++i) {
            const int f = (DN_CHUNK + i) * 32 + lane;
            const int s = f / NV_I;
            const int v = f - s * NV_I;
            const int p = t * TOP_K + s;
            if (f < DN_FLAT && sid[p] >= 0) {
                float w[W_VEC], a[W_VEC];
                dequant_vec(mine[i][lane], ssc[i], w);
                load_mid(mid, p, v, a);
                acc[0] = fmaf(swt[p] * srs[i], dot(w, a, ssc[i]), acc[0]);
            }
        }
    }
    while (true) {
        int nitem = item;
        int nc0 = c0 + DN_CHUNK;
        if (DN_STASH > 0 && item == first && c0 == 0) nc0 += DN_STASH;  // already done from the stash
        if (nc0 >= DN_VPL) {
            nc0 = 0;
            nitem = item + stride;
        }
        const bool more = nitem < items;
        uint4 wn[DN_CHUNK][ROWS];
        WScale wsn[DN_CHUNK][ROWS];
        float rsn[DN_CHUNK][ROWS];
        if (more) load(nitem, nc0, wn, wsn, rsn);  // in flight during this unit's math
        const int hr = item / m;
        const int t = item - hr * m;
#pragma unroll
        for (int i = 0; i < DN_CHUNK; ++i) {
            const int f = (c0 + i) * 32 + lane;
            if (c0 + i < DN_VPL && f < DN_FLAT) {
                const int s = f / NV_I;
                const int v = f - s * NV_I;
                const int p = t * TOP_K + s;
                if (sid[p] >= 0) {
                    float a[W_VEC];
                    load_mid(mid, p, v, a);
#pragma unroll
                    for (int q = 0; q < ROWS; ++q) {
                        float w[W_VEC];
                        dequant_vec(wv[i][q], wsc[i][q], w);
                        acc[q] = fmaf(swt[p] * rsc[i][q], dot(w, a, wsc[i][q]), acc[q]);
                    }
                }
            }
        }
        if (nc0 == 0) {  // the item is complete
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                const float v = warp_sum(acc[q]);
                if (lane == 0) {
                    const float b = HAS_BIAS ? w2_bias_sum(sid + t * TOP_K, swt + t * TOP_K, w2_bias, hr * ROWS + q) : 0.0f;
                    y[(long)t * HIDDEN + hr * ROWS + q] = narrow(v + b, (const act_t*)nullptr);
                }
                acc[q] = 0.0f;
            }
            if (!more) break;
        }
        item = nitem;
        c0 = nc0;
#pragma unroll
        for (int i = 0; i < DN_CHUNK; ++i) {
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                wv[i][q] = wn[i][q];
                wsc[i][q] = wsn[i][q];
                rsc[i][q] = rsn[i][q];
            }
        }
    }
}

// The step's ids (validated: -1 where out of range) and routing weights, staged in shared memory.
__device__ __forceinline__ void stage_pairs(const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
                                            int pairs, int* sid, float* swt) {
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = __ldg(topk_ids + p);
        sid[p] = e >= 0 && e < EXPERTS ? e : -1;
        swt[p] = __ldg(topk_weights + p);
    }
    __syncthreads();
}

// Entry points. gate_up comes in one version per token tile (tokens served per pass over a w13
// row); the host picks the smallest tile that covers the step. down has no token tile and is
// launched as a programmatic dependent of gate_up.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_down)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_down(const __grid_constant__ DownParams params) {
    MOE_UNPACK_DownParams(params);
    if (family_skipped(choice, FAMILY_WARP_DECODE)) return;
    extern __shared__ int smem[];
    dequant_setup();
    // The ids and weights are the step's inputs: staging them overlaps the tail of gate_up.
    int* sid = smem;
    float* swt = reinterpret_cast<float*>(smem + m * TOP_K);
    stage_pairs(topk_ids, topk_weights, m * TOP_K, sid, swt);
    // No block of this grid waits on another, and the next kernel waits (griddepcontrol.wait) for
    // our completion before it reads anything: let it launch once all our blocks have started, so
    // that its blocks take the SM slots ours free instead of launching after our last one.
    pdl_launch_dependents();
    down_phase<DN_ROWS>(sid, swt, mid, w2, w2_scales, w2_bias, y, m);
}
#endif  // entry moe_down
// As moe_down, with DN_STASH_VECS more vectors per lane of each warp's first item copied to shared
// memory before the wait: at M = 1, where each warp holds one item, more of it is in flight during
// gate_up's tail (H100, Qwen3 fp8: 24.7 -> 21.0 us per layer with 4; 8 measured slower).
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_down_stash)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_down_stash(const __grid_constant__ DownParams params) {
    MOE_UNPACK_DownParams(params);
    if (family_skipped(choice, FAMILY_WARP_DECODE)) return;
    extern __shared__ int smem[];
    dequant_setup();
    int* sid = smem;
    float* swt = reinterpret_cast<float*>(smem + m * TOP_K);
    stage_pairs(topk_ids, topk_weights, m * TOP_K, sid, swt);
    pdl_launch_dependents();  // as in moe_down
    down_phase<1, DN_STASH_VECS>(sid, swt, mid, w2, w2_scales, w2_bias, y, m);
}
#endif  // entry moe_down_stash
{%- for mt in token_tiles %}
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gate_up_t{{ mt }})
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_gate_up_t{{ mt }}(const __grid_constant__ GateUpParams params) {
    MOE_UNPACK_GateUpParams(params);
    extern __shared__ int smem[];
    dequant_setup();
    pdl_wait();  // x, the routing and mid's previous readers belong to earlier kernels
    if (family_skipped(choice, FAMILY_WARP_DECODE)) return;
    pdl_launch_dependents();  // the down kernel may launch and stage its inputs now
    GuUnit<{{ mt }}> first;
    const bool loaded = load_first_unit(topk_ids, m, w13, w13_scales, first);
    XStage xs;
    const Routing r = route_and_stage(x, topk_ids, m, smem, err, xs);
    gate_up_phase<{{ mt }}>(r, x, xs, w13, w13_scales, w13_bias, mid, first, loaded);
}
#endif  // entry moe_gate_up_t{{ mt }}
{%- endfor %}
{% include "decode_bulk.cuh" %}
{% include "decode_resident.cuh" %}
{% include "router.cuh" %}

// Shared experts (DeepSeek-V3, Qwen2-MoE): every token's routing [m, R_TOP_K] widened to
// [m, TOP_K], its last SHARED slots naming experts R_EXPERTS .. with weight 1, or
// sigmoid(x . gate) where SHARED_GATED. A routed id outside [0, R_EXPERTS) becomes -1 (counted
// and skipped by the kernels), so no caller id can reach a shared expert. One warp per token.
constexpr int SHARED = {{ shared }};
constexpr bool SHARED_GATED = {{ shared_gated }};
static_assert(R_TOP_K + SHARED == TOP_K && R_EXPERTS + SHARED == EXPERTS, "shared experts follow the routed ones");
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_expand_routing)
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_expand_routing(const __grid_constant__ ExpandParams params) {
    MOE_UNPACK_ExpandParams(params);
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTE_WARPS + threadIdx.x / 32;
    if (t >= m) return;
    for (int s = lane; s < R_TOP_K; s += 32) {
        const int e = ids_in[(long)t * R_TOP_K + s];
        dst_ids[(long)t * TOP_K + s] = e >= 0 && e < R_EXPERTS ? e : -1;
        dst_weights[(long)t * TOP_K + s] = weights_in[(long)t * R_TOP_K + s];
    }
    float w = 1.0f;
    if (SHARED_GATED && shared_on) {
        static_assert(HIDDEN % 8 == 0, "8 activations per 16-byte load");
        const uint4* xt = reinterpret_cast<const uint4*>(x + (long)t * HIDDEN);
        float dot = 0.0f;
        for (int i = lane; i < HIDDEN / 8; i += 32) {
            float f[8];
            widen8(__ldg(xt + i), (const act_t*)nullptr, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) dot = fmaf(f[j], __ldg(gate + 8 * i + j), dot);
        }
        dot = warp_sum(dot);
        w = 1.0f / (1.0f + __expf(-dot));
    }
    // shared_on = 0: the shared slots stay empty (an expert-parallel rank's experts on a peer's
    // tokens, whose shared experts run on their own rank).
    for (int j = lane; j < SHARED; j += 32) {
        dst_ids[(long)t * TOP_K + R_TOP_K + j] = shared_on ? R_EXPERTS + j : -1;
        dst_weights[(long)t * TOP_K + R_TOP_K + j] = shared_on ? w : 0.0f;
    }
}
#endif  // entry moe_expand_routing

// Routing ids given as int64 (PyTorch's index type), narrowed to the int32 every kernel reads.
// An id outside int32 becomes -1, which the kernels count as out of range and skip.
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ids_from_i64)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_ids_from_i64(const __grid_constant__ IdsFromI64Params params) {
    MOE_UNPACK_IdsFromI64Params(params);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const long long v = src[i];
        dst[i] = (v < -2147483648LL || v > 2147483647LL) ? -1 : (int)v;
    }
}
#endif  // entry moe_ids_from_i64
