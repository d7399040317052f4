// fp16 weights, 8 per vector: cvt.f32.f16.
__device__ __forceinline__ void dequant_vec(const uint4 v, const WScale&, float (&w)[W_VEC]) {
    widen8(v, (const __half*)nullptr, w);
}
