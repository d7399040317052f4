// One-token steps streamed through shared memory by bulk copies.
// At M = 1 a block's whole share of the step's weights is small (Qwen3 4-bit: about 95 KB of w13
// and 48 KB of w2 per SM), so one producer thread per block can put most or all of it in flight
// at once, where register-fed warps hold a unit or two each and stall on every refill. down's
// blocks, resident beside gate_up's, stream their w2 before gate_up has finished: the step's
// bytes then flow as one stream.
//   moe_gate_up_bulk: tile = GW neurons of one pair's expert: their gate rows, then their up
//     rows (two contiguous runs of w13); consumer warp w owns neuron w of each tile.
//   moe_down_bulk: tile = DW hidden rows of every slot's expert (TOP_K contiguous runs of w2);
//     consumer warp w owns row w of each tile.
// Warp 0 produces (gate_up: lane q copies consumer q's rows; down: one lane copies the tile),
// warps 1..GW (DW) consume, through a ring of STAGES tiles (BkRing). Each consumer loads its next
// tile's scales from global memory while it works on the current one. The tiles land in bursts,
// so the math after them needs more warps than the register-fed kernels give it (16: 8 measured
// slower on the H100).
constexpr bool BK_DN_H2 = W_H2 && {{ bulk_dn_h2 }};  // down's intermediate as fp16 pairs
constexpr int GW = {{ bulk_gu_warps }};  // gate_up's consumer warps
constexpr int DW = {{ bulk_dn_warps }};  // down's
constexpr int BK_GU_THREADS = (GW + 1) * 32;
constexpr int BK_DN_THREADS = (DW + 1) * 32;
constexpr int BK_GU_STAGES = {{ bulk_gu_stages }};
constexpr int BK_DN_STAGES = {{ bulk_dn_stages }};
static_assert(BK_GU_STAGES >= 1 && BK_GU_STAGES <= 8 && BK_DN_STAGES >= 1 && BK_DN_STAGES <= 8,
              "at most 8 stages (16 mbarriers)");
static_assert(INTER % GW == 0 && HIDDEN % DW == 0, "whole tiles");
constexpr int BK_ROW13 = NV_H * 16;  // bytes of a w13 row
constexpr int BK_ROW2 = NV_I * 16;   // bytes of a w2 row
constexpr int BK_GU_TILE = 2 * GW * BK_ROW13;
constexpr int BK_DN_TILE = TOP_K * DW * BK_ROW2;
constexpr int BK_GU_PER_PAIR = INTER / GW;  // gate_up tiles per (token, slot) pair
constexpr int BK_GU_TILES = TOP_K * BK_GU_PER_PAIR;
constexpr int BK_DN_TILES = HIDDEN / DW;
__host__ __device__ constexpr int align128(int b) { return (b + 127) & ~127; }
// A ring of STAGES tiles: Q full barriers per stage (the producer's arrival plus the bytes of
// their part of the tile) and one empty barrier (each consumer warp's arrival once it has read
// the stage). gate_up gives each consumer warp its own full barrier, so that a warp starts on its
// rows as soon as they have landed rather than when the whole tile has.
template <int STAGES, int Q>
struct BkRing {
    static constexpr int BYTES = align128(8 * STAGES * (Q + 1));
    unsigned bars;
    __device__ __forceinline__ unsigned full(int st, int q = 0) const { return bars + 8 * (st * Q + q); }
    __device__ __forceinline__ unsigned empty(int st) const { return bars + 8 * (STAGES * Q + st); }
    // One thread (then a block barrier before any use).
    __device__ __forceinline__ void init(int consumers) const {
        for (int st = 0; st < STAGES; ++st) {
            for (int q = 0; q < Q; ++q) mbar_init(full(st, q), 1);
            mbar_init(empty(st), consumers);
        }
        mbar_init_fence();
    }
};
using GuRing = BkRing<BK_GU_STAGES, GW>;
using DnRing = BkRing<BK_DN_STAGES, 1>;
// Dynamic shared memory (exactly the host's bulk_smem_bytes: asserted below): the ring's barriers, then
//   gate_up: the staged token (a 16-byte exponent slot, then XS_TOKEN_FLOATS floats), the stages;
//   down: the step's ids, weights and mid's exponents, mid (TOP_K rows of MID_ROW floats, or half
//     that as fp16 pairs), the stages.
constexpr int BK_GU_X = GuRing::BYTES;
constexpr int BK_GU_STAGE0 = BK_GU_X + align128(16 + XS_TOKEN_FLOATS * 4);
constexpr int BK_DN_PAIRS = DnRing::BYTES;
constexpr int BK_DN_MID = BK_DN_PAIRS + align128(12 * TOP_K);
constexpr int BK_DN_STAGE0 = BK_DN_MID + TOP_K * MID_ROW * 4;
constexpr int HOST_BK_GU_SMEM = {{ bulk_gu_smem }};  // bulk_smem_bytes: gate_up's,
constexpr int HOST_BK_DN_SMEM = {{ bulk_dn_smem }};  // down's
static_assert(BK_GU_STAGE0 + BK_GU_STAGES * BK_GU_TILE == HOST_BK_GU_SMEM &&
                  BK_DN_STAGE0 + BK_DN_STAGES * BK_DN_TILE == HOST_BK_DN_SMEM,
              "the bulk kernels' dynamic shared memory (bulk_smem_bytes)");
