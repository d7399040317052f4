// lut: every code's value in a shared-memory table, filled from constant memory by each block.
// Lanes reading the same entry broadcast; a 16-entry table spans 16 banks, so 4-bit lookups never
// conflict (constant memory would serialize divergent lookups).
constexpr int W_LUT = {{ fmt.lut_len }};
__constant__ unsigned w_lut_bits[W_LUT] = {
    {{ fmt.lut }}
};
__shared__ float w_lut[W_LUT];
__device__ __forceinline__ void dequant_setup() {
    for (int i = threadIdx.x; i < W_LUT; i += blockDim.x) w_lut[i] = __uint_as_float(w_lut_bits[i]);
    __syncthreads();
}
