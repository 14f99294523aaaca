// The CUDA kernel templates of kernels_templates/, embedded in the library at build time
// (cmake/embed_templates.cmake) so that it needs no file besides itself at run time.
#pragma once

#include <string>
#include <vector>

namespace rope_jit {

struct EmbeddedTemplate {
    std::string name;    // file name, e.g. "rope.cu"
    std::string source;  // the template text
};

const std::vector<EmbeddedTemplate>& embedded_templates();

}  // namespace rope_jit
