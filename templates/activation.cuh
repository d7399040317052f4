// The gated activation act(gate), applied before the product with up.
__device__ __forceinline__ float moe_act(float g) {
{%- match activation %}
{%- when Activation::Silu %}
    // The fast division: exact enough for a value rounded to bf16 next, and 0 where exp overflows.
    return __fdividef(g, 1.0f + __expf(-g));
{%- when Activation::GeluTanh %}
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
{%- endmatch %}
}
