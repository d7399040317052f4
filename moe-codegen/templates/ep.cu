// moeforge expert-parallel exchange: {{ spec_id }}
// The kernels around the NCCL transfers of an expert-parallel step on one rank:
//   moe_ep_count    per block of tokens, how many go to each slab;
//   moe_ep_place    each token's row in each slab it goes to (after every earlier block's) and
//                   its routing rows there;
//   moe_ep_pack     each token's activations into the slabs it goes to;
//   moe_ep_combine  each token's partial outputs (its own experts', then each peer's) summed in
//                   rank order in fp32: the same bits whatever the arrival order (a split own
//                   launch's combine, moe_combine_rows, does the same itself);
//   moe_route       the whole layer's router (router.cuh), for steps from logits.
// Slab j (1 <= j < ranks) travels to rank (rank + j) % ranks and, from the receiver's side, holds
// rows from rank (receiver - j) % ranks; slab 0 is this rank's own experts, which read x in place.
// The transfer buffers hold one chunk per rank, `slab_stride` apart, chunk d for (or from) rank d:
// an all-to-all's layout (this rank's own chunk unused).
// A slab's rows carry the receiver's local expert ids and routing weights, `slots` per row (the
// receiver's layer's top-k: min(k, the experts it owns)); rows past the step's count are padding
// with every id -1, which the layer skips.
{% include "common.cuh" %}

typedef {{ act_type }} act_t;
// Every kernel's parameter struct (moe_codegen::params: one declaration for Rust and C).
{{ params }}
constexpr int HIDDEN = {{ hidden }};
constexpr int EXPERTS = {{ experts }};
constexpr int TOP_K = {{ top_k }};
constexpr int MAX_RANKS = {{ max_ranks }};
constexpr int PLAN_THREADS = {{ plan_threads }};
constexpr int ROW_THREADS = {{ row_threads }};
constexpr int PLAN_WARPS = PLAN_THREADS / 32;
constexpr int ROW_VECS = HIDDEN * (int)sizeof(act_t) / 16;  // 16-byte vectors per activation row
constexpr int VEC_ELEMS = 16 / (int)sizeof(act_t);
static_assert(HIDDEN * sizeof(act_t) % 16 == 0, "activation rows are whole 16-byte vectors");
static_assert(MAX_RANKS <= 64, "a token's destinations are one 64-bit mask");
constexpr long ROW_BYTES = (long)ROW_VECS * 16;
// fp8 dispatch: a token travels as e4m3, one f32 scale per 128 of its columns (amax / 448), the
// scales after the codes, the row padded to 16 bytes; the receiver unpacks it (moe_ep_unpack).
constexpr bool WIRE_FP8 = {{ wire_fp8 }};
static_assert(!WIRE_FP8 || HIDDEN % 128 == 0, "fp8 dispatch: whole 128-column scale blocks");
// The layer has shared experts, which run on the token's own rank: every token then has an
// own-experts row (its output read by moe_ep_combine), whether or not a routed expert is here.
constexpr bool SHARED = {{ shared }};
constexpr long WIRE_ROW_BYTES = WIRE_FP8 ? (HIDDEN + HIDDEN / 32 + 15) / 16 * 16 : ROW_BYTES;

// A peer slab, one NCCL transfer: `rows` activation rows (as they travel), then the rows' local
// expert ids, then their weights (`slots` per row), each part 16-byte aligned (the host's
// `slab_bytes`).
__device__ __forceinline__ long meta_bytes(int rows, int slots) { return ((long)rows * slots * 4 + 15) / 16 * 16; }
__device__ __forceinline__ long slab_bytes(int rows, int slots) { return rows * WIRE_ROW_BYTES + 2 * meta_bytes(rows, slots); }
// Chunks are as long as the largest slab (a rank's slots are at most TOP_K).
__device__ __forceinline__ long slab_stride(int rows) { return slab_bytes(rows, TOP_K); }
// Slab j's offset in the send buffer: chunk (rank + j) % ranks.
__device__ __forceinline__ long slab_offset(int j, int rows, int rank, int ranks) {
    return (long)((rank + j) % ranks) * slab_stride(rows);
}

__device__ __forceinline__ unsigned ep_lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}
__device__ __forceinline__ float act_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float act_to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void f_to_act(float v, __nv_bfloat16& o) { o = __float2bfloat16_rn(v); }
__device__ __forceinline__ void f_to_act(float v, __half& o) { o = __float2half_rn(v); }

