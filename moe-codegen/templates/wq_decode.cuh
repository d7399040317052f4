// Decoding a weight format's packed words into act_t pairs, LUT-free, for the grouped family's
// mixed-input GEMMs: in registers (gemm_wq.cuh, mma.sync) and into shared memory by the
// producer warpgroup (gemm_wsq.cuh, wgmma). The pair order within a word is the one x and the
// intermediate are stored in (x_pair_col), so it never needs undoing.
constexpr int WQ_BITS = 128 / W_VEC;         // bits per code (W_VEC codes per 16 bytes)
constexpr int WQ_CPW = 32 / WQ_BITS;         // codes per 32-bit word
constexpr int WQ_PAIRS = WQ_CPW / 2;         // act_t pairs a word decodes to
constexpr int WQ_SUB = 4 * W_VEC;            // codes per subtile (stage): 128 or 64
constexpr int WQ_X_ROW = WQ_SUB * 2;         // a token row's bytes per stage
constexpr bool WQ_BF16 = {{ act_bf16 }};     // the MMAs' type is the activations' (bf16 or fp16)
// bf16 e2m1 weights are decoded times 1 / WQ_UNIT and the epilogue multiplies it back: NVFP4's
// e4m3 group scales (up to 448) times the decode's 2^126 stay inside bf16 that way.
constexpr float WQ_UNIT = WQ_BF16 && {{ fmt.scales == "nvfp4" }} ? 65536.0f : 1.0f;
static_assert(WQ_BITS == 4 || WQ_BITS == 8, "4- or 8-bit codes");
// bf16 e2m1 with e8m0 scales: a scale of 2 or more leaves the decode's one multiply (s 2^126)
// past bf16's range, and such a warp's stage takes two (wq_decode_stage<true>). NVFP4's e4m3 scales
// (at most 448 times 2^110) never do.
constexpr bool WQ_BIG_SCALES = WQ_BF16 && {{ fmt.codec == "e2m1" && fmt.scales != "nvfp4" }};
__device__ __forceinline__ bool wq_big(float s) { return !(s * __int_as_float(0x7e800000) < 1.6e38f); }
// The same test on a group's scale as stored: an e8m0 code of 128 or more is a scale of 2 or more.
__device__ __forceinline__ bool wq_big(const WScale& ws) {
{%- if fmt.scales == "e8m0" %}
    return ws.e >= 128u;
{%- else %}
    return wq_big(group_scale(ws, 0));
{%- endif %}
}
// Per-channel asymmetric int4 (one fp16 scale and zero point per row): the scale is applied to
// the row's sums in the epilogue, in fp32, so that n - z reaches the tensor cores exact rather
// than each weight's (n - z) s being rounded to bf16 (which cost about 1.5e-3 of rel L2).
constexpr bool WQ_SCALE_IN_EPILOGUE = {{ fmt.scales == "f16_zero" && fmt.group == 0 }};
// f16 group scales that hold for whole stages (groups of at least WQ_SUB codes: int4 and int4
// asym g128, int8 g64 and g128): the mixed-input mma.sync GEMM leaves them out of the decode, so
// the tensor cores multiply n - z exact, and scales each stage's sums in fp32 (gemm_wq.cuh). That
// saves bf16 its two instructions a pair (the scale's hi / lo split), fp16 its one.
{%- if fmt.scales == "f16" || fmt.scales == "f16_zero" %}
constexpr bool WQ_STAGE_SCALE = W_GROUP >= WQ_SUB;
{%- else %}
constexpr bool WQ_STAGE_SCALE = false;
{%- endif %}
// The scale the epilogue multiplies row `row`'s sums by.
template <class M>
__device__ __forceinline__ float wq_row_scale(const void* scales, long row) {
    if constexpr (WQ_SCALE_IN_EPILOGUE) return group_scale(load_wscale<M>(scales, row, 0), 0) * WQ_UNIT;
    else return row_scale<M>(scales, row) * WQ_UNIT;
}
static_assert(X_PAIR_GROUP == WQ_CPW, "x and mid paired as the codes of a word (x_pair_col)");
// A reduction of K codes takes ceil(K / WQ_SUB) stages; 4-bit K may end in half a subtile
// (gpt-oss's 2880 = 22.5 x 128), whose missing half is zero-filled.
static_assert(HIDDEN % 64 == 0 && INTER % 64 == 0, "whole half subtiles");

