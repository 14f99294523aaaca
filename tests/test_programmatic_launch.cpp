// rope_jit_config.programmatic_launch, what can be checked without a GPU: every RoPE kernel,
// compiled for sm_90, waits for the preceding grid (griddepcontrol.wait) before its first access
// to global memory, and then lets the next grid launch; for older targets it has neither
// instruction (they do not exist there). The GPU suite (test_gpu_programmatic_launch.cpp) checks
// the results of programmatic launches against plain ones.
#include <doctest/doctest.h>

#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernel_launch.h"
#include "env_guard.h"
#include "jit/kernel_source.h"
#include "rope_jit/rope_jit.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_recipe.h"
#include "kernel_spec_variants.h"

using rope_jit::KernelSpec;

namespace {

// The kinds of RoPE kernel: rope.cu's staged and direct paths, out-of-place copies, the
// frequency gradient, the KV cache with FP8, QK-norm forwards on rope.cu and on rope_norm.cu,
// and rope_norm.cu's backward.
std::vector<KernelSpec> kernel_kinds() {
    KernelSpec base = rope_test::llama_like_kernel_spec();
    base.table_dtype = 2;
    base.position_mode = 1;
    base.positions_int64 = 1;
    rope_test::SpecVariants variants(base, [](KernelSpec& spec) { spec.validate(); });
    auto add = [&](const rope_test::SpecVariants::Change& change) { variants.add(change); };
    add([](KernelSpec&) {});
    add([](KernelSpec& s) { s.rotary_dim = 32, s.in_place_q = s.in_place_k = 0, s.copy_vec = 8; });
    add([](KernelSpec& s) {
        s.backward = 1, s.angles_from_inv_freq = 1, s.table_full = 0, s.table_vec_loads = 0;
        s.table_dtype = 0;
        s.freq_grad = 1, s.in_place_q = s.in_place_k = 0;
    });
    add([](KernelSpec& s) {
        s.in_place_k = 0, s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128;
        s.v_vec = 8;
    });
    // QK-norm forwards: on rope_norm.cu (its blocks of 256 threads), and with a KV cache on
    // rope.cu's direct path (every feature rotated; its blocks) or on rope_norm.cu (partial).
    add([](KernelSpec& s) {
        s.qk_norm = 1, s.block_threads = 256, s.norm_weight_dtype = 2, s.norm_weight_vec_loads = 1;
    });
    add([](KernelSpec& s) {
        s.qk_norm = 1, s.norm_weight_dtype = 2, s.norm_weight_vec_loads = 1, s.in_place_k = 0;
        s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128, s.v_vec = 8;
    });
    add([](KernelSpec& s) {
        s.qk_norm = 1, s.block_threads = 256, s.norm_weight_dtype = 2, s.norm_weight_vec_loads = 1,
        s.in_place_k = 0, s.rotary_dim = 64, s.copy_vec = 8;
        s.kv_cache = 2, s.kv_index_int64 = 1, s.kv_fp8 = 1, s.v_dim = 128, s.v_vec = 8;
    });
    add([](KernelSpec& s) {
        s.qk_norm = 1, s.block_threads = 256, s.norm_weight_dtype = 2, s.backward = 1,
        s.norm_weight_grad = 1;
        s.in_place_q = s.in_place_k = 0;
    });
    return variants.specs();
}

std::string ptx_of(const KernelSpec& spec, const char* arch) {
    const rope_jit::CompileResult ptx = rope_jit::compile_cuda(
        rope_jit::specialize_kernel(spec), "rope.cu", arch, {}, rope_jit::kernel_headers());
    return std::string(ptx.binary.data());
}

// The PTX lines of the kernel's body (after its entry) that touch memory other than the
// parameter, constant, local and shared spaces: global and generic loads, stores, atomics,
// reductions, asynchronous and bulk copies, prefetches.
bool touches_global_memory(const std::string& line) {
    static const std::regex access(
        "^\\s*(@!?%p[0-9]+\\s+)?(ld|st|atom|red|cp|prefetch|cvta\\.to\\.global|multimem)\\.");
    static const std::regex other_space("\\.(param|const|local|shared)[.\\s]");
    if (line.find("cvta.to.global") != std::string::npos) return false;  // address arithmetic
    return std::regex_search(line, access) && !std::regex_search(line, other_space);
}

}  // namespace

