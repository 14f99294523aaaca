// An on/off switch in the environment: 1 (on), 0 (off), or unset or empty (no say). Any other
// value is an error naming the variable, never read as one of the two ("off" was read as on).
#pragma once

#include <cstdlib>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

// true for 1, false for 0, nullopt when `name` is unset or empty; throws INVALID_ARGUMENT
// naming it for any other value.
inline std::optional<bool> env_switch(const char* name) {
    const char* value = std::getenv(name);
    if (value == nullptr || value[0] == '\0') return std::nullopt;
    if (std::strcmp(value, "1") == 0) return true;
    if (std::strcmp(value, "0") == 0) return false;
    fail_argument(fmt::format("{}: expected 0 or 1, got '{}'", name, value));
}

}  // namespace rope_jit
