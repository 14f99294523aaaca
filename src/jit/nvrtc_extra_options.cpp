#include "jit/nvrtc_extra_options.h"

#include <cstdlib>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace rope_jit {

namespace {

constexpr const char* kVariable = "ROPE_JIT_NVRTC_EXTRA_OPTIONS";

std::vector<std::string> words(const std::string& text) {
    std::istringstream stream(text);
    std::vector<std::string> out;
    for (std::string word; stream >> word;) out.push_back(word);
    return out;
}

// Whether the spec's field `name` reads `value`; a spec that is not a JSON object matches no
// condition.
bool field_is(const nlohmann::json& spec, const std::string& name, const std::string& value) {
    if (!spec.is_object()) return false;
    const auto field = spec.find(name);
    if (field == spec.end()) return false;
    return field->is_string() ? field->get<std::string>() == value : field->dump() == value;
}

}  // namespace

std::vector<std::string> nvrtc_extra_options_for(const std::string& spec_json,
                                                 const std::string& rules) {
    std::vector<std::string> options;
    std::optional<nlohmann::json> spec;  // parsed for the first rule with conditions
    size_t start = 0;
    for (size_t rule_index = 0; start <= rules.size(); ++rule_index) {
        size_t end = rules.find(';', start);
        if (end == std::string::npos) end = rules.size();
        const std::string rule = rules.substr(start, end - start);
        start = end + 1;
        if (words(rule).empty()) continue;  // "a;;b", a trailing ';'
        const auto bad = [&](const std::string& why) {
            fail_argument(fmt::format("{}: rule {} ('{}'): {}", kVariable, rule_index + 1, rule,
                                      why));
        };
        const size_t colon = rule.find(':');
        const std::vector<std::string> conditions =
            colon == std::string::npos ? std::vector<std::string>{} : words(rule.substr(0, colon));
        const std::vector<std::string> rule_options =
            words(colon == std::string::npos ? rule : rule.substr(colon + 1));
        if (rule_options.empty()) bad("names no option");
        for (const std::string& option : rule_options)
            if (option[0] != '-') bad(fmt::format("option '{}' does not start with '-'", option));
        bool matches = true;
        for (const std::string& condition : conditions) {
            const size_t equals = condition.find('=');
            if (equals == std::string::npos || equals == 0)
                bad(fmt::format("condition '{}' is not FIELD=VALUE", condition));
            if (!spec)
                spec = nlohmann::json::parse(spec_json, nullptr, /*allow_exceptions=*/false);
            matches = matches && field_is(*spec, condition.substr(0, equals),
                                          condition.substr(equals + 1));
        }
        if (matches) options.insert(options.end(), rule_options.begin(), rule_options.end());
    }
    return options;
}

std::vector<std::string> nvrtc_extra_options_for(const std::string& spec_json) {
    const char* rules = std::getenv(kVariable);
    if (rules == nullptr || *rules == '\0') return {};
    return nvrtc_extra_options_for(spec_json, rules);
}

}  // namespace rope_jit
