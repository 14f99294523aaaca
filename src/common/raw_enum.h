// A C caller may store any integer in an enum field of an argument struct. Reading such a
// field as the C++ enum type is undefined behaviour when the value has no enumerator, so
// fields are validated as the raw integers the caller wrote.
#pragma once

#include <cstring>

namespace rope_jit {

template <typename Enum>
int raw_enum(const Enum& field) {
    static_assert(sizeof(Enum) == sizeof(int), "C enums of this API are int-sized");
    int value;
    std::memcpy(&value, &field, sizeof value);
    return value;
}

}  // namespace rope_jit
