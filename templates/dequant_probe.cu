// moeforge dequant probe: {{ fmt.name }} / {{ fmt.variant }}, {{ tensors }} x [{{ rows }}, {{ cols }}].
// Decodes every 16-byte vector through the format's seam, exactly as the kernel families do, and
// writes out[r][c] = w * group_scale * row_scale in fp32 (the product the Rust dequantizer defines).
// Formats with a packed-half decode (W_H2) are decoded both ways; an element where the two differ
// comes out NaN.
{% include "common.cuh" %}
{% include "dequant.cuh" %}

constexpr int P_K = {{ cols }};
constexpr int P_N = {{ rows }};
constexpr int P_E = {{ tensors }};
using PM = WMat<P_K, P_N, P_E>;
constexpr int P_NV = P_K / W_VEC;

extern "C" __global__ void __launch_bounds__(256) dequant_probe(const uint4* __restrict__ w,
                                                                const void* __restrict__ scales,
                                                                float* __restrict__ out) {
    dequant_setup();
    const long total = (long)P_E * P_N * P_NV;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long row = i / P_NV;
        const int v = (int)(i % P_NV);
        const uint4 q = ldg_stream(w + i);
        const WScale ws = load_wscale<PM>(scales, row, v);
        float x[W_VEC];
        dequant_vec(q, ws, x);
        if constexpr (W_H2) {
            // The packed-half decode must give the same values: where it does not, NaN.
            __half2 h[W_VEC / 2];
            dequant_h2(q, ws, h);
#pragma unroll
            for (int p = 0; p < W_VEC / 2; ++p) {
                const float2 f = __half22float2(h[p]);
                if (f.x != x[h2_elem(p, 0)]) x[h2_elem(p, 0)] = __int_as_float(0x7fc00000);
                if (f.y != x[h2_elem(p, 1)]) x[h2_elem(p, 1)] = __int_as_float(0x7fc00000);
            }
        }
        const float rs = row_scale<PM>(scales, row);
#pragma unroll
        for (int j = 0; j < W_VEC; ++j) {
            out[i * W_VEC + j] = __fmul_rn(__fmul_rn(x[j], group_scale(ws, j / (W_VEC / W_GROUPS))), rs);
        }
    }
}
