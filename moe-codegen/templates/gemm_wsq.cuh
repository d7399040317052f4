// Weights decoded into wgmma's B stages by the producer warpgroup (gemm_ws.cuh, WS_DECODE): the
// mixed-input GEMMs on Hopper's warp-specialised pipeline. Each k-tile (64 codes of every weight
// row of the tile) arrives packed, as stored, in a ring slot (BN rows x WSQ_ROW_BYTES, by TMA);
// producer thread t decodes the slot's 16-byte vectors t, t + 128, .. (row q / WSQ_CH, part
// q % WSQ_CH) with wq_decode, the group scales applied, into 16-byte chunks of act_t at the
// stage's swizzled row positions. A word's pairs come out in x_pair_col order, the order x and
// the intermediate are stored in, so wgmma's K runs through both operands alike. Each weight
// is decoded once per tile of BM = 128 rows: by the producer, and for 4-bit codes half of it by
// the consumer warpgroups, whose issue slots are idle under their wgmma (WsqSplit, gemm_ws.cuh).
constexpr int WSQ_ROW_BYTES = 8 * WQ_BITS;    // packed bytes of a weight row per k-tile (64 codes)
constexpr int WSQ_CH = WSQ_ROW_BYTES / 16;    // its 16-byte vectors: 2 (4-bit) or 4 (8-bit)
static_assert(WSQ_ROW_BYTES * 8 == 64 * WQ_BITS && PACK_BITS == WQ_BITS, "a k-tile of 64 codes per row");
// The scales of a thread's vectors: a producer thread's (N, of which the first NP unless it
// decodes all), or a consumer thread's (NC).
template <int BN, bool CONSUMER>
struct WsqScales {
    static constexpr int N = CONSUMER ? WsqSplit<BN>::NC : WsqSplit<BN>::N;
    WScale s[N > 0 ? N : 1];
};
// Vector j of this thread's: the producer's (thread t < 128) or the consumers' (t - 128 of 256).
template <int BN, bool CONSUMER>
__device__ __forceinline__ int wsq_vec(int j) {
    if constexpr (CONSUMER) return 128 * WsqSplit<BN>::NP + (threadIdx.x - 128) + 256 * j;
    else return threadIdx.x + 128 * j;
}
// The scales of k-tile kt's vectors of this thread (a producer's: all N, or its NP where the
// consumers decode the rest); b_row(r): the global weight row of tile row r.
template <int BN, bool CONSUMER, class M, class BRow>
__device__ __forceinline__ WsqScales<BN, CONSUMER> wsq_scales(const void* scales, BRow b_row, int kt, bool all) {
    WsqScales<BN, CONSUMER> r;
#pragma unroll
    for (int j = 0; j < WsqScales<BN, CONSUMER>::N; ++j) {
        if (!CONSUMER && !all && j >= WsqSplit<BN>::NP) break;
        const int q = wsq_vec<BN, CONSUMER>(j);
        r.s[j] = load_wscale<M>(scales, b_row(q / WSQ_CH), kt * WSQ_CH + q % WSQ_CH);
    }
    return r;
}
// Shared-memory accesses of the decode without a memory clobber, so that ptxas may overlap them:
// volatile asm keeps them after the slot's wait and before the stage's fence and arrival.
__device__ __forceinline__ uint4 wsq_lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 { %0, %1, %2, %3 }, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ void sts128(unsigned addr, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.shared.v4.u32 [%0], { %1, %2, %3, %4 };" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}
// Decode NV vectors q0 + STRIDE j of the packed slot at src into the B stage at dst, with the
// scales s[j]; BIG: the two-multiply decode of MX scales past one multiply (wq_decode's `big`).
// The vectors' loads are issued four at a time before their decode: one latency per four
// vectors rather than one each (all eight of int8's at once spilled).
template <bool BIG, int NV, int STRIDE>
__device__ __forceinline__ void wsq_decode_vecs(const WScale* sc, int q0, unsigned src, unsigned dst) {
    constexpr int G = NV % 4 == 0 ? 4 : NV % 3 == 0 ? 3 : NV % 2 == 0 ? 2 : 1;  // (192 columns of int8: 6)
    static_assert(NV % G == 0, "whole groups of vectors");
#pragma unroll
    for (int j0 = 0; j0 < NV; j0 += G) {
        uint4 vs[G];
#pragma unroll
        for (int g = 0; g < G; ++g) vs[g] = wsq_lds128(src + 16 * (q0 + STRIDE * (j0 + g)));
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int j = j0 + g;
            const int q = q0 + STRIDE * j, r = q / WSQ_CH, part = q % WSQ_CH;
            const uint4 v = vs[g];
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
            const WScale& ws = sc[j];
            constexpr bool big = BIG;
            if constexpr (WQ_BITS == 4) {
                // A word is 8 codes: one chunk of the row (chunk 4 part + i).
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned p[WQ_PAIRS];
                    wq_decode(big, words[i], ws, group_scale(ws, i * W_GROUPS / 4), p);
                    sts128(dst + swz(r, 4 * part + i), p[0], p[1], p[2], p[3]);
                }
            } else {
                // Two words of 4 codes a chunk (chunk 2 part + i).
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    unsigned a[WQ_PAIRS], b[WQ_PAIRS];
                    wq_decode(big, words[2 * i], ws, group_scale(ws, 2 * i * W_GROUPS / 4), a);
                    wq_decode(big, words[2 * i + 1], ws, group_scale(ws, (2 * i + 1) * W_GROUPS / 4), b);
                    sts128(dst + swz(r, 2 * part + i), a[0], a[1], b[0], b[1]);
                }
            }
        }
    }
}
// One warp-uniform branch per call, where any of the warp's vectors needs the two-multiply
// decode: a branch per vector diverged within the warp and kept the vectors' decodes apart.
template <int NV, int STRIDE>
__device__ __forceinline__ void wsq_decode_part(const WScale* sc, int q0, unsigned src, unsigned dst) {
    bool big = false;
    if constexpr (WQ_BIG_SCALES)
#pragma unroll
        for (int j = 0; j < NV; ++j) big |= wq_big(sc[j]);
    if (WQ_BIG_SCALES && __any_sync(0xffffffffu, big)) wsq_decode_vecs<true, NV, STRIDE>(sc, q0, src, dst);
    else wsq_decode_vecs<false, NV, STRIDE>(sc, q0, src, dst);
}
// A producer thread's vectors of the k-tile in slot src into the B stage dst: its share, then
// (`all`) the consumers' too, through the same code (one copy of the decode: two spilled).
template <int BN>
__device__ __forceinline__ void wsq_decode(WsqScales<BN, false> sc, bool all, unsigned src, unsigned dst) {
    using P = WsqSplit<BN>;
#pragma unroll 1
    for (int h = 0;; ++h) {
        wsq_decode_part<P::NP, 128>(sc.s, threadIdx.x + h * 128 * P::NP, src, dst);
        if (!P::ON || !all || h == P::N / P::NP - 1) break;
#pragma unroll
        for (int j = 0; j + P::NP < P::N; ++j) sc.s[j] = sc.s[j + P::NP];  // the next pass's scales first
    }
}
// A consumer thread's share.
template <int BN>
__device__ __forceinline__ void wsq_decode(const WsqScales<BN, true>& sc, bool, unsigned src, unsigned dst) {
    if constexpr (WsqSplit<BN>::ON) wsq_decode_part<WsqSplit<BN>::NC, 256>(sc.s, wsq_vec<BN, true>(0), src, dst);
}
// ws_gemm's b_decode: a producer thread's vectors, or a consumer thread's share.
template <int BN>
struct WsqDecoder {
    __device__ void operator()(const WsqScales<BN, false>& sc, bool all, unsigned src, unsigned dst) const {
        wsq_decode<BN>(sc, all, src, dst);
    }
    __device__ void operator()(const WsqScales<BN, true>& sc, bool all, unsigned src, unsigned dst) const {
        wsq_decode<BN>(sc, all, src, dst);
    }
};
// A consumer warpgroup fills its `cols` with f(j) for the tile's BN columns (the weight rows'
// epilogue scales), once its warps agree the previous item's epilogue is done with them;
// cols_ready() then waits for every thread's stores.
template <int BN, class F>
__device__ __forceinline__ void fill_cols(float* cols, F f) {
    const int t = threadIdx.x % 128;
    asm volatile("bar.sync %0, 128;" ::"r"(threadIdx.x / 128 + 1) : "memory");
#pragma unroll
    for (int j = t; j < BN; j += 128) cols[j] = f(j);
}
