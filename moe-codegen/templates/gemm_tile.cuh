// One BM x BN tile of C = A . B^T on tensor cores, both operands K-major in shared memory.
// Stages hold 128 bytes of K per row (64 bf16 or 128 e4m3) in the 128-byte swizzle that wgmma
// reads (16-byte chunk c of row r at chunk c ^ (r % 8)), which ldmatrix reads without bank
// conflicts too. Every thread loads (cp.async, STAGES - 1 k-tiles ahead) and every warp computes:
//   wgmma    (sm_90a): warpgroup g owns rows 64g..64g+63 and all BN columns;
//   mma.sync (others): warp (wm, wn) of a 2 x 4 grid owns 64 rows and BN / 4 columns.
// The accumulator is float acc[MF * NF * 4]: fragment (mf, nf) holds rows row0 + 16 mf + lane / 4
// (+ 8 for i >= 2) and columns col0 + 8 nf + 2 (lane % 4) (+ 1 for odd i), the mma C layout.
constexpr int BK_BYTES = 128;
// bf16 on wgmma leaves one k-tile's MMAs in flight while the next is issued; fp8 must read each
// k-tile's partial sums (to scale them), so it waits. A stage is refilled only once no MMA in
// flight can still read it, which leaves STAGES - 1 - INFLIGHT k-tiles loading ahead.
constexpr int INFLIGHT = (MOE_WGMMA && !FP8) ? 1 : 0;
constexpr int AHEAD = STAGES - 1 - INFLIGHT;
static_assert(AHEAD >= 1, "at least one k-tile loading ahead");

__device__ __forceinline__ unsigned swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

template <int BN>
struct TileShape {
    static constexpr int A_BYTES = BM * BK_BYTES;
    static constexpr int B_BYTES = BN * BK_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;  // + alignment slack
    static constexpr int A_PER_THREAD = BM * 8 / GEMM_THREADS;      // 16-byte chunks per stage
    static constexpr int B_PER_THREAD = BN * 8 / GEMM_THREADS;
    static_assert(BM * 8 % GEMM_THREADS == 0 && BN * 8 % GEMM_THREADS == 0, "whole chunks per thread");
#if MOE_WGMMA
    static constexpr int MF = 1, NF = BN / 8;
#else
    static constexpr int MF = 4, NF = BN / 32;
#endif
    static constexpr int ACC = MF * NF * 4;
};

__device__ __forceinline__ int frag_row0() {
    const int warp = threadIdx.x / 32;
#if MOE_WGMMA
    return (warp / 4) * 64 + (warp % 4) * 16;
#else
    return (warp / 4) * 64;
#endif
}
template <int BN>
__device__ __forceinline__ int frag_col0() {
#if MOE_WGMMA
    return 0;
#else
    return (threadIdx.x / 32 % 4) * (BN / 4);
#endif
}
// Row / column of accumulator element (mf, nf, i) of this thread.
__device__ __forceinline__ int frag_row(int row0, int mf, int i) { return row0 + 16 * mf + (threadIdx.x % 32) / 4 + 8 * (i / 2); }
__device__ __forceinline__ int frag_col(int col0, int nf, int i) { return col0 + 8 * nf + 2 * (threadIdx.x % 4) + (i % 2); }

