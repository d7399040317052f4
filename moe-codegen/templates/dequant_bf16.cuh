// bf16 weights, 8 per vector: widening is a 16-bit shift.
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    widen8(v, (const __nv_bfloat16*)nullptr, w);
}
