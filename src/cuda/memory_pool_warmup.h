// The first stream-ordered allocation (cuMemAllocAsync) on a device sets up the device's
// memory pool: about 10 ms of host time on an H200 (CUDA 13, measured), whatever the size.
// A fresh process's first attention call needs a workspace from that pool and also loads its
// kernels (disk cache, cuModuleLoadData: several ms more), so paying the setup on a second
// thread while the caller loads the kernels takes the larger of the two instead of their sum.
#pragma once

#include <thread>

#include "cuda/cuda_driver.h"

namespace rope_jit {

// Touches the memory pool of `context`'s device from a thread of its own: one 1-byte
// allocation and its free on a private non-blocking stream, so that no stream of the caller
// sees the allocation. Best effort: any failure is left to the caller's real allocation to
// report. The destructor waits for the thread.
class MemoryPoolWarmup {
public:
    MemoryPoolWarmup(const CudaDriverApi& api, CUcontext context);
    MemoryPoolWarmup(const MemoryPoolWarmup&) = delete;
    MemoryPoolWarmup& operator=(const MemoryPoolWarmup&) = delete;
    ~MemoryPoolWarmup();

private:
    std::thread thread_;
};

// Whether `stream` (NULL: the legacy default stream) is known not to be capturing a graph: a
// call being captured takes no warm-up (its allocation becomes a graph node, not the pool's
// first use).
bool stream_not_capturing(const CudaDriverApi& api, CUstream stream);

}  // namespace rope_jit
