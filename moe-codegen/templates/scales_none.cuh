// No scales.
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = false;
struct WScale {};
template <class M>
__device__ __forceinline__ const void* wscale_ptr(const void* scales, long, int) { return scales; }  // no group scales
template <class M>
__device__ __forceinline__ WScale load_wscale(const void*, long, int) { return WScale{}; }
__device__ __forceinline__ float group_scale(const WScale&, int) { return 1.0f; }
template <class M>
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
