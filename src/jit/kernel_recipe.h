// What the JIT core needs of a kernel of any op (RoPE, attention, the ones to come): the op's
// folder turns its spec into a recipe, and the builder, the disk cache, the memory cache and
// the loader work from recipes alone, so they include no op header.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace rope_jit {

struct KernelRecipe {
    // The spec's canonical JSON, naming its op ("op": "rope"): hashed into the disk-cache key
    // and stored in the entry, where cache maintenance reads it back (ops/op_registry.h).
    std::string spec_json;
    // The embedded template the source specializes ("rope.cu"), and its name in diagnostics.
    std::string template_name;
    // The module's extern "C" entry ("rope_kernel"), and a second one or empty: another path
    // of the op compiled as a function of its own, so that its registers are allocated for it
    // alone ("rope_direct_kernel"); the launcher picks one per call (LoadedKernel).
    std::string entry;
    std::string second_entry;
    // The specialized source (specialize_template), made only on a cache miss.
    std::function<std::string()> source;
    // The target to compile for on a device of target `device_target` ("sm_90"); empty: that
    // target itself. Attention's wgmma kernels need the arch-specific "sm_90a". May throw
    // Error(UNSUPPORTED) for a device the kernel cannot run on.
    std::function<std::string(const std::string& device_target)> target;
    // Dynamic shared memory a launch takes; above the default 48 KiB, loading the module opts
    // the function in to it.
    int dynamic_shared_bytes = 0;
    // The kernels a caller almost surely asks for next (a forward's backward kernels), or
    // empty. Called on the caller's thread when this recipe misses the disk cache, before its
    // compile starts (a hit at the first look calls nothing; one found after waiting for
    // another compile of it does); the runtime builds what it returns in the background
    // (jit/background_builds.h). The recipes it returns must own everything they use.
    std::function<std::vector<KernelRecipe>()> follow_ups;

    std::string compile_target(const std::string& device_target) const {
        return target ? target(device_target) : device_target;
    }
};

}  // namespace rope_jit
