// How a RoPE kernel spec becomes a kernel of the JIT core (jit/kernel_recipe.h): the template
// it specializes, the module's entry, its spec JSON. Needs NVRTC to build, not a GPU.
#pragma once

#include <string>

#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_recipe.h"
#include "ops/rope/kernel_spec.h"

namespace rope_jit {

// The op's name: the "op" of its spec JSON and its memory-cache keys.
inline constexpr char kRopeOp[] = "rope";

// Whether `spec` runs on the QK-norm kernel, kernels_templates/rope_norm.cu: its QK-norm specs
// but the forwards rope.cu takes on its direct path (RopePlan::norm_items).
bool takes_norm_kernel(const KernelSpec& spec);

// The full source NVRTC compiles for `spec`: its preamble and kernels_templates/rope.cu (or,
// where takes_norm_kernel, rope_norm.cu).
std::string specialize_kernel(const KernelSpec& spec);

// The recipe of `spec`. Throws Error(INVALID_ARGUMENT) when the spec does not validate.
KernelRecipe rope_recipe(const KernelSpec& spec);

// build_kernel_binary(rope_recipe(spec), ...): the binary of `spec` for `target` ("sm_90").
KernelBinary build_kernel_binary(const KernelSpec& spec, const std::string& target,
                                 const DiskCache* disk, KernelStats& stats);

}  // namespace rope_jit
