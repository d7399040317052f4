// moeforge expert-parallel exchange: {{ spec_id }}
// The kernels around the NCCL transfers of an expert-parallel step on one rank:
//   moe_ep_plan     the step's routing -> where each token goes (one block, tokens in order);
//   moe_ep_pack     each token's activations into the send slab of every peer it goes to;
//   moe_ep_combine  each token's partial outputs (its own experts', then each peer's) summed in
//                   rank order in fp32: the same bits whatever the arrival order.
// Slab j (1 <= j < ranks) travels to rank (rank + j) % ranks and, from the receiver's side, holds
// rows from rank (receiver - j) % ranks; slab 0 is this rank's own experts, which read x in place.
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

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_plan)
// One block walks the tokens in order, PLAN_THREADS at a time: a token's row in slab j is the
// count of earlier tokens bound for j (warp ballots, then a scan over the warps), so the plan and
// everything after it are deterministic. A slab full at `rows` drops the rest (counted in err[1]);
// ids outside [0, EXPERTS) other than -1 (a padding slot) are skipped and counted in err[0].
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
moe_ep_plan(const __grid_constant__ EpPlanParams params) {
    MOE_UNPACK_EpPlanParams(params);
    __shared__ int base[MAX_RANKS];               // rows given out so far, per slab
    __shared__ int warp_base[PLAN_WARPS][MAX_RANKS];
    __shared__ int slab_off[MAX_RANKS];           // first id of each slab in send_ids
    __shared__ int slab_slots[MAX_RANKS];
    __shared__ int invalid, dropped;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        int off = 0;
        for (int j = 0; j < ranks; ++j) {
            const int s = slots[(rank + j) % ranks];
            slab_slots[j] = s;
            slab_off[j] = off;
            if (j > 0) off += rows * s;
        }
        invalid = 0;
        dropped = 0;
    }
    if (tid < MAX_RANKS) base[tid] = 0;
    __syncthreads();
    for (int t0 = 0; t0 < m; t0 += PLAN_THREADS) {
        const int t = t0 + tid;
        int e[TOP_K], o[TOP_K];
        float w[TOP_K];
        unsigned long long mask = 0;
        int bad = 0;
#pragma unroll
        for (int s = 0; s < TOP_K; ++s) {
            e[s] = -1;
            o[s] = -1;
            w[s] = 0.f;
            if (t < m) {
                int v = __ldg(topk_ids + (long)t * TOP_K + s);
                if (v != -1 && (v < 0 || v >= EXPERTS)) {
                    ++bad;
                    v = -1;
                }
                if (v >= 0) {
                    e[s] = v;
                    o[s] = __ldg(owner + v);
                    w[s] = __ldg(topk_weights + (long)t * TOP_K + s);
                    mask |= 1ull << ((o[s] - rank + ranks) % ranks);
                }
            }
        }
        for (int j = 0; j < ranks; ++j) {
            const unsigned b = __ballot_sync(MOE_FULL_MASK, (mask >> j) & 1);
            if (lane == 0) warp_base[warp][j] = __popc(b);
        }
        __syncthreads();
        if (tid < ranks) {
            int run = base[tid];
            for (int wp = 0; wp < PLAN_WARPS; ++wp) {
                const int c = warp_base[wp][tid];
                warp_base[wp][tid] = run;
                run += c;
            }
            base[tid] = run;
        }
        __syncthreads();
        for (int j = 0; j < ranks; ++j) {
            const bool goes = (mask >> j) & 1;
            const unsigned b = __ballot_sync(MOE_FULL_MASK, goes);
            if (t >= m) continue;
            const int p = (rank + j) % ranks;
            if (j == 0) {
                // Own experts: every token gets a row (x is read in place), -1 where none is here.
                pos[(long)t * ranks] = goes ? t : -1;
                bad += write_row(e, o, w, local, p, slab_slots[0], self_ids + (long)t * slab_slots[0],
                                 self_weights + (long)t * slab_slots[0]);
                continue;
            }
            int row = -1;
            if (goes) {
                row = warp_base[warp][j] + __popc(b & ep_lanemask_lt());
                if (row < rows) {
                    const long at = slab_off[j] + (long)row * slab_slots[j];
                    bad += write_row(e, o, w, local, p, slab_slots[j], send_ids + at, send_weights + at);
                } else {
                    row = -1;
                    atomicAdd(&dropped, 1);
                }
            }
            pos[(long)t * ranks + j] = row;
        }
        if (bad) atomicAdd(&invalid, bad);
        __syncthreads();  // warp_base is rewritten by the next tokens
    }
    // Padding rows: the receiver's layer runs every row of the slab and skips ids of -1.
    for (int j = 1; j < ranks; ++j) {
        const int used = min(base[j], rows);
        const long first = slab_off[j] + (long)used * slab_slots[j];
        const long n = (long)(rows - used) * slab_slots[j];
        for (long i = tid; i < n; i += PLAN_THREADS) {
            send_ids[first + i] = -1;
            send_weights[first + i] = 0.f;
        }
    }
    if (tid == 0) {
        if (invalid) atomicAdd(err, invalid);
        if (dropped) atomicAdd(err + 1, dropped);
    }
}
#endif

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_pack)
// Block t copies token t's row into each peer slab that takes it.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
moe_ep_pack(const __grid_constant__ EpPackParams params) {
    MOE_UNPACK_EpPackParams(params);
    const int t = blockIdx.x;
    if (t >= m) return;
    const uint4* src = x + (long)t * ROW_VECS;
    for (int j = 1; j < ranks; ++j) {
        const int row = __ldg(pos + (long)t * ranks + j);
        if (row < 0) continue;
        uint4* dst = send_x + ((long)(j - 1) * rows + row) * ROW_VECS;
        for (int v = threadIdx.x; v < ROW_VECS; v += ROW_THREADS) dst[v] = __ldg(src + v);
    }
}
#endif

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_ep_combine)
// Block t sums token t's partials: rank p's, for p = 0, 1, ..., from y_self (this rank) or from
// the slab rank p returned (y_peers, slab j at (j - 1) * rows), in fp32, rounded once.
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
                                   : __ldg(y_peers + ((long)(j - 1) * rows + row) * ROW_VECS + v);
            const act_t* a = reinterpret_cast<const act_t*>(&u);
#pragma unroll
            for (int i = 0; i < VEC_ELEMS; ++i) acc[i] += act_to_f(a[i]);
        }
        uint4 out;
        act_t* o = reinterpret_cast<act_t*>(&out);
#pragma unroll
        for (int i = 0; i < VEC_ELEMS; ++i) f_to_act(acc[i], o[i]);
        y[(long)t * ROW_VECS + v] = out;
    }
}
#endif
