// INT4 codes (unsigned nibbles, element 2j in the low nibble of byte j), 32 per vector, minus
// {% if fmt.asym %}the group's zero point{% else %}8{% endif %}, decoded with {{ fmt.variant }}.
{%- if fmt.variant != "bits" %}
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale& ws, float (&w)[W_VEC]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
{%- if fmt.asym %}
    const int z = zero_point(ws);
{%- else %}
    (void)ws;
    constexpr int z = 8;
{%- endif %}
{%- if fmt.variant == "hardware" %}
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * i + j] = __int2float_rn((int)((words[i] >> (4 * j)) & 15u) - z);
    }
{%- else %}
{%- if fmt.asym %}
    const float zf = (float)z;
{%- endif %}
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
{%- if fmt.asym %}
            w[8 * i + j] = w_lut[(words[i] >> (4 * j)) & 15u] - zf;
{%- else %}
            w[8 * i + j] = w_lut[(words[i] >> (4 * j)) & 15u];  // the table holds n - 8
{%- endif %}
        }
    }
{%- endif %}
}
{%- else %}
// Magic number: nibble n as the low mantissa bits of an fp16 with exponent bits 0x6400 reads
// 1024 + n (or 1024 + 16 n one nibble up), exactly. In each 16-bit half, mask 0x000f keeps
// nibble 0 (elements 0 / 4 of the word), 0x00f0 nibble 1 (1 / 5); shifting the word by 8 brings
// nibbles 2 and 3 (2 / 6, 3 / 7) down. Then (1024 + n) - (1024 + z) and
// (1024 + 16 n) / 16 - (64 + z) are n - z, exactly, two elements per instruction. They stay fp16
// pairs (gate_up's dot products use them as they are; dequant.cuh widens them for dequant_vec).
// Pair 4i + j holds elements 8i + j (low half) and 8i + j + 4 (high half).
#define MOE_W_H2 1
constexpr float W_ABS_MAX = {% if fmt.asym %}15.0f{% else %}8.0f{% endif %};  // |n - z|
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 8 * (p >> 2) + (p & 3) + 4 * hi; }
__device__ __forceinline__ void dequant_h2(const uint4 v, const WScale& ws, __half2 (&h)[W_VEC / 2]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
{%- if fmt.asym %}
    const int z = zero_point(ws);
{%- else %}
    (void)ws;
    constexpr int z = 8;
{%- endif %}
    const __half2 lo_sub = u32_as_h2((0x6400u | (unsigned)z) * 0x00010001u);
    const __half2 hi_add = u32_as_h2((0xd400u + ((unsigned)z << 4)) * 0x00010001u);
    const __half2 sixteenth = u32_as_h2(0x2c002c00u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned x = words[i];
        const unsigned t = x >> 8;
        h[4 * i + 0] = __hsub2(u32_as_h2(and_or<0x000f000fu, 0x64006400u>(x)), lo_sub);
        h[4 * i + 1] = __hfma2(u32_as_h2(and_or<0x00f000f0u, 0x64006400u>(x)), sixteenth, hi_add);
        h[4 * i + 2] = __hsub2(u32_as_h2(and_or<0x000f000fu, 0x64006400u>(t)), lo_sub);
        h[4 * i + 3] = __hfma2(u32_as_h2(and_or<0x00f000f0u, 0x64006400u>(t)), sixteenth, hi_add);
    }
}
{%- endif %}
