// From a spec to a loadable binary for one target: the disk cache first, else specialize
// and compile with NVRTC, then store. Knows nothing of devices or contexts, so it also
// serves prewarming on machines without a GPU.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "disk_cache.h"
#include "kernel_spec.h"

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
    bool from_disk = false;
    std::string key_hex;
};

// The cache key: SHA-256 over the cache format version, the templates' digest, the spec's
// canonical JSON, the exact NVRTC options, the NVRTC version and the target.
std::string kernel_cache_key(const KernelSpec& spec, const std::string& target_used,
                             const std::vector<std::string>& options);

// The binary of `spec` for `target` ("sm_90"). `disk` may be NULL (memory-only runtime).
// Throws Error(COMPILE) with the NVRTC log, or Error(BACKEND_UNAVAILABLE) without NVRTC.
KernelBinary build_kernel_binary(const KernelSpec& spec, const std::string& target, const DiskCache* disk,
                                 KernelStats& stats);

}  // namespace rope_jit
