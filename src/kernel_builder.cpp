#include "kernel_builder.h"

#include <chrono>

#include <fmt/format.h>

#include "error.h"
#include "kernel_source.h"
#include "nvrtc_compiler.h"
#include "nvrtc_loader.h"
#include "sha256.h"

namespace rope_jit {

namespace {

// Line info costs nothing at run time and lets compute-sanitizer and profilers name lines.
const std::vector<std::string> kExtraOptions = {"-lineinfo"};

}  // namespace

std::string kernel_cache_key(const KernelSpec& spec, const std::string& target_used,
                             const std::vector<std::string>& options) {
    Sha256 hash;
    auto field = [&](std::string_view text) {
        hash.update(text);
        hash.update(std::string_view("\n", 1));
    };
    field(fmt::format("rope-jit cache format {}", kCacheFormatVersion));
    field(templates_digest());
    field(spec.to_json());
    for (const std::string& option : options) field(option);
    field("nvrtc " + nvrtc_version_string());
    field(target_used);
    return hash.finish_hex();
}

KernelBinary build_kernel_binary(const KernelSpec& spec, const std::string& target, const DiskCache* disk,
                                 KernelStats& stats) {
    spec.validate();
    if (nvrtc_api() == nullptr)
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE, "NVRTC is not available: " + nvrtc_load_error());
    const std::string target_used = choose_target(target, nvrtc_supported_archs());
    std::vector<std::string> options = default_compile_options();
    options.push_back("--gpu-architecture=" + target_used);
    options.insert(options.end(), kExtraOptions.begin(), kExtraOptions.end());

    KernelBinary binary;
    binary.key_hex = kernel_cache_key(spec, target_used, options);
    binary.is_ptx = target_used.rfind("compute_", 0) == 0;
    const CacheEntryId id{binary.key_hex, nvrtc_version_string(), target, binary.is_ptx ? "ptx" : "cubin"};
    if (disk != nullptr) {
        if (std::optional<CacheEntry> entry = disk->load(id)) {
            stats.disk_hits.fetch_add(1, std::memory_order_relaxed);
            binary.image = std::move(entry->payload);
            binary.from_disk = true;
            return binary;
        }
    }

    const auto start = std::chrono::steady_clock::now();
    CompileResult compiled = compile_cuda(specialize_kernel(spec), "rope.cu", target_used, kExtraOptions, kernel_headers());
    const auto elapsed = std::chrono::steady_clock::now() - start;
    stats.compiles.fetch_add(1, std::memory_order_relaxed);
    stats.compile_microseconds.fetch_add(
        uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(elapsed).count()), std::memory_order_relaxed);
    if (compiled.options != options)
        throw Error(ROPE_JIT_ERROR_INTERNAL, "the compiler used other options than the cache key hashed");
    binary.image = std::move(compiled.binary);
    if (disk != nullptr && disk->store(id, CacheEntry{spec.to_json(), binary.image}))
        stats.disk_writes.fetch_add(1, std::memory_order_relaxed);
    return binary;
}

}  // namespace rope_jit