// One token's routing restricted to rank `p`'s experts: its local ids and weights in slot order,
// then -1 / 0 up to `slots`. Returns the experts that did not fit (a token naming one expert twice).
__device__ __forceinline__ int write_row(const int (&e)[TOP_K], const int (&o)[TOP_K], const float (&w)[TOP_K],
                                         const int* __restrict__ local, int p, int slots, int* __restrict__ ids,
                                         float* __restrict__ wts) {
    int n = 0, over = 0;
#pragma unroll
    for (int s = 0; s < TOP_K; ++s) {
        if (e[s] < 0 || o[s] != p) continue;
        if (n < slots) {
            ids[n] = __ldg(local + e[s]);
            wts[n] = w[s];
            ++n;
        } else {
            ++over;
        }
    }
    for (; n < slots; ++n) {
        ids[n] = -1;
        wts[n] = 0.f;
    }
    return over;
}

// A token's experts (-1 for none), their owners and weights, and the slabs it goes to (bit j:
// slab j). `bad` counts ids outside [0, EXPERTS) other than -1 (a padding slot), which are skipped.
struct TokenRoute {
    int e[TOP_K], o[TOP_K];
    float w[TOP_K];
    unsigned long long mask;
    int bad;
};
__device__ __forceinline__ TokenRoute load_route(const int* __restrict__ topk_ids, const float* __restrict__ topk_weights,
                                                 const int* __restrict__ owner, int t, int m, int rank, int ranks) {
    TokenRoute r;
    r.mask = 0;
    r.bad = 0;
#pragma unroll
    for (int s = 0; s < TOP_K; ++s) {
        r.e[s] = -1;
        r.o[s] = -1;
        r.w[s] = 0.f;
        if (t < m) {
            int v = __ldg(topk_ids + (long)t * TOP_K + s);
            if (v != -1 && (v < 0 || v >= EXPERTS)) {
                ++r.bad;
                v = -1;
            }
            if (v >= 0) {
                r.e[s] = v;
                r.o[s] = __ldg(owner + v);
                r.w[s] = topk_weights ? __ldg(topk_weights + (long)t * TOP_K + s) : 0.f;
                r.mask |= 1ull << ((r.o[s] - rank + ranks) % ranks);
            }
        }
    }
    return r;
}

