// Versioned C structs: every public struct starts with struct_size, so that a caller built
// against an older (smaller) or newer (larger) header still passes it safely.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

// Copies a caller's struct into one of this library's size, with defaults for every field
// the caller's (older) struct does not have.
template <typename Struct>
Struct read_versioned(const Struct* user, void (*init)(Struct*), const char* name) {
    Struct args;
    init(&args);
    if (user == nullptr) fail_argument(fmt::format("{}: NULL", name));
    const size_t size = user->struct_size;
    // Every version of a struct has a size that is a multiple of its alignment; any other
    // size would cut a field (a pointer) in two.
    if (size < sizeof(size_t) || size > (size_t(1) << 20) || size % alignof(Struct) != 0)
        fail_argument(
            fmt::format("{}: struct_size is {}; initialize the struct with its _init function "
                        "before setting fields",
                        name, size));
    std::memcpy(static_cast<void*>(&args), user, std::min(size, sizeof(Struct)));
    args.struct_size = sizeof(Struct);
    return args;
}

}  // namespace rope_jit