// Packed act_t pairs in a 32-bit word: a - b, a * b, a * b + c, and (a, b) from two floats.
template <class T>
struct Pair2;
template <>
struct Pair2<__nv_bfloat16> {
    using type = __nv_bfloat162;
};
template <>
struct Pair2<__half> {
    using type = __half2;
};
using act2_t = Pair2<act_t>::type;
__device__ __forceinline__ act2_t as_act2(unsigned u) { return *reinterpret_cast<const act2_t*>(&u); }
__device__ __forceinline__ unsigned act2_bits(act2_t v) { return *reinterpret_cast<const unsigned*>(&v); }
__device__ __forceinline__ unsigned act2_sub(unsigned a, unsigned b) { return act2_bits(__hsub2(as_act2(a), as_act2(b))); }
__device__ __forceinline__ unsigned act2_mul(unsigned a, unsigned b) { return act2_bits(__hmul2(as_act2(a), as_act2(b))); }
__device__ __forceinline__ unsigned act2_fma(unsigned a, unsigned b, unsigned c) {
    return act2_bits(__hfma2(as_act2(a), as_act2(b), as_act2(c)));
}
__device__ __forceinline__ unsigned act2_pack(float lo, float hi) {
    if constexpr (WQ_BF16) {
        const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const unsigned*>(&r);
    } else {
        return h2_as_u32(__floats2half2_rn(lo, hi));
    }
}
__device__ __forceinline__ unsigned act2_splat(float v) { return act2_pack(v, v); }
// An fp16 pair (exact) times s, rounded to act_t: where s may leave fp16's range (e8m0 scales).
__device__ __forceinline__ unsigned h2_scaled(unsigned h, float s) {
    const float2 f = h2_to_f2(h);
    return act2_pack(f.x * s, f.y * s);
}

