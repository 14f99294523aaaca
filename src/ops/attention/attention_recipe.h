// How an attention kernel spec becomes a kernel of the JIT core (jit/kernel_recipe.h): the
// template it specializes, the module's entry, the target it compiles for (wgmma kernels need
// sm_90a) and the shared memory its launches take. Needs NVRTC to build, not a GPU.
#pragma once

#include <string>

#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_recipe.h"
#include "ops/attention/attention_spec.h"

namespace rope_jit {

// The op's name: the "op" of its spec JSON and its memory-cache keys.
inline constexpr char kAttentionOp[] = "attention";

// The target an attention kernel compiles for on a device whose target is `device_target`:
// that one, except that wgmma kernels exist only on the arch-specific sm_90a (and only for an
// sm_90 device: Error(UNSUPPORTED) otherwise).
std::string attention_target(const AttentionSpec& spec, const std::string& device_target);

// The recipe of `spec`. Throws Error(INVALID_ARGUMENT) when the spec does not validate.
KernelRecipe attention_recipe(const AttentionSpec& spec);

// The binary of an attention kernel for a device of `target` ("sm_90"; attention_target picks
// what NVRTC is asked for), through the shared builder (disk cache, NVRTC, the same key scheme
// as RoPE kernels). Needs NVRTC, not a GPU.
KernelBinary build_attention_binary(const AttentionSpec& spec, const std::string& target,
                                    const DiskCache* disk, KernelStats& stats);

}  // namespace rope_jit
