// moe_decode_resident: a one-token step in one cooperative launch, for 16-bit weights where every
// block's share of the step's w2 fits in its shared memory (host: resident_smem_bytes).
// Block b owns hidden rows [b rows, b rows + rows) of y. At its start it bulk-copies those rows of
// each slot's w2 into shared memory (one copy per slot, the rows contiguous in w2 [E, H, I]);
// meanwhile its warps stream w13: unit u = (slot u / I, neuron u % I), warp w of block b taking
// units b + G (w + WARPS i), a warp's gate and up rows wholly in flight (RES_NC 16-byte vectors a
// lane of each). The intermediate goes to `mid` [TOP_K, I] f32. After one grid barrier every
// block has the whole intermediate and its w2 rows on chip: its down is shared-memory reads,
// with no weight stream after the barrier. So the step's bytes are one stream from the start,
// where the split kernels (gate_up, then down) pay a second ramp and tail.
// The barrier: one release add per block, one acquiring poller per block; the last block out
// resets both counters (`sync` [2], zero between launches) for the next launch.
{%- if resident %}
typedef {{ w16_type }} w16_t;  // the weights' element type
constexpr int RES_WARPS = {{ res_warps }};
constexpr int RES_NC = HIDDEN / 256;  // 16-byte vectors per lane of a w13 row
constexpr int RES_MC = INTER / 256;   // ... of a w2 row
static_assert(HIDDEN % 256 == 0 && INTER % 256 == 0, "whole 16-byte vectors per lane (resident_fits)");
static_assert(W_VEC == 8, "16-bit weights");
// Shared memory past the w2 rows [TOP_K][rows][INTER]: x in fp32 [HIDDEN], each (slot, row)'s
// sum [TOP_K][rows], the mbarrier (host: resident_smem_bytes).
__host__ __device__ constexpr int res_w2_bytes(int rows) { return TOP_K * rows * INTER * 2; }
__host__ __device__ constexpr int res_smem_bytes(int rows) {
    return res_w2_bytes(rows) + HIDDEN * 4 + (TOP_K * rows * 4 + 7) / 8 * 8 + 8;
}
// The host sizes the launch with resident_smem_bytes: the same at two row counts (both are linear
// in the rows past the rounding, which 8-row multiples keep whole).
static_assert(res_smem_bytes(8) == {{ res_smem8 }} && res_smem_bytes(16) == {{ res_smem16 }}, "resident_smem_bytes");
// Eight weights times eight fp32 activations, added to acc.
__device__ __forceinline__ float res_dot8(uint4 w, float4 a, float4 b, float acc) {
    float f[8];
    widen8(w, static_cast<const w16_t*>(nullptr), f);
    acc = fmaf(f[0], a.x, acc);
    acc = fmaf(f[1], a.y, acc);
    acc = fmaf(f[2], a.z, acc);
    acc = fmaf(f[3], a.w, acc);
    acc = fmaf(f[4], b.x, acc);
    acc = fmaf(f[5], b.y, acc);
    acc = fmaf(f[6], b.z, acc);
    return fmaf(f[7], b.w, acc);
}
// Eight per-lane values summed over the warp in 9 shuffles: lane bits 4, 3 and 2 pick the value
// a lane keeps (value 4 b4 + 2 b3 + b2), whose sum lanes l with l % 4 == 0 return.
__device__ __forceinline__ float res_sum8(float (&v)[8], int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const bool hi = lane & 16;
        v[i] = (hi ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, hi ? v[i] : v[i + 4], 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool hi = lane & 8;
        v[i] = (hi ? v[i + 2] : v[i]) + __shfl_xor_sync(0xffffffffu, hi ? v[i] : v[i + 2], 8);
    }
    const bool hi = lane & 4;
    float r = (hi ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[1], 4);
    r += __shfl_xor_sync(0xffffffffu, r, 2);
    return r + __shfl_xor_sync(0xffffffffu, r, 1);
}
// One unit: neuron j of slot s's expert e, its intermediate value (lane 0's is the one kept).
__device__ __forceinline__ float res_unit(const uint4* __restrict__ w13, const float* __restrict__ w13_bias,
                                          const float* xs, int e, int j, int lane) {
    const char* g = reinterpret_cast<const char*>(w13) + ((long)e * 2 * INTER + j) * HIDDEN * 2;
    const char* up = g + (long)INTER * HIDDEN * 2;
    uint4 gv[RES_NC], uv[RES_NC];
#pragma unroll
    for (int c = 0; c < RES_NC; ++c) gv[c] = ldg_stream(g + 16 * (lane + 32 * c));
#pragma unroll
    for (int c = 0; c < RES_NC; ++c) uv[c] = ldg_stream(up + 16 * (lane + 32 * c));
    float ga = 0.f, ua = 0.f;
#pragma unroll
    for (int c = 0; c < RES_NC; ++c) {
        const float4* xp = reinterpret_cast<const float4*>(xs) + 2 * (lane + 32 * c);
        const float4 a = xp[0], b = xp[1];
        ga = res_dot8(gv[c], a, b, ga);
        ua = res_dot8(uv[c], a, b, ua);
    }
    ga = warp_sum(ga);
    ua = warp_sum(ua);
    if constexpr (HAS_BIAS) {
        ga += w13_bias[(long)e * 2 * INTER + j];
        ua += w13_bias[(long)e * 2 * INTER + INTER + j];
    }
    return moe_glu(ga, ua);
}

