// moe_decode_resident: a one-token step in one cooperative launch, for 16-bit weights where every
// block's share of the step's w2 fits in its shared memory (host: resident_renders, resident_rows,
// resident_smem_bytes; the decode and row scales are the format's, but per-channel fp8, int8 and
// int4 ran slower this way than on the split kernels).
// Block b owns hidden rows [b rows, b rows + rows) of y. At its start it bulk-copies those rows of
// each slot's w2 into shared memory (one copy per slot, the rows contiguous in w2 [E, H, I], packed
// as stored); meanwhile its warps stream w13: unit u = (slot u / I, neuron u % I), warp w of block
// b taking units b + G (w + WARPS i), a warp's gate and up rows wholly in flight (RES_VPL 16-byte
// vectors a lane of each). The intermediate goes to `mid` [TOP_K, I] f32. After one grid barrier
// every block has the whole intermediate and its w2 rows on chip: its down is shared-memory
// reads, with no weight stream after the barrier. So the step's bytes are one stream from the
// start, where the split kernels (gate_up, then down) pay a second ramp and tail. Weights decode
// through the format's dequant_vec (the warp-decode seam), row scales on each dot product.
// The barrier: one release add per block, one acquiring poller per block; the last block out
// resets both counters (`sync` [2], zero between launches) for the next launch.
{%- if resident %}
constexpr int RES_WARPS = {{ res_warps }};
constexpr int RES_VPL = HIDDEN / W_VEC / 32;                 // 16-byte vectors per lane of a w13 row
constexpr int RES_NV_I = INTER / W_VEC;                      // ... of a w2 row
constexpr int RES_VPL_I = (RES_NV_I + 31) / 32;              // ... per lane of it (the last may be partial)
constexpr int RES_ROW_BYTES = RES_NV_I * 16;                 // a w2 row's bytes
static_assert(HIDDEN % (32 * W_VEC) == 0 && INTER % W_VEC == 0, "whole vectors per lane (resident_renders)");
static_assert(!W_GROUP_SCALED, "row scales at most (resident_renders)");
// Shared memory past the w2 rows [TOP_K][rows]: x in fp32 [HIDDEN], each (slot, row)'s sum
// [TOP_K][rows], the mbarrier (host: resident_smem_bytes).
__host__ __device__ constexpr int res_w2_bytes(int rows) { return TOP_K * rows * RES_ROW_BYTES; }
__host__ __device__ constexpr int res_smem_bytes(int rows) {
    return res_w2_bytes(rows) + HIDDEN * 4 + (TOP_K * rows * 4 + 7) / 8 * 8 + 8;
}
// The host sizes the launch with resident_smem_bytes: the same at two row counts (both are linear
// in the rows past the rounding, which 8-row multiples keep whole).
static_assert(res_smem_bytes(8) == {{ res_smem8 }} && res_smem_bytes(16) == {{ res_smem16 }}, "resident_smem_bytes");
// One vector of weights (W_VEC, decoded) times W_VEC fp32 activations staged lane-major (float4
// q of the vector at a[32 q]), added to acc.
__device__ __forceinline__ float res_dot(const uint4 v, const float4* a, float acc) {
    float w[W_VEC];
    dequant_vec(v, WScale{}, w);
#pragma unroll
    for (int q = 0; q < W_VEC / 4; ++q) {
        const float4 x4 = a[32 * q];
        acc = fmaf(w[4 * q], x4.x, acc);
        acc = fmaf(w[4 * q + 1], x4.y, acc);
        acc = fmaf(w[4 * q + 2], x4.z, acc);
        acc = fmaf(w[4 * q + 3], x4.w, acc);
    }
    return acc;
}
// The same with the activations in registers.
__device__ __forceinline__ float res_dot(const uint4 v, const float (&a)[W_VEC], float acc) {
    float w[W_VEC];
    dequant_vec(v, WScale{}, w);
#pragma unroll
    for (int i = 0; i < W_VEC; ++i) acc = fmaf(w[i], a[i], acc);
    return acc;
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
__device__ __forceinline__ float res_unit(const uint4* __restrict__ w13, const void* __restrict__ w13_scales,
                                          const float* __restrict__ w13_bias, const float4* xs, int e, int j, int lane) {
    const long grow = (long)e * 2 * INTER + j, urow = grow + INTER;
    const uint4* g = w13 + grow * (HIDDEN / W_VEC);
    const uint4* up = w13 + urow * (HIDDEN / W_VEC);
    uint4 gv[RES_VPL], uv[RES_VPL];
#pragma unroll
    for (int c = 0; c < RES_VPL; ++c) gv[c] = ldg_stream(g + lane + 32 * c);
#pragma unroll
    for (int c = 0; c < RES_VPL; ++c) uv[c] = ldg_stream(up + lane + 32 * c);
    float ga = 0.f, ua = 0.f;
#pragma unroll
    for (int c = 0; c < RES_VPL; ++c) {
        const float4* a = xs + c * (W_VEC / 4) * 32 + lane;
        ga = res_dot(gv[c], a, ga);
        ua = res_dot(uv[c], a, ua);
    }
    ga = warp_sum(ga) * row_scale<W13>(w13_scales, grow);
    ua = warp_sum(ua) * row_scale<W13>(w13_scales, urow);
    if constexpr (HAS_BIAS) {
        ga += w13_bias[grow];
        ua += w13_bias[urow];
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
        for (int s = 0; s < TOP_K; ++s) bytes += sid[s] >= 0 ? nrows * RES_ROW_BYTES : 0;
        mbar_arrive_expect_tx(bar, bytes);
        const unsigned long long policy = l2_evict_first();
        for (int s = 0; s < TOP_K; ++s)
            if (sid[s] >= 0)
                bulk_load(smem_u32(w2s + s * rows * RES_ROW_BYTES), w2 + ((long)sid[s] * HIDDEN + r0) * RES_NV_I,
                          nrows * RES_ROW_BYTES, bar, policy);
    }
    // x in fp32, lane-major: float4 k of vector v = 32 c + l at (c W_VEC / 4 + k) 32 + l, so that a
    // warp's loads of one float4 of its lanes' vectors are conflict-free (a lane's vector side by
    // side was 2-way conflicted at 8 elements a vector).
    float4* xs4 = reinterpret_cast<float4*>(xs);
    for (int i = threadIdx.x; i < HIDDEN / 8; i += RES_WARPS * 32) {
        float f[8];
        widen8(reinterpret_cast<const uint4*>(x)[i], static_cast<const act_t*>(nullptr), f);
        const int v = 8 * i / W_VEC, k = (8 * i - v * W_VEC) / 4;
        xs4[((v >> 5) * (W_VEC / 4) + k) * 32 + (v & 31)] = make_float4(f[0], f[1], f[2], f[3]);
        xs4[((v >> 5) * (W_VEC / 4) + k + 1) * 32 + (v & 31)] = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
    for (int u = blockIdx.x + grid * warp; u < TOP_K * INTER; u += grid * RES_WARPS) {
        const int s = u / INTER, e = sid[s];
        const float v = e >= 0 ? res_unit(w13, w13_scales, w13_bias, xs4, e, u % INTER, lane) : 0.f;
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
        // Task (slot s, rows 8 q .. 8 q + 7): the slot's intermediate in registers, each row's w2
        // from shared memory.
        const int groups = (nrows + 7) / 8;
        for (int task = warp; task < TOP_K * groups; task += RES_WARPS) {
            const int s = task % TOP_K, q = task / TOP_K;
            if (sid[s] < 0) continue;
            // The slot's intermediate at this lane's vectors of a w2 row.
            float mv[RES_VPL_I][W_VEC];
#pragma unroll
            for (int c = 0; c < RES_VPL_I; ++c) {
                const int vi = lane + 32 * c;
                if (vi >= RES_NV_I) continue;
#pragma unroll
                for (int f = 0; f < W_VEC / 4; ++f) {
                    const float4 m4 = __ldcg(reinterpret_cast<const float4*>(mid + s * INTER + vi * W_VEC) + f);
                    mv[c][4 * f] = m4.x;
                    mv[c][4 * f + 1] = m4.y;
                    mv[c][4 * f + 2] = m4.z;
                    mv[c][4 * f + 3] = m4.w;
                }
            }
            float v[8];
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const int row = min(q * 8 + rr, nrows - 1);
                const uint4* wrow = reinterpret_cast<const uint4*>(w2s + (s * rows + row) * RES_ROW_BYTES);
                float acc = 0.f;
#pragma unroll
                for (int c = 0; c < RES_VPL_I; ++c)
                    if (lane + 32 * c < RES_NV_I) acc = res_dot(wrow[lane + 32 * c], mv[c], acc);
                v[rr] = acc;
            }
            const float sum = res_sum8(v, lane);
            const int row = q * 8 + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
            if (lane % 4 == 0 && row < nrows)
                part[s * rows + row] = sum * row_scale<W2>(w2_scales, (long)sid[s] * HIDDEN + r0 + row);
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
// Not launched: this spec's weights have group scales, or rows of partial vectors per lane
// (resident_renders).
extern "C" __global__ void moe_decode_resident(const __grid_constant__ ResidentParams) {}
#endif  // entry moe_decode_resident
{%- endif %}
