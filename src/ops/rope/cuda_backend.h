// The CUDA backend: runs a checked RopeProblem whose tensors live on a GPU. Per call it
// resolves the caller's context (the stream's, else the current one, else the device's
// primary context), finds the kernel for the problem's spec in the memory cache (building
// it from the disk cache or NVRTC on a miss), fills the kernel's parameters and launches on
// the caller's stream. It never synchronizes, allocates or creates contexts on that path,
// so calls can be captured in CUDA graphs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_driver.h"
#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_cache.h"
#include "ops/rope/rope_problem.h"

namespace rope_jit {

// Where a launch runs, and what was current when the call came in.
struct LaunchContext {
    CUcontext context = nullptr;
    CUcontext current = nullptr;
};

// The launch geometry of a rope kernel: blocks of tokens_per_block tokens, `threads` threads
// and `shared_bytes` of dynamic shared memory. heads_k is 0 without k; units = batch * the
// longer of q's and k's sequences; sms = the device's multiprocessors. Throws
// Error(UNSUPPORTED) when one token's shared memory or the grid exceeds a launch.
struct RopeLaunch {
    int64_t blocks = 0, threads = 0;
    unsigned shared_bytes = 0;
    int tokens_per_block = 0;
};
RopeLaunch plan_rope_launch(const KernelSpec& spec, int64_t heads_q, int64_t heads_k, int64_t units,
                            int64_t sms);

class CudaBackend {
public:
    // Throws Error(BACKEND_UNAVAILABLE) without a driver or a device. `disk` may be NULL and
    // must outlive the backend; so must `stats`.
    CudaBackend(const DiskCache* disk, KernelStats& stats, bool debug_checks);
    ~CudaBackend();
    CudaBackend(const CudaBackend&) = delete;
    CudaBackend& operator=(const CudaBackend&) = delete;

    int device_count() const { return int(devices_.size()); }
    // "sm_90" for device `ordinal`.
    const std::string& target(int ordinal) const { return devices_.at(size_t(ordinal))->target; }

    // Enqueues the problem on `stream` (a CUstream; NULL = legacy default stream).
    void rope(const RopeProblem& problem, void* stream);

    // The context a launch on `stream` for device `ordinal` runs in: the stream's (which must
    // belong to that device, else fail_argument); for the NULL stream the current context when
    // it belongs to that device, else the device's primary context. Also returns the current
    // context, for the ContextScope that makes the launch context current. Shared with the
    // attention launcher (cuda_attention.cpp).
    LaunchContext resolve_context(int ordinal, CUstream stream);

private:
    struct Device {
        CUdevice handle = 0;
        std::string target;
        int multiprocessors = 1;
        CUcontext primary = nullptr;  // retained on first use, released at destruction
        std::once_flag primary_once;
    };

    CUcontext primary_context(int ordinal);
    // The ordinal of a device handle; -1 for one the runtime does not know.
    int ordinal_of(CUdevice device) const;
    LoadedKernel kernel_for(const KernelSpec& spec, CUcontext context, int ordinal);
    void check_positions_on_device(const RopeProblem& problem, CUstream stream);

    const CudaDriverApi& api_;
    const DiskCache* disk_;
    KernelStats& stats_;
    bool debug_checks_;
    std::vector<std::unique_ptr<Device>> devices_;
    KernelCache kernels_;
};

}  // namespace rope_jit
