#include "jit/kernel_source.h"

#include "jit/embedded_templates.h"
#include "common/error.h"
#include "common/sha256.h"

namespace rope_jit {

namespace {

const EmbeddedTemplate& find_template(const std::string& name) {
    for (const EmbeddedTemplate& t : embedded_templates())
        if (t.name == name) return t;
    throw Error(ROPE_JIT_ERROR_INTERNAL,
                "kernel template '" + name + "' is not embedded in the library");
}

}  // namespace

std::string specialize_template(const std::string& preamble, const std::string& template_name) {
    // The #line directive makes NVRTC's diagnostics point into the template, not the preamble.
    return preamble + "#line 1 \"" + template_name + "\"\n" + find_template(template_name).source;
}

const std::vector<NamedSource>& kernel_headers() {
    static const std::vector<NamedSource> headers = [] {
        std::vector<NamedSource> list;
        for (const EmbeddedTemplate& t : embedded_templates())
            if (t.name.size() > 2 && t.name.compare(t.name.size() - 2, 2, ".h") == 0)
                list.push_back({t.name, t.source});
        return list;
    }();
    return headers;
}

const std::string& templates_digest() {
    static const std::string digest = [] {
        Sha256 hash;
        for (const EmbeddedTemplate& t : embedded_templates()) {
            hash.update(t.name);
            hash.update(std::string_view("\0", 1));
            hash.update(t.source);
            hash.update(std::string_view("\0", 1));
        }
        return hash.finish_hex();
    }();
    return digest;
}

}  // namespace rope_jit
