// A fast non-cryptographic hash of an object's bytes, for the in-memory kernel caches: their
// keys (KernelSpec, AttentionSpec) are structs of int32 fields with no padding, compared and
// hashed as plain bytes on the launch path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace rope_jit {

// FNV-1a over 8-byte words (one multiply per word, not per byte), then the 4-byte tail.
inline size_t hash_bytes(const void* data, size_t size) noexcept {
    const unsigned char* bytes = static_cast<const unsigned char*>(data);
    uint64_t hash = 1469598103934665603ull;
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
        uint64_t word;
        std::memcpy(&word, bytes + i, 8);
        hash = (hash ^ word) * 1099511628211ull;
    }
    for (; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    return size_t(hash ^ (hash >> 32));
}

}  // namespace rope_jit
