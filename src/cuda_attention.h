// The CUDA side of attention: runs a checked AttentionProblem whose tensors live on a GPU. Per
// call it resolves the caller's context through the CUDA backend, chooses the kernels
// (choose_attention_specs), finds each in its memory cache (building it from the disk cache
// or NVRTC on a miss), fills the parameters and launches on the caller's stream. Like the RoPE
// path it never synchronizes, allocates or creates contexts on that path, so calls can be
// captured in CUDA graphs.
#pragma once

#include <string>
#include <vector>

#include "attention_problem.h"
#include "attention_spec.h"
#include "cuda_backend.h"
#include "disk_cache.h"
#include "kernel_builder.h"
#include "kernel_cache.h"

namespace rope_jit {

// What the kernel choice needs of a device: its compute capability, the shared memory a block
// may opt in to, and whether the wgmma forward can run (sm_90, and the loaded NVRTC is 12.0 or
// newer: older ones cannot emit sm_90a).
AttentionDevice attention_device(int compute_capability, int max_shared_bytes);

// The target an attention kernel compiles for on a device whose target is `device_target`:
// that one, except that wgmma kernels exist only on the arch-specific variant (sm_90 -> sm_90a).
std::string attention_target(const AttentionSpec& spec, const std::string& device_target);

// The binary of an attention kernel for a device of `target` ("sm_90"; attention_target picks
// what NVRTC is asked for), through the shared builder (disk cache, NVRTC, the same key scheme
// as RoPE kernels). Needs NVRTC, not a GPU.
KernelBinary build_attention_binary(const AttentionSpec& spec, const std::string& target, const DiskCache* disk,
                                    KernelStats& stats);

class CudaAttention {
public:
    // `backend`, `disk` (may be NULL) and `stats` must outlive this object.
    CudaAttention(CudaBackend& backend, const DiskCache* disk, KernelStats& stats);
    ~CudaAttention();
    CudaAttention(const CudaAttention&) = delete;
    CudaAttention& operator=(const CudaAttention&) = delete;

    // Enqueues the forward or backward (problem.backward) on `stream` (a CUstream; NULL = the
    // legacy default stream).
    void run(const AttentionProblem& problem, void* stream);

private:
    LoadedKernel kernel_for(const AttentionSpec& spec, CUcontext context, int ordinal);

    const CudaDriverApi& api_;
    CudaBackend& backend_;
    const DiskCache* disk_;
    KernelStats& stats_;
    std::vector<AttentionDevice> devices_;
    AttentionKernelCache kernels_;
};

}  // namespace rope_jit
