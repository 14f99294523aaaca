// Specialization: a kernel's source is its spec's constexpr preamble followed, unchanged, by
// the embedded template. The templates' digest enters every cache key, so editing a
// template invalidates the cubins built from the old text.
#pragma once

#include <string>
#include <vector>

#include "jit/nvrtc_compiler.h"

namespace rope_jit {

// A preamble of constexpr values followed by the embedded template `template_name`
// ("attention.cu"), with a #line so diagnostics point into the template.
std::string specialize_template(const std::string& preamble, const std::string& template_name);

// The template headers a source may include (rope_params.h, host_device.h...).
const std::vector<NamedSource>& kernel_headers();

// SHA-256 (hex) over every embedded template's name and text.
const std::string& templates_digest();

}  // namespace rope_jit
