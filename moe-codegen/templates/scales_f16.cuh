// One fp16 scale per {{ fmt.group }} elements along K ([E * N, K / {{ fmt.group }}] halves).
constexpr int W_GROUP = {{ fmt.group }};
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = true;
static_assert(W_GROUP % W_VEC == 0, "a group spans whole vectors");
struct WScale {
    unsigned short h;
};
// Where the scale of vector `vec` of `row` lies.
template <class M>
__device__ __forceinline__ const unsigned short* wscale_ptr(const void* scales, long row, int vec) {
    return reinterpret_cast<const unsigned short*>(scales) + row * (M::K / W_GROUP) + (vec * W_VEC) / W_GROUP;
}
template <class M>
__device__ __forceinline__ WScale load_wscale(const void* scales, long row, int vec) {
    return WScale{ __ldg(wscale_ptr<M>(scales, row, vec)) };
}
__device__ __forceinline__ float group_scale(const WScale& ws, int) { return __half2float(__ushort_as_half(ws.h)); }
template <class M>
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
