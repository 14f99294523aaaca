#include "ops/op_registry.h"

#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "ops/attention/attention_recipe.h"
#include "ops/rope/rope_recipe.h"

namespace rope_jit {

namespace {

// One line per op.
const OpRegistration kOps[] = {
    register_op<KernelSpec, rope_recipe>(kRopeOp),
    register_op<AttentionSpec, attention_recipe>(kAttentionOp),
};

}  // namespace

const OpRegistration* find_op(const std::string& name) {
    for (const OpRegistration& op : kOps)
        if (name == op.name) return &op;
    return nullptr;
}

const OpRegistration* op_of_spec_json(const std::string& spec_json, std::string* error) {
    const nlohmann::json j = parse_bounded_json(spec_json);
    const char* problem = nullptr;
    const OpRegistration* op = nullptr;
    if (!j.is_object()) {
        problem = "a spec is a JSON object";
    } else if (!j.contains("op")) {
        op = find_op(kRopeOp);
    } else if (!j["op"].is_string() || (op = find_op(j["op"].get<std::string>())) == nullptr) {
        if (error != nullptr)
            *error = "op: must be one of " + registered_op_names() + ", got " + j["op"].dump();
        return nullptr;
    }
    if (problem != nullptr && error != nullptr) *error = problem;
    return op;
}

std::string registered_op_names() {
    std::string names;
    for (const OpRegistration& op : kOps)
        names += (names.empty() ? "" : ", ") + std::string(op.name);
    return names;
}

}  // namespace rope_jit
