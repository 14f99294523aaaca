// The host's door to the RoPE launch plan (kernels_templates/rope_params.h): the plan of a
// kernel spec, computed by the same constexpr function the kernel specializes itself with.
#pragma once

#include "ops/rope/kernel_spec.h"
#include "rope_params.h"

namespace rope_jit {

// The specialization constants of `spec`, as the kernel reads them from its preamble.
RopeShape rope_shape(const KernelSpec& spec);

inline RopePlan rope_plan(const KernelSpec& spec) {
    return rope_plan(rope_shape(spec));
}

}  // namespace rope_jit
