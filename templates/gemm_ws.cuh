// Warp-specialised, persistent GEMM tiles for sm_90a. One producer warpgroup fills a ring of
// STAGES shared-memory stages: B (the expert's weight rows) by TMA, A (rows gathered through the
// alignment's permutation) by cp.async. Two consumer warpgroups run wgmma on them, each owning 64
// of the tile's BM = 128 rows and all BN columns. Per stage a `full` mbarrier (129 arrivals: the
// producer threads' cp.async completions and the TMA's bytes) and an `empty` one (8 arrivals: the
// consumer warps, once their MMAs have read it) replace the block barrier per k-tile, and the
// producer runs ahead across tiles, so a tile's epilogue overlaps the next tile's loads.
// Named barrier 1 syncs the producer warpgroup.
// Stages use the layout of gemm_tile.cuh: 128 bytes of K per row, 128-byte swizzle (what TMA's
// CU_TENSOR_MAP_SWIZZLE_128B writes, on 1024-byte aligned stages).
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;  // 128 x 56 + 256 x 224 <= 64 K registers
static_assert(BM == 128 && GEMM_THREADS == 384, "a producer and two 64-row consumer warpgroups");

template <int BN>
struct WsShape {
    static constexpr int A_BYTES = BM * BK_BYTES;
    static constexpr int B_BYTES = BN * BK_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int NF = BN / 8;  // n8 fragments of a consumer's m64nBN accumulator
    static constexpr int ACC = NF * 4;
    static constexpr int A_ROWS = BM / 16;  // rows each producer thread gathers per stage (8 chunks of 16 B per row)
};