static_assert(x_stage_bytes(1) <= BK_GU_STAGE0 - BK_GU_X && 3 * TOP_K * sizeof(int) <= BK_DN_MID - BK_DN_PAIRS,
              "gate_up's staged token; down's ids, weights and exponents");

// Barrier 1: the N consumer warps only (the producer never waits on them this way).
template <int N>
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(N * 32) : "memory");
}

// gate_up: this block's next tile from t on whose pair has a valid expert (BK_GU_TILES: none left),
// and the first w13 row (gate) of tile t.
__device__ __forceinline__ int bk_gu_next(const int* __restrict__ ids, int t) {
    for (; t < BK_GU_TILES; t += gridDim.x) {
        const int e = __ldg(ids + t / BK_GU_PER_PAIR);
        if (e >= 0 && e < EXPERTS) break;
    }
    return t;
}
__device__ __forceinline__ long bk_gu_row(const int* __restrict__ ids, int t) {
    return (long)__ldg(ids + t / BK_GU_PER_PAIR) * 2 * INTER + (t % BK_GU_PER_PAIR) * GW;
}

// A consumer lane's scales for its gate row grow and up row of a tile.
struct BkGuScales {
    WScale gs[VPL_H], us[VPL_H];
    float gr, ur;
    __device__ __forceinline__ void load(const void* __restrict__ sc, long grow, int lane) {
        gr = row_scale<W13>(sc, grow);
        ur = row_scale<W13>(sc, grow + INTER);
#pragma unroll
        for (int i = 0; i < VPL_H; ++i) {
            const int v = i * 32 + lane;
            if (v < NV_H) {
                gs[i] = load_wscale<W13>(sc, grow, v);
                us[i] = load_wscale<W13>(sc, grow + INTER, v);
            }
        }
    }
};

