#include "kernel_spec_sets.h"

#include <fstream>
#include <functional>
#include <sstream>
#include <utility>

#include <fmt/format.h>

namespace rope_jit_cache {

namespace {

using nlohmann::json;

// Values straight from each model's published config (config.json of the HF checkpoint):
// head_dim = hidden_size / num_attention_heads unless the config sets head_dim; rotary_dim =
// head_dim * partial_rotary_factor (rotary_pct, rotary_dim); gqa = heads / kv heads.
const std::vector<Preset> kPresets = {
    {"llama3-8b", "hidden 4096, 32 heads, 8 kv heads", 128, 128, ROPE_JIT_STYLE_HALF, 4},
    {"llama3-70b", "hidden 8192, 64 heads, 8 kv heads", 128, 128, ROPE_JIT_STYLE_HALF, 8},
    {"mistral-7b", "hidden 4096, 32 heads, 8 kv heads", 128, 128, ROPE_JIT_STYLE_HALF, 4},
    {"qwen2.5-7b", "hidden 3584, 28 heads, 4 kv heads", 128, 128, ROPE_JIT_STYLE_HALF, 7},
    {"gemma-2-9b", "head_dim 256, 16 heads, 8 kv heads", 256, 256, ROPE_JIT_STYLE_HALF, 2},
    {"phi-3-mini", "hidden 3072, 32 heads, 32 kv heads, full rotary", 96, 96, ROPE_JIT_STYLE_HALF, 1},
    {"phi-4-mini", "hidden 3072, 24 heads, 8 kv heads, partial_rotary_factor 0.75", 128, 96, ROPE_JIT_STYLE_HALF, 3},
    {"phi-2", "hidden 2560, 32 heads, partial_rotary_factor 0.4", 80, 32, ROPE_JIT_STYLE_HALF, 1},
    {"gpt-j-6b", "hidden 4096, 16 heads, rotary_dim 64, rotate_every_two", 256, 64, ROPE_JIT_STYLE_INTERLEAVED, 1},
    {"gpt-neox-20b", "hidden 6144, 64 heads, rotary_pct 0.25", 96, 24, ROPE_JIT_STYLE_HALF, 1},
};

struct Named {
    const char* name;
    int value;
};

const Named kStyles[] = {{"half", ROPE_JIT_STYLE_HALF}, {"interleaved", ROPE_JIT_STYLE_INTERLEAVED}};
const Named kDirections[] = {{"forward", 0}, {"backward", 1}};
const Named kPositions[] = {{"implicit", ROPE_JIT_POSITIONS_IMPLICIT},
                            {"indices", ROPE_JIT_POSITIONS_INDICES},
                            {"seqlen-offsets", ROPE_JIT_POSITIONS_SEQLEN_OFFSETS}};
const Named kAngles[] = {{"table-full", ROPE_JIT_ANGLES_TABLE_FULL},
                         {"table-half", ROPE_JIT_ANGLES_TABLE_HALF},
                         {"inv-freq", ROPE_JIT_ANGLES_INV_FREQ}};

template <size_t N>
int lookup(const Named (&table)[N], const std::string& value, const std::string& what) {
    for (const Named& named : table)
        if (value == named.name) return named.value;
    std::string known;
    for (const Named& named : table) known += std::string(known.empty() ? "" : ", ") + named.name;
    throw UsageError(fmt::format("{}: unknown value '{}' (known: {})", what, value, known));
}

template <size_t N>
const char* name_of(const Named (&table)[N], int value) {
    for (const Named& named : table)
        if (named.value == value) return named.name;
    return "?";
}

DLDataType float_dtype(const std::string& value, const std::string& what) {
    if (value == "float32" || value == "f32" || value == "fp32") return {kDLFloat, 32, 1};
    if (value == "float16" || value == "f16" || value == "fp16") return {kDLFloat, 16, 1};
    if (value == "bfloat16" || value == "bf16") return {kDLBfloat, 16, 1};
    throw UsageError(fmt::format("{}: unknown value '{}' (known: float32, float16, bfloat16)", what, value));
}

const char* float_dtype_name(DLDataType dtype) {
    if (dtype.code == kDLFloat && dtype.bits == 32) return "float32";
    if (dtype.code == kDLFloat && dtype.bits == 16) return "float16";
    if (dtype.code == kDLBfloat && dtype.bits == 16) return "bfloat16";
    return "?";
}

const char* short_dtype(DLDataType dtype) {
    if (dtype.code == kDLFloat && dtype.bits == 32) return "f32";
    if (dtype.code == kDLFloat && dtype.bits == 16) return "f16";
    if (dtype.code == kDLBfloat && dtype.bits == 16) return "bf16";
    if (dtype.code == kDLInt && dtype.bits == 32) return "int32";
    if (dtype.code == kDLInt && dtype.bits == 64) return "int64";
    return "?";
}

std::string text_of(const json& value, const std::string& what) {
    if (!value.is_string()) throw UsageError(fmt::format("{}: expected a string, got {}", what, value.dump()));
    return value.get<std::string>();
}

int32_t int_of(const json& value, const std::string& what) {
    if (!value.is_number_integer() || value.get<int64_t>() < INT32_MIN || value.get<int64_t>() > INT32_MAX)
        throw UsageError(fmt::format("{}: expected an integer, got {}", what, value.dump()));
    return value.get<int32_t>();
}

int bool_of(const json& value, const std::string& what) {
    if (!value.is_boolean()) throw UsageError(fmt::format("{}: expected true or false, got {}", what, value.dump()));
    return value.get<bool>() ? 1 : 0;
}

using Setter = std::function<void(rope_jit_kernel_spec&, const json&, const std::string&)>;

// Field name -> how one value of it sets a spec. The order is the help text's.
const std::vector<std::pair<std::string, Setter>>& setters() {
    static const std::vector<std::pair<std::string, Setter>> table = {
        {"head_dim", [](auto& s, const json& v, const std::string& w) { s.head_dim = int_of(v, w); }},
        {"rotary_dim", [](auto& s, const json& v, const std::string& w) { s.rotary_dim = int_of(v, w); }},
        {"rotary_offset", [](auto& s, const json& v, const std::string& w) { s.rotary_offset = int_of(v, w); }},
        {"gqa_group", [](auto& s, const json& v, const std::string& w) { s.gqa_group = int_of(v, w); }},
        {"dtype", [](auto& s, const json& v, const std::string& w) { s.dtype = float_dtype(text_of(v, w), w); }},
        {"table_dtype",
         [](auto& s, const json& v, const std::string& w) { s.table_dtype = float_dtype(text_of(v, w), w); }},
        {"style",
         [](auto& s, const json& v, const std::string& w) {
             s.style = rope_jit_style(lookup(kStyles, text_of(v, w), w));
         }},
        {"direction",
         [](auto& s, const json& v, const std::string& w) { s.backward = lookup(kDirections, text_of(v, w), w); }},
        {"positions",
         [](auto& s, const json& v, const std::string& w) {
             s.positions = rope_jit_position_mode(lookup(kPositions, text_of(v, w), w));
         }},
        {"index_dtype",
         [](auto& s, const json& v, const std::string& w) {
             const std::string text = text_of(v, w);
             if (text == "int32") s.index_dtype = {kDLInt, 32, 1};
             else if (text == "int64") s.index_dtype = {kDLInt, 64, 1};
             else throw UsageError(fmt::format("{}: unknown value '{}' (known: int32, int64)", w, text));
         }},
        {"angles",
         [](auto& s, const json& v, const std::string& w) {
             s.angles = rope_jit_angle_source(lookup(kAngles, text_of(v, w), w));
         }},
        {"has_k", [](auto& s, const json& v, const std::string& w) { s.has_k = bool_of(v, w); }},
        {"packed", [](auto& s, const json& v, const std::string& w) { s.packed = bool_of(v, w); }},
        {"xpos", [](auto& s, const json& v, const std::string& w) { s.xpos = bool_of(v, w); }},
        {"in_place", [](auto& s, const json& v, const std::string& w) { s.in_place = bool_of(v, w); }},
    };
    return table;
}

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UsageError(fmt::format("--manifest: cannot read '{}'", path));
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

std::vector<NamedSpec> named(const std::vector<rope_jit_kernel_spec>& specs, const std::string& source) {
    std::vector<NamedSpec> out;
    for (const rope_jit_kernel_spec& spec : specs) out.push_back(NamedSpec{spec, {source}});
    return out;
}

}  // namespace

const std::vector<Preset>& presets() { return kPresets; }

json preset_template(const Preset& preset) {
    return json{{"head_dim", preset.head_dim},
                {"rotary_dim", preset.rotary_dim},
                {"style", name_of(kStyles, preset.style)},
                {"gqa_group", preset.gqa_group},
                {"dtype", "bfloat16"},
                // HF models cast cos/sin to the activations' dtype before applying them.
                {"table_dtype", "bfloat16"},
                {"angles", "table-full"},
                {"direction", {"forward", "backward"}},
                {"positions", {"implicit", "indices"}},
                {"index_dtype", "int64"},
                {"has_k", true}};
}

const std::vector<std::string>& template_fields() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> out;
        for (const auto& [name, setter] : setters()) out.push_back(name);
        return out;
    }();
    return names;
}

