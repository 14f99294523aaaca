#include "jit/kernel_cache.h"

namespace rope_jit {

KernelCache::KernelCache() {
    snapshots_.push_back(std::make_unique<const Map>());
    snapshot_.store(snapshots_.back().get(), std::memory_order_release);
}

KernelCache::~KernelCache() = default;

LoadedKernel KernelCache::find(const SpecKey& spec, CUcontext context) const noexcept {
    const Map* map = snapshot_.load(std::memory_order_acquire);
    auto it = map->find(Key{spec, context});
    return it == map->end() ? LoadedKernel{} : it->second;
}

LoadedKernel KernelCache::get_or_build(const SpecKey& spec, CUcontext context,
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

void KernelCache::unload_all(const CudaDriverApi& api) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : *snapshot_.load(std::memory_order_acquire)) {
        if (api.cuCtxPushCurrent(entry.first.context) != CUDA_SUCCESS) continue;
        api.cuModuleUnload(entry.second.module);
        CUcontext popped = nullptr;
        api.cuCtxPopCurrent(&popped);
    }
}

}  // namespace rope_jit
