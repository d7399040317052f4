// FP4 e2m1 codes (element 2j in the low nibble of byte j), 32 per vector, decoded with {{ fmt.variant }}
// ({% if fmt.native_e2m1 %}cvt.rn.f16x2.e2m1x2{% else %}through e4m3 on sm_90{% endif %} for hardware).
{%- if fmt.variant == "lut" %}
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * i + j] = w_lut[(words[i] >> (4 * j)) & 15u];
    }
}
{%- else %}
// Decoded to fp16 pairs (gate_up's dot products use them as they are; dequant.cuh widens them for
// dequant_vec).
#define MOE_W_H2 1
{%- if fmt.variant == "bits" %}
constexpr float W_ABS_MAX = 6.0f;
// Pair 4i + j holds elements 8i + j (low half) and 8i + j + 4 (high half).
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 8 * (p >> 2) + (p & 3) + 4 * hi; }
{%- else if !fmt.native_e2m1 %}
// The pairs hold the values times 2^-6 (see below).
#define MOE_W_H2_UNIT 0.015625f
constexpr float W_ABS_MAX = 6.0f / 64.0f;
// Pairs 4i .. 4i + 3 hold elements 8i + (0, 2), (4, 6), (1, 3), (5, 7).
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) {
    return 8 * (p >> 2) + 4 * (p & 1) + ((p >> 1) & 1) + 2 * hi;
}
{%- else %}
constexpr float W_ABS_MAX = 6.0f;
// Pair p holds elements 2p (low half) and 2p + 1 (high half).
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 2 * p + hi; }
{%- endif %}
__device__ __forceinline__ void dequant_h2(const uint4 v, const WScale&, __half2 (&h)[W_VEC / 2]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned x = words[i];
{%- if fmt.variant == "bits" %}
        // LUT-free: in each 16-bit half, nibble p's sign goes to bit 15 and its exponent and
        // mantissa (3 bits) to bits 9-11, making an fp16 that holds the value times 2^-14 (fp16
        // bias 15, e2m1 bias 1; the subnormal 0.5 comes out exact); one multiply by 2^14 undoes it.
        // Nibble p of the low half is element p, of the high half element p + 4.
        const __half2 bias = u32_as_h2(0x74007400u);  // 2^14
        h[4 * i + 0] = __hmul2(u32_as_h2(((x << 12) & 0x80008000u) | ((x << 9) & 0x0e000e00u)), bias);
        h[4 * i + 1] = __hmul2(u32_as_h2(((x << 8) & 0x80008000u) | ((x << 5) & 0x0e000e00u)), bias);
        h[4 * i + 2] = __hmul2(u32_as_h2(((x << 4) & 0x80008000u) | ((x << 1) & 0x0e000e00u)), bias);
        h[4 * i + 3] = __hmul2(u32_as_h2((x & 0x80008000u) | ((x >> 3) & 0x0e000e00u)), bias);
{%- else if !fmt.native_e2m1 %}
        // No e2m1 conversion before sm_100: each code becomes an e4m3 byte whose exponent field
        // holds e2m1's exponent (bias 7 against 1) and whose mantissa's top bit holds its mantissa
        // bit, the value times 2^-6 (subnormals too), then one cvt.rn.f16x2.e4m3x2 per two codes.
        // Byte j of `ev` codes element 2j (nibble 2j: sign bit 3 -> 7, magnitude bits 0-2 -> 2-4),
        // of `od` element 2j + 1 (nibble 2j + 1: bits 4-6 -> 2-4, sign bit 7 stays).
        const unsigned ev = ((x << 2) & 0x1c1c1c1cu) | ((x << 4) & 0x80808080u);
        const unsigned od = ((x >> 2) & 0x1c1c1c1cu) | (x & 0x80808080u);
        e4m3x4_to_h2(ev, h[4 * i], h[4 * i + 1]);
        e4m3x4_to_h2(od, h[4 * i + 2], h[4 * i + 3]);
{%- else %}
        // cvt.rn.f16x2.e2m1x2 (sm_100a / sm_120a): one byte, two codes, low nibble to the low half.
        unsigned r[4];
        asm("{ .reg .b8 b0, b1, b2, b3;\n"
            "  mov.b32 { b0, b1, b2, b3 }, %4;\n"
            "  cvt.rn.f16x2.e2m1x2 %0, b0;\n"
            "  cvt.rn.f16x2.e2m1x2 %1, b1;\n"
            "  cvt.rn.f16x2.e2m1x2 %2, b2;\n"
            "  cvt.rn.f16x2.e2m1x2 %3, b3;\n"
            "}"
            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
            : "r"(x));
#pragma unroll
        for (int j = 0; j < 4; ++j) h[4 * i + j] = u32_as_h2(r[j]);
{%- endif %}
    }
}
{%- endif %}
