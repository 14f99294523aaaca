// libFuzzer target: JSON that becomes kernel specs. The first input byte picks the parser,
// the rest is the text:
//   0: KernelSpec::from_json (a cache entry's stored rope spec, and the manifest form);
//   1: AttentionSpec::from_json (a cache entry's stored attention spec);
//   2: rope-jit-cache's read_manifest (tools/kernel_spec_sets.cpp), read from a memfd.
// A parser must never crash; one that accepts a spec must give it back from its own to_json;
// one that refuses must say why (a non-empty error, or the manifest's UsageError).
//
// Two known manifest problems of issue 20 are kept out until the manifest reader bounds them
// itself (C1: deep nesting overflows the stack; C2: a short cross product runs for hours):
// inputs nested deeper than kMaxDepth, or expanding to more than kMaxSpecs specs, are skipped.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "kernel_spec_sets.h"
#include "ops/attention/attention_spec.h"
#include "ops/rope/kernel_spec.h"

namespace {

constexpr int kMaxDepth = 64;
constexpr size_t kMaxSpecs = 512;

// Bracket depth of the text, counted outside strings.
int nesting_depth(const std::string& text) {
    int depth = 0, deepest = 0;
    bool in_string = false, escaped = false;
    for (char c : text) {
        if (in_string) {
            if (escaped)
                escaped = false;
            else if (c == '\\')
                escaped = true;
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
    return deepest;
}

// How many specs the manifest's templates expand to (the product of each one's list sizes).
size_t expanded_specs(const nlohmann::json& manifest) {
    const nlohmann::json* templates = &manifest;
    if (manifest.is_object()) {
        if (!manifest.contains("specs")) return 0;
        templates = &manifest["specs"];
    }
    if (!templates->is_array()) return 0;
    size_t total = 0;
    for (const nlohmann::json& t : *templates) {
        if (!t.is_object()) continue;
        size_t product = 1;
        for (const auto& item : t.items()) {
            if (item.value().is_array()) product *= std::max<size_t>(item.value().size(), 1);
            if (product > kMaxSpecs) return kMaxSpecs + 1;
        }
        total += product;
        if (total > kMaxSpecs) return total;
    }
    return total;
}

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
    if (nesting_depth(text) > kMaxDepth) return;
    const nlohmann::json parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded() && expanded_specs(parsed) > kMaxSpecs) return;

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
