// Every op the runtime knows, one registration line each (op_registry.cpp), for the parts
// that meet a spec only as its JSON: cache maintenance (list, verify) names entries with it,
// and prewarming from a manifest rebuilds kernels from it. An op lives in its own folder
// (ops/<name>/: problem, spec, recipe, launcher, CPU reference) and joins here with one line;
// the JIT core and the device layer know no op.
#pragma once

#include <optional>
#include <string>

#include "jit/kernel_recipe.h"

namespace rope_jit {

struct OpRegistration {
    // The op's name: the "op" of its spec JSON ("rope").
    const char* name;
    // The spec in `spec_json` as a kernel recipe; nullopt with *error (when error is not
    // NULL) when the JSON is not a valid spec of this op.
    std::optional<KernelRecipe> (*recipe)(const std::string& spec_json, std::string* error);
    // The spec's describe(), nullopt when the JSON is not a valid spec of this op.
    std::optional<std::string> (*describe)(const std::string& spec_json);
};

// The registration of an op whose spec type has from_json(text, error*), describe() and a
// recipe maker (KernelSpec and rope_recipe): what a registration line calls.
template <typename Spec, KernelRecipe (*MakeRecipe)(const Spec&)>
OpRegistration register_op(const char* name) {
    OpRegistration op;
    op.name = name;
    op.recipe = [](const std::string& spec_json,
                   std::string* error) -> std::optional<KernelRecipe> {
        std::optional<Spec> spec = Spec::from_json(spec_json, error);
        if (!spec) return std::nullopt;
        return MakeRecipe(*spec);
    };
    op.describe = [](const std::string& spec_json) -> std::optional<std::string> {
        std::optional<Spec> spec = Spec::from_json(spec_json, nullptr);
        if (!spec) return std::nullopt;
        return spec->describe();
    };
    return op;
}

// The op named `name`, nullptr when none is.
const OpRegistration* find_op(const std::string& name);

// The op a spec JSON names in its "op" member ("rope" when it has none, as RoPE manifests
// may); nullptr when it is not a JSON object or names no registered op, with *error.
const OpRegistration* op_of_spec_json(const std::string& spec_json, std::string* error);

// The registered ops' names, comma-separated: "rope, attention".
std::string registered_op_names();

}  // namespace rope_jit
