// moeforge common device helpers: loads, reductions, programmatic dependent launch.
// The format seam every kernel family uses (dequant.cuh picks one scale include and one codec
// include per format and dequant variant):
//   W_VEC           elements in one 16-byte vector of packed weights
//   W_GROUPS        scale groups per vector; W_GROUP_SCALED whether they carry scales
//   WScale          the registers holding one vector's group scales (and zero points), loaded
//                   with the weights so that the load is in flight with them
//   load_wscale<M>(scales, row, vec) -> WScale
//   group_scale(ws, g) -> float
//   dequant_setup()  once per block before any dequant_vec (fills the lut table; a barrier)
//   dequant_vec(v, ws, w[W_VEC])  codes -> values (zero points applied, group scales not)
//   row_scale<M>(scales, row) -> float, applied once to a row's reduced dot product
//   W_H2            whether the codec also decodes to fp16 pairs (gate_up's packed-half dots):
//   dequant_h2(v, ws, h[W_VEC / 2])  codes -> fp16 pairs (dequant_vec is then these, widened)
//   h2_elem(p, hi)  the element pair p's low (hi = 0) or high half holds
//   W_ABS_MAX       the largest |value| dequant_h2 yields (bounds the fp16 sums)
//   W_H2_UNIT       what a code of value 1 decodes to in the pairs (a power of two, undone in
//                   fp32 by dot_h2 and the widening; 1 but for e2m1 through e4m3)
// M = WMat<K, N, E> describes the matrix: row length K, rows per expert N, experts E; `row` counts
// rows across experts (expert e's row n is e * N + n), `vec` 16-byte vectors along the row.
//
// Templates note: never write an opening brace directly followed by a percent sign (askama syntax).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define MOE_FULL_MASK 0xffffffffu

template <int K_, int N_, int E_>
struct WMat {
    static constexpr int K = K_;  // row length (the reduction axis)
    static constexpr int N = N_;  // rows per expert
    static constexpr int E = E_;  // experts
};

// Two fp16 in a 32-bit word, widened to fp32; the bits of a __half2 and back.
__device__ __forceinline__ __half2 u32_as_h2(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }
__device__ __forceinline__ unsigned h2_as_u32(__half2 h) { return *reinterpret_cast<const unsigned*>(&h); }
__device__ __forceinline__ float2 h2_to_f2(unsigned u) { return __half22float2(u32_as_h2(u)); }

// (a & B) | C in one lop3: written in C the compiler splits it in two, B and C both being
// immediates.
template <unsigned B, unsigned C>
__device__ __forceinline__ unsigned and_or(unsigned a) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(B), "r"(C));
    return d;
}

// Weights are streamed exactly once per step: skip L1 so the small activation vectors,
// which every warp of the SM re-reads, keep it.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// 16 bytes global -> shared, bypassing L1 (zero-filled when !valid), in flight until waited on.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, o);
    return v;
}
// The sum over each aligned group of N lanes (N a power of two up to 32), in every lane of it.
template <int N>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = N / 2; o > 0; o >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, o);
    return v;
}

// Programmatic dependent launch (sm_90+): the next kernel in the stream may start its
// prologue while this one drains; it must call pdl_wait() before reading what we wrote.
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The dispatcher (moe_choose) launches every candidate family of a step and writes which one runs;
// the others' kernels return at once. `choice` is null where the host chose the family.
constexpr int FAMILY_WARP_DECODE = 0, FAMILY_GROUPED = 1, FAMILY_FUSED = 2;
__device__ __forceinline__ bool family_skipped(const int* choice, int family) {
    return choice != nullptr && __ldcg(choice) != family;
}

// Eight 16-bit activations packed in a uint4, widened to fp32.
__device__ __forceinline__ void widen8(const uint4 v, const __nv_bfloat16*, float (&a)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(h[i]);
        a[2 * i] = f.x;
        a[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void widen8(const uint4 v, const __half*, float (&a)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __half22float2(h[i]);
        a[2 * i] = f.x;
        a[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ __nv_bfloat16 narrow(float v, const __nv_bfloat16*) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ __half narrow(float v, const __half*) { return __float2half_rn(v); }