// Each warp's count of tokens bound for each slab, into warp_n[warp][j].
__device__ __forceinline__ void warp_counts(unsigned long long mask, int ranks, int (*warp_n)[MAX_RANKS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int j = 0; j < ranks; ++j) {
        const unsigned b = __ballot_sync(MOE_FULL_MASK, (mask >> j) & 1);
        if (lane == 0) warp_n[warp][j] = __popc(b);
    }
}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_count)
// Block b counts its PLAN_THREADS tokens bound for each slab: counts[b * ranks + j]. A step of
// one block needs no counts (moe_ep_place starts at row 0) and skips this kernel.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
moe_ep_count(const __grid_constant__ EpCountParams params) {
    MOE_UNPACK_EpCountParams(params);
    pdl_launch_dependents();  // moe_ep_place waits for this grid before it reads counts
    __shared__ int warp_n[PLAN_WARPS][MAX_RANKS];
    const int t = blockIdx.x * PLAN_THREADS + threadIdx.x;
    const TokenRoute r = load_route(topk_ids, nullptr, owner, t, m, rank, ranks);
    warp_counts(r.mask, ranks, warp_n);
    __syncthreads();
    if (threadIdx.x < ranks) {
        int n = 0;
        for (int w = 0; w < PLAN_WARPS; ++w) n += warp_n[w][threadIdx.x];
        counts[blockIdx.x * ranks + threadIdx.x] = n;
    }
}
#endif

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_place)
// Block b places its tokens after every earlier block's (counts from moe_ep_count), so a
// token's row in slab j is the number of earlier tokens bound for j: deterministic, in token
// order. It writes each token's routing rows (its own experts' for every token, each peer's
// for the tokens bound there). Ids outside the experts other than -1 (a padding slot) are
// skipped and counted in err[0]; duplicates that overflow a row's slots too. A slab
// full at `rows` drops the rest (err[1]); the last block pads each slab's unused rows with -1.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
moe_ep_place(const __grid_constant__ EpPlaceParams params) {
    MOE_UNPACK_EpPlaceParams(params);
    // Launched as moe_ep_count's programmatic dependent (several blocks), and moe_ep_pack as
    // ours: each waits for its predecessor's grid before reading what it wrote.
    pdl_wait();
    pdl_launch_dependents();
    __shared__ int base[MAX_RANKS];  // this block's first row per slab, then past its last
    __shared__ int warp_n[PLAN_WARPS][MAX_RANKS];
    __shared__ long slab_ids[MAX_RANKS];  // byte offset of each slab's ids in `send`
    __shared__ int slab_slots[MAX_RANKS];
    __shared__ int dropped;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.x * PLAN_THREADS + tid;
    if (tid == 0) {
        for (int j = 0; j < ranks; ++j) {
            slab_slots[j] = slots[(rank + j) % ranks];
            slab_ids[j] = slab_offset(j, rows, rank, ranks) + rows * WIRE_ROW_BYTES;
        }
        dropped = 0;
    }
    if (tid < ranks) {
        int b = 0;
        for (int q = 0; q < (int)blockIdx.x; ++q) b += counts[q * ranks + tid];
        base[tid] = b;
    }
    const TokenRoute r = load_route(topk_ids, topk_weights, owner, t, m, rank, ranks);
    if (r.bad) atomicAdd(err, r.bad);
    warp_counts(r.mask, ranks, warp_n);
    __syncthreads();
    if (tid < ranks) {
        int run = base[tid];
        for (int w = 0; w < PLAN_WARPS; ++w) {
            const int c = warp_n[w][tid];
            warp_n[w][tid] = run;
            run += c;
        }
        base[tid] = run;
    }
    __syncthreads();
    for (int j = 0; j < ranks; ++j) {
        const bool goes = (r.mask >> j) & 1;
        const unsigned b = __ballot_sync(MOE_FULL_MASK, goes);
        if (t >= m) continue;
        const int p = (rank + j) % ranks;
        if (j == 0) {
            // Own experts: every token gets a row (x is read in place), -1 where none is here
            // (with shared experts there always is).
            pos[(long)t * ranks] = goes || SHARED ? t : -1;
            const int over = write_row(r.e, r.o, r.w, local, p, slab_slots[0], self_ids + (long)t * slab_slots[0],
                                       self_weights + (long)t * slab_slots[0]);
            if (over) atomicAdd(err, over);
            continue;
        }
        int row = -1;
        if (goes) {
            row = warp_n[warp][j] + __popc(b & ep_lanemask_lt());
            if (row < rows) {
                int* ids = reinterpret_cast<int*>(send + slab_ids[j]);
                float* wts = reinterpret_cast<float*>(send + slab_ids[j] + meta_bytes(rows, slab_slots[j]));
                const long at = (long)row * slab_slots[j];
                const int over = write_row(r.e, r.o, r.w, local, p, slab_slots[j], ids + at, wts + at);
                if (over) atomicAdd(err, over);
            } else {
                row = -1;
                atomicAdd(&dropped, 1);
            }
        }
        pos[(long)t * ranks + j] = row;
    }
    if (tid == 0 && dropped) atomicAdd(err + 1, dropped);
    // Padding rows: the receiver's layer runs every row of the slab and skips ids of -1.
    if (blockIdx.x == gridDim.x - 1) {
        for (int j = 1; j < ranks; ++j) {
            const int used = min(base[j], rows);
            int* ids = reinterpret_cast<int*>(send + slab_ids[j]);
            float* wts = reinterpret_cast<float*>(send + slab_ids[j] + meta_bytes(rows, slab_slots[j]));
            const long from = (long)used * slab_slots[j];
            const long n = (long)(rows - used) * slab_slots[j];
            for (long i = tid; i < n; i += PLAN_THREADS) {
                ids[from + i] = -1;
                wts[from + i] = 0.f;
            }
        }
    }
}
#endif

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_pack)
// Block t copies token t's activations into each peer slab that takes it (rows from
// moe_ep_place): one block per token keeps every SM copying.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
moe_ep_pack(const __grid_constant__ EpPackParams params) {
    MOE_UNPACK_EpPackParams(params);
    pdl_wait();  // moe_ep_place's rows
    const int t = blockIdx.x;
    if (t >= m) return;
    const uint4* src = x + (long)t * ROW_VECS;
    if constexpr (WIRE_FP8) {
        // Each 16 lanes hold one 128-column block (8 columns each): its amax by shuffles, then
        // the codes and (lane 0 of the 16) the scale into every slab the token goes to.
        static_assert(ROW_THREADS % 32 == 0 && VEC_ELEMS == 8, "16 lanes per 128 columns");
        for (int v0 = 0; v0 < ROW_VECS; v0 += ROW_THREADS) {
            const int v = v0 + threadIdx.x;
            const bool in = v < ROW_VECS;  // ROW_VECS is whole blocks of 16: a block is all in or out
            float f[8];
            const uint4 u = in ? __ldg(src + v) : make_uint4(0, 0, 0, 0);
            const act_t* a = reinterpret_cast<const act_t*>(&u);
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = act_to_f(a[i]), amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
            for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float scale = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / scale;
            unsigned q[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * h] * inv, f[4 * h + 1] * inv), __NV_SATFINITE, __NV_E4M3);
                const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * h + 2] * inv, f[4 * h + 3] * inv), __NV_SATFINITE, __NV_E4M3);
                q[h] = (unsigned)lo | ((unsigned)hi << 16);
            }
            if (!in) continue;
            for (int j = 1; j < ranks; ++j) {
                const int row = __ldg(pos + (long)t * ranks + j);
                if (row < 0) continue;
                char* dst = send + slab_offset(j, rows, rank, ranks) + row * WIRE_ROW_BYTES;
                *reinterpret_cast<uint2*>(dst + 8 * v) = make_uint2(q[0], q[1]);
                if (v % 16 == 0) *reinterpret_cast<float*>(dst + HIDDEN + 4 * (v / 16)) = scale;
            }
        }
        return;
    }
    for (int j = 1; j < ranks; ++j) {
        const int row = __ldg(pos + (long)t * ranks + j);
        if (row < 0) continue;
        uint4* dst = reinterpret_cast<uint4*>(send + slab_offset(j, rows, rank, ranks) + row * ROW_BYTES);
        for (int v = threadIdx.x; v < ROW_VECS; v += ROW_THREADS) dst[v] = __ldg(src + v);
    }
}
#endif

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_unpack)
// fp8 dispatch: block (j - 1) rows + r turns row r of the received slab j (chunk (rank - j) %
// ranks of recv) back into act_t (x_recv, slab j at (j - 1) * rows), for this rank's experts.
// Padding rows too: their ids are -1, and no expert reads them.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
moe_ep_unpack(const __grid_constant__ EpUnpackParams params) {
    MOE_UNPACK_EpUnpackParams(params);
    if (!WIRE_FP8 || rows <= 0) return;
    const int r = blockIdx.x % rows, j = blockIdx.x / rows + 1;
    const char* src = recv + (long)((rank - j + ranks) % ranks) * slab_stride(rows) + (long)r * WIRE_ROW_BYTES;
    uint4* dst = x_recv + ((long)(j - 1) * rows + r) * ROW_VECS;
    for (int v = threadIdx.x; v < ROW_VECS; v += ROW_THREADS) {
        const uint2 q = *reinterpret_cast<const uint2*>(src + 8 * v);
        const float scale = *reinterpret_cast<const float*>(src + HIDDEN + 4 * (v / 16));
        const unsigned w[2] = {q.x, q.y};
        uint4 out;
        act_t* o = reinterpret_cast<act_t*>(&out);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const __half2_raw p = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[h] >> (16 * b)), __NV_E4M3);
                const float2 fp = __half22float2(*reinterpret_cast<const __half2*>(&p));
                f_to_act(fp.x * scale, o[4 * h + 2 * b]);
                f_to_act(fp.y * scale, o[4 * h + 2 * b + 1]);
            }
        dst[v] = out;
    }
}
#endif

