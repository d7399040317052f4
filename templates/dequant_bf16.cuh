// bf16 weights: 8 per 16-byte vector, no scales.
constexpr int W_VEC = 8;
constexpr int W_GROUPS = 1;
constexpr bool W_GROUP_SCALED = false;
struct WScale {};
__device__ __forceinline__ WScale load_wscale(const void*, long, int) { return WScale{}; }
__device__ __forceinline__ float group_scale(const WScale&, int) { return 1.0f; }
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    widen8(v, (const __nv_bfloat16*)nullptr, w);
}
__device__ __forceinline__ float row_scale(const void*, long) { return 1.0f; }
