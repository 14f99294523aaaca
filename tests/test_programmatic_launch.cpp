// rope_jit_config.programmatic_launch, what can be checked without a GPU: every RoPE kernel,
// compiled for sm_90, waits for the preceding grid (griddepcontrol.wait) before its first access
// to global memory, and then lets the next grid launch; for older targets it has neither
// instruction (they do not exist there), so only modules compiled for sm_90 or later launch
// programmatically; the setting's default (AUTO), its values and the environment variable; the
// driver versions AUTO takes. The GPU suite (test_gpu_programmatic_launch.cpp) checks the results
// of programmatic launches against plain ones.
#include <doctest/doctest.h>

#include <algorithm>
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
#include "ops/rope/rope_plan.h"
#include "ops/rope/rope_recipe.h"
#include "kernel_spec_variants.h"

using rope_jit::KernelSpec;

namespace {

// The kinds of RoPE kernel: rope.cu's staged and direct paths, out-of-place copies (and the
// bulk path's entry), the frequency gradient, the KV cache with FP8, QK-norm forwards on
// rope.cu and on rope_norm.cu, rope_norm.cu's backward, and the flat path over dense rows (its
// item loop, and half-style out-of-place partial rotary by shuffles).
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
    add([](KernelSpec& s) { s.dense_rows = 1; });
    add([](KernelSpec& s) {
        s.dense_rows = 1, s.head_dim = 64, s.rotary_dim = 32, s.in_place_q = s.in_place_k = 0;
        s.copy_vec = 8;
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
    const std::vector<KernelSpec> kinds = kernel_kinds();
    // The flat kinds stay flat (the variants' validate() would not say if they did not).
    CHECK(rope_jit::rope_plan(kinds[kinds.size() - 2]).flat_rows);
    CHECK(rope_jit::rope_plan(kinds.back()).flat_shuffles);
    for (const KernelSpec& spec : kinds) {
        CAPTURE(spec.describe());
        // Each entry of the module on its own: a module holds up to four, the ones its plan
        // does not run left empty (no access, no wait).
        struct Entry {
            std::string name;
            bool kernel = true;  // false: a device function (.func), not inlined
            bool waited = false, released = false;
            int accesses = 0, accesses_before_wait = 0;
        };
        // A device function that ptxas did not inline counts where its caller calls it.
        static const std::regex func_name("\\.func\\s+(\\([^)]*\\)\\s*)?([A-Za-z_$][\\w$]*)");
        std::vector<Entry> entries;
        std::vector<std::string> lines;
        {
            std::istringstream ptx(ptx_of(spec, "compute_90"));
            for (std::string line; std::getline(ptx, line);) lines.push_back(line);
        }
        std::vector<std::string> global_funcs;  // functions that touch global memory
        {
            std::string current;
            for (const std::string& line : lines) {
                std::smatch match;
                if (line.find(".entry") != std::string::npos) current.clear();
                if (std::regex_search(line, match, func_name)) current = match[2];
                if (!current.empty() && touches_global_memory(line) &&
                    std::find(global_funcs.begin(), global_funcs.end(), current) ==
                        global_funcs.end())
                    global_funcs.push_back(current);
            }
        }
        const auto calls_global_func = [&](const std::string& line) {
            if (line.find("call") == std::string::npos) return false;
            for (const std::string& name : global_funcs)
                if (line.find(name) != std::string::npos) return true;
            return false;
        };
        for (const std::string& line : lines) {
            const bool entry_line = line.find(".entry") != std::string::npos;
            if (entry_line || std::regex_search(line, func_name)) {
                entries.push_back(Entry{line, entry_line});
                continue;
            }
            if (entries.empty() || !entries.back().kernel) continue;
            Entry& entry = entries.back();
            if (line.find("griddepcontrol.wait") != std::string::npos) entry.waited = true;
            if (line.find("griddepcontrol.launch_dependents") != std::string::npos) {
                CAPTURE(entry.name);
                CHECK(entry.waited);  // the trigger after the wait: at most two grids overlap
                entry.released = true;
            }
            if (touches_global_memory(line) || calls_global_func(line)) {
                ++entry.accesses;
                if (!entry.waited) {
                    ++entry.accesses_before_wait;
                    CAPTURE(entry.name);
                    CAPTURE(line);
                    CHECK(entry.waited);
                }
            }
        }
        int bodies = 0;
        for (const Entry& entry : entries) {
            if (entry.accesses == 0) continue;  // an entry this plan leaves empty
            CAPTURE(entry.name);
            ++bodies;
            CHECK(entry.waited);
            CHECK(entry.released);
            CHECK(entry.accesses_before_wait == 0);
        }
        CHECK(bodies > 0);  // the scan sees the module's accesses at all
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
    // The environment variable overrides a valid field, not a bad one.
    env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", "0");
    rope_jit_runtime* runtime = nullptr;
    CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(runtime == nullptr);
    config.programmatic_launch = ROPE_JIT_PROGRAMMATIC_ON;
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

namespace {

rope_jit::CUresult fake_cu_launch_kernel_ex(const rope_jit::CUlaunchConfig*, rope_jit::CUfunction,
                                            void**, void**) {
    return rope_jit::CUDA_SUCCESS;
}

}  // namespace

TEST_CASE(
    "a launch asked to be programmatic is one only on sm_90 and later, for a module compiled for "
    "sm_90 or later (an older module's kernels have no wait), with cuLaunchKernelEx") {
    rope_jit::CudaDriverApi api;
    // No cuLaunchKernelEx (a driver before CUDA 12.0): never.
    CHECK_FALSE(rope_jit::launches_programmatically(api, true, 90, 90));
    api.cuLaunchKernelEx = fake_cu_launch_kernel_ex;
    CHECK(rope_jit::launches_programmatically(api, true, 90, 90));
    CHECK(rope_jit::launches_programmatically(api, true, 100, 90));  // sm_90 PTX on a newer GPU
    CHECK_FALSE(rope_jit::launches_programmatically(api, false, 90, 90));
    CHECK_FALSE(rope_jit::launches_programmatically(api, true, 89, 89));
    // An H100 whose NVRTC could only compile compute_80 (choose_target's fallback).
    // (Its kernels have no griddepcontrol: the test of compute_80's PTX.)
    CHECK_FALSE(rope_jit::launches_programmatically(api, true, 90, 80));
}

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
