// The in-memory cache of loaded kernels, keyed by (spec, CUDA context): modules belong to a
// context, so each context that runs a spec loads its own. A hit is one hash lookup in an
// immutable snapshot, with no lock. A miss builds the kernel exactly once however many
// threads ask at the same time; different keys build in parallel. One cache per spec type:
// KernelCache for RoPE specs, AttentionKernelCache for attention specs.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ops/attention/attention_spec.h"
#include "cuda/cuda_driver.h"
#include "ops/rope/kernel_spec.h"

namespace rope_jit {

struct LoadedKernel {
    CUmodule module = nullptr;
    CUfunction function = nullptr;
};

// Loads a cubin or PTX image as a module of the current context and finds its entry point;
// on failure unloads the module and throws Error(ROPE_JIT_ERROR_CUDA) naming `entry`.
LoadedKernel load_kernel_module(const CudaDriverApi& api, const std::vector<char>& image, const char* entry);

template <typename Spec, typename SpecHash>
class BasicKernelCache {
public:
    BasicKernelCache();
    ~BasicKernelCache();
    BasicKernelCache(const BasicKernelCache&) = delete;
    BasicKernelCache& operator=(const BasicKernelCache&) = delete;

    // The kernel for (spec, context), or a null LoadedKernel when not cached. Lock-free.
    LoadedKernel find(const Spec& spec, CUcontext context) const noexcept;

    // find, else build() once (others asking meanwhile wait for that build and share its
    // result or its exception) and cache the result.
    LoadedKernel get_or_build(const Spec& spec, CUcontext context, const std::function<LoadedKernel()>& build);

    // Unloads every cached module in its own context. Best effort, for destructors: at process
    // exit the driver may already be shutting down.
    void unload_all(const CudaDriverApi& api) noexcept;

private:
    struct Key {
        Spec spec;
        CUcontext context;
        bool operator==(const Key& other) const { return spec == other.spec && context == other.context; }
    };
    struct KeyHash {
        size_t operator()(const Key& key) const noexcept {
            return SpecHash{}(key.spec) ^ (std::hash<const void*>{}(key.context) * 31);
        }
    };
    using Map = std::unordered_map<Key, LoadedKernel, KeyHash>;

    std::atomic<const Map*> snapshot_;
    mutable std::mutex mutex_;                        // writers and the in-flight table
    std::vector<std::unique_ptr<const Map>> snapshots_;  // every snapshot, freed at destruction
    std::unordered_map<Key, std::shared_future<LoadedKernel>, KeyHash> in_flight_;
};

using KernelCache = BasicKernelCache<KernelSpec, KernelSpecHash>;
using AttentionKernelCache = BasicKernelCache<AttentionSpec, AttentionSpecHash>;

}  // namespace rope_jit