// Puts this block's share of the step's w2 (1 / gridDim.x of each slot's expert) in flight to L2
// once its first gate_up tiles are: gate_up leaves DRAM half idle, and down's blocks, which do not
// fit beside gate_up's (registers), then find their w2 in L2. Lane s takes slot s.
__device__ __forceinline__ void bk_prefetch_w2(const int* __restrict__ ids, const uint4* __restrict__ w2, int lane) {
    constexpr long SLOT = (long)HIDDEN * BK_ROW2;  // bytes of one expert's w2
    const long chunk = (SLOT / gridDim.x + 15) / 16 * 16;
    for (int s = lane; s < TOP_K; s += 32) {
        const int e = __ldg(ids + s);
        const long lo = blockIdx.x * chunk;
        if (e < 0 || e >= EXPERTS || lo >= SLOT) continue;
        const char* p = reinterpret_cast<const char*>(w2) + e * SLOT + lo;
        const int bytes = (int)min(chunk, SLOT - lo);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
    }
}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_gate_up_bulk)
extern "C" __global__ void __launch_bounds__(BK_GU_THREADS, 1)
moe_gate_up_bulk(const __grid_constant__ GateUpBulkParams params) {
    MOE_UNPACK_GateUpBulkParams(params);
    extern __shared__ __align__(128) char bk_smem[];
    const GuRing ring{ smem_u32(bk_smem) };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) ring.init(GW);
    dequant_setup();
    __syncthreads();
    pdl_wait();  // x, the routing and mid's previous readers belong to earlier kernels
    pdl_launch_dependents();
    if (warp == 0) {
        if (blockIdx.x == 0) {
            for (int p = lane; p < TOP_K; p += 32) {
                const int e = __ldg(topk_ids + p);
                if (err && (e < 0 || e >= EXPERTS)) atomicAdd(err, 1);
            }
        }
        // Lane q copies consumer q's gate and up rows.
        const unsigned long long policy = l2_evict_first();
        const char* w = reinterpret_cast<const char*>(w13);
        int k = 0;
        for (int t = bk_gu_next(topk_ids, blockIdx.x); t < BK_GU_TILES; t = bk_gu_next(topk_ids, t + gridDim.x)) {
            const int st = k % BK_GU_STAGES;
            if (lane == 0) {
                mbar_wait(ring.empty(st), ((k / BK_GU_STAGES) & 1) ^ 1);
                for (int q = 0; q < GW; ++q) mbar_arrive_expect_tx(ring.full(st, q), 2 * BK_ROW13);
            }
            __syncwarp();
            if (lane < GW) {
                const long row = bk_gu_row(topk_ids, t) + lane;
                const unsigned dst = ring.bars + BK_GU_STAGE0 + st * BK_GU_TILE + lane * BK_ROW13;
                bulk_load(dst, w + row * BK_ROW13, BK_ROW13, ring.full(st, lane), policy);
                bulk_load(dst + GW * BK_ROW13, w + (row + INTER) * BK_ROW13, BK_ROW13, ring.full(st, lane), policy);
            }
            ++k;
            if (k == BK_GU_STAGES) bk_prefetch_w2(topk_ids, w2, lane);
        }
        if (k < BK_GU_STAGES) bk_prefetch_w2(topk_ids, w2, lane);
        return;
    }
    const int cw = warp - 1;
    float4* xsp = reinterpret_cast<float4*>(bk_smem + BK_GU_X);
    int t = bk_gu_next(topk_ids, blockIdx.x);
    BkGuScales cur;
    if (t < BK_GU_TILES) cur.load(w13_scales, bk_gu_row(topk_ids, t) + cw, lane);
    stage_x(x, 1, xsp, 1);
    consumers_sync<GW>();
    const XStage xs = x_views(1, xsp);
    const float xm = x_unscale(xs, 0);
    const int tok[1] = { 0 };
    for (int k = 0; t < BK_GU_TILES; ++k) {
        const int tn = bk_gu_next(topk_ids, t + gridDim.x);
        BkGuScales next;
        if (tn < BK_GU_TILES) next.load(w13_scales, bk_gu_row(topk_ids, tn) + cw, lane);
        const int st = k % BK_GU_STAGES;
        mbar_wait(ring.full(st, cw), (k / BK_GU_STAGES) & 1);
        const uint4* gq = reinterpret_cast<const uint4*>(bk_smem + BK_GU_STAGE0 + st * BK_GU_TILE) + cw * NV_H;
        const uint4* uq = gq + GW * NV_H;
        float ag[1] = { 0.0f }, au[1] = { 0.0f };
#pragma unroll
        for (int i = 0; i < VPL_H; ++i) {
            const int v = i * 32 + lane;
            if (v < NV_H) gu_accumulate<1>(gq[v], uq[v], cur.gs[i], cur.us[i], x, xs, tok, 1, v, ag, au);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.empty(st));
        const float g = warp_sum(ag[0]) * (cur.gr * xm);
        const float u = warp_sum(au[0]) * (cur.ur * xm);
        if (lane == 0) {
            float bg = 0.0f, bu = 0.0f;
            if constexpr (HAS_BIAS) {
                const long grow = bk_gu_row(topk_ids, t) + cw;
                bg = __ldg(w13_bias + grow), bu = __ldg(w13_bias + grow + INTER);
            }
            mid[mid_index(t / BK_GU_PER_PAIR, (t % BK_GU_PER_PAIR) * GW + cw)] = moe_glu(g + bg, u + bu);
        }
        cur = next;
        t = tn;
    }
}
#endif  // entry moe_gate_up_bulk

