// The bulk copy engine (sm_90 and later; PTX cp.async.bulk and mbarrier): copies of contiguous
// spans between global and shared memory that one thread issues and the engine carries out.
// A load completes on an mbarrier of the block's shared memory, which the threads wait on; a
// store is committed as a bulk group, whose reads of shared memory the issuing thread waits
// for before the next load overwrites the span. Plain CUDA without toolkit headers; the
// functions exist for sm_90 and later only (callers guard with __CUDA_ARCH__ too).
#ifndef ROPE_JIT_BULK_COPY_H
#define ROPE_JIT_BULK_COPY_H

namespace {

#if __CUDA_ARCH__ >= 900

// The 32-bit shared-memory address the bulk instructions take.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// An mbarrier that one arrival (the loading thread's) and the load's bytes complete. Made
// visible to the copy engine before any thread uses it (then a block barrier).
__device__ __forceinline__ void bulk_barrier_init(unsigned barrier) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ void bulk_barriers_ready() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Loads `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared
// `dst`; `barrier`'s phase completes when they have arrived.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes,
                                          unsigned barrier) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier),
                 "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(barrier)
        : "memory");
}

// Waits until `barrier`'s phase of this parity (0 for its first use, then alternating) has
// completed.
__device__ __forceinline__ void bulk_wait(unsigned barrier, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n"
            " .reg .pred ready;\n"
            " mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
            " selp.u32 %0, 1, 0, ready;\n"
            "}"
            : "=r"(done)
            : "r"(barrier), "r"(parity)
            : "memory");
    }
}

// Orders this thread's ordinary writes of shared memory before the copy engine's later reads
// of it (each writing thread, then a block barrier, then the bulk store).
__device__ __forceinline__ void bulk_fence_shared_writes() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Stores `bytes` from shared `src` to global `dst`, committed as a bulk group of its own.
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until every store group but the newest has read its shared memory.
__device__ __forceinline__ void bulk_wait_stores_read_but_newest() {
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

// Waits until every store group has completed.
__device__ __forceinline__ void bulk_wait_stores() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#endif

}  // namespace

#endif
