// The in-memory cache of loaded kernels of every op, keyed by (op, spec, CUDA context):
// modules belong to a context, so each context that runs a spec loads its own. A hit is one
// hash lookup in an immutable snapshot, with no lock. A miss builds the kernel exactly once
// however many threads ask at the same time; different keys build in parallel. The cache
// knows no op: a spec enters as its op's name and its bytes (SpecKey).
#pragma once

#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common/byte_hash.h"
#include "cuda/cuda_driver.h"

namespace rope_jit {

struct LoadedKernel {
    CUmodule module = nullptr;
    CUfunction function = nullptr;         // KernelRecipe::entry
    CUfunction second_function = nullptr;  // KernelRecipe::second_entry, or NULL
    int arch = 0;  // the architecture the module was compiled for (KernelBinary::arch)
};

// A spec of any op as the memory cache's key: the op's name and the spec's bytes. Specs are
// structs of int32 fields without padding, so equal bytes are equal specs; built on the launch
// path, so it is a fixed-size value with no allocation.
class SpecKey {
public:
    static constexpr size_t kMaxOpName = 15;
    static constexpr size_t kMaxSpecBytes = 256;

    template <typename Spec>
    static SpecKey of(const char* op, const Spec& spec) noexcept {
        static_assert(std::has_unique_object_representations_v<Spec>,
                      "compared as plain bytes: no padding");
        static_assert(sizeof(Spec) <= kMaxSpecBytes, "raise SpecKey::kMaxSpecBytes");
        SpecKey key;
        std::strncpy(key.op_, op, kMaxOpName);
        key.size_ = uint32_t(sizeof(Spec));
        std::memcpy(key.bytes_, &spec, sizeof(Spec));
        return key;
    }

    const char* op() const { return op_; }
    bool operator==(const SpecKey& other) const {
        return size_ == other.size_ && std::memcmp(op_, other.op_, sizeof op_) == 0 &&
               std::memcmp(bytes_, other.bytes_, size_) == 0;
    }
    size_t hash() const noexcept {
        return hash_bytes(op_, sizeof op_) ^ (hash_bytes(bytes_, size_) * 31);
    }

private:
    SpecKey() = default;
    char op_[kMaxOpName + 1] = {};
    uint32_t size_ = 0;
    alignas(8) unsigned char bytes_[kMaxSpecBytes];
};

class KernelCache {
public:
    KernelCache();
    ~KernelCache();
    KernelCache(const KernelCache&) = delete;
    KernelCache& operator=(const KernelCache&) = delete;

    // The kernel for (spec, context), or a null LoadedKernel when not cached. Lock-free.
    LoadedKernel find(const SpecKey& spec, CUcontext context) const noexcept;

    // find, else build() once (others asking meanwhile wait for that build and share its
    // result or its exception) and cache the result.
    LoadedKernel get_or_build(const SpecKey& spec, CUcontext context,
                              const std::function<LoadedKernel()>& build);

    // Unloads every cached module in its own context. Best effort, for destructors: at process
    // exit the driver may already be shutting down.
    void unload_all(const CudaDriverApi& api) noexcept;

private:
    struct Key {
        SpecKey spec;
        CUcontext context;
        bool operator==(const Key& other) const {
            return spec == other.spec && context == other.context;
        }
    };
    struct KeyHash {
        size_t operator()(const Key& key) const noexcept {
            return key.spec.hash() ^ (std::hash<const void*>{}(key.context) * 31);
        }
    };
    using Map = std::unordered_map<Key, LoadedKernel, KeyHash>;

    std::atomic<const Map*> snapshot_;
    mutable std::mutex mutex_;                           // writers and the in-flight table
    std::vector<std::unique_ptr<const Map>> snapshots_;  // every snapshot, freed at destruction
    std::unordered_map<Key, std::shared_future<LoadedKernel>, KeyHash> in_flight_;
};

}  // namespace rope_jit