{% include "router.cuh" %}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_combine)
// Block t sums token t's partials: rank p's, for p = 0, 1, ..., from y_self (this rank: then
// y_self_b, its shared experts' output, where `split` says they ran apart) or from the slab rank
// p returned (y_peers, chunk p of `rows` rows), in fp32, rounded once.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
moe_ep_combine(const __grid_constant__ EpCombineParams params) {
    MOE_UNPACK_EpCombineParams(params);
    const int t = blockIdx.x;
    if (t >= m) return;
    for (int v = threadIdx.x; v < ROW_VECS; v += ROW_THREADS) {
        float acc[VEC_ELEMS];
#pragma unroll
        for (int i = 0; i < VEC_ELEMS; ++i) acc[i] = 0.f;
        for (int p = 0; p < ranks; ++p) {
            const int j = (p - rank + ranks) % ranks;
            const int row = __ldg(pos + (long)t * ranks + j);
            if (row < 0) continue;
            const uint4 u = j == 0 ? __ldg(y_self + (long)t * ROW_VECS + v)
                                   : __ldg(y_peers + ((long)p * rows + row) * ROW_VECS + v);
            const act_t* a = reinterpret_cast<const act_t*>(&u);
#pragma unroll
            for (int i = 0; i < VEC_ELEMS; ++i) acc[i] += act_to_f(a[i]);
            if (j == 0 && split) {
                const uint4 u2 = __ldg(y_self_b + (long)t * ROW_VECS + v);
                const act_t* a2 = reinterpret_cast<const act_t*>(&u2);
#pragma unroll
                for (int i = 0; i < VEC_ELEMS; ++i) acc[i] += act_to_f(a2[i]);
            }
        }
        uint4 out;
        act_t* o = reinterpret_cast<act_t*>(&out);
#pragma unroll
        for (int i = 0; i < VEC_ELEMS; ++i) f_to_act(acc[i], o[i]);
        y[(long)t * ROW_VECS + v] = out;
    }
}
#endif
