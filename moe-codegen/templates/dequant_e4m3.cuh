// FP8 e4m3 codes, 16 per vector, decoded with {{ fmt.variant }}.
{%- if fmt.variant == "lut" %}
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 * i + j] = w_lut[(words[i] >> (8 * j)) & 0xffu];
    }
}
{%- else %}
// Decoded to fp16 pairs (gate_up's dot products use them as they are; dequant.cuh widens them for
// dequant_vec).
#define MOE_W_H2 1
constexpr float W_ABS_MAX = 448.0f;
{%- if fmt.variant == "hardware" %}
// Pair p holds elements 2p (low half) and 2p + 1 (high half).
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 2 * p + hi; }
{%- else %}
// Pair 2i holds elements 4i and 4i + 2, pair 2i + 1 elements 4i + 1 and 4i + 3.
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 4 * (p >> 1) + (p & 1) + 2 * hi; }
{%- endif %}
__device__ __forceinline__ void dequant_h2(const uint4 v, const WScale&, __half2 (&h)[W_VEC / 2]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned x = words[i];
{%- if fmt.variant == "hardware" %}
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            // cvt.rn.f16x2.e4m3x2 on sm_89+: two codes per instruction.
            __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)((x >> (16 * j)) & 0xffffu), __NV_E4M3);
            h[2 * i + j] = *reinterpret_cast<__half2*>(&r);
        }
{%- else %}
        // Each code's sign to bit 15 of an fp16, its exponent and mantissa (7 bits) to bits 7-13:
        // the fp16 then holds the value times 2^-8 (fp16 bias 15, e4m3 bias 7; subnormals too),
        // undone by one exact multiply. Bytes 1 and 3 already sit in the top of each 16-bit half.
        const __half2 bias = u32_as_h2(0x5c005c00u);  // 256
        h[2 * i] = __hmul2(u32_as_h2(((x << 8) & 0x80008000u) | ((x << 7) & 0x3f803f80u)), bias);
        h[2 * i + 1] = __hmul2(u32_as_h2((x & 0x80008000u) | ((x >> 1) & 0x3f803f80u)), bias);
{%- endif %}
    }
}
{%- endif %}
