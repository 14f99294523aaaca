#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

namespace rope_jit {

namespace {
void print_warning(const std::string& message) {
    std::fprintf(stderr, "rope_jit: warning: %s\n", message.c_str());
}

// A warning never fails a call, so a bad ROPE_JIT_QUIET is not an error: warnings stay on
// (silencing on a guess could hide a damaged cache) and the value is reported once.
bool quiet() {
    if (read_env_switch("ROPE_JIT_QUIET") == EnvSwitch::invalid) {
        static std::atomic<bool> reported{false};
        if (!reported.exchange(true)) {
            print_warning(env_switch_error("ROPE_JIT_QUIET") + "; warnings stay on");
        }
    }
    return warnings_silenced();
}
}  // namespace

void log_warning(const std::string& message) {
    if (quiet()) return;
    print_warning(message);
}

void log_warning_once(const std::string& key, const std::string& message) {
    static std::mutex mutex;
    static std::set<std::string> seen;
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!seen.insert(key).second) return;
    }
    log_warning(message);
}

}  // namespace rope_jit
