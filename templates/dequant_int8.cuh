// INT8 codes (two's complement), 16 per vector, decoded with {{ fmt.variant }}.
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    const unsigned words[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned x = words[i];
{%- if fmt.variant == "bits" %}
        // Magic number: with the sign bit flipped a code is q + 128 in [0, 256); as the low byte of
        // an fp16 whose high byte is 0x64 it reads 1024 + q + 128, exactly. Subtracting 1152
        // leaves q. One prmt builds two fp16, one hsub2 finishes them.
        const unsigned u = x ^ 0x80808080u;
        const __half2 magic = u32_as_h2(0x64806480u);  // 1152
        const float2 f02 = __half22float2(__hsub2(u32_as_h2(__byte_perm(u, 0x64646464u, 0x4240u)), magic));
        const float2 f13 = __half22float2(__hsub2(u32_as_h2(__byte_perm(u, 0x64646464u, 0x4341u)), magic));
        w[4 * i] = f02.x;
        w[4 * i + 1] = f13.x;
        w[4 * i + 2] = f02.y;
        w[4 * i + 3] = f13.y;
{%- else if fmt.variant == "hardware" %}
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 * i + j] = __int2float_rn((int)(signed char)((x >> (8 * j)) & 0xffu));
{%- else %}
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 * i + j] = w_lut[(x >> (8 * j)) & 0xffu];
{%- endif %}
    }
}
