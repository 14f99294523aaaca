// The one path from a spec of any op to a kernel function loaded in a CUDA context: the memory
// cache (jit/kernel_cache.h) on a hit, else the op's recipe built through the disk cache or
// NVRTC (jit/kernel_builder.h), loaded as a module of the context and cached. Counts memory
// hits here and disk hits and compiles in the builder. Owned by the runtime and shared by
// every launcher; unloads its modules when it dies, so it must die before the contexts do.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cache/disk_cache.h"
#include "jit/background_builds.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_cache.h"
#include "jit/kernel_recipe.h"

namespace rope_jit {

// Loads a cubin or PTX image as a module of the current context and finds its entry point
// (and `second_entry`, unless empty), opting them in to `dynamic_shared_bytes` above the default
// 48 KiB; on failure unloads the module and throws Error(ROPE_JIT_ERROR_CUDA) naming the entry.
LoadedKernel load_kernel_module(const CudaDriverApi& api, const std::vector<char>& image,
                                const std::string& entry, int dynamic_shared_bytes = 0,
                                const std::string& second_entry = "");

class KernelLoader {
public:
    // `disk` (may be NULL) and `stats` must outlive the loader.
    KernelLoader(const CudaDriverApi& api, const DiskCache* disk, KernelStats& stats);
    ~KernelLoader();
    KernelLoader(const KernelLoader&) = delete;
    KernelLoader& operator=(const KernelLoader&) = delete;

    // The kernel of `spec` in `context`, which the caller made current, for a device of
    // `target` ("sm_90"). On a memory miss, make_recipe() (called only then) gives the op's
    // recipe, built once however many threads ask. Throws the builder's and the driver's errors.
    template <typename MakeRecipe>
    LoadedKernel kernel_for(const SpecKey& spec, CUcontext context, const std::string& target,
                            MakeRecipe&& make_recipe) {
        if (LoadedKernel hit = kernels_.find(spec, context); hit.function != nullptr) {
            stats_.memory_hits.fetch_add(1, std::memory_order_relaxed);
            return hit;
        }
        return build(spec, context, target,
                     std::function<KernelRecipe()>(std::forward<MakeRecipe>(make_recipe)));
    }

    // Where a miss builds (BackgroundBuilds::build_now: a binary built in the background
    // first; a compiled recipe's follow-ups queued), or NULL (the default): the builder alone.
    // Set before any call; must outlive the loader's use of it; must share its disk and
    // stats.
    void set_background_builds(BackgroundBuilds* background) { background_ = background; }

private:
    LoadedKernel build(const SpecKey& spec, CUcontext context, const std::string& target,
                       const std::function<KernelRecipe()>& make_recipe);

    const CudaDriverApi& api_;
    const DiskCache* disk_;
    KernelStats& stats_;
    BackgroundBuilds* background_ = nullptr;
    KernelCache kernels_;
};

}  // namespace rope_jit
