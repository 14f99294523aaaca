#include "api/runtime.h"

#include <thread>

#include <fmt/format.h>

#include "api/prewarm_specs.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_recipe.h"
#include "ops/rope/cpu_reference.h"
#include "common/env_switch.h"
#include "common/error.h"
#include "common/log.h"
#include "jit/parallel_builds.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_recipe.h"
#include "common/raw_enum.h"
#include "cuda/kernel_launch.h"
#include "ops/rope/rope_problem.h"
#include "common/versioned_struct.h"

namespace rope_jit {

namespace {

// rope_jit_config.cpu_threads' bound: more threads than any host has cores would only take
// the system's threads from other processes.
constexpr int kMaxCpuThreads = 4096;

// rope_jit_config.programmatic_launch (a rope_jit_programmatic_launch value), unless
// $ROPE_JIT_PROGRAMMATIC_LAUNCH says 1 (on) or 0 (off), so that callers that build no config
// of their own (the Python package's default runtime, the HF drop-in) can choose too.
int programmatic_launch_setting(const rope_jit_config& config) {
    const int setting = config.programmatic_launch;
    if (setting != ROPE_JIT_PROGRAMMATIC_AUTO && setting != ROPE_JIT_PROGRAMMATIC_OFF &&
        setting != ROPE_JIT_PROGRAMMATIC_ON)
        fail_argument(fmt::format(
            "programmatic_launch: expected ROPE_JIT_PROGRAMMATIC_AUTO (-1), _OFF (0) or _ON (1), "
            "got {}",
            setting));
    const std::optional<bool> on = env_switch("ROPE_JIT_PROGRAMMATIC_LAUNCH");
    if (!on) return setting;
    return *on ? ROPE_JIT_PROGRAMMATIC_ON : ROPE_JIT_PROGRAMMATIC_OFF;
}

}  // namespace

Runtime::Runtime(const rope_jit_config& config)
    : cpu_threads_(config.cpu_threads), debug_checks_(config.debug_checks != 0) {
    if (config.cpu_threads < 0 || config.cpu_threads > kMaxCpuThreads)
        fail_argument(fmt::format("cpu_threads: must be 0 (one per hardware thread) to {}, got {}",
                                  kMaxCpuThreads, config.cpu_threads));
    if (config.disk_cache != 0 && config.cache_dir != nullptr && config.cache_dir[0] == '\0')
        fail_argument(
            "cache_dir: empty; pass NULL for the default root, or disk_cache = 0 for no disk "
            "cache");
    const int backend = raw_enum(config.backend);
    if (backend != ROPE_JIT_BACKEND_AUTO && backend != ROPE_JIT_BACKEND_CUDA &&
        backend != ROPE_JIT_BACKEND_CPU)
        fail_argument(fmt::format("backend: unknown value {}", backend));
    if (config.cache_max_bytes < -1)
        fail_argument(fmt::format("cache_max_bytes: must be >= 0, or -1 for the default, got {}",
                                  config.cache_max_bytes));
    const int programmatic_launch = programmatic_launch_setting(config);
    const bool background_builds =
        !background_builds_disabled_by_env() && config.background_builds != 0;
    if (config.disk_cache != 0) {
        const std::string root =
            config.cache_dir ? std::string(config.cache_dir) : DiskCache::default_root();
        const uint64_t max_bytes = config.cache_max_bytes == -1 ? DiskCache::default_max_bytes()
                                                                : uint64_t(config.cache_max_bytes);
        disk_ = std::make_unique<DiskCache>(root, DiskCache::default_read_only_roots(), max_bytes);
    }
    if (backend == ROPE_JIT_BACKEND_CPU) return;
    try {
        devices_ = std::make_unique<CudaDevices>();
        kernels_ = std::make_unique<KernelLoader>(devices_->api(), disk_.get(), stats_);
        rope_cuda_ = std::make_unique<RopeCuda>(
            *devices_, *kernels_, stats_, debug_checks_,
            programmatic_launch_requested(devices_->api(), programmatic_launch));
        attention_cuda_ = std::make_unique<CudaAttention>(*devices_, *kernels_, stats_);
        if (background_builds) {
            // Every core but the caller's (up to 4): the sm_90 attention backward's kernels
            // compile side by side, and beside the forward's compile (build_now).
            BackgroundBuilds::Limits limits;
            limits.threads = background_build_threads(std::thread::hardware_concurrency());
            background_ = std::make_unique<BackgroundBuilds>(disk_.get(), stats_, limits);
            kernels_->set_background_builds(background_.get());
        }
    } catch (const Error& e) {
        // AUTO falls back to the CPU when there is no usable GPU; CUDA insists.
        if (backend == ROPE_JIT_BACKEND_CUDA || e.status() != ROPE_JIT_ERROR_BACKEND_UNAVAILABLE)
            throw;
        background_.reset();
        attention_cuda_.reset();
        rope_cuda_.reset();
        kernels_.reset();
        devices_.reset();
    }
}

Runtime::~Runtime() {
    // Queued background builds are dropped and a running compile is waited for, before the
    // loader, the disk cache and the counters they use go away.
    if (background_) background_->stop();
}

ThreadPool& Runtime::cpu_pool() {
    std::call_once(pool_once_, [this] { pool_ = std::make_unique<ThreadPool>(cpu_threads_); });
    return *pool_;
}

namespace {

// The error for tensors that are not in host memory when the runtime cannot run them there:
// CUDA tensors without a CUDA backend, or a device rope-jit does not support. Returns when
// the tensors are on CUDA and `has_gpu_backend`.
void require_gpu(const DLDevice& device, bool has_gpu_backend) {
    if (device.device_type != kDLCUDA)
        fail_argument(fmt::format("q: lives on {}, which rope-jit cannot reach",
                                  device_name(device.device_type)));
    if (!has_gpu_backend)
        fail_argument(
            fmt::format("q: lives on CUDA device {}, but this runtime runs on the CPU backend "
                        "(no GPU was found, or ROPE_JIT_BACKEND_CPU was requested)",
                        device.device_id));
}

}  // namespace

void Runtime::rope(const rope_jit_rope_args& args) {
    RopeProblem problem = make_rope_problem(args);
    // An empty call still owes its frequency and norm weight gradients (zeros).
    const bool nothing_to_write =
        problem.empty() && !problem.has_freq_grad && !problem.has_norm_weight_grad;
    if (host_accessible(problem.device)) {
        // Its indices are checked even so: whether a call fails does not depend on which of
        // its dimensions are empty.
        check_positions_on_host(problem);
        if (!nothing_to_write) rope_cpu(problem, cpu_pool());
        return;
    }
    if (nothing_to_write) return;
    if (problem.device.device_type == kDLCUDA) {
        require_gpu(problem.device, rope_cuda_ != nullptr);
        rope_cuda_->run(problem, args.stream);
        return;
    }
    require_gpu(problem.device, false);
}

void Runtime::attention(const rope_jit_attention_args& args, bool backward) {
    const AttentionProblem problem = make_attention_problem(args, backward);
    if (host_accessible(problem.device)) {
        if (backward)
            attention_backward_cpu(problem, cpu_pool());
        else
            attention_forward_cpu(problem, cpu_pool());
        return;
    }
    if (problem.device.device_type == kDLCUDA) {
        require_gpu(problem.device, attention_cuda_ != nullptr);
        attention_cuda_->run(problem, args.stream);
        return;
    }
    require_gpu(problem.device, false);
}

size_t Runtime::attention_workspace_size(const rope_jit_attention_args& args, bool backward) {
    // The call's own checks (the workspace fields aside: the size is what they are for).
    rope_jit_attention_args call = args;
    call.workspace = nullptr;
    call.workspace_bytes = 0;
    const AttentionProblem problem = make_attention_problem(call, backward);
    if (host_accessible(problem.device)) return 0;
    require_gpu(problem.device, attention_cuda_ != nullptr);  // or the error the call gives
    return attention_cuda_->workspace_bytes(problem);
}

std::string Runtime::prewarm_target(const char* target) const {
    if (target != nullptr) {
        target_compute_capability(target);  // Error(INVALID_ARGUMENT) for "sm_9", "sm_90x"...
        return target;
    }
    if (devices_) return devices_->target(0);
    throw Error(
        ROPE_JIT_ERROR_BACKEND_UNAVAILABLE,
        "target: NULL asks for the local GPU's architecture, but this runtime has no GPU; name one "
        "(\"sm_90\")");
}

namespace {

// rope_jit.h promises one warning where a prewarm's kernels cannot be stored: without a disk
// cache none can (the disk cache warns of a root it cannot use).
void warn_if_not_kept(const DiskCache* disk, size_t kernels) {
    if (disk == nullptr && kernels > 0)
        log_warning(fmt::format(
            "prewarm: compiled {} kernel(s) that this runtime cannot keep (it has no disk "
            "cache): the calls that need them compile them again",
            kernels));
}

}  // namespace

void Runtime::prewarm_json(const char* specs_json, const char* target) {
    if (specs_json == nullptr) fail_argument("specs_json: NULL");
    const std::string chosen = prewarm_target(target);
    const std::vector<PrewarmKernel> kernels = expand_prewarm_json(specs_json, chosen);
    std::vector<KernelRecipe> recipes;
    for (const PrewarmKernel& kernel : kernels)
        recipes.push_back(kernel.attention ? attention_recipe(kernel.attention_spec)
                                           : rope_recipe(kernel.rope));
    // Every entry checked, then all compiled at once on every core, the slowest first.
    build_binaries_parallel(recipes, chosen, disk_.get(), stats_, 0, {},
                            prewarm_start_order(kernels));
    warn_if_not_kept(disk_.get(), recipes.size());
}

void Runtime::prewarm(const rope_jit_kernel_spec* specs, size_t n, const char* target) {
    if (n > 0 && specs == nullptr) fail_argument("specs: NULL with n > 0");
    const std::string chosen = prewarm_target(target);
    // The array may come from a caller built against another version of the header: its
    // elements lie specs[0].struct_size bytes apart, not sizeof(rope_jit_kernel_spec).
    size_t stride = 0;
    if (n > 0) {
        read_versioned(specs, rope_jit_kernel_spec_init, "specs[0]");  // checks struct_size
        stride = specs[0].struct_size;
    }
    std::vector<KernelRecipe> recipes;
    std::vector<std::string> names;
    for (size_t i = 0; i < n; ++i) {
        const auto* element = reinterpret_cast<const rope_jit_kernel_spec*>(
            reinterpret_cast<const char*>(specs) + i * stride);
        const std::string name = fmt::format("specs[{}]", i);
        if (element->struct_size != stride)
            fail_argument(fmt::format(
                "{}: struct_size is {}, but specs[0]'s is {}; every element of the array "
                "must have the same",
                name, element->struct_size, stride));
        const rope_jit_kernel_spec resolved =
            read_versioned(element, rope_jit_kernel_spec_init, name.c_str());
        try {
            recipes.push_back(rope_recipe(kernel_spec_from_public(resolved)));
        } catch (const Error& e) {
            throw Error(e.status(), fmt::format("{}: {}", name, e.what()));
        }
        names.push_back(name);
    }
    // Every spec checked, then all compiled at once on every core.
    build_binaries_parallel(recipes, chosen, disk_.get(), stats_, 0, names);
    warn_if_not_kept(disk_.get(), recipes.size());
}

}  // namespace rope_jit
