// From a spec to a loadable binary for one target: the disk cache first, else (under a
// cross-process lock on the key) specialize and compile with NVRTC, then store. Knows nothing of devices or contexts, so it also
// serves prewarming on machines without a GPU.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "ops/rope/kernel_spec.h"

namespace rope_jit {

// Counters a runtime exposes through rope_jit_get_stats. Updated with relaxed atomics.
struct KernelStats {
    std::atomic<uint64_t> memory_hits{0};
    std::atomic<uint64_t> disk_hits{0};
    std::atomic<uint64_t> compiles{0};
    std::atomic<uint64_t> compile_microseconds{0};
    std::atomic<uint64_t> disk_writes{0};
    std::atomic<uint64_t> launches{0};
};

struct KernelBinary {
    std::vector<char> image;  // cubin, or NUL-terminated PTX
    bool is_ptx = false;
};

// The cache key: SHA-256 over the cache format version, the templates' digest, the spec's
// canonical JSON (which names its op), the exact NVRTC options, the NVRTC version and the
// target.
std::string kernel_cache_key(const std::string& spec_json, const std::string& target_used,
                             const std::vector<std::string>& options);

// How `spec` compiles for a requested `target` ("sm_90") with the loaded NVRTC: what NVRTC
// is asked for, with which options, and the disk-cache entry that holds the result. Shared by
// building and by cache maintenance, which recomputes it to tell current entries from those
// of another rope-jit build. Throws Error(BACKEND_UNAVAILABLE) without NVRTC and
// choose_target's errors for a bad or unsupported target.
struct CompilePlan {
    std::string target_used;           // "sm_90", or "compute_90" when only PTX is possible
    std::vector<std::string> options;  // every NVRTC option, in order (hashed into the key)
    CacheEntryId entry;                // key, NVRTC version, requested target, "cubin"/"ptx"
};
CompilePlan plan_compile(const KernelSpec& spec, const std::string& target);
CompilePlan plan_compile(const std::string& spec_json, const std::string& target);

// The binary of `spec` for `target` ("sm_90"). `disk` may be NULL (memory-only runtime).
// On a disk miss it takes the key's CompileLock (compile_lock.h) and looks again before
// compiling, so processes and runtimes sharing a cache directory compile each key once; an
// entry a peer stored meanwhile counts as a disk hit.
// Throws Error(COMPILE) with the NVRTC log, or Error(BACKEND_UNAVAILABLE) without NVRTC.
KernelBinary build_kernel_binary(const KernelSpec& spec, const std::string& target, const DiskCache* disk,
                                 KernelStats& stats);

// What the builder needs of a kernel of any op (RoPE, attention): the spec's canonical JSON
// (hashed into the cache key, stored in the entry), the template it specializes (its name in
// NVRTC's diagnostics) and a maker of the specialized source, called only on a cache miss.
struct KernelRecipe {
    std::string spec_json;
    std::string program_name;
    std::function<std::string()> source;
};
// build_kernel_binary for any op; the spec is already validated.
KernelBinary build_kernel_binary(const KernelRecipe& recipe, const std::string& target, const DiskCache* disk,
                                 KernelStats& stats);

}  // namespace rope_jit
