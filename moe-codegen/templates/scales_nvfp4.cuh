// NVFP4: [E] fp32 global scales (one per expert matrix), then one e4m3 scale per 16 elements
// along K ([E * N, K / 16] bytes). A 32-element vector holds two groups; the global is the row scale.
constexpr int W_GROUPS = W_VEC / 16;
constexpr bool W_GROUP_SCALED = true;
struct WScale {
    unsigned short b;  // the vector's W_GROUPS e4m3 codes, group 0 in the low byte
};
// Where the vector's W_GROUPS e4m3 scales of `row` lie.
template <class M>
__device__ __forceinline__ const unsigned short* wscale_ptr(const void* scales, long row, int vec) {
    const unsigned char* body = reinterpret_cast<const unsigned char*>(scales) + 4 * M::E;
    return reinterpret_cast<const unsigned short*>(body + row * (M::K / 16) + vec * W_GROUPS);
}
template <class M>
__device__ __forceinline__ WScale load_wscale(const void* scales, long row, int vec) {
    return WScale{ __ldg(wscale_ptr<M>(scales, row, vec)) };
}
// Both groups' scales in one cvt.rn.f16x2.e4m3x2 (the same conversion for g = 0 and 1, so the
// compiler keeps one).
__device__ __forceinline__ float group_scale(const WScale& ws, int g) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)ws.b, __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
    return g == 0 ? f.x : f.y;
}
template <class M>
__device__ __forceinline__ float row_scale(const void* scales, long row) {
    // Rows count below 2^32: a 32-bit unsigned division by the constant (a multiply and a shift),
    // where the signed 64-bit one took about ten instructions per call.
    return __ldg(reinterpret_cast<const float*>(scales) + (unsigned)row / (unsigned)M::N);
}
