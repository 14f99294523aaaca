// The CUDA side of attention: runs a checked AttentionProblem whose tensors live on a GPU. Per
// call it takes the launch context from the device layer (cuda/cuda_devices.h), chooses the
// kernels (choose_attention_specs, under the ROPE_JIT_ATTENTION_KERNELS override read at
// creation), takes each from the kernel loader (cuda/kernel_loader.h),
// fills the parameters and launches on the caller's stream. Like the RoPE
// path it never synchronizes or creates contexts on that path, so calls can be captured in
// CUDA graphs; the sm_90 kernels' workspace is the caller's (rope_jit_attention_args.workspace)
// or else allocated and freed on the stream (cuMemAllocAsync / cuMemFreeAsync), which graphs
// capture too. (The first workspace allocated on a device, outside a capture of the call's
// stream, also touches the memory pool from a second thread on a private stream in relaxed
// capture mode: cuda/memory_pool_warmup.h.)
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_devices.h"
#include "cuda/kernel_loader.h"
#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_recipe.h"
#include "ops/attention/attention_spec.h"
#include "ops/attention/attention_workspace.h"

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

// The recipe of `spec`, a kernel of `problem`; each kernel of a forward that writes lse (which
// only a backward reads: training) names the backward kernels of that problem on `device`
// (with gradients laid out like their tensors) as follow-ups, which the runtime queues for
// background builds as soon as the first of them misses the disk cache
// (jit/background_builds.h).
KernelRecipe attention_recipe_with_backward(const AttentionSpec& spec,
                                            const AttentionProblem& problem,
                                            const AttentionDevice& device);

class CudaAttention {
public:
    // `devices`, `kernels` and `stats` must outlive this object.
    CudaAttention(CudaDevices& devices, KernelLoader& kernels, KernelStats& stats);
    CudaAttention(const CudaAttention&) = delete;
    CudaAttention& operator=(const CudaAttention&) = delete;

    // Enqueues the forward or backward (problem.backward) on `stream` (a CUstream; NULL = the
    // legacy default stream), in problem.workspace when the caller gave one.
    void run(const AttentionProblem& problem, void* stream);
    // The workspace bytes run() needs for `problem` (0: none); calls no driver function.
    size_t workspace_bytes(const AttentionProblem& problem) const;

private:
    // What a call runs: its kernels in launch order and the workspace they need.
    struct Plan {
        std::vector<AttentionSpec> kernels;
        AttentionWorkspaceLayout workspace;  // bytes 0: none
        bool workspace_fallback = false;     // kernels without a workspace in place of some
    };
    // The kernels `problem` runs under the override, and their workspace.
    Plan plan(const AttentionProblem& problem) const;
    // Turns `plan` into the kernels without a workspace (its allocation failed, or
    // "workspace=0" in the override).
    void without_workspace(const AttentionProblem& problem, Plan& plan) const;
    const AttentionDevice& device_of(const AttentionProblem& problem) const {
        return attention_devices_[size_t(problem.device.device_id)];
    }

    CudaDevices& devices_;
    KernelLoader& kernels_;
    KernelStats& stats_;
    std::vector<AttentionDevice> attention_devices_;  // what the kernel choice needs, per ordinal
    // ROPE_JIT_ATTENTION_KERNELS as it was when this object was created.
    const AttentionKernelOverride override_;
    // Per ordinal: whether a call has asked for a workspace there yet (the first one overlaps
    // the memory pool's setup with loading its kernels: cuda/memory_pool_warmup.h).
    std::unique_ptr<std::atomic<bool>[]> pool_used_;
};

}  // namespace rope_jit
