// Sets of kernel specs for rope-jit-cache prewarm: model presets, the spec flags and JSON
// manifests. All three become "spec templates" (JSON objects whose fields are values or lists
// of values) that expand, as the cross product of their lists, into rope_jit_kernel_specs.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rope_jit/rope_jit.h"

namespace rope_jit_cache {

// Bad input from the command line or a manifest: the tool exits with status 2.
class UsageError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// One spec to prewarm, with where it came from ("llama3-8b", "flags", "manifest.json#2").
struct NamedSpec {
    rope_jit_kernel_spec spec;
    std::vector<std::string> sources;  // several when presets share a spec
};

// A model preset: one attention layer's RoPE as the model's reference implementation runs it.
struct Preset {
    const char* name;
    const char* about;  // the config values the spec comes from
    int head_dim;
    int rotary_dim;
    rope_jit_style style;
    int gqa_group;  // num_attention_heads / num_key_value_heads
};

// Every preset, in a fixed order.
const std::vector<Preset>& presets();

// The template of a preset: bf16 q and k with bf16 HF-style full tables, forward and
// backward, with implicit positions and with int64 position indices (4 specs).
nlohmann::json preset_template(const Preset& preset);

// The spec template fields, in the order help texts list them. Each takes a value or a list:
//   head_dim (required), rotary_dim (0 = head_dim), rotary_offset, gqa_group: integers
//   dtype, table_dtype: float32 | float16 | bfloat16 (also f32, fp32, f16, fp16, bf16)
//   style: half | interleaved          direction: forward | backward
//   positions: implicit | indices | seqlen-offsets      index_dtype: int32 | int64
//   angles: table-full | table-half | inv-freq
//   has_k, packed, xpos, in_place: booleans
// Fields left out take rope_jit_kernel_spec_init's defaults.
const std::vector<std::string>& template_fields();

// Expands one template into specs (the cross product of its lists). `where` names the
// template in errors. Throws UsageError for an unknown field, a wrong type or value, or a
// missing head_dim.
std::vector<rope_jit_kernel_spec> expand_template(const nlohmann::json& spec_template, const std::string& where);

// The specs of a manifest file:
//   {"presets": ["llama3-8b", ...], "specs": [<template>, ...]}   or   [<template>, ...]
// Throws UsageError when the file cannot be read or parsed, or names an unknown preset.
std::vector<NamedSpec> read_manifest(const std::string& path);

// The preset's specs; throws UsageError naming the known presets for an unknown name.
std::vector<NamedSpec> preset_specs(const std::string& name);

// Appends `more` to `specs`, merging specs that describe the same kernel (their sources join).
void add_unique(std::vector<NamedSpec>& specs, const std::vector<NamedSpec>& more);

// A short, complete description of a spec, also its identity for add_unique:
// "bf16 fwd D128 R128@0 half qk gqa4 implicit table-full/bf16 inplace".
std::string describe(const rope_jit_kernel_spec& spec);

// The spec as a template with one value per field (what --json prints).
nlohmann::json spec_to_json(const rope_jit_kernel_spec& spec);

}  // namespace rope_jit_cache
