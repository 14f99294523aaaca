#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

namespace rope_jit {

namespace {
bool quiet() {
    const char* value = std::getenv("ROPE_JIT_QUIET");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
}
}  // namespace

void log_warning(const std::string& message) {
    if (quiet()) return;
    std::fprintf(stderr, "rope_jit: warning: %s\n", message.c_str());
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