std::vector<rope_jit_kernel_spec> expand_template(const json& spec_template, const std::string& where) {
    if (!spec_template.is_object())
        throw UsageError(fmt::format("{}: a spec must be a JSON object, got {}", where, spec_template.dump()));
    for (const auto& [key, value] : spec_template.items()) {
        bool known = false;
        for (const auto& [name, setter] : setters()) known = known || name == key;
        if (!known) {
            std::string fields;
            for (const std::string& name : template_fields()) fields += (fields.empty() ? "" : ", ") + name;
            throw UsageError(fmt::format("{}: unknown field '{}' (known: {})", where, key, fields));
        }
        if (value.is_array() && value.empty()) throw UsageError(fmt::format("{}.{}: empty list", where, key));
    }
    if (!spec_template.contains("head_dim")) throw UsageError(fmt::format("{}: head_dim is required", where));

    std::vector<rope_jit_kernel_spec> specs;
    rope_jit_kernel_spec base;
    rope_jit_kernel_spec_init(&base);
    // Depth-first over the fields in table order: the cross product of every list.
    std::function<void(size_t, rope_jit_kernel_spec)> expand = [&](size_t field, rope_jit_kernel_spec spec) {
        if (field == setters().size()) {
            specs.push_back(spec);
            return;
        }
        const auto& [name, setter] = setters()[field];
        if (!spec_template.contains(name)) {
            expand(field + 1, spec);
            return;
        }
        const json& value = spec_template.at(name);
        const std::string what = where + "." + name;
        if (!value.is_array()) {
            setter(spec, value, what);
            expand(field + 1, spec);
            return;
        }
        for (const json& each : value) {
            rope_jit_kernel_spec next = spec;
            setter(next, each, what);
            expand(field + 1, next);
        }
    };
    expand(0, base);
    return specs;
}