// A consumer lane's scales for its flat vectors of hidden row h, one per slot's expert.
struct BkDnScales {
    WScale ws[DN_VPL];
    float rs[DN_VPL];
    __device__ __forceinline__ void load(const void* __restrict__ sc, const int* sid, int h, int lane) {
#pragma unroll
        for (int i = 0; i < DN_VPL; ++i) {
            const int f = i * 32 + lane;
            const int s = f / NV_I;
            const int e = f < DN_FLAT ? sid[s] : -1;
            if (e >= 0) {
                const long rw = (long)e * HIDDEN + h;
                ws[i] = load_wscale<W2>(sc, rw, f - s * NV_I);
                rs[i] = row_scale<W2>(sc, rw);
            }
        }
    }
};

// mid in shared memory for the math after down's wait. Codecs with a packed-half decode get fp16
// pairs in their pair order (half the loads and a pair-FMA per two weights, where the wait on
// gate_up leaves the math on the critical path), row s scaled by 2^-mexp[s] as stage_x scales x,
// here also upwards so that small rows keep fp16's precision. The others get the fp32 rows.
// Consumer threads only; a consumer barrier follows.
__device__ __forceinline__ void bk_stage_mid(const float* __restrict__ mid, float* ms, int* mexp, int cw, int lane) {
    // A row's lane share is held in registers between its max and its conversion where it is
    // small (the second pass was a second round of loads).
    if constexpr (BK_DN_H2) {
        constexpr int Q = W_VEC / 4;  // float4 per vector
        constexpr bool HOLD = VPL_I * Q <= 16;
        uint4* mh = reinterpret_cast<uint4*>(ms);
        for (int s = cw; s < TOP_K; s += DW) {
            const float4* row = reinterpret_cast<const float4*>(mid + (long)s * MID_ROW);
            auto at = [&](int v, int k) { return row + (v >> 5) * Q * 32 + 32 * k + (v & 31); };
            float4 held[HOLD ? VPL_I * Q : 1];
            unsigned mx = 0;
#pragma unroll
            for (int i = 0; i < VPL_I; ++i) {
                const int v = i * 32 + lane;
                if (v < NV_I) {
#pragma unroll
                    for (int k = 0; k < Q; ++k) {
                        const float4 f = __ldg(at(v, k));
                        if constexpr (HOLD) held[i * Q + k] = f;
                        mx = max(max(__float_as_uint(fabsf(f.x)), __float_as_uint(fabsf(f.y))), mx);
                        mx = max(max(__float_as_uint(fabsf(f.z)), __float_as_uint(fabsf(f.w))), mx);
                    }
                }
            }
            mx = __reduce_max_sync(MOE_FULL_MASK, mx);
            // max < 2^(e - 126): scale by 2^-k with k = e - 126 - limit (either sign, bounded).
            const int k = min(max((int)(mx >> 23) - 126 - X_H2_LOG2_LIMIT, -100), 100);
            if (lane == 0) mexp[s] = k;
            const float sc = __uint_as_float((unsigned)(127 - k) << 23);
            auto get = [&](int i, int q) {
                if constexpr (HOLD) return held[i * Q + q];
                else return __ldg(at(i * 32 + lane, q));
            };
#pragma unroll
            for (int i = 0; i < VPL_I; ++i) {
                const int v = i * 32 + lane;
                if (v < NV_I) {
#pragma unroll
                    for (int qd = 0; qd < W_VEC / 8; ++qd) {
                        const float4 a = get(i, 2 * qd), b = get(i, 2 * qd + 1);
                        const float f[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
                        mh[((s * VPL_I + i) * (W_VEC / 8) + qd) * 32 + lane] = h2_quad(f, sc);
                    }
                }
            }
        }
    } else {
        for (int i = 32 * cw + lane; i < TOP_K * MID_ROW / 4; i += DW * 32) {
            cp_async16(smem_u32(ms + 4 * i), mid + 4 * i, true);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_down_bulk)
extern "C" __global__ void __launch_bounds__(BK_DN_THREADS, 1)
moe_down_bulk(const __grid_constant__ DownParams params) {
    MOE_UNPACK_DownParams(params);
    extern __shared__ __align__(128) char bk_smem[];
    const DnRing ring{ smem_u32(bk_smem) };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int* sid = reinterpret_cast<int*>(bk_smem + BK_DN_PAIRS);
    float* swt = reinterpret_cast<float*>(sid + TOP_K);
    if (threadIdx.x == 0) ring.init(DW);
    dequant_setup();
    // The ids, weights and w2 do not depend on gate_up: all of it goes out before the wait.
    stage_pairs(topk_ids, topk_weights, TOP_K, sid, swt);  // ends with a block barrier
    pdl_launch_dependents();  // as in moe_down
    if (warp == 0) {
        if (lane == 0) {
            const unsigned long long policy = l2_evict_first();
            const char* w = reinterpret_cast<const char*>(w2);
            int bytes = 0;
            for (int s = 0; s < TOP_K; ++s) bytes += sid[s] >= 0 ? DW * BK_ROW2 : 0;
            int k = 0;
            for (int t = blockIdx.x; t < BK_DN_TILES; t += gridDim.x, ++k) {
                const int st = k % BK_DN_STAGES;
                mbar_wait(ring.empty(st), ((k / BK_DN_STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(ring.full(st), bytes);
                const unsigned dst = ring.bars + BK_DN_STAGE0 + st * BK_DN_TILE;
                for (int s = 0; s < TOP_K; ++s) {
                    const int e = sid[s];
                    if (e >= 0) {
                        bulk_load(dst + s * DW * BK_ROW2, w + ((long)e * HIDDEN + t * DW) * BK_ROW2,
                                  DW * BK_ROW2, ring.full(st), policy);
                    }
                }
            }
        }
        return;
    }
    const int cw = warp - 1;
    int t = blockIdx.x;
    BkDnScales cur;
    if (t < BK_DN_TILES) cur.load(w2_scales, sid, t * DW + cw, lane);
    pdl_wait();  // mid is gate_up's output
    float* ms = reinterpret_cast<float*>(bk_smem + BK_DN_MID);
    int* mexp = sid + 2 * TOP_K;
    bk_stage_mid(mid, ms, mexp, cw, lane);
    consumers_sync<DW>();
    for (int k = 0; t < BK_DN_TILES; ++k) {
        const int tn = t + gridDim.x;
        BkDnScales next;
        if (tn < BK_DN_TILES) next.load(w2_scales, sid, tn * DW + cw, lane);
        const int st = k % BK_DN_STAGES;
        mbar_wait(ring.full(st), (k / BK_DN_STAGES) & 1);
        const uint4* wq = reinterpret_cast<const uint4*>(bk_smem + BK_DN_STAGE0 + st * BK_DN_TILE);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < DN_VPL; ++i) {
            const int f = i * 32 + lane;
            const int s = f / NV_I;
            const int v = f - s * NV_I;
            if (f < DN_FLAT && sid[s] >= 0) {
                const uint4 q = wq[(s * DW + cw) * NV_I + v];
                if constexpr (BK_DN_H2) {
                    __half2 w[W_VEC / 2], a[W_VEC / 2];
                    dequant_h2(q, cur.ws[i], w);
                    load_h2<VPL_I>(reinterpret_cast<const uint4*>(ms), s, v, a);
                    const float unscale = __uint_as_float((unsigned)(127 + mexp[s]) << 23);
                    acc = fmaf(swt[s] * cur.rs[i] * unscale, dot_h2(w, a, cur.ws[i]), acc);
                } else {
                    float w[W_VEC], a[W_VEC];
                    dequant_vec(q, cur.ws[i], w);
                    load_mid<true>(ms, s, v, a);
                    acc = fmaf(swt[s] * cur.rs[i], dot(w, a, cur.ws[i]), acc);
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.empty(st));
        const float sum = warp_sum(acc);
        if (lane == 0) {
            const float b = HAS_BIAS ? w2_bias_sum(sid, swt, w2_bias, t * DW + cw) : 0.0f;
            y[t * DW + cw] = narrow(sum + b, (const act_t*)nullptr);
        }
        cur = next;
        t = tn;
    }
}
#endif  // entry moe_down_bulk
