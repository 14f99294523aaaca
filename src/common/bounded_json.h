// JSON text from outside the library (prewarm specs and manifests, cache entries' stored specs,
// the NVRTC memo) parsed with a bound on its nesting. nlohmann parses deep input without
// recursing, but dump() recurses, and the errors that quote a value call it: a 200 KB
// "[[[[...]]]]" given to rope_jit_prewarm_json, or stored as a cache entry's spec, overflowed
// the stack of the process (and of every `rope-jit-cache verify` that read the entry).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace rope_jit {

// The deepest nesting any document takes: a manifest of spec objects holding lists of values
// is 3 levels deep.
constexpr int kMaxJsonDepth = 16;

// The deepest nesting of [ and { outside strings in `text`; counting stops past `limit`.
int json_nesting_depth(std::string_view text, int limit);

// `text` as a JSON string would hold it, without the quotes ("a\u0000b\n"): for messages
// that quote a key, where a NUL would cut the C API's message and a newline break its line.
std::string escaped_json_text(const std::string& text);

// `text` parsed, or a discarded value where it is not JSON, nests deeper than kMaxJsonDepth or
// gives a key twice in one object, with the reason in *why ("not valid JSON: " and where and
// why the parser stopped, "nests deeper than 16 levels", "key 'x' given twice in one object")
// when why is not NULL.
nlohmann::json parse_bounded_json(std::string_view text, std::string* why = nullptr);

}  // namespace rope_jit
