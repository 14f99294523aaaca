// A guard for refactors of the RoPE launch path that must not change what runs: fingerprints
// of the PTX that a representative set of specs compiles to (sm_90), and the launch geometry
// (grid, block, dynamic shared memory) the host picks for a set of problems. Opt-in (skipped
// unless --no-skip): run once before a change with ROPE_JIT_FINGERPRINT_OUT=before.txt and once
// after with ROPE_JIT_FINGERPRINT_BASELINE=before.txt, which fails naming every line that
// differs:
//   build/tests/rope_jit_tests -tc='*fingerprint*' --no-skip
// ROPE_JIT_FINGERPRINT_TEMPLATES=<dir> compiles another version's kernels_templates/ (from
// git archive) in the same build; ROPE_JIT_FINGERPRINT_PTX_DIR=<dir> writes each spec's
// normalized PTX there, to diff. NVRTC emits every namespace-scope constexpr of a template as
// a global of the module, so adding or removing a named constant changes the PTX (data only).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/sha256.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/rope_cuda.h"
#include "ops/rope/rope_recipe.h"
#include "ops/rope/kernel_spec.h"
#include "kernel_spec_variants.h"

using rope_jit::KernelSpec;

namespace {

// The specs: every preamble constant takes each of its values at least once.
std::vector<KernelSpec> fingerprint_specs() {
    rope_test::SpecVariants variants(rope_test::llama_like_kernel_spec(), [](KernelSpec& spec) {
        if (spec.angles_from_inv_freq) spec.table_full = 0;  // no table to be full
    });
    auto add = [&](const rope_test::SpecVariants::Change& change) { variants.add(change); };
    add([](KernelSpec&) {});
    add([](KernelSpec& s) { s.backward = 1; });
    add([](KernelSpec& s) { s.interleaved = 1; });
    add([](KernelSpec& s) { s.interleaved = 1, s.table_full = 1; });
    add([](KernelSpec& s) { s.table_full = 1; });
    add([](KernelSpec& s) { s.rotary_dim = 64; });  // partial, in place
    add([](KernelSpec& s) {
        s.rotary_dim = 64, s.rotary_offset = 32, s.in_place_q = s.in_place_k = 0, s.copy_vec = 8;
    });
    add([](KernelSpec& s) { s.rotary_dim = 64, s.in_place_q = s.in_place_k = 0; });  // scalar copy
    add([](KernelSpec& s) {
        s.rotary_dim = 64, s.interleaved = 1, s.in_place_q = s.in_place_k = 0, s.copy_vec = 8;
    });
    add([](KernelSpec& s) {
        s.rotary_dim = 64, s.in_place_k = 0, s.copy_vec = 8;
    });                                                           // q in place only
    add([](KernelSpec& s) { s.in_place_q = s.in_place_k = 0; });  // full, out of place
    add([](KernelSpec& s) { s.position_mode = 1, s.positions_int64 = 1; });
    add([](KernelSpec& s) { s.position_mode = 1; });
    add([](KernelSpec& s) { s.position_mode = 2, s.seqlen_offsets_int64 = 1; });
    add([](KernelSpec& s) { s.packed = 1, s.cu_seqlens_int64 = 0; });
    add([](KernelSpec& s) { s.packed = 1, s.cu_seqlens_int64 = 1, s.position_mode = 2; });
    add([](KernelSpec& s) { s.angles_from_inv_freq = 1, s.table_vec_loads = 0; });
    add([](KernelSpec& s) {
        s.angles_from_inv_freq = 1, s.table_vec_loads = 0, s.inv_freq_dtype = 2;
    });
    add([](KernelSpec& s) { s.has_xpos = 1, s.k_own_angles = 1, s.xpos_dtype = 0; });
    add([](KernelSpec& s) { s.k_own_angles = 1; });
    add([](KernelSpec& s) { s.dtype = 1; });
    add([](KernelSpec& s) { s.dtype = 0, s.vec = 4; });
    add([](KernelSpec& s) { s.table_dtype = 2; });
    add([](KernelSpec& s) { s.table_dtype = 1, s.table_vec_loads = 0; });
    add([](KernelSpec& s) { s.vec = 1, s.vec_loads = 0, s.table_vec_loads = 0; });
    add([](KernelSpec& s) { s.vec = 2; });
    add([](KernelSpec& s) { s.vec = 4, s.interleaved = 1; });
    add([](KernelSpec& s) { s.has_k = 0, s.gqa_group = 1; });
    add([](KernelSpec& s) { s.gqa_group = 1; });
    add([](KernelSpec& s) { s.head_dim = s.rotary_dim = 80, s.gqa_group = 8; });
    add([](KernelSpec& s) { s.head_dim = s.rotary_dim = 256; });
    add([](KernelSpec& s) { s.head_dim = s.rotary_dim = 64, s.interleaved = 1, s.backward = 1; });
    add([](KernelSpec& s) { s.position_mode = 1, s.mrope_axes = 3; });
    add([](KernelSpec& s) {
        s.position_mode = 1, s.mrope_axes = 3, s.interleaved = 1, s.table_full = 1;
    });
    add([](KernelSpec& s) {
        s.backward = 1, s.angles_from_inv_freq = 1, s.table_vec_loads = 0, s.freq_grad = 1;
        s.in_place_q = s.in_place_k = 0;
    });
    add([](KernelSpec& s) {
        s.backward = 1, s.angles_from_inv_freq = 1, s.table_vec_loads = 0, s.freq_grad = 1,
        s.interleaved = 1;
        s.in_place_q = s.in_place_k = 0;
    });
    add([](KernelSpec& s) { s.block_threads = 256; });
    // Each module kind (rope_params.h, rope_module_kernels): the flat path, with copies; a KV
    // cache's direct entry, with QK-norm (norm_items). The bulk path's are above (partial rotary
    // out of place).
    add([](KernelSpec& s) { s.dense_rows = 1; });
    add([](KernelSpec& s) {
        s.dense_rows = 1, s.rotary_dim = 64, s.interleaved = 1, s.in_place_q = s.in_place_k = 0;
        s.copy_vec = 8;
    });
    add([](KernelSpec& s) {  // half style in rows of 8 vectors: partners by shuffles
        s.head_dim = 64, s.dense_rows = 1, s.rotary_dim = 32, s.in_place_q = s.in_place_k = 0;
        s.copy_vec = 8;
    });
    add([](KernelSpec& s) {
        s.in_place_k = 0, s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128;
        s.v_vec = 8;
    });
    add([](KernelSpec& s) {
        s.qk_norm = 1, s.norm_weight_dtype = 2, s.norm_weight_vec_loads = 1, s.in_place_k = 0;
        s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128, s.v_vec = 8;
    });
    return variants.specs();
}

// PTX without what depends on naming alone: comments, line info, register numbers, labels.
std::vector<std::string> normalized_ptx_lines(const std::string& ptx) {
    static const std::regex reg("(%[a-z]+)[0-9]+"), label("\\$L__[A-Za-z0-9_]+");
    std::vector<std::string> lines;
    std::istringstream in(ptx);
    std::string line;
    while (std::getline(in, line)) {
        const size_t start = line.find_first_not_of(" \t");
        if (start == std::string::npos) continue;
        line = line.substr(start);
        if (line.rfind("//", 0) == 0 || line.rfind(".loc", 0) == 0 || line.rfind(".file", 0) == 0)
            continue;
        if (line.rfind(".section", 0) == 0) break;  // debug sections follow the code
        line = std::regex_replace(std::regex_replace(line, reg, "$1"), label, "$L");
        lines.push_back(line);
    }
    return lines;
}

std::string hash_lines(const std::vector<std::string>& lines) {
    rope_jit::Sha256 hash;
    for (const std::string& line : lines) {
        hash.update(line);
        hash.update(std::string_view("\n", 1));
    }
    return hash.finish_hex().substr(0, 16);
}

// The text of a file of ROPE_JIT_FINGERPRINT_TEMPLATES.
std::string read_file(const std::string& path) {
    std::ifstream in(path);
    REQUIRE_MESSAGE(in.good(), "cannot read " << path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

// "lines=N multiset=H order=H": the sorted multiset of normalized lines, and their order. With
// ROPE_JIT_FINGERPRINT_PTX_DIR set, also writes the normalized PTX there as <index>.ptx, to
// diff when a fingerprint changes.
std::string ptx_fingerprint(const KernelSpec& spec, size_t index) {
    std::string source = rope_jit::specialize_kernel(spec);
    std::vector<rope_jit::NamedSource> headers = rope_jit::kernel_headers();
    if (const char* dir = std::getenv("ROPE_JIT_FINGERPRINT_TEMPLATES")) {
        source =
            spec.preamble() + "#line 1 \"rope.cu\"\n" + read_file(std::string(dir) + "/rope.cu");
        for (rope_jit::NamedSource& header : headers) {
            std::ifstream probe(std::string(dir) + "/" + header.name);
            if (probe.good()) header.source = read_file(std::string(dir) + "/" + header.name);
        }
    }
    const rope_jit::CompileResult ptx =
        rope_jit::compile_cuda(source, "rope.cu", "compute_90", {"-lineinfo"}, headers);
    std::vector<std::string> lines = normalized_ptx_lines(std::string(ptx.binary.data()));
    if (const char* dir = std::getenv("ROPE_JIT_FINGERPRINT_PTX_DIR")) {
        std::ofstream file(std::string(dir) + "/" + std::to_string(index) + ".ptx");
        for (const std::string& line : lines) file << line << "\n";
    }
    const std::string order = hash_lines(lines);
    std::sort(lines.begin(), lines.end());
    return "lines=" + std::to_string(lines.size()) + " multiset=" + hash_lines(lines) +
           " order=" + order;
}

std::string launch_fingerprint(const KernelSpec& spec, int64_t heads_q, int64_t heads_k,
                               int64_t units, int64_t sms) {
    try {
        const rope_jit::RopeLaunch launch =
            rope_jit::plan_rope_launch(spec, heads_q, heads_k, units, sms, true);
        return "grid=" + std::to_string(launch.blocks) +
               " block=" + std::to_string(launch.threads) +
               " shared=" + std::to_string(launch.shared_bytes) +
               " tokens=" + std::to_string(launch.tokens_per_block);
    } catch (const rope_jit::Error& e) {
        return std::string("error: ") + e.what();
    }
}

}  // namespace

TEST_CASE("RoPE codegen fingerprint: PTX of representative specs and launch geometry" *
          doctest::skip()) {
    std::vector<std::string> lines;
    const std::vector<KernelSpec> specs = fingerprint_specs();
    const bool nvrtc = rope_jit::nvrtc_api() != nullptr;
    if (!nvrtc) MESSAGE("NVRTC not available: launch geometry only");
    for (size_t i = 0; i < specs.size(); ++i) {
        const KernelSpec& spec = specs[i];
        CAPTURE(spec.describe());
        spec.validate();
        const std::string name = "spec " + std::to_string(i) + " [" + spec.describe() + "]";
        if (nvrtc) lines.push_back(name + " ptx " + ptx_fingerprint(spec, i));
        const int64_t heads_k = spec.has_k ? 8 : 0;
        const int64_t heads_q = spec.has_k ? heads_k * spec.gqa_group : 32;
        struct Shape {
            int64_t units, sms;
        };
        for (const Shape shape :
             {Shape{1, 132}, Shape{7, 132}, Shape{4 * 4096, 132}, Shape{32768, 132},
              Shape{8 * 2048, 16}, Shape{int64_t(3) << 40, 132}})
            lines.push_back(name + " launch units=" + std::to_string(shape.units) +
                            " sms=" + std::to_string(shape.sms) + " hq=" + std::to_string(heads_q) +
                            " hk=" + std::to_string(heads_k) + ": " +
                            launch_fingerprint(spec, heads_q, heads_k, shape.units, shape.sms));
        // One head, and many heads: the block fit's extremes.
        lines.push_back(name + " launch one head: " +
                        launch_fingerprint(spec, 1, spec.has_k ? 1 : 0, 4096, 132));
        lines.push_back(name + " launch 128 heads: " +
                        launch_fingerprint(spec, 128, spec.has_k ? 128 : 0, 4096, 132));
    }
    // Shared memory that does not fit one token: a wide inv_freq spec with M-RoPE rows.
    KernelSpec wide = specs.front();
    wide.head_dim = wide.rotary_dim = 8192;
    wide.angles_from_inv_freq = 1, wide.k_own_angles = 1, wide.table_vec_loads = 0;
    wide.table_full = 0;
    lines.push_back("wide inv_freq launch: " + launch_fingerprint(wide, 8, 8, 100, 132));

    if (const char* out = std::getenv("ROPE_JIT_FINGERPRINT_OUT")) {
        std::ofstream file(out);
        for (const std::string& line : lines) file << line << "\n";
        MESSAGE("wrote " << lines.size() << " fingerprint lines to " << out);
    }
    if (const char* baseline = std::getenv("ROPE_JIT_FINGERPRINT_BASELINE")) {
        std::ifstream file(baseline);
        REQUIRE_MESSAGE(file.good(), "cannot read " << baseline);
        std::vector<std::string> expected;
        for (std::string line; std::getline(file, line);) expected.push_back(line);
        CHECK(expected.size() == lines.size());
        for (size_t i = 0; i < std::min(expected.size(), lines.size()); ++i) {
            CAPTURE(i);
            CHECK(lines[i] == expected[i]);
        }
    }
}
