#include "common/bounded_json.h"

#include <algorithm>
#include <set>
#include <vector>

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
    // A key given twice in one object: nlohmann keeps the last value, so {"head_dim": 128,
    // "head_dim": 64} passed as D64 without a word (adversarial pass, session 38). Refused,
    // as a field that cannot be read one way.
    std::vector<std::set<std::string>> open_objects;  // the keys seen in each object open
    std::string duplicate;
    bool found_duplicate = false;
    auto watch_keys = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        using Event = nlohmann::json::parse_event_t;
        if (event == Event::object_start) {
            open_objects.emplace_back();
        } else if (event == Event::object_end) {
            open_objects.pop_back();
        } else if (event == Event::key && !found_duplicate) {
            std::string key = parsed.get<std::string>();
            if (open_objects.back().count(key)) {
                duplicate = std::move(key);
                found_duplicate = true;
            } else {
                open_objects.back().insert(std::move(key));
            }
        }
        return true;
    };
    document = nlohmann::json::parse(text.begin(), text.end(), watch_keys,
                                     /*allow_exceptions=*/false);
    if (document.is_discarded()) {
        if (why) *why = "not valid JSON";
    } else if (found_duplicate) {
        document = nlohmann::json(nlohmann::json::value_t::discarded);
        if (why) *why = "key '" + escaped_json_text(duplicate) + "' given twice in one object";
    }
    return document;
}

}  // namespace rope_jit
