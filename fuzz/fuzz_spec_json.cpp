// libFuzzer target: JSON that becomes kernel specs. The first input byte picks the parser,
// the rest is the text:
//   0: KernelSpec::from_json (a cache entry's stored rope spec, and the manifest form);
//   1: AttentionSpec::from_json (a cache entry's stored attention spec);
//   2: rope-jit-cache's read_manifest (tools/kernel_spec_sets.cpp), read from a memfd.
// A parser must never crash; one that accepts a spec must give it back from its own to_json;
// one that refuses must say why (a non-empty error, or the manifest's UsageError).
// The manifest reader bounds depth, size and spec count itself (issue 20, C1 and C2), so
// every input reaches it.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernel_spec_sets.h"
#include "ops/attention/attention_spec.h"
#include "ops/rope/kernel_spec.h"

namespace {

template <typename Spec>
void round_trip(const std::string& text) {
    std::string error;
    const auto spec = Spec::from_json(text, &error);
    if (!spec) {
        if (error.empty()) __builtin_trap();
        return;
    }
    const std::string canonical = spec->to_json();
    const auto again = Spec::from_json(canonical, &error);
    if (!again || again->to_json() != canonical) __builtin_trap();
}

void read_manifest_text(const std::string& text) {
    static const int fd = memfd_create("fuzz_manifest", 0);
    if (fd < 0) __builtin_trap();
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) != ssize_t(text.size()))
        __builtin_trap();
    try {
        const std::string path = "/proc/self/fd/" + std::to_string(fd);
        const auto specs = rope_jit_cache::read_manifest(path, rope_jit_cache::Ops{});
        if (specs.empty()) __builtin_trap();  // "names no spec" is a UsageError
    } catch (const rope_jit_cache::UsageError& e) {
        if (e.what()[0] == '\0') __builtin_trap();
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
    switch (data[0] % 3) {
        case 0: round_trip<rope_jit::KernelSpec>(text); break;
        case 1: round_trip<rope_jit::AttentionSpec>(text); break;
        default: read_manifest_text(text); break;
    }
    return 0;
}
