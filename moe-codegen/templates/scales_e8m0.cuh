// OCP MX: one E8M0 byte per {{ fmt.group }} elements along K ([E * N, K / {{ fmt.group }}] bytes): 2^(e - 127).
constexpr int W_GROUP = {{ fmt.group }};
constexpr int W_GROUPS = W_VEC > W_GROUP ? W_VEC / W_GROUP : 1;
constexpr bool W_GROUP_SCALED = true;
static_assert(W_GROUPS == 1, "an MX group spans at least one vector");
struct WScale {
    unsigned e;
};
// Where the scale of vector `vec` of `row` lies.
template <class M>
__device__ __forceinline__ const unsigned char* wscale_ptr(const void* scales, long row, int vec) {
    return reinterpret_cast<const unsigned char*>(scales) + row * (M::K / W_GROUP) + (vec * W_VEC) / W_GROUP;
}
template <class M>
__device__ __forceinline__ WScale load_wscale(const void* scales, long row, int vec) {
    return WScale{ __ldg(wscale_ptr<M>(scales, row, vec)) };
}
// The exponent moved into place; code 0 is 2^-127, an fp32 subnormal.
__device__ __forceinline__ float group_scale(const WScale& ws, int) {
    return __uint_as_float(ws.e ? ws.e << 23 : 0x00400000u);
}
template <class M>
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
