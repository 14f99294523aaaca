// One kernel launch with a single argument block, optionally as a programmatic dependent
// launch: shared by the RoPE launchers (src/ops/rope/rope_cuda.cpp).
#pragma once

#include "cuda/cuda_driver.h"

namespace rope_jit {

// A 1-D launch: `blocks` blocks of `threads` threads, `shared_bytes` of dynamic shared memory,
// the kernel's one parameter at `arguments`.
struct KernelLaunch {
    CUfunction function = nullptr;
    unsigned blocks = 0, threads = 0, shared_bytes = 0;
    void* arguments = nullptr;
};

// Enqueues `launch` on `stream`. `programmatic`: with programmatic stream serialization
// (rope_jit_config.programmatic_launch), so that the grid may start while the kernel before it
// on the stream finishes; the kernel must wait for that grid (griddepcontrol.wait) before it
// touches memory. Only where the device takes it (`compute_capability` >= 90) and the driver
// has cuLaunchKernelEx; elsewhere a plain launch. Throws Error(ROPE_JIT_ERROR_CUDA) naming
// `what` when the driver refuses the launch.
void launch_kernel(const CudaDriverApi& api, const KernelLaunch& launch, CUstream stream,
                   bool programmatic, int compute_capability, const char* what);

}  // namespace rope_jit
