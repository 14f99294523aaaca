// The machinery behind each op's spec field table (ROPE_JIT_ROPE_SPEC_FIELDS,
// ROPE_JIT_ATTENTION_SPEC_FIELDS): a row per int32 member with its JSON key, its values
// (integers, booleans, or a vocabulary of names stored as their index), its range and the
// template's constexpr name. Each op's spec turns its X-macro into an array of SpecField and
// walks it for the preamble, JSON in and out and range checks, so a new field is one line.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"

namespace rope_jit {

// What values a field takes.
struct SpecValues {
    enum Kind { integer, boolean, named } kind;
    const char* const* names = nullptr;  // names[i] is stored as i
    int count = 0;
    bool constant_is_bool = false;  // the preamble writes `constexpr bool`
    // The preamble writes an enumerator (`enum : bool { NAME = false };`) instead of a
    // constexpr variable. NVRTC emits every namespace-scope constexpr variable as a global of
    // the module and no enumerator, so a field added this way leaves the PTX of the specs
    // that existed before it (which keep its default) unchanged.
    bool constant_is_enumerator = false;
};

// Whether a JSON object (a manifest entry) may leave the field out: PLAIN fields take the
// struct's default, DERIVED ones a value computed from the others, REQUIRED ones must be there.
enum class SpecPresence { Plain, Derived, Required };

template <typename Spec>
struct SpecField {
    int32_t Spec::*member;
    const char* member_name;
    const char* key;  // JSON key; nullptr: set through a composite key of the op
    const SpecValues* values;
    int64_t min, max;
    const char* constant;  // the template's constexpr; nullptr: none
    SpecPresence presence;
    const char* name() const { return key != nullptr ? key : member_name; }
};

// "a, b, c".
inline std::string spec_value_names(const SpecValues& values) {
    std::string text;
    for (int i = 0; i < values.count; ++i) text += std::string(i ? ", " : "") + values.names[i];
    return text;
}

// The JSON of a stored value.
inline nlohmann::json spec_value_json(const SpecValues& values, int32_t value) {
    switch (values.kind) {
        case SpecValues::boolean: return bool(value);
        case SpecValues::named:
            return value >= 0 && value < values.count ? nlohmann::json(values.names[value])
                                                      : nlohmann::json(value);
        case SpecValues::integer: break;
    }
    return value;
}

// One JSON value of field `key` as the stored integer; throws std::runtime_error naming the
// field for a wrong type, an unknown name or a number outside [min, max].
inline int32_t spec_parse_value(const char* key, const SpecValues& values, int64_t min, int64_t max,
                                const nlohmann::json& value) {
    switch (values.kind) {
        case SpecValues::boolean:
            if (!value.is_boolean())
                throw std::runtime_error(
                    fmt::format("{}: expected true or false, got {}", key, value.dump()));
            return value.get<bool>() ? 1 : 0;
        case SpecValues::named:
            if (value.is_string())
                for (int i = 0; i < values.count; ++i)
                    if (value.get<std::string>() == values.names[i]) return i;
            throw std::runtime_error(fmt::format("{}: expected one of {}, got {}", key,
                                                 spec_value_names(values), value.dump()));
        case SpecValues::integer: break;
    }
    if (!value.is_number_integer())
        throw std::runtime_error(fmt::format("{}: expected an integer, got {}", key, value.dump()));
    // An unsigned value above INT64_MAX is simply out of range.
    const bool huge = value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX);
    const int64_t number = huge ? INT64_MAX : value.get<int64_t>();
    if (number < min || number > max)
        throw std::runtime_error(
            fmt::format("{}: must be in [{}, {}], got {}", key, min, max, value.dump()));
    return int32_t(number);
}

// The preamble lines of the fields that have a constexpr name.
template <typename Spec, size_t N>
std::string spec_constants(const Spec& spec, const SpecField<Spec> (&fields)[N]) {
    std::string text;
    for (const SpecField<Spec>& f : fields) {
        if (f.constant == nullptr) continue;
        const int32_t value = spec.*f.member;
        if (f.values->constant_is_enumerator && f.values->constant_is_bool)
            text +=
                fmt::format("enum : bool {{ {} = {} }};\n", f.constant, value ? "true" : "false");
        else if (f.values->constant_is_enumerator)
            text += fmt::format("enum : int {{ {} = {} }};\n", f.constant, value);
        else if (f.values->constant_is_bool)
            text += fmt::format("constexpr bool {} = {};\n", f.constant, value ? "true" : "false");
        else
            text += fmt::format("constexpr int {} = {};\n", f.constant, value);
    }
    return text;
}

// The first field outside its range, as a message; "" when all are in range.
template <typename Spec, size_t N>
std::string spec_range_problem(const Spec& spec, const SpecField<Spec> (&fields)[N]) {
    for (const SpecField<Spec>& f : fields) {
        const int32_t value = spec.*f.member;
        if (value < f.min || value > f.max)
            return fmt::format("{} must be in [{}, {}], got {}", f.name(), f.min, f.max, value);
    }
    return {};
}

// Sets the fields of `spec` that `j` names (keys of the table; composite keys are the op's);
// throws std::runtime_error for a key in neither, or a bad value, or a missing REQUIRED field.
template <typename Spec, size_t N>
void spec_read_fields(Spec& spec, const SpecField<Spec> (&fields)[N], const nlohmann::json& j,
                      std::initializer_list<const char*> other_keys) {
    for (const auto& item : j.items()) {
        bool known = false;
        for (const char* key : other_keys) known = known || item.key() == key;
        for (const SpecField<Spec>& f : fields)
            known = known || (f.key != nullptr && item.key() == f.key);
        if (known) continue;
        std::string keys;
        for (const char* key : other_keys) keys += std::string(keys.empty() ? "" : ", ") + key;
        for (const SpecField<Spec>& f : fields)
            if (f.key != nullptr) keys += std::string(", ") + f.key;
        throw std::runtime_error(
            fmt::format("unknown field '{}' (known: {})", escaped_json_text(item.key()), keys));
    }
    for (const SpecField<Spec>& f : fields) {
        if (f.key == nullptr) continue;
        if (j.contains(f.key))
            spec.*f.member = spec_parse_value(f.key, *f.values, f.min, f.max, j[f.key]);
        else if (f.presence == SpecPresence::Required)
            throw std::runtime_error(fmt::format("{}: required", f.key));
    }
}

// Writes every keyed field into `j`.
template <typename Spec, size_t N>
void spec_write_fields(const Spec& spec, const SpecField<Spec> (&fields)[N], nlohmann::json& j) {
    for (const SpecField<Spec>& f : fields)
        if (f.key != nullptr) j[f.key] = spec_value_json(*f.values, spec.*f.member);
}

}  // namespace rope_jit
