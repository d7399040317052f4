// Groups the step's (token, slot) pairs by expert, in shared memory, so that a warp can stream
// one expert's weight row once and apply it to every token routed to that expert.
//
// Unique experts are numbered in order of first appearance; each one's pair indices
// (p = token * TOP_K + slot) are listed in increasing p, i.e. increasing token.
// Ids outside [0, EXPERTS) are counted in *err and contribute nothing.
struct Routing {
    int num_unique;
    const int* map;      // [experts] expert id -> unique index, or -1
    const int* uexp;     // [num_unique] expert id
    const int* ucnt;     // [num_unique] pairs routed to it
    const int* uoff;     // [num_unique] first index into entries
    const int* entries;  // [num_pairs] pair indices grouped by expert
};

// Shared-memory ints the routing needs for a step of num_pairs pairs, plus scratch for the caller:
// two ints per possible unique expert (scratch 0 and 1) and two per pair (scratch 2). The host's
// routing_smem_bytes is checked against it (warp_decode.cu).
__host__ __device__ constexpr int routing_smem_ints(int num_pairs, int experts) {
    return experts + 5 * (num_pairs < experts ? num_pairs : experts) + 4 * num_pairs + 1;
}
// Scratch array `which`: 0 or 1 (one int per possible unique expert) or 2 (two ints per pair), at
// this many ints into the tables (scratch 2 ends at routing_smem_ints: checked where it is used).
__host__ __device__ constexpr int routing_scratch_ints(int num_pairs, int experts, int which) {
    return experts + (3 + which) * (num_pairs < experts ? num_pairs : experts) + 2 * num_pairs + 1;
}
__device__ __forceinline__ int* routing_scratch(int* smem, int num_pairs, int experts, int which) {
    return smem + routing_scratch_ints(num_pairs, experts, which);
}

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

struct NoWork {
    __device__ void operator()() const {}
};

// `others` runs on the block's threads past the first warp while that warp builds the tables (the
// final barrier orders whatever it stores).
template <class Others = NoWork>
__device__ Routing build_routing(const int* __restrict__ topk_ids, int num_pairs, int experts, int* smem,
                                 int* __restrict__ err, const Others& others = Others{}) {
    const int umax = num_pairs < experts ? num_pairs : experts;
    int* map = smem;                   // expert -> unique index, or -1
    int* uexp = map + experts;
    int* ucnt = uexp + umax;
    int* uoff = ucnt + umax;
    int* entries = uoff + umax;
    int* tmp = entries + num_pairs;    // per pair: (unique << 16) | rank, or -1
    int* num_unique = tmp + num_pairs;
    for (int i = threadIdx.x; i < experts; i += blockDim.x) map[i] = -1;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const unsigned lt = lanemask_lt();
        int nu = 0;
        for (int base = 0; base < num_pairs; base += 32) {
            const int p = base + lane;
            int e = -1;
            if (p < num_pairs) {
                e = __ldg(topk_ids + p);
                if (e < 0 || e >= experts) {
                    if (err && blockIdx.x == 0) atomicAdd(err, 1);  // every block sees it; count once
                    e = -1;
                }
            }
            const unsigned peers = __match_any_sync(MOE_FULL_MASK, e);
            const int leader = __ffs(peers) - 1;
            int u = e >= 0 ? map[e] : -1;
            const bool is_new = e >= 0 && u < 0 && lane == leader;
            const unsigned fresh = __ballot_sync(MOE_FULL_MASK, is_new);
            if (is_new) {
                u = nu + __popc(fresh & lt);
                map[e] = u;
                uexp[u] = e;
                ucnt[u] = 0;
            }
            nu += __popc(fresh);
            __syncwarp();
            if (e >= 0) {
                u = map[e];
                tmp[p] = (u << 16) | (ucnt[u] + __popc(peers & lt));
            } else if (p < num_pairs) {
                tmp[p] = -1;
            }
            __syncwarp();
            if (e >= 0 && lane == leader) ucnt[u] += __popc(peers);
            __syncwarp();
        }
        // Exclusive prefix sum of the counts.
        int run = 0;
        for (int base = 0; base < nu; base += 32) {
            const int u = base + lane;
            const int c = u < nu ? ucnt[u] : 0;
            int incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int n = __shfl_up_sync(MOE_FULL_MASK, incl, o);
                if (lane >= o) incl += n;
            }
            if (u < nu) uoff[u] = run + incl - c;
            run += __shfl_sync(MOE_FULL_MASK, incl, 31);
        }
        __syncwarp();
        for (int p = lane; p < num_pairs; p += 32) {
            const int t = tmp[p];
            if (t >= 0) entries[uoff[t >> 16] + (t & 0xffff)] = p;
        }
        if (lane == 0) *num_unique = nu;
    } else {
        others();
    }
    __syncthreads();
    return Routing{*num_unique, map, uexp, ucnt, uoff, entries};
}
