// One fp32 scale per output row ([E * N] floats), applied once to the row's dot product rather
// than to every element.
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = false;
struct WScale {};
template <class M>
__device__ __forceinline__ const void* wscale_ptr(const void* scales, long, int) { return scales; }  // no group scales
template <class M>
__device__ __forceinline__ WScale load_wscale(const void*, long, int) { return WScale{}; }
__device__ __forceinline__ float group_scale(const WScale&, int) { return 1.0f; }
template <class M>
__device__ __forceinline__ float row_scale(const void* scales, long row) {
    return __ldg(reinterpret_cast<const float*>(scales) + row);
}
