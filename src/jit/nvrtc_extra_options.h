// NVRTC options chosen per kernel from the environment, so that options which trade code for
// compile time (--Ofast-compile=min|mid: 1.5-3x faster attention compiles, different SASS)
// can be A/B-tested on a GPU without rebuilding the library. Off unless set.
//
//   ROPE_JIT_NVRTC_EXTRA_OPTIONS="RULE[;RULE...]"   RULE = [FIELD=VALUE ... :] OPTION ...
//
// A rule's conditions compare top-level fields of the kernel's canonical spec JSON (what
// `rope-jit-cache list --json` prints): a string field equals VALUE, any other field's JSON
// text equals VALUE ("true", "128"). A rule without conditions applies to every kernel. Every
// matching rule's options are added, in order, after the library's own. For example
//   "op=attention kind=backward-wgmma: --Ofast-compile=min; op=rope: --Ofast-compile=mid"
// The options are part of the cache key (kernel_builder.h), so entries built with and without
// them never mix; cache maintenance keeps entries built with the library's defaults and with
// the options the variable gives now (run without it, it reports A/B entries as stale).
#pragma once

#include <string>
#include <vector>

namespace rope_jit {

// The options ROPE_JIT_NVRTC_EXTRA_OPTIONS gives the kernel of `spec_json`, read now; empty
// when unset. Throws Error(INVALID_ARGUMENT) naming the variable for a malformed value (an
// option not starting with '-', a condition without '=', a rule with no option).
std::vector<std::string> nvrtc_extra_options_for(const std::string& spec_json);

// The same for an explicit `rules` text (tests).
std::vector<std::string> nvrtc_extra_options_for(const std::string& spec_json,
                                                 const std::string& rules);

}  // namespace rope_jit
