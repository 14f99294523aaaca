// The CUDA side of attention: runs a checked AttentionProblem whose tensors live on a GPU. Per
// call it resolves the caller's context through the CUDA backend, chooses the kernels
// (choose_attention_specs, under the ROPE_JIT_ATTENTION_KERNELS override read at creation),
// finds each in its memory cache (building it from the disk cache or NVRTC on a miss), fills
// the parameters and launches on the caller's stream. Like the RoPE path it never
// synchronizes, allocates or creates contexts on that path, so calls can be captured in CUDA
// graphs.
#pragma once

#include <string>
#include <vector>

#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"
#include "ops/rope/cuda_backend.h"
#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_cache.h"

namespace rope_jit {

// The oldest NVRTC (major version) the wgmma forward is chosen with: the one it was validated
// with on a GPU. NVRTC 12 also emits sm_90a, but its ptxas never ran this kernel here, and
// ptxas 13.0 already needed a workaround (Q fragments reloaded every tile).
constexpr int kWgmmaNvrtcMajor = 13;
// Whether an NVRTC of version "MAJOR.MINOR" gets the wgmma forward ("" when not loaded: no).
bool nvrtc_runs_wgmma_forward(const std::string& nvrtc_version);

// What the kernel choice needs of a device: its compute capability, the shared memory a block
// may opt in to, and whether the wgmma forward runs (sm_90 with nvrtc_runs_wgmma_forward).
AttentionDevice attention_device(int compute_capability, int max_shared_bytes);

// The target an attention kernel compiles for on a device whose target is `device_target`:
// that one, except that wgmma kernels exist only on the arch-specific sm_90a (and only for an
// sm_90 device: Error(UNSUPPORTED) otherwise).
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
    // ROPE_JIT_ATTENTION_KERNELS as it was when this object was created.
    const AttentionKernelOverride override_;
    AttentionKernelCache kernels_;
};

}  // namespace rope_jit
