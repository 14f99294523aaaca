#include "runtime.h"

#include <fmt/format.h>

#include "cpu_reference.h"
#include "error.h"
#include "rope_problem.h"

namespace rope_jit {

Runtime::Runtime(const rope_jit_config& config)
    : cpu_threads_(config.cpu_threads),
      debug_checks_(config.debug_checks != 0),
      cache_dir_(config.cache_dir ? config.cache_dir : ""),
      disk_cache_(config.disk_cache != 0) {
    switch (config.backend) {
        case ROPE_JIT_BACKEND_AUTO:
        case ROPE_JIT_BACKEND_CPU:
            backend_ = ROPE_JIT_BACKEND_CPU;
            break;
        case ROPE_JIT_BACKEND_CUDA:
            throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE,
                        "backend: ROPE_JIT_BACKEND_CUDA requested, but this build has no CUDA backend yet");
        default:
            fail_argument(fmt::format("backend: unknown value {}", int(config.backend)));
    }
    if (config.cpu_threads < 0)
        fail_argument(fmt::format("cpu_threads: must be >= 0 (0 = one per hardware thread), got {}",
                                  config.cpu_threads));
}

ThreadPool& Runtime::cpu_pool() {
    std::call_once(pool_once_, [this] { pool_ = std::make_unique<ThreadPool>(cpu_threads_); });
    return *pool_;
}

void Runtime::rope(const rope_jit_rope_args& args) {
    RopeProblem problem = make_rope_problem(args);
    if (host_accessible(problem.device)) {
        check_positions_on_host(problem);
        rope_cpu(problem, cpu_pool());
        return;
    }
    if (problem.device.device_type == kDLCUDA && backend_ == ROPE_JIT_BACKEND_CPU)
        fail_argument(fmt::format("q: lives on CUDA device {}, but this runtime runs on the CPU backend "
                                  "(no GPU was found, or ROPE_JIT_BACKEND_CPU was requested)",
                                  problem.device.device_id));
    fail_argument(fmt::format("q: lives on {}, which rope-jit cannot reach", device_name(problem.device.device_type)));
}

}  // namespace rope_jit
