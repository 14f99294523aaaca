#include "jit/kernel_cache.h"

#include <string>

namespace rope_jit {

template <typename Spec, typename SpecHash>
BasicKernelCache<Spec, SpecHash>::BasicKernelCache() {
    snapshots_.push_back(std::make_unique<const Map>());
    snapshot_.store(snapshots_.back().get(), std::memory_order_release);
}

template <typename Spec, typename SpecHash>
BasicKernelCache<Spec, SpecHash>::~BasicKernelCache() = default;

template <typename Spec, typename SpecHash>
LoadedKernel BasicKernelCache<Spec, SpecHash>::find(const Spec& spec, CUcontext context) const noexcept {
    const Map* map = snapshot_.load(std::memory_order_acquire);
    auto it = map->find(Key{spec, context});
    return it == map->end() ? LoadedKernel{} : it->second;
}

template <typename Spec, typename SpecHash>
LoadedKernel BasicKernelCache<Spec, SpecHash>::get_or_build(const Spec& spec, CUcontext context,
                                                            const std::function<LoadedKernel()>& build) {
    if (LoadedKernel hit = find(spec, context); hit.function != nullptr) return hit;
    const Key key{spec, context};
    std::promise<LoadedKernel> promise;
    std::shared_future<LoadedKernel> future;
    bool builder = false;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        const Map* map = snapshot_.load(std::memory_order_acquire);
        if (auto it = map->find(key); it != map->end()) return it->second;
        if (auto it = in_flight_.find(key); it != in_flight_.end()) {
            future = it->second;
        } else {
            future = promise.get_future().share();
            in_flight_.emplace(key, future);
            builder = true;
        }
    }
    if (!builder) return future.get();  // rethrows the builder's exception

    try {
        LoadedKernel kernel = build();
        std::lock_guard<std::mutex> lock(mutex_);
        // Publish a new snapshot; old ones stay alive (readers may hold them) until the
        // cache dies. Specs per process are few, so the copies stay small.
        auto next = std::make_unique<Map>(*snapshot_.load(std::memory_order_acquire));
        next->emplace(key, kernel);
        snapshots_.push_back(std::move(next));
        snapshot_.store(snapshots_.back().get(), std::memory_order_release);
        in_flight_.erase(key);
        promise.set_value(kernel);
        return kernel;
    } catch (...) {
        // A failed build is not cached: the next call tries again (and reports again).
        std::lock_guard<std::mutex> lock(mutex_);
        in_flight_.erase(key);
        promise.set_exception(std::current_exception());
        throw;
    }
}

template <typename Spec, typename SpecHash>
void BasicKernelCache<Spec, SpecHash>::unload_all(const CudaDriverApi& api) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : *snapshot_.load(std::memory_order_acquire)) {
        if (api.cuCtxPushCurrent(entry.first.context) != CUDA_SUCCESS) continue;
        api.cuModuleUnload(entry.second.module);
        CUcontext popped = nullptr;
        api.cuCtxPopCurrent(&popped);
    }
}

LoadedKernel load_kernel_module(const CudaDriverApi& api, const std::vector<char>& image, const char* entry) {
    LoadedKernel kernel;
    check_cu(api.cuModuleLoadData(&kernel.module, image.data()), "cuModuleLoadData");
    const CUresult found = api.cuModuleGetFunction(&kernel.function, kernel.module, entry);
    if (found != CUDA_SUCCESS) {
        api.cuModuleUnload(kernel.module);
        throw_cuda_error(found, (std::string("cuModuleGetFunction(") + entry + ")").c_str());
    }
    return kernel;
}

template class BasicKernelCache<KernelSpec, KernelSpecHash>;
template class BasicKernelCache<AttentionSpec, AttentionSpecHash>;

}  // namespace rope_jit
