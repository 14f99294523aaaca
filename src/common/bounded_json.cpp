#include "common/bounded_json.h"

#include <algorithm>

namespace rope_jit {

int json_nesting_depth(std::string_view text, int limit) {
    int depth = 0, deepest = 0;
    bool in_string = false, escaped = false;
    for (const char c : text) {
        if (in_string) {
            if (escaped)
                escaped = false;
            else if (c == '\\')
                escaped = true;
            else if (c == '"')
                in_string = false;
            continue;
        }
        if (c == '"')
            in_string = true;
        else if (c == '[' || c == '{')
            deepest = std::max(deepest, ++depth);
        else if (c == ']' || c == '}')
            --depth;
        if (deepest > limit) break;
    }
    return deepest;
}

std::string escaped_json_text(const std::string& text) {
    const std::string quoted =
        nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return quoted.substr(1, quoted.size() - 2);
}

nlohmann::json parse_bounded_json(std::string_view text, std::string* why) {
    nlohmann::json document(nlohmann::json::value_t::discarded);
    if (json_nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth) {
        if (why) *why = "nests deeper than " + std::to_string(kMaxJsonDepth) + " levels";
        return document;
    }
    document = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    if (document.is_discarded() && why) *why = "not valid JSON";
    return document;
}

}  // namespace rope_jit
