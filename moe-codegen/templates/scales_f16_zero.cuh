// Asymmetric INT4: one u32 record per {% if fmt.group == 0 %}row{% else %}{{ fmt.group }} elements along K{% endif %}: bits 0-15 the fp16 scale,
// bits 16-23 the zero point. One aligned load brings both.
constexpr int W_GROUP = {{ fmt.group }};  // 0: the whole row
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = true;
struct WScale {
    unsigned r;
};
// Where the record of vector `vec` of `row` lies.
template <class M>
__device__ __forceinline__ const unsigned* wscale_ptr(const void* scales, long row, int vec) {
    constexpr int G = W_GROUP ? W_GROUP : M::K;
    static_assert(G % W_VEC == 0, "a group spans whole vectors");
    return reinterpret_cast<const unsigned*>(scales) + row * (M::K / G) + (vec * W_VEC) / G;
}
template <class M>
__device__ __forceinline__ WScale load_wscale(const void* scales, long row, int vec) {
    return WScale{ __ldg(wscale_ptr<M>(scales, row, vec)) };
}
__device__ __forceinline__ float group_scale(const WScale& ws, int) {
    return __half2float(__ushort_as_half((unsigned short)(ws.r & 0xffffu)));
}
__device__ __forceinline__ int zero_point(const WScale& ws) { return (int)((ws.r >> 16) & 0xffu); }
template <class M>
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
