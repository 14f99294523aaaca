#include "jit/kernel_builder.h"

#include <optional>

#include <fmt/format.h>

#include "cache/compile_lock.h"
#include "common/error.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_extra_options.h"
#include "jit/nvrtc_loader.h"
#include "common/sha256.h"
#include "common/stopwatch.h"

namespace rope_jit {

namespace {

// Line info costs nothing at run time and lets compute-sanitizer and profilers name lines.
const std::vector<std::string> kExtraOptions = {"-lineinfo"};

std::optional<CacheEntry> timed_load(const DiskCache& disk, const CacheEntryId& id,
                                     const std::string& spec_json, KernelStats& stats) {
    const Stopwatch stopwatch;
    std::optional<CacheEntry> entry = disk.load(id, &spec_json);
    stats.disk_lookup_microseconds.fetch_add(stopwatch.microseconds(), std::memory_order_relaxed);
    return entry;
}

}  // namespace

std::string kernel_cache_key(const std::string& spec_json, const std::string& target_used,
                             const std::vector<std::string>& options) {
    Sha256 hash;
    auto field = [&](std::string_view text) {
        hash.update(text);
        hash.update(std::string_view("\n", 1));
    };
    field(fmt::format("rope-jit cache format {}", kCacheFormatVersion));
    field(templates_digest());
    field(spec_json);
    for (const std::string& option : options) field(option);
    field("nvrtc " + nvrtc_version_string());
    field(target_used);
    return hash.finish_hex();
}

CompilePlan plan_compile(const std::string& spec_json, const std::string& target,
                         bool environment_options) {
    // The identity (version and architectures) is all a plan needs: a disk hit must not pay
    // for loading NVRTC (jit/nvrtc_identity.h).
    require_nvrtc_identity();
    CompilePlan plan;
    plan.target_used = choose_target(target, nvrtc_supported_archs());
    plan.extra_options = kExtraOptions;
    if (environment_options)
        for (std::string& option : nvrtc_extra_options_for(spec_json))
            plan.extra_options.push_back(std::move(option));
    plan.options = compile_options(plan.target_used, plan.extra_options);
    const bool is_ptx = plan.target_used.rfind("compute_", 0) == 0;
    plan.entry = CacheEntryId{kernel_cache_key(spec_json, plan.target_used, plan.options),
                              nvrtc_version_string(), target, is_ptx ? "ptx" : "cubin"};
    return plan;
}

KernelBinary build_kernel_binary(const KernelRecipe& recipe, const std::string& target,
                                 const DiskCache* disk, KernelStats& stats,
                                 const std::function<void()>& on_miss) {
    const CompilePlan plan = plan_compile(recipe.spec_json, recipe.compile_target(target));
    const CacheEntryId& id = plan.entry;

    KernelBinary binary;
    binary.is_ptx = id.kind == "ptx";
    binary.arch = target_arch(plan.target_used);
    std::optional<CompileLock> lock;  // held from a miss until the entry is stored
    std::optional<CacheEntry> entry;
    if (disk != nullptr) {
        entry = timed_load(*disk, id, recipe.spec_json, stats);
        if (!entry) {
            if (on_miss) on_miss();
            // Another process, or another runtime of this one, may be compiling this very
            // kernel into the same cache: wait for it, then look again, so that each key is
            // compiled once per cache directory (compile_lock.h).
            // The wait also ends when an entry file appears (or another replaces the one
            // load() refused): a peer stored it, whoever holds the lock now.
            const auto refused = disk->entry_file_stamp(id);
            lock.emplace(*disk, id.key_hex, kCompileLockMaxWait, [&] {
                const auto now = disk->entry_file_stamp(id);
                return now && !(refused && *now == *refused);
            });
            entry = timed_load(*disk, id, recipe.spec_json, stats);
        }
    }
    if (disk == nullptr && on_miss) on_miss();
    if (entry) {
        stats.disk_hits.fetch_add(1, std::memory_order_relaxed);
        binary.image = std::move(entry->payload);
        return binary;
    }

    // The plan may rest on the identity memo while the compile loads the real library: should
    // the library report another version or other architectures (nvrtc_loader.cpp), plan again
    // with its values rather than store a kernel under a key that names another NVRTC. Once
    // loaded, the library's values are final, so this recurses at most once.
    require_nvrtc();
    if (plan_compile(recipe.spec_json, recipe.compile_target(target)).entry.key_hex != id.key_hex) {
        lock.reset();
        return build_kernel_binary(recipe, target, disk, stats);
    }
    // target_used is choose_target's fixed point, so NVRTC gets exactly plan.options, the
    // options the key hashed (compile_options builds both).
    CompileResult compiled = compile_cuda(recipe.source(), recipe.template_name, plan.target_used,
                                          plan.extra_options, kernel_headers());
    stats.compiles.fetch_add(1, std::memory_order_relaxed);
    stats.compile_microseconds.fetch_add(uint64_t(compiled.milliseconds * 1000.0),
                                         std::memory_order_relaxed);
    binary.image = std::move(compiled.binary);
    binary.compiled = true;
    if (disk != nullptr && disk->store(id, CacheEntry{recipe.spec_json, binary.image})) {
        stats.disk_writes.fetch_add(1, std::memory_order_relaxed);
        // NVRTC loaded before this store may have found no default root to leave its memo
        // in (a first prewarm makes the root only now): leave it once the root is there.
        if (disk->root() == DiskCache::default_root()) nvrtc_remember_identity(disk->root());
    }
    return binary;
}

}  // namespace rope_jit
