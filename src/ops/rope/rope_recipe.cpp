#include "ops/rope/rope_recipe.h"

#include "jit/kernel_source.h"
#include "ops/rope/rope_plan.h"

namespace rope_jit {

namespace {

// The plain kernel, which also takes the QK-norm forwards of its plan (RopePlan::norm_items),
// and the one that normalizes each head first (the other QK-norm specs).
const char* template_of(const KernelSpec& spec) {
    return takes_norm_kernel(spec) ? "rope_norm.cu" : "rope.cu";
}
const char* entry_of(const KernelSpec& spec) {
    return takes_norm_kernel(spec) ? "rope_norm_kernel" : "rope_kernel";
}
// rope.cu's second entry, where its plan has one: the direct path's own (RopePlan::direct_entry;
// the launcher takes it where plan_rope_launch chooses the direct path), the bulk path
// (RopePlan::bulk_rows; taken where bulk_rows_of allows it) or the flat path
// (RopePlan::flat_rows; where flat_rows_of does). No plan has two: the direct path's entry is
// for KV cache specs, which the flat path leaves alone, and the bulk path is for calls that
// copy unrotated features, which neither of the others makes.
const char* second_entry_of(const KernelSpec& spec) {
    if (takes_norm_kernel(spec)) return "";
    const RopeModuleKernels kernels = rope_module_kernels(rope_plan(spec));
    if (kernels.direct) return "rope_direct_kernel";
    if (kernels.bulk) return "rope_bulk_kernel";
    return kernels.flat ? "rope_flat_kernel" : "";
}

}  // namespace

bool takes_norm_kernel(const KernelSpec& spec) {
    return spec.qk_norm && !rope_plan(spec).norm_items;
}

std::string specialize_kernel(const KernelSpec& spec) {
    return specialize_template(spec.preamble(), template_of(spec));
}

KernelRecipe rope_recipe(const KernelSpec& spec) {
    spec.validate();
    KernelRecipe recipe;
    recipe.spec_json = spec.to_json();
    recipe.template_name = template_of(spec);
    recipe.entry = entry_of(spec);
    recipe.second_entry = second_entry_of(spec);
    recipe.source = [spec] { return specialize_kernel(spec); };
    // The launcher sizes shared memory under the 48 KiB a block takes without opting in.
    return recipe;
}

KernelBinary build_kernel_binary(const KernelSpec& spec, const std::string& target,
                                 const DiskCache* disk, KernelStats& stats) {
    return build_kernel_binary(rope_recipe(spec), target, disk, stats);
}

}  // namespace rope_jit