// A box of the 2-D tensor map at (k element, row) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap& map, int k, int row, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], [%4];" ::"r"(
            dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(k), "r"(row), "r"(bar)
        : "memory");
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// The tiles of `work` items, each a BM x BN tile over KT k-tiles, taken in order from a global
// counter (zero before launch) by whichever block is free: blocks that share a weight tile
// (consecutive items, see work_item) then stream it at the same time, so it comes from DRAM
// once; a static split drifts apart over the waves and re-reads it.
//   a_row(item, r)             global address of row r of A (K-major), null for a padding row
//   b_load(item, kt, dst, bar) one thread: TMA the item's B k-tile (BN x 128 bytes) to dst
//   promote(item, kt, part, acc, row0)  FP8: fold the k-tile's partial sums into acc
//   epilogue(item, acc, row0)  consumer: the accumulator, rows row0 + lane / 4 (+ 8) of the tile
// A consumer warpgroup whose 64 rows are all padding (an expert's last tile holding <= 64 pairs:
// padding rows close a tile) keeps the barrier protocol but skips its MMAs and its epilogue.
// Consumer accumulators are the wgmma m64nBN layout: fragment nf, element i holds row
// row0 + lane / 4 + 8 (i / 2) and column 8 nf + 2 (lane % 4) + i % 2.
// Shared memory: STAGES stages (1024-aligned), full[STAGES] and empty[STAGES] mbarriers, the item
// of each stage (-1: no more work) and the producer's two item slots.
template <int BN, int KT, class Item, class ARow, class BLoad, class Promote, class Epilogue>
__device__ __forceinline__ void ws_gemm(char* smem_raw, int work, int* work_counter, const int* __restrict__ sorted_rows,
                                        Item item, ARow a_row, BLoad b_load, Promote promote, Epilogue epilogue) {
    using S = WsShape<BN>;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned bars = base + STAGES * S::STAGE_BYTES;
    auto full = [&](int st) { return bars + 8 * st; };
    auto empty = [&](int st) { return bars + 8 * (STAGES + st); };
    volatile int* stage_item = reinterpret_cast<volatile int*>(smem_raw + (bars + 16 * STAGES - smem_u32(smem_raw)));
    volatile int* next_item = stage_item + STAGES;
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(full(st), 128 + 1);
            mbar_init(empty(st), 8);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        set_max_regs_dec<PRODUCER_REGS>();
        const int t = threadIdx.x, c = t % 8;
        int s = 0;  // k-tiles produced so far: stage s % STAGES, its use number s / STAGES
        for (int i = 0;; ++i) {
            // Two slots: thread 0 refills one while the others may still read the other.
            if (t == 0) next_item[i & 1] = atomicAdd(work_counter, 1);
            asm volatile("bar.sync 1, 128;" ::: "memory");
            const int w = next_item[i & 1];
            if (w >= work) {  // tell the consumers: a stage with no data and item -1
                const int st = s % STAGES;
                mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
                if (t == 0) {
                    stage_item[st] = -1;
                    mbar_arrive(full(st));
                }
                mbar_arrive(full(st));
                break;
            }
            const auto it = item(w);
            const char* rows[S::A_ROWS];
#pragma unroll
            for (int j = 0; j < S::A_ROWS; ++j) rows[j] = a_row(it, t / 8 + 16 * j);
            const char* any = rows[0] ? rows[0] : a_row(it, 0);  // row 0 of a tile is never padding
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++s) {
                const int st = s % STAGES;
                mbar_wait(empty(st), ((s / STAGES) & 1) ^ 1);
                const unsigned sa = base + st * S::STAGE_BYTES;
                if (t == 0) {
                    stage_item[st] = w;
                    mbar_arrive_expect_tx(full(st), S::B_BYTES);
                    b_load(it, kt, sa + S::A_BYTES, full(st));
                }
#pragma unroll
                for (int j = 0; j < S::A_ROWS; ++j)
                    cp_async16(sa + swz(t / 8 + 16 * j, c), (rows[j] ? rows[j] : any) + kt * BK_BYTES + c * 16,
                               rows[j] != nullptr);
                cp_async_arrive_noinc(full(st));
            }
        }
        cp_async_wait<0>();
    } else {
        set_max_regs_inc<CONSUMER_REGS>();
        const int cw = threadIdx.x / 32 - 4;  // consumer warp 0..7
        const int row0 = (cw / 4) * 64 + (cw % 4) * 16;
        const unsigned a_off = (cw / 4) * 64 * BK_BYTES;
        auto release = [&](int st) {
            __syncwarp();
            if (threadIdx.x % 32 == 0) mbar_arrive(empty(st));
        };
        int s = 0;
        for (;;) {
            mbar_wait(full(s % STAGES), (s / STAGES) & 1);
            const int w = stage_item[s % STAGES];
            if (w < 0) break;
            const auto it = item(w);
            if (sorted_rows[it.tile * BM + row0 - row0 % 64] < 0) {
#pragma unroll 1
                for (int kt = 0; kt < KT; ++kt, ++s) {
                    if (kt > 0) mbar_wait(full(s % STAGES), (s / STAGES) & 1);
                    release(s % STAGES);
                }
                continue;
            }
            float acc[S::ACC];
            float part[FP8 ? S::ACC : 1];
            if (FP8)
#pragma unroll
                for (int j = 0; j < S::ACC; ++j) acc[j] = 0.f;
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++s) {
                const int st = s % STAGES;
                if (kt > 0) mbar_wait(full(st), (s / STAGES) & 1);
                fence_async_smem();  // A arrived through the generic proxy (cp.async); wgmma reads via the async one
                const unsigned sa = base + st * S::STAGE_BYTES, sb = sa + S::A_BYTES;
                float* d = FP8 ? part : acc;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)  // FP8 starts each k-tile afresh; 16-bit only the item
                    Wgmma<BN>::mma(d, wgmma_desc(sa + a_off + 32 * ks), wgmma_desc(sb + 32 * ks),
                                   ks > 0 || (!FP8 && kt > 0));
                wgmma_commit();
                if (FP8) {
                    wgmma_wait0();
                    release(st);
                    promote(it, kt, part, acc, row0);
                } else {
                    // Keep this k-tile's MMAs in flight; the previous one's are done with its stage.
                    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                    if (kt > 0) release((s - 1) % STAGES);
                }
            }
            if (!FP8) {
                wgmma_wait0();
                release((s - 1) % STAGES);
            }
            epilogue(it, acc, row0);
        }
    }
}
