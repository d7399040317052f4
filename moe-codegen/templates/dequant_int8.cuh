// INT8 codes (two's complement), 16 per vector, decoded with {{ fmt.variant }}.
{%- if fmt.variant == "bits" %}
// Magic number: with the sign bit flipped a code is q + 128 in [0, 256); as the low byte of an
// fp16 whose high byte is 0x64 it reads 1024 + q + 128, exactly. Subtracting 1152 leaves q. One
// prmt builds two fp16, one hsub2 finishes them. They stay fp16 pairs (gate_up's dot products use
// them as they are; dequant.cuh widens them for dequant_vec): pair 2i holds elements 4i and
// 4i + 2, pair 2i + 1 elements 4i + 1 and 4i + 3.
#define MOE_W_H2 1
constexpr float W_ABS_MAX = 128.0f;
__device__ __forceinline__ constexpr int h2_elem(int p, int hi) { return 4 * (p >> 1) + (p & 1) + 2 * hi; }
__device__ __forceinline__ void dequant_h2(const uint4 v, const WScale&, __half2 (&h)[W_VEC / 2]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
    const __half2 magic = u32_as_h2(0x64806480u);  // 1152
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned u = words[i] ^ 0x80808080u;
        h[2 * i] = __hsub2(u32_as_h2(__byte_perm(u, 0x64646464u, 0x4240u)), magic);
        h[2 * i + 1] = __hsub2(u32_as_h2(__byte_perm(u, 0x64646464u, 0x4341u)), magic);
    }
}
{%- else %}
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
{%- if fmt.variant == "hardware" %}
            w[4 * i + j] = __int2float_rn((int)(signed char)((words[i] >> (8 * j)) & 0xffu));
{%- else %}
            w[4 * i + j] = w_lut[(words[i] >> (8 * j)) & 0xffu];
{%- endif %}
        }
    }
}
{%- endif %}