std::vector<NamedSpec> read_manifest(const std::string& path) {
    const json manifest = json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
    if (manifest.is_discarded()) throw UsageError(fmt::format("--manifest: '{}' is not valid JSON", path));
    std::vector<NamedSpec> specs;
    json templates = json::array();
    if (manifest.is_array()) {
        templates = manifest;
    } else if (manifest.is_object()) {
        for (const auto& [key, value] : manifest.items()) {
            if (key == "presets") {
                if (!value.is_array()) throw UsageError(fmt::format("{}: presets must be a list of names", path));
                for (const json& name : value) add_unique(specs, preset_specs(text_of(name, path + ".presets")));
            } else if (key == "specs") {
                if (!value.is_array()) throw UsageError(fmt::format("{}: specs must be a list of objects", path));
                templates = value;
            } else {
                throw UsageError(fmt::format("{}: unknown key '{}' (known: presets, specs)", path, key));
            }
        }
    } else {
        throw UsageError(fmt::format("{}: expected an object with presets and specs, or a list of specs", path));
    }
    for (size_t i = 0; i < templates.size(); ++i) {
        const std::string where = fmt::format("{}#{}", path, i);
        add_unique(specs, named(expand_template(templates[i], where), where));
    }
    if (specs.empty()) throw UsageError(fmt::format("--manifest: '{}' names no spec", path));
    return specs;
}

