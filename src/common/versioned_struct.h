// Versioned C structs: every public struct starts with struct_size, so that a caller built
// against an older (smaller) or newer (larger) header still passes it safely.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

// The largest struct_size taken: far past any version's struct, and a bound on what a
// garbage size could make an _init write or a call read.
constexpr size_t kMaxStructSize = size_t(1) << 20;

// Throws Error(INVALID_ARGUMENT) naming `name` unless `user`'s struct_size is one some version of
// Struct can have: every version's size is a multiple of its alignment, and any other size
// would cut a field (a pointer, a counter) in two.
template <typename Struct>
size_t checked_struct_size(const Struct* user, const char* name) {
    if (user == nullptr) fail_argument(fmt::format("{}: NULL", name));
    const size_t size = user->struct_size;
    if (size < sizeof(size_t) || size > kMaxStructSize || size % alignof(Struct) != 0)
        fail_argument(
            fmt::format("{}: struct_size is {}; initialize the struct with its _init function "
                        "before setting fields",
                        name, size));
    return size;
}

// Copies a caller's struct into one of this library's size, with defaults for every field
// the caller's (older) struct does not have.
template <typename Struct>
Struct read_versioned(const Struct* user, void (*init)(Struct*), const char* name) {
    Struct args;
    init(&args);
    const size_t size = checked_struct_size(user, name);
    std::memcpy(static_cast<void*>(&args), user, std::min(size, sizeof(Struct)));
    args.struct_size = sizeof(Struct);
    return args;
}

// What rope_jit_X_init_sized writes into a caller's struct of `size` bytes (the size the
// caller was compiled with): this library's defaults (from `init`) up to that size, zeros past
// this library's struct, and struct_size = size, so that a struct of another version is
// filled exactly to its end. A size too small to hold struct_size itself, or past
// kMaxStructSize, writes nothing (the call that reads the struct then names it).
template <typename Struct>
void init_caller_struct(Struct* user, size_t size, void (*init)(Struct*)) {
    if (user == nullptr || size < sizeof(size_t) || size > kMaxStructSize) return;
    Struct defaults;
    init(&defaults);
    std::memset(static_cast<void*>(user), 0, size);
    std::memcpy(static_cast<void*>(user), &defaults, std::min(size, sizeof(Struct)));
    user->struct_size = size;
}

}  // namespace rope_jit
