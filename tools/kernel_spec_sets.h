// Sets of kernel specs for rope-jit-cache prewarm: model presets, the spec flags and JSON
// manifests. All three become spec templates: JSON objects in the library's one spec
// vocabulary (rope_jit_prewarm_json in rope_jit.h) whose values may be lists, standing for
// the cross product of their lists. The library expands each resulting spec, for each
// target, into the exact kernels (rope_jit_prewarm_plan); this file knows no spec field.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace rope_jit_cache {

// Bad input from the command line or a manifest: the tool exits with status 2.
class UsageError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Bounds on what a manifest may ask for, so that a hostile or mistaken file fails at once
// with a message instead of exhausting memory, the stack or the afternoon.
constexpr size_t kMaxManifestBytes = size_t(4) << 20;  // 4 MiB
constexpr size_t kMaxSpecs = 20000;  // specs after every cross product, times their targets

// Which ops a preset prewarms (--ops).
struct Ops {
    bool rope = true;
    bool attention = true;
};
// "rope,attention" (a subset, comma-separated); throws UsageError naming --ops otherwise.
Ops parse_ops(const std::vector<std::string>& names);

// A spec template and where it came from ("llama3-8b", "flags", "manifest.json#2").
struct SpecTemplate {
    nlohmann::json fields;
    std::string source;
    std::string target;  // "" = the run's targets; a listed entry keeps its own
};

// A model preset: one attention layer of the model as the library's own integrations run it.
struct Preset {
    const char* name;
    const char* about;  // the config values the spec comes from
    int head_dim;
    int rotary_dim;
    const char* style;     // "half", "interleaved" or "proportional" (RoPE only: no attention)
    int gqa_group;         // num_attention_heads / num_key_value_heads
    bool qk_norm = false;  // RMSNorm of q and k heads before the rotation (bf16 weights)
};

// Every preset, in a fixed order.
const std::vector<Preset>& presets();

// The templates of a preset, for the ops asked for:
// - RoPE as rope_jit.rope, apply_rope and the HF drop-in call it: bf16 q and k with bf16
//   full tables (HF casts cos/sin to the activations' dtype), forward and backward, in place
//   and out of place (apply_rope and the HF drop-in return new tensors, and their backward
//   too), with implicit positions, int64 position indices and int64 per-sequence offsets
//   (the HF drop-in with a batch of several [B, S, R] tables). With qk_norm: the same with the
//   norm fused (bf16 weights), the backward with weight gradients.
// - Attention as rope_jit.attention / rope_jit.torch_ops.attention call it: bf16, bf16
//   tables of either format, causal, with and without lse, forward and backward (not for
//   proportional presets: the attention op has no such pairs).
std::vector<SpecTemplate> preset_templates(const std::string& name, const Ops& ops);

// The templates of a manifest file:
//   {"presets": ["llama3-8b", ...], "ops": ["rope"], "specs": [<template>, ...]},
//   [<template>, ...], or what `rope-jit-cache list --json` prints (its "ok" items, each for
//   the target it was listed under).
// Throws UsageError when the file cannot be read, is a directory, is larger than
// kMaxManifestBytes, is a FIFO or pipe nothing is written to for 10 s, nests deeper than
// rope_jit::kMaxJsonDepth, is not valid JSON, names an unknown key or preset, or holds more
// than kMaxSpecs templates.
std::vector<SpecTemplate> read_manifest(const std::string& path, const Ops& ops);

// Appends `more` to `templates`. Each template is at least one spec, so past kMaxSpecs of them
// it throws UsageError naming `where` at once: a manifest of 400000 preset names took 2.4 GB
// before the budget on specs was reached (session 45).
void append_templates(std::vector<SpecTemplate>& templates, std::vector<SpecTemplate> more,
                      const std::string& where);

// The specs of a template: the cross product of its list values, each a JSON object with one
// value per field, the last list varying fastest. Each is made when asked for: a template's
// other values copied into all of 20000 specs at once took gigabytes (a 80 KB string, 1.6 GB).
class TemplateSpecs {
  public:
    // Throws UsageError for a template that is not an object, an empty list, or more than
    // `budget` specs counted once for each of its `targets` (a template without lists is one
    // spec). Keeps a reference to the template's fields.
    TemplateSpecs(const SpecTemplate& spec_template, size_t budget, size_t targets);
    TemplateSpecs(SpecTemplate&&, size_t, size_t) = delete;
    size_t size() const { return count_; }
    // The i-th spec, i < size().
    nlohmann::json spec(size_t i) const;

  private:
    const nlohmann::json& fields_;
    size_t count_ = 1;
};

// One kernel to prewarm.
struct PlannedKernel {
    std::string target;
    std::string spec_json;    // canonical, as the cache stores it
    std::string description;  // the library's short description
    std::vector<std::string> sources;
};

// The kernels of `templates` for `targets` (each template's own target, when it has one), in
// order, duplicates merged (their sources join) by a hash of target and canonical spec.
// Throws UsageError naming the template for a spec the library rejects, or for more than
// kMaxSpecs specs, each counted once for every target it is planned for.
std::vector<PlannedKernel> plan_kernels(const std::vector<SpecTemplate>& templates,
                                        const std::vector<std::string>& targets);

// Whether `target` is an architecture name: sm_XY or compute_XY (two to four digits, no
// leading zero), optionally with the arch-specific suffix a or f.
bool valid_target(const std::string& target);

}  // namespace rope_jit_cache