std::vector<NamedSpec> preset_specs(const std::string& name) {
    for (const Preset& preset : kPresets)
        if (name == preset.name) return named(expand_template(preset_template(preset), name), name);
    std::string known;
    for (const Preset& preset : kPresets) known += std::string(known.empty() ? "" : ", ") + preset.name;
    throw UsageError(fmt::format("--preset: unknown model '{}' (known: {})", name, known));
}

void add_unique(std::vector<NamedSpec>& specs, const std::vector<NamedSpec>& more) {
    for (const NamedSpec& candidate : more) {
        const std::string identity = describe(candidate.spec);
        bool merged = false;
        for (NamedSpec& existing : specs) {
            if (describe(existing.spec) != identity) continue;
            for (const std::string& source : candidate.sources) existing.sources.push_back(source);
            merged = true;
            break;
        }
        if (!merged) specs.push_back(candidate);
    }
}

std::string describe(const rope_jit_kernel_spec& spec) {
    const int rotary = spec.rotary_dim == 0 ? spec.head_dim : spec.rotary_dim;
    // Index dtypes only matter where indices are read.
    const bool reads_indices = spec.positions != ROPE_JIT_POSITIONS_IMPLICIT || spec.packed;
    return fmt::format("{} {} D{} R{}@{} {} {} {} {}{}{} {}/{}{} {}", short_dtype(spec.dtype),
                       spec.backward ? "bwd" : "fwd", spec.head_dim, rotary, spec.rotary_offset,
                       name_of(kStyles, spec.style), spec.has_k ? "qk" : "q",
                       spec.has_k ? fmt::format("gqa{}", spec.gqa_group) : std::string("-"),
                       name_of(kPositions, spec.positions),
                       reads_indices ? fmt::format("/{}", short_dtype(spec.index_dtype)) : std::string(),
                       spec.packed ? " packed" : "", name_of(kAngles, spec.angles), short_dtype(spec.table_dtype),
                       spec.xpos ? " xpos" : "", spec.in_place ? "inplace" : "outofplace");
}

json spec_to_json(const rope_jit_kernel_spec& spec) {
    return json{{"head_dim", spec.head_dim},
                {"rotary_dim", spec.rotary_dim == 0 ? spec.head_dim : spec.rotary_dim},
                {"rotary_offset", spec.rotary_offset},
                {"gqa_group", spec.gqa_group},
                {"dtype", float_dtype_name(spec.dtype)},
                {"table_dtype", float_dtype_name(spec.table_dtype)},
                {"style", name_of(kStyles, spec.style)},
                {"direction", spec.backward ? "backward" : "forward"},
                {"positions", name_of(kPositions, spec.positions)},
                {"index_dtype", short_dtype(spec.index_dtype)},
                {"angles", name_of(kAngles, spec.angles)},
                {"has_k", spec.has_k != 0},
                {"packed", spec.packed != 0},
                {"xpos", spec.xpos != 0},
                {"in_place", spec.in_place != 0}};
}

}  // namespace rope_jit_cache
