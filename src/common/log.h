// Warnings go to stderr with a "rope_jit: warning:" prefix. They never fail a call: they
// report a degraded mode (an unusable cache directory, a corrupt entry set aside).
// ROPE_JIT_QUIET=1 silences them; 0 or unset keeps them; any other value keeps them and is
// reported once.
#pragma once

#include <string>

#include "common/env_switch.h"

namespace rope_jit {

// Whether ROPE_JIT_QUIET silences warnings (only 1 does): the one rule, also for a tool whose
// output points at a warning.
inline bool warnings_silenced() { return read_env_switch("ROPE_JIT_QUIET") == EnvSwitch::on; }

void log_warning(const std::string& message);

// Prints a warning only the first time `key` is seen in this process (e.g. one warning per
// unusable cache root, however many calls hit it).
void log_warning_once(const std::string& key, const std::string& message);

}  // namespace rope_jit
