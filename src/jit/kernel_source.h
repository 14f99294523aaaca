// Specialization: a kernel's source is its spec's constexpr preamble followed, unchanged, by
// the embedded template. The templates' digest enters every cache key, so editing a
// template invalidates the cubins built from the old text.
#pragma once

#include <string>
#include <vector>

#include "ops/rope/kernel_spec.h"
#include "jit/nvrtc_compiler.h"

namespace rope_jit {

// The full source NVRTC compiles for `spec`.
std::string specialize_kernel(const KernelSpec& spec);

// A preamble of constexpr values followed by the embedded template `template_name`
// ("attention.cu"), with a #line so diagnostics point into the template.
std::string specialize_template(const std::string& preamble, const std::string& template_name);

// The template headers the source may include (rope_params.h).
const std::vector<NamedSource>& kernel_headers();

// SHA-256 (hex) over every embedded template's name and text.
const std::string& templates_digest();

// The name of the one extern "C" entry of every module.
constexpr const char* kKernelEntry = "rope_kernel";

}  // namespace rope_jit
