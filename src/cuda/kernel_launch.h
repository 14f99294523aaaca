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

// The first driver version (CUDA 12.3) that captures a programmatic launch into a CUDA graph
// as a programmatic edge; ROPE_JIT_PROGRAMMATIC_AUTO launches plainly under older drivers.
constexpr int kProgrammaticGraphDriverVersion = 12030;

// Whether the RoPE launches of a runtime ask to be programmatic, from the runtime's
// rope_jit_programmatic_launch `setting`: ON yes, OFF no, AUTO where the driver's version
// (cuDriverGetVersion) is kProgrammaticGraphDriverVersion or later.
bool programmatic_launch_requested(const CudaDriverApi& api, int setting);

// Whether a launch asked to be programmatic (programmatic_launch_requested) is one: the device
// takes it (`compute_capability` >= 90), the kernel's module was compiled for sm_90 or later
// (`kernel_arch`, LoadedKernel::arch: only there do the kernels wait for the preceding grid;
// an NVRTC that cannot target the device compiles for an older architecture, without the
// wait, and a programmatic launch of that kernel could read what the grid before it has not
// yet written), and the driver has cuLaunchKernelEx. The launcher tells the kernel
// (RopeKernelParams::programmatic) and launch_kernel alike.
bool launches_programmatically(const CudaDriverApi& api, bool requested, int compute_capability,
                               int kernel_arch);

// Enqueues `launch` on `stream`. `programmatic` (launches_programmatically's answer): with
// programmatic stream serialization, so that the grid may start while the kernel before it on
// the stream finishes; the kernel must wait for that grid (griddepcontrol.wait) before it
// touches memory. Throws Error(ROPE_JIT_ERROR_CUDA) naming `what` when the driver refuses the
// launch.
void launch_kernel(const CudaDriverApi& api, const KernelLaunch& launch, CUstream stream,
                   bool programmatic, const char* what);

}  // namespace rope_jit