#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_decode_resident)
extern "C" __global__ void __launch_bounds__(RES_WARPS * 32, 1)
moe_decode_resident(const __grid_constant__ ResidentParams params) {
    MOE_UNPACK_ResidentParams(params);
    if (family_skipped(choice, FAMILY_WARP_DECODE)) return;
    extern __shared__ __align__(128) unsigned char res_smem[];
    __shared__ int sid[TOP_K];
    __shared__ float swt[TOP_K];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grid = gridDim.x;
    const int r0 = blockIdx.x * rows, nrows = max(0, min(rows, HIDDEN - r0));
    unsigned char* w2s = res_smem;
    float* xs = reinterpret_cast<float*>(res_smem + res_w2_bytes(rows));
    float* part = xs + HIDDEN;
    const unsigned bar = smem_u32(res_smem + res_smem_bytes(rows) - 8);
    if (threadIdx.x < TOP_K) {
        const int e = topk_ids[threadIdx.x];
        const bool ok = e >= 0 && e < EXPERTS;
        sid[threadIdx.x] = ok ? e : -1;
        swt[threadIdx.x] = topk_weights[threadIdx.x];
        if (!ok && blockIdx.x == 0) atomicAdd(err, 1);
    }
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    // This block's w2 rows of every slot, in flight for the whole up phase.
    if (threadIdx.x == 0 && nrows > 0) {
        int bytes = 0;
        for (int s = 0; s < TOP_K; ++s) bytes += sid[s] >= 0 ? nrows * INTER * 2 : 0;
        mbar_arrive_expect_tx(bar, bytes);
        const unsigned long long policy = l2_evict_first();
        for (int s = 0; s < TOP_K; ++s)
            if (sid[s] >= 0)
                bulk_load(smem_u32(w2s + s * rows * INTER * 2),
                          reinterpret_cast<const char*>(w2) + ((long)sid[s] * HIDDEN + r0) * INTER * 2,
                          nrows * INTER * 2, bar, policy);
    }
    for (int i = threadIdx.x; i < HIDDEN / 8; i += RES_WARPS * 32) {
        float f[8];
        widen8(reinterpret_cast<const uint4*>(x)[i], static_cast<const act_t*>(nullptr), f);
        reinterpret_cast<float4*>(xs)[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4*>(xs)[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
    for (int u = blockIdx.x + grid * warp; u < TOP_K * INTER; u += grid * RES_WARPS) {
        const int s = u / INTER, e = sid[s];
        const float v = e >= 0 ? res_unit(w13, w13_bias, xs, e, u % INTER, lane) : 0.f;
        if (lane == 0) mid[u] = v;
    }
    // The grid barrier: this block's intermediate values before, every block's after.
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync) : "memory");
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(sync) : "memory");
        } while (seen < (unsigned)grid);
    }
    __syncthreads();
    if (nrows > 0) {
        mbar_wait(bar, 0);
        // Task (slot s, 8 rows from 8 q): the slot's intermediate in registers, each row's w2 from
        // shared memory.
        const int groups = (nrows + 7) / 8;
        for (int task = warp; task < TOP_K * groups; task += RES_WARPS) {
            const int s = task % TOP_K, q = task / TOP_K;
            if (sid[s] < 0) continue;
            float4 mv[RES_MC][2];
#pragma unroll
            for (int c = 0; c < RES_MC; ++c) {
                const float4* mp = reinterpret_cast<const float4*>(mid + s * INTER) + 2 * (lane + 32 * c);
                mv[c][0] = __ldcg(mp);
                mv[c][1] = __ldcg(mp + 1);
            }
            float v[8];
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const int row = min(q * 8 + rr, nrows - 1);
                const unsigned char* wrow = w2s + (s * rows + row) * INTER * 2;
                float acc = 0.f;
#pragma unroll
                for (int c = 0; c < RES_MC; ++c)
                    acc = res_dot8(*reinterpret_cast<const uint4*>(wrow + 16 * (lane + 32 * c)), mv[c][0], mv[c][1], acc);
                v[rr] = acc;
            }
            const float sum = res_sum8(v, lane);
            const int row = q * 8 + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
            if (lane % 4 == 0 && row < nrows) part[s * rows + row] = sum;
        }
        __syncthreads();
        if (threadIdx.x < nrows) {
            const int r = r0 + threadIdx.x;
            float acc = 0.f;
            for (int s = 0; s < TOP_K; ++s) {
                if (sid[s] < 0) continue;
                float b = 0.f;
                if constexpr (HAS_BIAS) b = w2_bias[(long)sid[s] * HIDDEN + r];
                acc += swt[s] * (part[s * rows + threadIdx.x] + b);
            }
            y[r] = narrow(acc, static_cast<const act_t*>(nullptr));
        }
    }
    // The last block out resets the counters for the next launch (every block has passed the
    // barrier by then).
    if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == (unsigned)grid - 1) {
        sync[0] = 0;
        sync[1] = 0;
    }
}
#endif  // entry moe_decode_resident
{%- else %}
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_decode_resident)
// Not launched: this spec's weights are not 16-bit (resident_fits).
extern "C" __global__ void moe_decode_resident(const __grid_constant__ ResidentParams) {}
#endif  // entry moe_decode_resident
{%- endif %}
