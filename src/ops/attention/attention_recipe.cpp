#include "ops/attention/attention_recipe.h"

#include <fmt/format.h>

#include "common/error.h"
#include "jit/kernel_source.h"

namespace rope_jit {

namespace {

constexpr const char* kAttentionTemplate = "attention.cu";
constexpr const char* kAttentionEntry = "attention_kernel";

}  // namespace

std::string attention_target(const AttentionSpec& spec, const std::string& device_target) {
    if (!spec.wgmma) return device_target;
    if (device_target != "sm_90" && device_target != "sm_90a")
        throw Error(
            ROPE_JIT_ERROR_UNSUPPORTED,
            fmt::format("wgmma attention kernels run on sm_90 only, not {}", device_target));
    return "sm_90a";
}

KernelRecipe attention_recipe(const AttentionSpec& spec) {
    spec.validate();
    KernelRecipe recipe;
    recipe.spec_json = spec.to_json();
    recipe.template_name = kAttentionTemplate;
    recipe.entry = kAttentionEntry;
    recipe.source = [spec] { return specialize_template(spec.preamble(), kAttentionTemplate); };
    recipe.target = [spec](const std::string& device_target) {
        return attention_target(spec, device_target);
    };
    // Blocks of the tensor-core kernels take more than the default 48 KiB of shared memory.
    recipe.dynamic_shared_bytes = spec.shared_bytes();
    return recipe;
}

KernelBinary build_attention_binary(const AttentionSpec& spec, const std::string& target,
                                    const DiskCache* disk, KernelStats& stats) {
    return build_kernel_binary(attention_recipe(spec), target, disk, stats);
}

}  // namespace rope_jit
