// Weight format {{ fmt.name }}: {{ fmt.codec }} codes, {{ fmt.scales }} scales, dequant variant {{ fmt.variant }}.
constexpr int W_VEC = {{ fmt.vec }};
{%- if fmt.scales == "none" %}
{% include "scales_none.cuh" %}
{%- else if fmt.scales == "row" %}
{% include "scales_row.cuh" %}
{%- else if fmt.scales == "block128" %}
{% include "scales_block128.cuh" %}
{%- else if fmt.scales == "e8m0" %}
{% include "scales_e8m0.cuh" %}
{%- else if fmt.scales == "f16" %}
{% include "scales_f16.cuh" %}
{%- else if fmt.scales == "f16_zero" %}
{% include "scales_f16_zero.cuh" %}
{%- else if fmt.scales == "nvfp4" %}
{% include "scales_nvfp4.cuh" %}
{%- endif %}
{%- if fmt.variant == "lut" %}
{% include "dequant_lut.cuh" %}
{%- else %}
__device__ __forceinline__ void dequant_setup() {}
{%- endif %}
{%- if fmt.codec == "e2m1" %}
// cvt.rn.f16x2.e4m3x2 on both 16-bit halves of a word: its bytes 0, 1 to lo, bytes 2, 3 to hi.
// On the device the halves go to the conversions as they are: the intrinsic takes a 16-bit value,
// and FP4 with the shift and mask that make it measured slower (H100, M = 1: nvfp4 13.51 against
// 13.07 us). fp8's own decode keeps the intrinsic, which measured faster in its register-fed
// gate_up (18.3 against 18.9 us). Hosts use the intrinsic.
__device__ __forceinline__ void e4m3x4_to_h2(unsigned x, __half2& lo, __half2& hi) {
#ifdef __CUDA_ARCH__
    unsigned a, b;
    asm("{ .reg .b16 l, h;\n"
        "  mov.b32 { l, h }, %2;\n"
        "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
        "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
        "}"
        : "=r"(a), "=r"(b)
        : "r"(x));
    lo = u32_as_h2(a);
    hi = u32_as_h2(b);
#else
    __half2_raw l = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x & 0xffffu), __NV_E4M3);
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x >> 16), __NV_E4M3);
    lo = *reinterpret_cast<__half2*>(&l);
    hi = *reinterpret_cast<__half2*>(&h);
#endif
}
{%- endif %}
{%- if fmt.codec == "bf16" %}
{% include "dequant_bf16.cuh" %}
{%- else if fmt.codec == "fp16" %}
{% include "dequant_fp16.cuh" %}
{%- else if fmt.codec == "e4m3" %}
{% include "dequant_e4m3.cuh" %}
{%- else if fmt.codec == "int8" %}
{% include "dequant_int8.cuh" %}
{%- else if fmt.codec == "uint4" %}
{% include "dequant_uint4.cuh" %}
{%- else if fmt.codec == "e2m1" %}
{% include "dequant_e2m1.cuh" %}
{%- endif %}

#ifdef MOE_W_H2
constexpr bool W_H2 = true;
#ifdef MOE_W_H2_UNIT
constexpr float W_H2_UNIT = MOE_W_H2_UNIT;
#undef MOE_W_H2_UNIT
#else
constexpr float W_H2_UNIT = 1.0f;
#endif
// Codecs with a pair decode: the fp32 values are the pairs, widened.
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale& ws, float (&w)[W_VEC]) {
    __half2 h[W_VEC / 2];
    dequant_h2(v, ws, h);
#pragma unroll
    for (int p = 0; p < W_VEC / 2; ++p) {
        const float2 f = __half22float2(h[p]);
        w[h2_elem(p, 0)] = f.x * (1.0f / W_H2_UNIT);
        w[h2_elem(p, 1)] = f.y * (1.0f / W_H2_UNIT);
    }
}
#else
// No packed-half decode for this format and variant: gate_up's dot products stay in fp32.
constexpr bool W_H2 = false;
constexpr float W_ABS_MAX = 1.0f;
constexpr float W_H2_UNIT = 1.0f;
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 2 * p + hi; }
__device__ __forceinline__ void dequant_h2(const uint4, const WScale&, __half2 (&)[W_VEC / 2]) {}
#endif
#undef MOE_W_H2  // a switch for this include only (the host test renders many formats into one file)
