// One fp32 scale per 128x128 block ([E * N / 128, K / 128] floats; N is a multiple of 128, so no
// block straddles two experts). A 16-byte vector lies in one block: its scale is a group scale.
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = true;
struct WScale {
    float s;
};
// Where the block scale of vector `vec` of `row` lies.
template <class M>
__device__ __forceinline__ const float* wscale_ptr(const void* scales, long row, int vec) {
    return reinterpret_cast<const float*>(scales) + (row >> 7) * (M::K / 128) + (vec * W_VEC) / 128;  // rows >= 0
}
template <class M>
__device__ __forceinline__ WScale load_wscale(const void* scales, long row, int vec) {
    return WScale{ __ldg(wscale_ptr<M>(scales, row, vec)) };
}
__device__ __forceinline__ float group_scale(const WScale& ws, int) { return ws.s; }
template <class M>
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