TEST_CASE("RoPE kernels wait for the preceding grid before touching global memory (sm_90)") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    for (const KernelSpec& spec : kernel_kinds()) {
        CAPTURE(spec.describe());
        std::istringstream ptx(ptx_of(spec, "compute_90"));
        std::string line;
        bool in_kernel = false, waited = false, released = false;
        int accesses_before_wait = 0, accesses = 0;
        while (std::getline(ptx, line)) {
            if (line.find(".entry") != std::string::npos) in_kernel = true;
            if (!in_kernel) continue;
            if (line.find("griddepcontrol.wait") != std::string::npos) waited = true;
            if (line.find("griddepcontrol.launch_dependents") != std::string::npos) {
                CHECK(waited);  // the trigger after the wait: at most two grids overlap
                released = true;
            }
            if (touches_global_memory(line)) {
                ++accesses;
                if (!waited) {
                    ++accesses_before_wait;
                    CAPTURE(line);
                    CHECK(waited);
                }
            }
        }
        CHECK(in_kernel);
        CHECK(waited);
        CHECK(released);
        CHECK(accesses > 0);  // the scan sees the kernel's accesses at all
        CHECK(accesses_before_wait == 0);
    }
}

TEST_CASE("RoPE kernels for targets before sm_90 have no grid dependency instructions") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    for (const KernelSpec& spec : {kernel_kinds().front(), kernel_kinds()[4]}) {
        CAPTURE(spec.describe());
        CHECK(ptx_of(spec, "compute_80").find("griddepcontrol") == std::string::npos);
    }
}

TEST_CASE(
    "programmatic_launch is AUTO by default; AUTO, OFF and ON are accepted (a CPU runtime has "
    "nothing to launch), any other value is refused by name") {
    EnvGuard env;
    env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", nullptr);
    rope_jit_config config;
    rope_jit_config_init(&config);
    CHECK(config.programmatic_launch == ROPE_JIT_PROGRAMMATIC_AUTO);
    CHECK(ROPE_JIT_PROGRAMMATIC_AUTO == -1);
    CHECK(ROPE_JIT_PROGRAMMATIC_OFF == 0);
    CHECK(ROPE_JIT_PROGRAMMATIC_ON == 1);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    for (const int setting :
         {ROPE_JIT_PROGRAMMATIC_AUTO, ROPE_JIT_PROGRAMMATIC_OFF, ROPE_JIT_PROGRAMMATIC_ON}) {
        CAPTURE(setting);
        config.programmatic_launch = setting;
        rope_jit_runtime* runtime = nullptr;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        CHECK(rope_jit_backend(runtime) == ROPE_JIT_BACKEND_CPU);
        rope_jit_runtime_free(runtime);
    }
    for (const int setting : {2, -2, 256}) {
        CAPTURE(setting);
        config.programmatic_launch = setting;
        rope_jit_runtime* runtime = nullptr;
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(runtime == nullptr);
        const std::string error = rope_jit_last_error();
        CHECK(error.find("programmatic_launch") != std::string::npos);
        CHECK(error.find(std::to_string(setting)) != std::string::npos);
    }
    // The environment variable overrides the field, a bad field value included.
    env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", "0");
    rope_jit_runtime* runtime = nullptr;
    CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    rope_jit_runtime_free(runtime);
}

namespace {

int fake_driver_version = 0;

rope_jit::CUresult fake_cu_driver_get_version(int* version) {
    *version = fake_driver_version;
    return rope_jit::CUDA_SUCCESS;
}

}  // namespace

TEST_CASE(
    "programmatic launches are asked for: ON always, OFF never, AUTO from CUDA 12.3 (graphs "
    "capture them as programmatic edges)") {
    rope_jit::CudaDriverApi api;
    CHECK(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_ON));
    CHECK_FALSE(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_OFF));
    // No cuDriverGetVersion: AUTO launches plainly.
    CHECK_FALSE(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_AUTO));
    api.cuDriverGetVersion = fake_cu_driver_get_version;
    for (const auto& [version, wanted] : std::vector<std::pair<int, bool>>{
             {11080, false}, {12000, false}, {12020, false}, {12030, true}, {13000, true}}) {
        CAPTURE(version);
        fake_driver_version = version;
        CHECK(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_AUTO) == wanted);
        CHECK(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_ON));
        CHECK_FALSE(rope_jit::programmatic_launch_requested(api, ROPE_JIT_PROGRAMMATIC_OFF));
    }
}

TEST_CASE(
    "ROPE_JIT_PROGRAMMATIC_LAUNCH: 0, 1 and empty are accepted, anything else is refused by name") {
    EnvGuard env;
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    for (const char* value : {"0", "1", ""}) {
        CAPTURE(value);
        env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", value);
        rope_jit_runtime* runtime = nullptr;
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        rope_jit_runtime_free(runtime);
    }
    for (const char* value : {"yes", "2", " 1"}) {
        CAPTURE(value);
        env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", value);
        rope_jit_runtime* runtime = nullptr;
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(runtime == nullptr);
        CHECK(std::string(rope_jit_last_error()).find("ROPE_JIT_PROGRAMMATIC_LAUNCH") !=
              std::string::npos);
    }
}
