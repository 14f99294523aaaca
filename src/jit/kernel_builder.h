// From a kernel recipe (jit/kernel_recipe.h) to a loadable binary for one target: the disk
// cache first, else (under a cross-process lock on the key) specialize and compile with NVRTC,
// then store. Knows no op, device or context, so it also serves prewarming on machines
// without a GPU.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "jit/kernel_recipe.h"

namespace rope_jit {

// Counters a runtime exposes through rope_jit_get_stats. Updated with relaxed atomics.
struct KernelStats {
    std::atomic<uint64_t> memory_hits{0};
    std::atomic<uint64_t> disk_hits{0};
    std::atomic<uint64_t> compiles{0};
    std::atomic<uint64_t> compile_microseconds{0};
    std::atomic<uint64_t> disk_writes{0};
    std::atomic<uint64_t> launches{0};
    // Background builds (jit/background_builds.h): finished, failed (swallowed), and refused
    // or dropped (full queue, runtime destroyed first).
    std::atomic<uint64_t> background_builds{0};
    std::atomic<uint64_t> background_failures{0};
    std::atomic<uint64_t> background_dropped{0};
    // Attention calls that ran the kernels without a workspace: its allocation failed.
    std::atomic<uint64_t> attention_workspace_fallbacks{0};
    // Where a first call's time goes besides compiling (summed over the threads that count
    // into these stats): disk cache lookups (hits and misses: read, checks) and module loads
    // (cuModuleLoadData, attributes).
    std::atomic<uint64_t> disk_lookup_microseconds{0};
    std::atomic<uint64_t> module_load_microseconds{0};
};

struct KernelBinary {
    std::vector<char> image;  // cubin, or NUL-terminated PTX
    bool is_ptx = false;
    bool compiled = false;  // NVRTC made it just now (not read from the disk cache)
    // The architecture it was compiled for (target_arch of choose_target's answer): older than
    // the device's where this NVRTC cannot target the device, so that code for newer
    // architectures only (__CUDA_ARCH__ guards) is absent from it.
    int arch = 0;
};

// The cache key: SHA-256 over the cache format version, the templates' digest, the spec's
// canonical JSON (which names its op), the exact NVRTC options, the NVRTC version and the
// target.
std::string kernel_cache_key(const std::string& spec_json, const std::string& target_used,
                             const std::vector<std::string>& options);

// How the spec of `spec_json` compiles for `target` ("sm_90") with the NVRTC whose version and
// architectures nvrtc_loader.h gives (from its identity memo without loading it, when valid): what
// NVRTC is asked for, with which options, and the disk-cache entry that holds the result. Shared by
// building and by cache maintenance, which recomputes it to tell current entries from those
// of another rope-jit build. Throws Error(BACKEND_UNAVAILABLE) without NVRTC and
// choose_target's errors for a bad or unsupported target.
struct CompilePlan {
    std::string target_used;           // "sm_90", or "compute_90" when only PTX is possible
    std::vector<std::string> options;  // every NVRTC option, in order (hashed into the key)
    // The options after the defaults and the architecture: the builder's own ("-lineinfo"),
    // then those ROPE_JIT_NVRTC_EXTRA_OPTIONS gives this spec (jit/nvrtc_extra_options.h).
    std::vector<std::string> extra_options;
    CacheEntryId entry;  // key, NVRTC version, requested target, "cubin"/"ptx"
};
// `environment_options`: with the options ROPE_JIT_NVRTC_EXTRA_OPTIONS gives the kernel (what
// a compile now uses), or without (a build's defaults; cache maintenance judges both).
CompilePlan plan_compile(const std::string& spec_json, const std::string& target,
                         bool environment_options = true);

// The binary of `recipe` for a device of `target` ("sm_90"; recipe.compile_target picks what
// NVRTC is asked for). The recipe's spec is already validated. `disk` may be NULL
// (memory-only runtime). On a disk miss it takes the key's CompileLock (compile_lock.h) and
// looks again before compiling, so processes and runtimes sharing a cache directory compile
// each key once; an entry a peer stored meanwhile counts as a disk hit.
// `on_miss`, when set, is called once on the caller's thread as soon as the disk cache has
// missed (before the compile lock and the compile): background builds queue the kernels the
// caller will want next there, so that they compile side by side with this one. Its
// exceptions propagate (it should throw none).
// Throws Error(COMPILE) with the NVRTC log, Error(BACKEND_UNAVAILABLE) without NVRTC, and the
// recipe's target errors.
KernelBinary build_kernel_binary(const KernelRecipe& recipe, const std::string& target,
                                 const DiskCache* disk, KernelStats& stats,
                                 const std::function<void()>& on_miss = {});

}  // namespace rope_jit