#if MOE_WGMMA
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <int N>
struct Wgmma;
{%- for w in wgmma_ns %}
// m64n{{ w.n }}k(32 bytes): d (+)= A[64 x 32 B] . B[{{ w.n }} x 32 B]^T.
template <>
struct Wgmma<{{ w.n }}> {
    static __device__ __forceinline__ void mma(float* d, unsigned long long a, unsigned long long b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %{{ w.regs + 2 }}, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n{{ w.n }}k{{ mma_k }}.f32.{{ mma_type }}.{{ mma_type }} "
            "{ {% for i in 0..w.regs %}%{{ i }}{% if !loop.last %}, {% endif %}{% endfor %} }, "
            "%{{ w.regs }}, %{{ w.regs + 1 }}, p, 1, 1{{ wgmma_trans }};\n}\n"
            : {% for i in 0..w.regs %}"+f"(d[{{ i }}]){% if !loop.last %}, {% endif %}{% endfor %}
            : "l"(a), "l"(b), "r"(accumulate));
    }
};
{%- endfor %}
#else
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// m16n8k(32 bytes): d += a . b, f32 accumulate.
__device__ __forceinline__ void mma_16x8(float* d, const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k{{ mma_k }}.row.col.f32.{{ mma_type }}.{{ mma_type }}.f32 "
        "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// acc (+)= A_stage . B_stage^T over one k-tile (4 steps of 32 bytes). `fresh`: overwrite acc.
template <int BN>
__device__ __forceinline__ void mma_stage(unsigned sa, unsigned sb, float* acc, bool fresh) {
    using T = TileShape<BN>;
#if MOE_WGMMA
    (void)fresh;
    const int wg = threadIdx.x / 128;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        Wgmma<BN>::mma(acc, wgmma_desc(sa + wg * 64 * 128 + 32 * ks), wgmma_desc(sb + 32 * ks), (fresh && ks == 0) ? 0 : 1);
    wgmma_commit();
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(INFLIGHT) : "memory");
#else
    if (fresh)
#pragma unroll
        for (int j = 0; j < T::ACC; ++j) acc[j] = 0.f;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm = warp / 4, wn = warp % 4;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        unsigned a[T::MF][4];
#pragma unroll
        for (int mf = 0; mf < T::MF; ++mf)
            ldmatrix_x4(sa + swz(wm * 64 + mf * 16 + lane % 16, 2 * ks + lane / 16), a[mf]);
#pragma unroll
        for (int np = 0; np < T::NF / 2; ++np) {
            unsigned b[4];
            ldmatrix_x4(sb + swz(wn * (BN / 4) + np * 16 + (lane / 16) * 8 + lane % 8, 2 * ks + (lane / 8) % 2), b);
#pragma unroll
            for (int mf = 0; mf < T::MF; ++mf) {
                mma_16x8(acc + (mf * T::NF + 2 * np) * 4, a[mf], b[0], b[1]);
                mma_16x8(acc + (mf * T::NF + 2 * np + 1) * 4, a[mf], b[2], b[3]);
            }
        }
    }
#endif
}

// The mainloop over KT k-tiles. `a_src[j]` / `b_src[j]`: this thread's row pointers (bytes) for
// its A / B chunks, null for padding rows (zero-filled). FP8 operands carry a scale per 128 of K:
// each k-tile is reduced into `part`, then promote(kt, part) folds it into acc in fp32.
template <int BN, int KT, class Promote>
__device__ __forceinline__ void gemm_tile(char* smem, const char* const (&a_src)[TileShape<BN>::A_PER_THREAD],
                                          const char* const (&b_src)[TileShape<BN>::B_PER_THREAD], float* acc,
                                          float* part, Promote promote) {
    using T = TileShape<BN>;
    const unsigned base = (smem_u32(smem) + 1023u) & ~1023u;
    const int c = threadIdx.x % 8, r0 = threadIdx.x / 8;
    auto load = [&](int stage, int kt) {
        const unsigned sa = base + stage * T::STAGE_BYTES, sb = sa + T::A_BYTES;
#pragma unroll
        for (int j = 0; j < T::A_PER_THREAD; ++j) {
            const char* p = a_src[j];
            cp_async16(sa + swz(r0 + 32 * j, c), p ? p + kt * BK_BYTES + c * 16 : b_src[0], p != nullptr);
        }
#pragma unroll
        for (int j = 0; j < T::B_PER_THREAD; ++j)
            cp_async16(sb + swz(r0 + 32 * j, c), b_src[j] + kt * BK_BYTES + c * 16, true);
    };
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < KT) load(s, s);
        cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<AHEAD - 1>();
#if MOE_WGMMA
        fence_async_smem();
#endif
        __syncthreads();
        const int next = kt + AHEAD;
        if (next < KT) load(next % STAGES, next);
        cp_async_commit();
        const unsigned sa = base + (kt % STAGES) * T::STAGE_BYTES;
        if (FP8) {
            mma_stage<BN>(sa, sa + T::A_BYTES, part, true);
            promote(kt, part);
        } else {
            mma_stage<BN>(sa, sa + T::A_BYTES, acc, kt == 0);
        }
    }
#if MOE_WGMMA
    wgmma_wait0();
#endif
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites these stages
}
