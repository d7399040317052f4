// Host stand-ins for the CUDA device built-ins the dequant includes use, so that g++ can compile
// the rendered include and run it on the CPU (tests/host_dequant.rs). Each is written from its
// documented semantics, with IEEE round-to-nearest-even arithmetic: fp16 ops are computed in
// float or double (exact for these operands) and rounded once to fp16.
#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __constant__ static
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __syncthreads() ((void)0)

struct Dim3 {
    unsigned x = 0;
};
static Dim3 threadIdx, blockIdx, blockDim{1}, gridDim{1};

struct uint4 {
    unsigned x, y, z, w;
};
struct float2 {
    float x, y;
};

static inline unsigned f2u(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __int2float_rn(int i) { return (float)i; }
template <class T> static inline T __ldg(const T* p) { return *p; }

// fp16 <-> float, round to nearest even, subnormals included.
static inline float h2f(unsigned short h) {
    const unsigned s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
static inline unsigned short f2h(double v) {
    const unsigned short s = std::signbit(v) ? 0x8000 : 0;
    const double a = std::fabs(v);
    if (std::isnan(v)) return 0x7e00;
    if (a < std::ldexp(1.0, -14)) return s | (unsigned short)std::nearbyint(a / std::ldexp(1.0, -24));
    int e;
    std::frexp(a, &e);
    e -= 1;  // a in [2^e, 2^(e+1))
    double n = std::nearbyint(a / std::ldexp(1.0, e - 10));  // [1024, 2048], ties to even
    if (n == 2048) {
        n = 1024;
        e += 1;
    }
    if (e > 15) return s | 0x7c00;
    return s | (unsigned short)(((e + 15) << 10) | ((unsigned)n - 1024));
}

struct __half_raw {
    unsigned short x;
};
struct __half2_raw {
    unsigned short x, y;
};
struct __half {
    unsigned short x;
    __half() = default;
    __half(__half_raw r) : x(r.x) {}
};
struct __half2 {
    __half x, y;
};
static inline __half mkh(unsigned short b) { __half h; h.x = b; return h; }
static inline float __half2float(__half h) { return h2f(h.x); }
static inline __half __ushort_as_half(unsigned short u) { return mkh(u); }
static inline float2 __half22float2(__half2 h) { return float2{h2f(h.x.x), h2f(h.y.x)}; }
static inline __half2 __hsub2(__half2 a, __half2 b) {
    return __half2{mkh(f2h((double)h2f(a.x.x) - h2f(b.x.x))), mkh(f2h((double)h2f(a.y.x) - h2f(b.y.x)))};
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
    return __half2{mkh(f2h((double)h2f(a.x.x) * h2f(b.x.x))), mkh(f2h((double)h2f(a.y.x) * h2f(b.y.x)))};
}
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    // Exact in double for fp16 operands whose product and sum need < 53 bits (true here).
    return __half2{mkh(f2h((double)h2f(a.x.x) * h2f(b.x.x) + h2f(c.x.x))),
                   mkh(f2h((double)h2f(a.y.x) * h2f(b.y.x) + h2f(c.y.x)))};
}
static inline __half2 u32_as_h2(unsigned u) { __half2 h; std::memcpy(&h, &u, 4); return h; }
static inline unsigned h2_as_u32(__half2 h) { unsigned u; std::memcpy(&u, &h, 4); return u; }
static inline float2 h2_to_f2(unsigned u) { return __half22float2(u32_as_h2(u)); }
template <unsigned B, unsigned C>
static inline unsigned and_or(unsigned a) { return (a & B) | C; }

// prmt.b32 default mode: result byte k = byte (s >> 4k) & 7 of {y, x} (x bytes 0-3, y 4-7).
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= (unsigned)((v >> (8 * ((s >> (4 * k)) & 7))) & 0xff) << (8 * k);
    return r;
}

// e4m3fn -> fp16 (exact), as cvt.rn.f16x2.e4m3x2 does.
typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
static inline unsigned short e4m3_to_h(unsigned char b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 | m), e - 10);
    if (e == 15 && m == 7) v = NAN;
    return f2h(b & 0x80 ? -(double)v : (double)v);
}
static inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t b, __nv_fp8_interpretation_t) {
    return __half_raw{e4m3_to_h(b)};
}
static inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t v, __nv_fp8_interpretation_t) {
    return __half2_raw{e4m3_to_h(v & 0xff), e4m3_to_h(v >> 8)};
}

// 16-bit activations / weights widened to fp32.
struct __nv_bfloat16 {
    unsigned short x;
};
static inline void widen8(const uint4 v, const __nv_bfloat16*, float (&a)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) {
        a[2 * i] = __uint_as_float(w[i] << 16);
        a[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
static inline void widen8(const uint4 v, const __half*, float (&a)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) {
        a[2 * i] = h2f(w[i] & 0xffff);
        a[2 * i + 1] = h2f(w[i] >> 16);
    }
}

template <int K_, int N_, int E_>
struct WMat {
    static constexpr int K = K_;
    static constexpr int N = N_;
    static constexpr int E = E_;
};
static inline uint4 ldg_stream(const void* p) { uint4 r; std::memcpy(&r, p, 16); return r; }
