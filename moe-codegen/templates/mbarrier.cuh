// Shared-memory mbarriers and bulk copies (sm_90+): a producer thread arms a barrier with the
// bytes it expects, the copy engine completes them, consumers wait on the barrier's phase.
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Add `bytes` to the transactions the current phase waits for, without arriving.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, int bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive and add `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive once this thread's earlier cp.async copies have landed (counted in the barrier's init).
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Spin on try_wait until the phase of the given parity has completed; SEM qualifies the acquire.
#define MOE_MBAR_WAIT_LOOP(SEM)                                                          \
    "{\n.reg .pred done;\nWAIT:\n"                                                       \
    "mbarrier.try_wait.parity" SEM ".shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n"
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
    asm volatile(MOE_MBAR_WAIT_LOOP("") ::"r"(bar), "r"(parity) : "memory");
}
// The same, acquiring at cluster scope what other blocks of the cluster released on arrival.
__device__ __forceinline__ void mbar_wait_cluster(unsigned bar, int parity) {
    asm volatile(MOE_MBAR_WAIT_LOOP(".acquire.cluster") ::"r"(bar), "r"(parity) : "memory");
}
// Makes the barriers' initialisation visible to the copy engine (then a block barrier).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// An L2 policy for data read once: evicted first, so that what is re-read stays.
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) global -> shared, completing on `bar`.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, int bytes, unsigned bar,
                                          unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}
