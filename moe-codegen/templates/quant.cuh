// Activations to e4m3 for the fp8 grouped GEMMs: x by token (moe_prepare's quant_token) and
// the intermediate by row (moe_quant_mid), with their f32 scales.
// Eight values times inv to e4m3 (saturating), packed in order.
__device__ __forceinline__ uint2 pack_e4m3x8(const float* v, float inv) {
    unsigned packed[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const __nv_fp8x2_storage_t lo =
            __nv_cvt_float2_to_fp8x2(make_float2(v[4 * h] * inv, v[4 * h + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi =
            __nv_cvt_float2_to_fp8x2(make_float2(v[4 * h + 2] * inv, v[4 * h + 3] * inv), __NV_SATFINITE, __NV_E4M3);
        packed[h] = (unsigned)lo | ((unsigned)hi << 16);
    }
    return make_uint2(packed[0], packed[1]);
}

// Eight activations (16 bytes) as floats.
__device__ __forceinline__ void unpack8(const uint4& raw, float* v) {
    static_assert(sizeof(act_t) == 2, "8 activations per 16-byte load");
    const act_t* e = reinterpret_cast<const act_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (float)e[i];
}
// 16 bytes of global memory in one load. Dereferenced in place, as a reference into unpack8, the
// uint4 became eight 2-byte loads (its halves are what is read).
__device__ __forceinline__ uint4 ld16(const void* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p)
                 : "memory");
    return r;
}
__device__ __forceinline__ void load8(const act_t* p, float* v) { unpack8(ld16(p), v); }
// The e4m3 scale (amax / 448) of the 128 values a half warp holds, 8 per live lane in v; every
// lane of the warp calls it (the shuffles).
__device__ __forceinline__ float half_warp_scale(const float* v, bool live) {
    float amax = 0.f;
    if (live)
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(MOE_FULL_MASK, amax, o));
    return amax > 0.f ? amax / 448.f : 1.f;
}

// Activations to e4m3 with one f32 scale per 128 along K (rows [rows, COLS] -> q, s [rows, COLS / 128]).
// Half a warp quantizes one 128-element block, 16 bytes per lane. rows: `m`, or *num_tiles * BM
// when num_tiles is given, and then only the rows that hold a pair (sorted_rows >= 0): what the
// others hold reaches only outputs that are never stored (the warp-specialised GEMM2 zero-fills
// them).
template <int COLS>
__device__ __forceinline__ void quant_rows(const act_t* __restrict__ in, int m, const int* __restrict__ num_tiles,
                                           const int* __restrict__ sorted_rows, unsigned char* __restrict__ q,
                                           float* __restrict__ s) {
    static_assert(sizeof(act_t) == 2, "8 activations per 16-byte load");
    const int rows = num_tiles ? *num_tiles * BM : m;
    const long blocks = (long)rows * (COLS / 128);
    const int sub = threadIdx.x % 16;
    const long step = (long)gridDim.x * blockDim.x / 16;
    for (long b = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 16; b < blocks + (step - blocks % step) % step; b += step) {
        // Every lane of the warp runs each round (the shuffles), idle ones past the end.
        const long row = b / (COLS / 128), blk = b % (COLS / 128);
        const bool live = b < blocks && (!num_tiles || sorted_rows[row] >= 0);
        float v[8];
        if (live) load8(in + row * COLS + blk * 128 + sub * 8, v);
        const float scale = half_warp_scale(v, live);
        if (!live) continue;
        *reinterpret_cast<uint2*>(q + row * COLS + blk * 128 + sub * 8) = pack_e4m3x8(v, 1.f / scale);
        if (sub == 0) s[row * (COLS / 128) + blk] = scale;
    }
}
// Token t's row of x to e4m3 by one warp: with one scale for the row (X_PER_ROW, into s[t]), else
// one per 128 columns (s[t, HIDDEN / 128], half a warp per 128-column block).
__device__ __forceinline__ void quant_token(const act_t* __restrict__ x, long t, unsigned char* __restrict__ q,
                                            float* __restrict__ s) {
    static_assert(!FP8 || HIDDEN % 128 == 0, "whole 128-column blocks");
    const int lane = threadIdx.x % 32;
    const act_t* row = x + t * HIDDEN;
    float v[8];
    if constexpr (X_PER_ROW) {
        // The row's 16-byte chunks lane, lane + 32, ..: read for the amax, then again (from L1)
        // to convert, four loads in flight at a time (the block's 1024 threads have 64 registers;
        // the second pass loads its four before it stores any, or the compiler orders each load
        // after the store before it).
        constexpr int CHUNKS = (HIDDEN / 8 + 31) / 32;
        float amax = 0.f;
#pragma unroll 4
        for (int j = 0; j < CHUNKS; ++j) {
            const int c = lane + 32 * j;
            if (c < HIDDEN / 8) {
                load8(row + 8 * c, v);
#pragma unroll
                for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(MOE_FULL_MASK, amax, o));
        const float scale = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / scale;
        for (int j0 = 0; j0 < CHUNKS; j0 += 4) {
            uint4 raw[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * (j0 + j);
                if (j0 + j < CHUNKS && c < HIDDEN / 8) raw[j] = ld16(row + 8 * c);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * (j0 + j);
                if (j0 + j < CHUNKS && c < HIDDEN / 8) {
                    unpack8(raw[j], v);
                    *reinterpret_cast<uint2*>(q + t * HIDDEN + 8 * c) = pack_e4m3x8(v, inv);
                }
            }
        }
        if (lane == 0) s[t] = scale;
    } else {
        constexpr int BLOCKS = HIDDEN / 128;
#pragma unroll
        for (int b0 = 0; b0 < BLOCKS; b0 += 2) {  // every lane runs each round (the shuffles)
            const int blk = b0 + lane / 16, c = blk * 16 + lane % 16;
            const bool live = blk < BLOCKS;
            if (live) load8(row + 8 * c, v);
            const float scale = half_warp_scale(v, live);
            if (!live) continue;
            *reinterpret_cast<uint2*>(q + t * HIDDEN + 8 * c) = pack_e4m3x8(v, 1.f / scale);
            if (lane % 16 == 0) s[t * BLOCKS + blk] = scale;
        }
    }
}
#if !defined(MOE_ONLY) || defined(MOE_ONLY_moe_quant_mid)
extern "C" __global__ void __launch_bounds__(ELEMWISE_THREADS)
moe_quant_mid(const __grid_constant__ QuantMidParams params) {
    MOE_UNPACK_QuantMidParams(params);
    pdl_wait();  // a programmatic dependent of GEMM1
    pdl_launch_dependents();
    quant_rows<INTER>(mid, 0, num_tiles, sorted_rows, q, s);
}
#endif  // entry moe_quant_mid