// One word of codes -> WQ_PAIRS act_t pairs (pair p: codes p and p + WQ_PAIRS, low half first),
// times the group scale s (when the format has group scales; row scales wait for the epilogue).
// big: some scale of the warp's stage is past the one-multiply range (WQ_BIG_SCALES); a constant
// at every call. SCALE false: the group scale is left out (WQ_STAGE_SCALE), zero points kept.
template <bool SCALE = true>
__device__ __forceinline__ void wq_decode(bool big, unsigned w, const WScale& ws, float s, unsigned (&out)[WQ_PAIRS]) {
    (void)big;
    (void)ws;
    (void)s;
{%- if fmt.codec == "uint4" %}
    // Magic number: nibble n under the exponent of 128 (bf16) or 1024 (fp16) reads 128 + n or
    // 1024 + n exactly; minus the same plus the zero point leaves n - z exactly.
{%- if fmt.asym %}
    const unsigned z = (unsigned)zero_point(ws);
{%- else %}
    constexpr unsigned z = 8;
{%- endif %}
    constexpr unsigned magic = WQ_BF16 ? 0x43004300u : 0x64006400u;
    const unsigned off = ((WQ_BF16 ? 0x4300u : 0x6400u) + z) * 0x00010001u;
    // An fp16 group scale is exact in fp16; in bf16 it is split in two (hi + lo, both bf16), so
    // that (n - z) * s is rounded once, per weight, like the other formats' products, rather
    // than through a rounded scale shared by the whole group.
    const unsigned s_hi = act2_splat(s);
    const unsigned s_lo = WQ_BF16 ? act2_splat(s - __bfloat162float(__float2bfloat16_rn(s))) : 0u;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        unsigned v = act2_sub(and_or<0x000f000fu, magic>(w >> (4 * p)), off);
        if constexpr (W_GROUP_SCALED && !WQ_SCALE_IN_EPILOGUE && SCALE)
            v = WQ_BF16 ? act2_fma(v, s_hi, act2_mul(v, s_lo)) : act2_mul(v, s_hi);
        out[p] = v;
    }
{%- else if fmt.codec == "int8" %}
    const unsigned u = w ^ 0x80808080u;  // q + 128, unsigned
    if constexpr (WQ_BF16) {
        // Byte b under fp32's 2^23 exponent reads 2^23 + b; minus 2^23 + 128 leaves q exactly.
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7650u + j)) - 8388736.0f;
        const float sc = W_GROUP_SCALED && SCALE ? s : 1.0f;
        out[0] = act2_pack(f[0] * sc, f[2] * sc);
        out[1] = act2_pack(f[1] * sc, f[3] * sc);
    } else {
        // fp16: byte b under 1024's exponent reads 1024 + b; minus 1152 leaves q exactly.
        const unsigned magic = 0x64806480u;
        out[0] = act2_sub(__byte_perm(u, 0x64646464u, 0x4240u), magic);
        out[1] = act2_sub(__byte_perm(u, 0x64646464u, 0x4341u), magic);
        if constexpr (W_GROUP_SCALED && SCALE) {
            const unsigned s2 = act2_splat(s);
            out[0] = act2_mul(out[0], s2);
            out[1] = act2_mul(out[1], s2);
        }
    }
{%- else if fmt.codec == "e2m1" %}
    if constexpr (WQ_BF16) {
        // Nibble p's sign to bit 15 and its exponent and mantissa bits to bits 6-8 of each half: a
        // bf16 holding the value times 2^-126 (subnormal 0.5 included). One multiply places both
        // at once (nibble n at bits 0-3 times 2^12 + 2^6, or at bits 4-7 times 2^8 + 2^2: the two
        // copies do not overlap, so nothing carries) and one AND keeps them. Then one multiply by
        // s 2^126 / WQ_UNIT (exact: a power of two, or an e4m3 value times one); an MX scale of 2
        // or more would overflow that, and takes two multiplies instead (big).
        const unsigned lo = w, hi = w >> 8;
        const unsigned v[4] = {((lo & 0x000f000fu) * 0x1040u) & 0x81c081c0u, ((lo & 0x00f000f0u) * 0x104u) & 0x81c081c0u,
                               ((hi & 0x000f000fu) * 0x1040u) & 0x81c081c0u, ((hi & 0x00f000f0u) * 0x104u) & 0x81c081c0u};
        if (WQ_BIG_SCALES && big) {
            const unsigned up = 0x7e807e80u, sx = act2_splat(s);  // 2^126, then s
#pragma unroll
            for (int p = 0; p < 4; ++p) out[p] = act2_mul(act2_mul(v[p], up), sx);
        } else {
{%- if fmt.scales == "e8m0" %}
            // s 2^126 = 2^(e - 1) as a bf16 pair straight from the code (e < 128 here; WQ_UNIT 1).
            const unsigned s2 = ws.e * 0x00800080u + 0x3f003f00u;
{%- else %}
            const unsigned s2 = act2_splat(s * (__int_as_float(0x7e800000) / WQ_UNIT));  // s 2^126 / WQ_UNIT
{%- endif %}
#pragma unroll
            for (int p = 0; p < 4; ++p) out[p] = act2_mul(v[p], s2);
        }
    } else {
        // fp16: the same bits at 9-11 hold the value times 2^-14; widened and scaled in fp32
        // (an e8m0 scale may leave fp16's range).
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const unsigned y = w << (4 * (3 - p));
            const unsigned v = (y & 0x80008000u) | ((y >> 3) & 0x0e000e00u);
            out[p] = h2_scaled(v, 16384.0f * s);
        }
    }
{%- else if fmt.codec == "e4m3" %}
    // Pair p: bytes p and p + 2.
    if constexpr (WQ_BF16) {
        // Sign to bit 15, exponent and mantissa to bits 4-10: a bf16 holding the value times
        // 2^-120 (subnormals too); times 2^120 exactly, then the e8m0 scale.
        const unsigned up = 0x7b807b80u;  // 2^120
        const unsigned s2 = act2_splat(s);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const unsigned y = w >> (8 * p);
            const unsigned v = act2_mul(((y << 8) & 0x80008000u) | ((y << 4) & 0x07f007f0u), up);
            out[p] = W_GROUP_SCALED ? act2_mul(v, s2) : v;  // per-channel fp8: the epilogue scales
        }
    } else {
        const unsigned y = __byte_perm(w, 0u, 0x3120u);  // bytes 0, 2, 1, 3
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(y >> (16 * p)), __NV_E4M3);
            out[p] = h2_scaled((unsigned)h.x | ((unsigned)h.y << 16), s);
        }
    }
{%- endif %}
}
