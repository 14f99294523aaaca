// The object behind a rope_jit_runtime handle: the backend chosen at creation, the CPU
// worker pool (started on first use) and, on the CUDA backend, the kernel cache. Each public
// operation enters here after the C API shim has read the caller's structs.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "rope_jit/rope_jit.h"
#include "thread_pool.h"

namespace rope_jit {

class Runtime {
public:
    // Throws Error(BACKEND_UNAVAILABLE) when config asks for CUDA and there is none.
    explicit Runtime(const rope_jit_config& config);

    rope_jit_backend_kind backend() const { return backend_; }
    void rope(const rope_jit_rope_args& args);

private:
    ThreadPool& cpu_pool();

    rope_jit_backend_kind backend_ = ROPE_JIT_BACKEND_CPU;
    int cpu_threads_ = 0;
    bool debug_checks_ = false;
    std::string cache_dir_;
    bool disk_cache_ = true;
    std::once_flag pool_once_;
    std::unique_ptr<ThreadPool> pool_;
};

}  // namespace rope_jit
