// The gated activation act(gate), applied before the product with up (moe_glu).
__device__ __forceinline__ float moe_act(float g) {
{%- match activation %}
{%- when Activation::Silu %}
    // The fast division: exact enough for a value rounded to bf16 next, and 0 where exp overflows.
    return __fdividef(g, 1.0f + __expf(-g));
{%- when Activation::GeluTanh %}
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
{%- when Activation::SwigluOai %}
    // gpt-oss: gate clamped above at the limit, then gate * sigmoid(alpha * gate) (the constants:
    // moe_codegen::spec::SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA).
    g = fminf(g, 7.0f);
    return __fdividef(g, 1.0f + __expf(-1.702f * g));
{%- endmatch %}
}
// One intermediate value from its neuron's gate and up projections.
__device__ __forceinline__ float moe_glu(float g, float u) {
{%- match activation %}
{%- when Activation::SwigluOai %}
    return moe_act(g) * (fminf(fmaxf(u, -7.0f), 7.0f) + 1.0f);
{%- else %}
    return moe_act(g) * u;
{%- endmatch %}
}
// moe_act with SiLU's exp2 and reciprocal approximate and flushing denormals: the same values for
// every input (1 + a denormal is 1; a reciprocal past 2^126 is 0 either way), three instructions
// fewer a value (no __expf range fix-up). GEMM1's e4m3 epilogue takes it (H100, Qwen3-30B-A3B
// fp8 at M = 4096, six rounds on two machines, us: balanced 419.1-422.6 against 422.2-424.3,
// skewed 439.0-442.4 against 440.7-444.0, uniform within the spread); with it everywhere, bf16
// ran slower under uniform routing (682.9-685.1 against 676.5-677.1), so the others keep moe_act.
__device__ __forceinline__ float moe_act_ftz(float g) {
{%- match activation %}
{%- when Activation::Silu %}
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return g * r;
{%- else %}
    return moe_act(g);
{%- endmatch %}
}
// moe_glu through moe_act_ftz.
__device__ __forceinline__ float moe_glu_ftz(float g, float u) {
{%- match activation %}
{%- when Activation::Silu %}
    return moe_act_ftz(g) * u;
{%- else %}
    return moe_glu(g, u);
{%- endmatch %}
}
