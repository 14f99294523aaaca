// The one way internal code reports a failure: throw rope_jit::Error with the status the C API
// returns and a message naming what was wrong. The C API shim (c_api.cpp) catches it, stores
// the message for rope_jit_last_error() and returns the status; nothing escapes the API.
#pragma once

#include <stdexcept>
#include <string>

#include "rope_jit/rope_jit.h"

namespace rope_jit {

class Error : public std::runtime_error {
public:
    Error(rope_jit_status status, const std::string& message)
        : std::runtime_error(message), status_(status) {}
    rope_jit_status status() const noexcept { return status_; }

private:
    rope_jit_status status_;
};

// Shorthand for the most common failure: a bad argument, named in the message.
[[noreturn]] inline void fail_argument(const std::string& message) {
    throw Error(ROPE_JIT_ERROR_INVALID_ARGUMENT, message);
}

}  // namespace rope_jit
