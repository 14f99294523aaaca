// The object behind a rope_jit_runtime handle: the backend chosen at creation, the disk
// cache, the kernel counters, with a GPU the CUDA layer (devices, the kernel loader shared by
// every op, one launcher per op) and the CPU worker pool (started on first use). Each public
// operation enters here after the C API shim has read the caller's structs.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "cache/disk_cache.h"
#include "cuda/cuda_devices.h"
#include "cuda/kernel_loader.h"
#include "jit/background_builds.h"
#include "jit/kernel_builder.h"
#include "ops/attention/cuda_attention.h"
#include "ops/rope/rope_cuda.h"
#include "rope_jit/rope_jit.h"
#include "common/thread_pool.h"

namespace rope_jit {

class Runtime {
public:
    // Throws Error(BACKEND_UNAVAILABLE) when config asks for CUDA and there is none.
    explicit Runtime(const rope_jit_config& config);
    ~Runtime();

    rope_jit_backend_kind backend() const {
        return devices_ ? ROPE_JIT_BACKEND_CUDA : ROPE_JIT_BACKEND_CPU;
    }
    void rope(const rope_jit_rope_args& args);
    // Attention with rotary fused in: the forward, or (backward) the gradients.
    void attention(const rope_jit_attention_args& args, bool backward);
    // The workspace bytes that call needs (rope_jit_attention_workspace_size): 0 on the CPU.
    size_t attention_workspace_size(const rope_jit_attention_args& args, bool backward);
    void prewarm(const rope_jit_kernel_spec* specs, size_t n, const char* target);
    // Specs as JSON text (api/prewarm_specs.h), for every op.
    void prewarm_json(const char* specs_json, const char* target);
    const KernelStats& stats() const { return stats_; }
    // For diagnostics and cache maintenance: the disk cache (nullptr when memory-only) and
    // the CUDA devices (nullptr on the CPU backend).
    const DiskCache* disk_cache() const { return disk_.get(); }
    const CudaDevices* cuda() const { return devices_.get(); }
    // The background builds, NULL when off (tests and benchmarks wait on it).
    BackgroundBuilds* background_builds() { return background_.get(); }

private:
    ThreadPool& cpu_pool();
    // `target`, or the local GPU's for NULL (Error(BACKEND_UNAVAILABLE) without one).
    std::string prewarm_target(const char* target) const;

    int cpu_threads_ = 0;
    bool debug_checks_ = false;
    std::unique_ptr<DiskCache> disk_;  // NULL: memory-only
    KernelStats stats_;
    // The CUDA layer, all NULL on the CPU backend. Declared in this order so that the
    // launchers die first, then the loader (which unloads its modules in their contexts),
    // then the devices (which release their primary contexts).
    std::unique_ptr<CudaDevices> devices_;
    std::unique_ptr<KernelLoader> kernels_;
    std::unique_ptr<RopeCuda> rope_cuda_;
    std::unique_ptr<CudaAttention> attention_cuda_;
    // Builds a compiled forward's backward kernels (jit/background_builds.h); NULL when off or
    // on the CPU backend. Dies first (~Runtime stops it): its jobs use disk_ and stats_.
    std::unique_ptr<BackgroundBuilds> background_;
    std::once_flag pool_once_;
    std::unique_ptr<ThreadPool> pool_;
};

}  // namespace rope_jit
