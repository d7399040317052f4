// moeforge dequant probe: {{ fmt.name }} / {{ fmt.variant }}, {{ tensors }} x [{{ rows }}, {{ cols }}].
// Decodes every 16-byte vector through the format's seam, exactly as the kernel families do, and
// writes out[r][c] = w * group_scale * row_scale in fp32 (the product the Rust dequantizer defines).
// For codecs with a pair decode (W_H2), dequant_vec is those pairs widened, so this covers them.
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
        const float rs = row_scale<PM>(scales, row);
#pragma unroll
        for (int j = 0; j < W_VEC; ++j) {
            out[i * W_VEC + j] = __fmul_rn(__fmul_rn(x[j], group_scale(ws, j / (W_VEC / W_GROUPS))), rs);
        }
    }
}
