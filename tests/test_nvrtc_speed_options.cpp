// The options compile_cuda adds to make NVRTC faster (nvrtc_compiler.cpp, speed_options) are
// left out of CompileResult::options, and so of every cache key, because they change no code.
// This checks that claim where it matters: each kind of module the templates make compiles to
// the same cubin, byte for byte, with NVRTC called directly without -minimal.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "attention_test_support.h"
#include "common/error.h"
#include "jit/kernel_recipe.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "kernel_spec_variants.h"
#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_recipe.h"
#include "ops/rope/rope_recipe.h"

using namespace rope_jit;

namespace {

// The cubin of `source` from NVRTC itself, with `options` alone, plus --no-cache where NVRTC
// has the driver's compute cache (it only keeps this test from writing there).
std::vector<char> cubin_without_speed_options(const std::string& source, const std::string& name,
                                              const std::vector<std::string>& options) {
    const NvrtcApi& api = require_nvrtc();
    std::vector<const char*> names, texts;
    for (const NamedSource& header : kernel_headers()) {
        names.push_back(header.name.c_str());
        texts.push_back(header.source.c_str());
    }
    nvrtcProgram program = nullptr;
    REQUIRE(api.nvrtcCreateProgram(&program, source.c_str(), name.c_str(), int(names.size()),
                                   texts.data(), names.data()) == NVRTC_SUCCESS);
    std::vector<const char*> pointers;
    for (const std::string& option : options) pointers.push_back(option.c_str());
    int major = 0, minor = 0;
    REQUIRE(api.nvrtcVersion(&major, &minor) == NVRTC_SUCCESS);
    if (major > 12 || (major == 12 && minor >= 9)) pointers.push_back("--no-cache");
    const nvrtcResult compiled =
        api.nvrtcCompileProgram(program, int(pointers.size()), pointers.data());
    size_t size = 0;
    std::vector<char> cubin;
    if (compiled == NVRTC_SUCCESS && api.nvrtcGetCUBINSize(program, &size) == NVRTC_SUCCESS) {
        cubin.resize(size);
        if (api.nvrtcGetCUBIN(program, cubin.data()) != NVRTC_SUCCESS) cubin.clear();
    }
    api.nvrtcDestroyProgram(&program);
    REQUIRE(compiled == NVRTC_SUCCESS);
    return cubin;
}

void check_same_cubin(const KernelRecipe& recipe) {
    CAPTURE(recipe.spec_json);
    const std::string source = recipe.source();
    const CompileResult result =
        compile_cuda(source, recipe.template_name, recipe.compile_target("sm_90"), {},
                     kernel_headers());
    REQUIRE_FALSE(result.is_ptx);
    for (const std::string& option : result.options) {
        CHECK(option != "-minimal");
        CHECK(option != "--no-cache");
    }
    const std::vector<char> reference =
        cubin_without_speed_options(source, recipe.template_name, result.options);
    CHECK(reference.size() == result.binary.size());
    CHECK(reference == result.binary);
}

// Whether this NVRTC has -minimal (12.4 and later).
bool has_minimal() {
    const std::string& version = nvrtc_version_string();
    const size_t dot = version.find('.');
    const int major = std::stoi(version.substr(0, dot)), minor = std::stoi(version.substr(dot + 1));
    return major > 12 || (major == 12 && minor >= 4);
}

}  // namespace

TEST_CASE("a caller's option NVRTC refuses fails that compile and leaves the speed options on") {
    if (nvrtc_api() == nullptr) {
        MESSAGE("NVRTC not available: " << nvrtc_load_error());
        return;
    }
    const std::vector<std::string> before = nvrtc_speed_options();
    CHECK_THROWS_AS(compile_cuda("extern \"C\" __global__ void k() {}", "k.cu", "sm_90",
                                 {"--no-such-option"}),
                    Error);
    CHECK(nvrtc_speed_options() == before);
    if (has_minimal()) CHECK(std::find(before.begin(), before.end(), "-minimal") != before.end());
}

TEST_CASE("NVRTC's speed options change no code: every kind of module compiles to the same "
          "cubin without them") {
    if (nvrtc_api() == nullptr) {
        MESSAGE("NVRTC not available: " << nvrtc_load_error());
        return;
    }
    // The comparison means something only where compile_cuda adds -minimal.
    if (!has_minimal()) {
        MESSAGE("NVRTC " << nvrtc_version_string() << " has no -minimal");
        return;
    }
    const std::vector<std::string> speed = nvrtc_speed_options();
    REQUIRE(std::find(speed.begin(), speed.end(), "-minimal") != speed.end());
    // RoPE: the staged path; the flat path; the bulk path (partial rotary out of place); a KV
    // cache's direct entry; QK-norm on rope_norm.cu.
    rope_test::SpecVariants variants(rope_test::llama_like_kernel_spec());
    variants.add([](KernelSpec&) {});
    variants.add([](KernelSpec& s) { s.dense_rows = 1; });
    variants.add([](KernelSpec& s) {
        s.rotary_dim = 64, s.in_place_q = s.in_place_k = 0, s.copy_vec = 8;
    });
    variants.add([](KernelSpec& s) {
        s.in_place_k = 0, s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128;
        s.v_vec = 8;
    });
    variants.add([](KernelSpec& s) {
        s.qk_norm = 1, s.block_threads = 256, s.norm_weight_dtype = 2, s.norm_weight_vec_loads = 1;
    });
    for (const KernelSpec& spec : variants.specs()) check_same_cubin(rope_recipe(spec));

    // Attention: the sm_90 forward (wgmma, sm_90a) of a Llama-like causal problem.
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 1, c.Hq = 32, c.Hk = 8, c.Sq = c.Sk = 16, c.D = c.R = 128, c.causal = true;
    std::mt19937 rng(1);
    attention_test::Problem problem(c, rng);
    const AttentionDevice h200{90, 232448, true, true};
    const std::vector<AttentionSpec> specs =
        choose_attention_specs(make_attention_problem(problem.args(), false), h200);
    REQUIRE_FALSE(specs.empty());
    check_same_cubin(attention_recipe(specs.back()));
}
