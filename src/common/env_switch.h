// An on/off switch in the environment: 1 (on), 0 (off), or unset or empty (no say). Any other
// value is a mistake, never read as one of the two ("off" and "false" were read as on).
#pragma once

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

enum class EnvSwitch { unset, on, off, invalid };

// What `name` says, without judging a bad value: callers that must not fail (warnings) read
// this; the rest call env_switch.
inline EnvSwitch read_env_switch(const char* name) {
    const char* value = std::getenv(name);
    if (value == nullptr || value[0] == '\0') return EnvSwitch::unset;
    if (std::strcmp(value, "1") == 0) return EnvSwitch::on;
    if (std::strcmp(value, "0") == 0) return EnvSwitch::off;
    return EnvSwitch::invalid;
}

// The message for a value other than 0 or 1.
inline std::string env_switch_error(const char* name) {
    const char* value = std::getenv(name);
    return fmt::format("{}: expected 0 or 1, got '{}'", name, value != nullptr ? value : "");
}

// true for 1, false for 0, nullopt when `name` is unset or empty; throws INVALID_ARGUMENT
// naming it for any other value.
inline std::optional<bool> env_switch(const char* name) {
    switch (read_env_switch(name)) {
        case EnvSwitch::unset: return std::nullopt;
        case EnvSwitch::on: return true;
        case EnvSwitch::off: return false;
        case EnvSwitch::invalid: break;
    }
    fail_argument(env_switch_error(name));
}

}  // namespace rope_jit
