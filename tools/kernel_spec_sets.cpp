#include "kernel_spec_sets.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <regex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "cache_item_states.h"
#include "common/bounded_json.h"
#include "rope_jit/rope_jit.h"

namespace rope_jit_cache {

namespace {

using nlohmann::json;

// Values straight from each model's published config (config.json of the HF checkpoint):
// head_dim = hidden_size / num_attention_heads unless the config sets head_dim; rotary_dim =
// head_dim * partial_rotary_factor (rotary_pct, rotary_dim); gqa = heads / kv heads.
const std::vector<Preset> kPresets = {
    {"llama3-8b", "hidden 4096, 32 heads, 8 kv heads", 128, 128, "half", 4},
    {"llama3-70b", "hidden 8192, 64 heads, 8 kv heads", 128, 128, "half", 8},
    {"mistral-7b", "hidden 4096, 32 heads, 8 kv heads", 128, 128, "half", 4},
    {"qwen2.5-7b", "hidden 3584, 28 heads, 4 kv heads", 128, 128, "half", 7},
    {"gemma-2-9b", "head_dim 256, 16 heads, 8 kv heads", 256, 256, "half", 2},
    {"phi-3-mini", "hidden 3072, 32 heads, 32 kv heads, full rotary", 96, 96, "half", 1},
    {"phi-4-mini", "hidden 3072, 24 heads, 8 kv heads, partial_rotary_factor 0.75", 128, 96, "half",
     3},
    {"phi-2", "hidden 2560, 32 heads, partial_rotary_factor 0.4", 80, 32, "half", 1},
    {"gpt-j-6b", "hidden 4096, 16 heads, rotary_dim 64, rotate_every_two", 256, 64, "interleaved",
     1},
    {"gpt-neox-20b", "hidden 6144, 64 heads, rotary_pct 0.25", 96, 24, "half", 1},
    // The full-attention layers, as issue 23 describes them; the kv grouping is an assumption
    // still to check against the published config.json.
    {"gemma-4",
     "full-attention layers: head_dim 512, proportional rotary (pairs (i, i+256)), "
     "partial_rotary_factor 0.25; kv grouping 2 assumed",
     512, 128, "proportional", 2},
    // QK-norm (q_norm and k_norm RMSNorm over head_dim before the rotation).
    {"qwen3-8b", "hidden 4096, 32 heads, 8 kv heads, head_dim 128, q_norm/k_norm", 128, 128, "half",
     4, true},
};

// How long a FIFO or pipe may go without data or its end before the read gives up.
constexpr int kPipeWaitSeconds = 10;

// Reads at most kMaxManifestBytes (+1 to tell a larger file), so /dev/zero or a huge file
// fails at once. Opened without blocking: open() of a FIFO that no process writes blocked for
// ever (session 45). A FIFO or pipe is then read as data arrives (a writer may open it after
// this), until its writer closes it or kPipeWaitSeconds pass without data.
std::string read_text(const std::string& path) {
    const std::string cannot_read = fmt::format("--manifest: cannot read '{}'", path);
    const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw UsageError(cannot_read);
    struct stat st;
    std::string error;
    if (fstat(fd, &st) != 0)
        error = cannot_read;
    else if (S_ISDIR(st.st_mode))
        error = fmt::format("--manifest: '{}' is a directory", path);
    const bool is_pipe = error.empty() && S_ISFIFO(st.st_mode);
    // Anything else is read as a file is, blocking.
    if (error.empty() && !is_pipe && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        error = cannot_read;
    std::string text;
    char buffer[1 << 16];
    while (error.empty()) {
        if (is_pipe) {
            pollfd readable{fd, POLLIN, 0};
            const int ready = poll(&readable, 1, kPipeWaitSeconds * 1000);
            if (ready < 0 && errno == EINTR) continue;
            if (ready < 0) {
                error = cannot_read;
                break;
            }
            if (ready == 0) {
                error = fmt::format("--manifest: '{}': nothing written to it for {} s", path,
                                    kPipeWaitSeconds);
                break;
            }
        }
        const ssize_t got = read(fd, buffer, sizeof buffer);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got < 0) error = cannot_read;
        if (got <= 0) break;
        text.append(buffer, size_t(got));
        if (text.size() > kMaxManifestBytes)
            error = fmt::format("--manifest: '{}' is larger than the {} MiB a manifest may have",
                                path, kMaxManifestBytes >> 20);
    }
    close(fd);
    if (!error.empty()) throw UsageError(error);
    return text;
}

std::string text_of(const json& value, const std::string& what) {
    if (!value.is_string())
        throw UsageError(fmt::format("{}: expected a string, got {}", what, value.dump()));
    return value.get<std::string>();
}

// The "ok" entries of a `rope-jit-cache list --json` document, each for its own target. An
// item that is no object, has no state or one `list` never writes ("okay"), or an "ok" one
// with an empty target, is a usage error: they were skipped, or given the default target,
// without a word (adversarial pass, session 49). Items in another state are skipped.
std::vector<SpecTemplate> listed_templates(const json& listing, const std::string& path) {
    if (!listing["items"].is_array())
        throw UsageError(fmt::format("{}: items must be a list", path));
    std::vector<SpecTemplate> templates;
    for (size_t i = 0; i < listing["items"].size(); ++i) {
        const json& item = listing["items"][i];
        const std::string where = fmt::format("{}: items[{}]", path, i);
        if (!item.is_object())
            throw UsageError(fmt::format("{}: expected an object, got {} {}", where,
                                         item.is_array() ? "an" : "a", item.type_name()));
        if (!item.contains("state")) throw UsageError(where + " has no state");
        const std::string state = text_of(item["state"], where + ".state");
        if (!is_item_state_name(state))
            throw UsageError(fmt::format("{}.state: expected one of {}, got \"{}\"", where,
                                         item_state_names(), rope_jit::escaped_json_text(state)));
        if (state != "ok") continue;
        if (!item.contains("spec_json") || !item["spec_json"].is_object() ||
            !item.contains("target"))
            throw UsageError(where + " has no spec_json object or target");
        const std::string target = text_of(item["target"], where + ".target");
        if (target.empty()) throw UsageError(where + ".target: empty");
        templates.push_back(SpecTemplate{item["spec_json"], fmt::format("{}#items[{}]", path, i),
                                         target});
    }
    return templates;
}

// Each template is at least one spec: past kMaxSpecs of them, a run is refused before any is
// expanded.
void check_template_count(size_t count, const std::string& where) {
    if (count > kMaxSpecs)
        throw UsageError(
            fmt::format("{}: past the {} specs one run may prewarm", where, kMaxSpecs));
}

}  // namespace

Ops parse_ops(const std::vector<std::string>& names) {
    Ops ops{false, false};
    for (const std::string& name : names) {
        if (name == "rope")
            ops.rope = true;
        else if (name == "attention")
            ops.attention = true;
        else
            throw UsageError(fmt::format("--ops: unknown op '{}' (known: rope, attention)", name));
    }
    if (!ops.rope && !ops.attention) throw UsageError("--ops: name rope, attention or both");
    return ops;
}

const std::vector<Preset>& presets() {
    return kPresets;
}

std::vector<SpecTemplate> preset_templates(const std::string& name, const Ops& ops) {
    for (const Preset& preset : kPresets) {
        if (name != preset.name) continue;
        std::vector<SpecTemplate> templates;
        json rope{{"op", "rope"},
                  {"head_dim", preset.head_dim},
                  {"rotary_dim", preset.rotary_dim},
                  {"style", preset.style},
                  {"gqa_group", preset.gqa_group},
                  {"dtype", "bfloat16"},
                  {"table_dtype", "bfloat16"},
                  {"angles", "table-full"},
                  {"direction", {"forward", "backward"}},
                  {"positions", {"implicit", "indices", "seqlen-offsets"}},
                  {"in_place_q", {true, false}}};
        if (ops.rope && preset.qk_norm) {
            // The forward, and the backward with the weight gradients (a training step).
            rope["qk_norm"] = true;
            rope["norm_weight_dtype"] = "bfloat16";
            rope["direction"] = "forward";
            templates.push_back(SpecTemplate{rope, name, ""});
            // Inference as vLLM calls it: QK-norm + RoPE + k and v written into a paged cache
            // at slot_mapping, bf16 or FP8 (issue 23), positions per token, q in place.
            json kv = rope;
            kv["positions"] = "indices";
            kv["in_place_q"] = true;
            kv["kv_cache"] = "slot-mapping";
            kv["kv_fp8"] = {false, true};
            kv["v_head_dim"] = preset.head_dim;
            templates.push_back(SpecTemplate{kv, name, ""});
            rope["direction"] = "backward";
            rope["norm_weight_grad"] = true;
            templates.push_back(SpecTemplate{rope, name, ""});
        } else if (ops.rope) {
            templates.push_back(SpecTemplate{rope, name, ""});
            // Calls on dense rows in prefill (C-contiguous [B, H, S, D] q and k, rope_jit.rope's
            // default layout, or [B, S, H, D] ones rotated whole) take the flat path's kernel
            // (dense_rows; dropped, and the duplicate merged, where the plan has no flat path);
            // decode and other layouts the first template's.
            json dense_rows = rope;
            dense_rows["dense_rows"] = true;
            templates.push_back(SpecTemplate{dense_rows, name, ""});
        }
        // The attention op has no proportional pairs: such a preset prewarms RoPE only.
        if (ops.attention && std::string(preset.style) != "proportional")
            templates.push_back(SpecTemplate{json{{"op", "attention"},
                                                  {"head_dim", preset.head_dim},
                                                  {"rotary_dim", preset.rotary_dim},
                                                  {"style", preset.style},
                                                  {"gqa_group", preset.gqa_group},
                                                  {"dtype", "bfloat16"},
                                                  {"table_dtype", "bfloat16"},
                                                  {"table_full", {false, true}},
                                                  {"causal", true},
                                                  {"write_lse", {true, false}},
                                                  {"direction", {"forward", "backward"}}},
                                             name, ""});
        return templates;
    }
    std::string known;
    for (const Preset& preset : kPresets)
        known += std::string(known.empty() ? "" : ", ") + preset.name;
    throw UsageError(fmt::format("--preset: unknown model '{}' (known: {})", name, known));
}

std::vector<SpecTemplate> read_manifest(const std::string& path, const Ops& ops) {
    const std::string text = read_text(path);
    std::string why;
    const json manifest = rope_jit::parse_bounded_json(text, &why);
    if (manifest.is_discarded()) throw UsageError(fmt::format("--manifest: '{}': {}", path, why));
    std::vector<SpecTemplate> templates;
    json specs = json::array();
    if (manifest.is_array()) {
        specs = manifest;
    } else if (manifest.is_object() && manifest.contains("items") &&
               manifest.contains("command") &&
               text_of(manifest["command"], path + ".command") == "list") {
        return listed_templates(manifest, path);
    } else if (manifest.is_object()) {
        Ops manifest_ops = ops;
        if (manifest.contains("ops")) {
            if (!manifest["ops"].is_array())
                throw UsageError(fmt::format("{}: ops must be a list of names", path));
            std::vector<std::string> names;
            for (const json& name : manifest["ops"]) names.push_back(text_of(name, path + ".ops"));
            manifest_ops = parse_ops(names);
        }
        for (const auto& [key, value] : manifest.items()) {
            if (key == "presets") {
                if (!value.is_array())
                    throw UsageError(fmt::format("{}: presets must be a list of names", path));
                for (const json& name : value)
                    append_templates(templates,
                                     preset_templates(text_of(name, path + ".presets"),
                                                      manifest_ops),
                                     path + ".presets");
            } else if (key == "specs") {
                if (!value.is_array())
                    throw UsageError(fmt::format("{}: specs must be a list of objects", path));
                specs = value;
            } else if (key != "ops") {
                throw UsageError(
                    fmt::format("{}: unknown key '{}' (known: presets, ops, specs)", path,
                                rope_jit::escaped_json_text(key)));
            }
        }
    } else {
        throw UsageError(
            fmt::format("{}: expected an object with presets and specs, or a list of specs", path));
    }
    check_template_count(templates.size() + specs.size(), path);
    for (size_t i = 0; i < specs.size(); ++i)
        templates.push_back(SpecTemplate{specs[i], fmt::format("{}#{}", path, i), ""});
    if (templates.empty()) throw UsageError(fmt::format("--manifest: '{}' names no spec", path));
    return templates;
}

void append_templates(std::vector<SpecTemplate>& templates, std::vector<SpecTemplate> more,
                      const std::string& where) {
    check_template_count(templates.size() + more.size(), where);
    for (SpecTemplate& t : more) templates.push_back(std::move(t));
}

TemplateSpecs::TemplateSpecs(const SpecTemplate& spec_template, size_t budget, size_t targets)
    : fields_(spec_template.fields) {
    const std::string& where = spec_template.source;
    budget /= std::max<size_t>(1, targets);
    const std::string per_target =
        targets > 1 ? fmt::format(", each counted for its {} targets", targets) : "";
    if (!fields_.is_object())
        throw UsageError(
            fmt::format("{}: a spec must be a JSON object, got {}", where, fields_.dump()));
    // The count first, so that a few bytes of lists cannot ask for billions of specs.
    for (const auto& [key, value] : fields_.items()) {
        if (!value.is_array()) continue;
        if (value.empty()) throw UsageError(fmt::format("{}.{}: empty list", where, key));
        if (count_ > budget / value.size())
            throw UsageError(fmt::format(
                "{}: its lists stand for more than the {} specs one run may prewarm{}", where,
                kMaxSpecs, per_target));
        count_ *= value.size();
    }
    // (A template without lists is one spec: it counts too, else the caller's budget, less
    // each template's specs, wrapped below zero past kMaxSpecs and let any list through.)
    if (count_ > budget)
        throw UsageError(fmt::format("{}: past the {} specs one run may prewarm{}", where,
                                     kMaxSpecs, per_target));
}

json TemplateSpecs::spec(size_t i) const {
    // i in mixed radix, the last list its lowest digit. Each list gives one element: copying
    // the template whole made a list of 20000 values 4e8 copies for its 20000 specs.
    json spec = json::object();
    for (auto field = fields_.rbegin(); field != fields_.rend(); ++field) {
        if (!field->is_array()) {
            spec[field.key()] = field.value();
            continue;
        }
        const size_t n = field->size();
        spec[field.key()] = (*field)[i % n];
        i /= n;
    }
    return spec;
}

std::vector<PlannedKernel> plan_kernels(const std::vector<SpecTemplate>& templates,
                                        const std::vector<std::string>& targets) {
    std::vector<PlannedKernel> kernels;
    std::unordered_map<std::string, size_t> index;  // target + canonical spec -> kernels[i]
    size_t budget = kMaxSpecs;
    // kernels[i] + "\n" + a source it has: a kernel that 20000 specs of a manifest share
    // looked its sources up one by one, 2e8 comparisons (session 45).
    std::unordered_set<std::string> sourced;
    struct Visit {
        std::vector<PlannedKernel>* kernels;
        std::unordered_map<std::string, size_t>* index;
        std::unordered_set<std::string>* sourced;
        const std::string* target;
        const std::string* source;
    };
    auto visit = [](const char* spec_json, const char* description, void* user) -> int {
        Visit& v = *static_cast<Visit*>(user);
        const auto [at, added] = v.index->emplace(*v.target + "\n" + spec_json, v.kernels->size());
        if (added)
            v.kernels->push_back(PlannedKernel{*v.target, spec_json, description, {*v.source}});
        if (v.sourced->insert(std::to_string(at->second) + "\n" + *v.source).second && !added)
            (*v.kernels)[at->second].sources.push_back(*v.source);
        return 0;
    };
    for (const SpecTemplate& t : templates) {
        const std::vector<std::string> own{t.target};
        const std::vector<std::string>& for_targets = t.target.empty() ? targets : own;
        // Each spec counts once per target: 20000 specs for 8 targets planned 160000 kernels.
        const TemplateSpecs specs(t, budget, for_targets.size());
        budget -= specs.size() * std::max<size_t>(1, for_targets.size());
        for (const std::string& target : for_targets) {
            for (size_t i = 0; i < specs.size(); ++i) {
                const std::string where =
                    specs.size() == 1 ? t.source : fmt::format("{} (spec {})", t.source, i);
                Visit v{&kernels, &index, &sourced, &target, &t.source};
                const rope_jit_status status =
                    rope_jit_prewarm_plan(specs.spec(i).dump().c_str(), target.c_str(), visit, &v);
                if (status != ROPE_JIT_OK) {
                    // The library names the field; "json: " is its name for the text it was given.
                    std::string error = rope_jit_last_error();
                    if (error.rfind("json: ", 0) == 0) error = error.substr(6);
                    if (status == ROPE_JIT_ERROR_INVALID_ARGUMENT)
                        throw UsageError(fmt::format("{}: {}", where, error));
                    throw std::runtime_error(fmt::format("{}: {}", where, error));
                }
            }
        }
    }
    return kernels;
}

bool valid_target(const std::string& target) {
    static const std::regex pattern("(sm|compute)_[1-9][0-9]{1,3}[af]?");
    return std::regex_match(target, pattern);
}

}  // namespace rope_jit_cache
