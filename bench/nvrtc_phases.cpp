// Where a cold compile's time goes, without a GPU: NVRTC's first use (dlopen, version and
// architectures, then the first compile that pulls in its builtins) against later compiles,
// and NVRTC 13's own per-phase timing (--time) for RoPE and attention kernels of the
// Llama-3-8B shape on sm_90. Built by hand against the library's objects (see
// bench/results/cold_start_notes.md); one fresh process per run:
//   nvrtc_phases [--time DIR]     prints one JSON line
//   nvrtc_phases --extra OPTION   every compile also gets OPTION ("-Ofast-compile=min"): times
//                                 and a hash of each binary, to compare with no option
//   nvrtc_phases --background early|after   a first attention forward and its backward
//                                 right after, with background builds queued at the
//                                 forward's first miss (early) or after its compile (after)
//   nvrtc_phases --rope-first early|off[-warm]   a fresh process's first RoPE compile with
//                                 its backward compiling beside it, or alone (-warm: NVRTC's
//                                 first use paid before)
//   nvrtc_phases --set THREADS    the Llama-3-8B training set (4 RoPE kernels of the preset,
//                                 the attention kernels of a forward and its backward) built
//                                 at once with build_binaries_parallel, the attention kernels
//                                 first (what prewarming a preset does)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../tests/attention_test_support.h"
#include "jit/background_builds.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "jit/parallel_builds.h"
#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_recipe.h"
#include "ops/attention/attention_spec.h"
#include "ops/attention/cuda_attention.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_cuda.h"
#include "ops/rope/rope_recipe.h"

using namespace rope_jit;
using Clock = std::chrono::steady_clock;

static double ms_since(Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

int main(int argc, char** argv) {
    std::string time_dir = argc > 2 && std::string(argv[1]) == "--time" ? argv[2] : "";
    std::string extra_option = argc > 2 && std::string(argv[1]) == "--extra" ? argv[2] : "";
    auto start = Clock::now();
    require_nvrtc();
    const double load_ms = ms_since(start);
    start = Clock::now();
    nvrtc_supported_archs();
    const double archs_ms = ms_since(start);

    // The Llama-3-8B RoPE spec (bf16 q and k, fp32 half table, D128, GQA 4, in place), its
    // backward, and the interleaved variant.
    KernelSpec rope{};
    rope.dtype = 2;
    rope.head_dim = rope.rotary_dim = 128;
    rope.has_k = 1;
    rope.gqa_group = 4;
    rope.vec = 8;
    rope.vec_loads = 1;
    KernelSpec back = rope;
    back.backward = 1;
    KernelSpec inter = rope;
    inter.interleaved = 1;
    std::vector<std::pair<std::string, KernelRecipe>> recipes = {
        {"rope_fwd", rope_recipe(rope)},
        {"rope_bwd", rope_recipe(back)},
        {"rope_interleaved", rope_recipe(inter)}};
    // The attention kernels of B=1 S=1024 Hq=32 Hk=8 D=128 causal bf16 on an H200 (sequence
    // length does not enter the choice; a short one keeps the host tensors small).
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 1;
    c.Hq = 32;
    c.Hk = 8;
    c.Sq = c.Sk = 16;
    c.D = c.R = 128;
    c.causal = true;
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    const AttentionDevice h200{90, 232448, true, true};
    // Named by kind ("attn_forward", "attn_backward-wgmma"...); the sm_90 prepare kernel,
    // which forward and backward share, once.
    for (bool backward : {false, true})
        for (const AttentionSpec& s :
             choose_attention_specs(make_attention_problem(args, backward), h200)) {
            const std::string json = s.to_json();
            const size_t kind_at = json.find("\"kind\": \"") != std::string::npos
                                       ? json.find("\"kind\": \"") + 9
                                       : json.find("\"kind\":\"") + 8;
            const std::string name =
                "attn_" + json.substr(kind_at, json.find('"', kind_at) - kind_at);
            bool seen = false;
            for (const auto& recipe : recipes) seen = seen || recipe.first == name;
            if (!seen) recipes.push_back({name, attention_recipe(s)});
        }

    if (argc > 2 && std::string(argv[1]) == "--rope-first") {
        // A fresh process's first RoPE compile (NVRTC's first use included) as the loader
        // builds it: "early" with its backward queued at the miss and compiling beside it
        // (today), "off" alone. Prints the forward's time.
        KernelStats stats;
        BackgroundBuilds::Limits limits;
        limits.threads = background_build_threads(std::thread::hardware_concurrency());
        BackgroundBuilds background(nullptr, stats, limits);
        // "early-warm" / "off-warm": NVRTC's first use paid before, by a one-line kernel.
        const std::string mode = argv[2];
        const bool early = mode.rfind("early", 0) == 0;
        if (mode.size() > 5 && mode.substr(mode.size() - 5) == "-warm")
            compile_cuda("extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }", "tiny.cu",
                         "sm_90", {"-lineinfo"});
        start = Clock::now();
        background.build_now(early ? rope_recipe_with_backward(rope) : rope_recipe(rope), "sm_90");
        std::printf("{\"scheduling\":\"%s\",\"first_ms\":%f}\n", argv[2], ms_since(start));
        return 0;
    }
    if (argc > 2 && std::string(argv[1]) == "--background") {
        // A first attention forward (with lse) and the first backward right after it, as a
        // runtime's loader builds them (BackgroundBuilds::build_now, memory-only), NVRTC
        // already warmed up. "early": today's build_now, which queues the backward's kernels
        // at the forward's first disk miss; "after": the follow-ups submitted only once the
        // forward kernel compiled (the scheduling before). Prints how long the forward's
        // builds took and how long the backward's then waited.
        const bool early = std::string(argv[2]) == "early";
        compile_cuda("extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }", "tiny.cu",
                     "sm_90", {"-lineinfo"});
        KernelStats stats;
        BackgroundBuilds::Limits limits;
        limits.threads = background_build_threads(std::thread::hardware_concurrency());
        BackgroundBuilds background(nullptr, stats, limits);
        const AttentionProblem forward = make_attention_problem(args, false);
        const AttentionProblem backward = make_attention_problem(args, true);
        std::vector<std::string> built;  // what the caller's "memory cache" holds
        start = Clock::now();
        for (const AttentionSpec& s : choose_attention_specs(forward, h200)) {
            KernelRecipe recipe = attention_recipe_with_backward(s, forward, h200);
            if (early) {
                background.build_now(recipe, "sm_90");
            } else {
                auto follow_ups = recipe.follow_ups;
                recipe.follow_ups = nullptr;
                background.build_now(recipe, "sm_90");
                // Before, only the forward kernel named them (not the prepare kernel).
                if (follow_ups && s.kind == int32_t(AttentionKernelKind::Forward))
                    for (KernelRecipe& next : follow_ups())
                        if (next.spec_json != recipe.spec_json) background.submit(next, "sm_90");
            }
            built.push_back(s.to_json());
        }
        const double forward_ms = ms_since(start);
        start = Clock::now();
        for (const AttentionSpec& s : choose_attention_specs(backward, h200))
            if (std::find(built.begin(), built.end(), s.to_json()) == built.end())
                background.build_now(attention_recipe_with_backward(s, backward, h200), "sm_90");
        std::printf("{\"scheduling\":\"%s\",\"threads\":%d,\"forward_ms\":%f,"
                    "\"backward_wait_ms\":%f}\n",
                    argv[2], limits.threads, forward_ms, ms_since(start));
        return 0;
    }
    if (argc > 2 && std::string(argv[1]) == "--set") {
        // The preset's RoPE kernels: bf16 full tables, forward and backward, implicit
        // positions and int64 indices; the attention kernels first (the longest).
        std::vector<KernelRecipe> set;
        for (size_t i = 3; i < recipes.size(); ++i) set.push_back(recipes[i].second);
        for (int backward : {0, 1})
            for (int indices : {0, 1}) {
                KernelSpec spec = rope;
                spec.table_dtype = 2;
                spec.table_full = 1;
                spec.backward = backward;
                spec.position_mode = indices;
                spec.positions_int64 = indices;
                set.push_back(rope_recipe(spec));
            }
        KernelStats stats;
        start = Clock::now();
        build_binaries_parallel(set, "sm_90", nullptr, stats, std::atoi(argv[2]));
        std::printf("{\"kernels\":%zu,\"threads\":%s,\"wall_ms\":%f,\"nvrtc_ms\":%f}\n", set.size(),
                    argv[2], ms_since(start), stats.compile_microseconds.load() / 1e3);
        return 0;
    }
    std::string json = "{";
    json += "\"load_ms\":" + std::to_string(load_ms) + ",\"archs_ms\":" + std::to_string(archs_ms);
    start = Clock::now();
    compile_cuda("extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }", "tiny.cu", "sm_90",
                 {"-lineinfo"});
    json += ",\"tiny_first_ms\":" + std::to_string(ms_since(start));
    start = Clock::now();
    std::vector<std::string> tiny_options = {"-lineinfo"};
    if (!time_dir.empty()) tiny_options.push_back("--time=" + time_dir + "/tiny.csv");
    compile_cuda("extern \"C\" __global__ void k(float* x) { x[0] = 2.0f; }", "tiny.cu", "sm_90",
                 tiny_options);
    json += ",\"tiny_second_ms\":" + std::to_string(ms_since(start));
    for (auto& [name, recipe] : recipes) {
        std::vector<std::string> extra = {"-lineinfo"};
        if (!time_dir.empty()) extra.push_back("--time=" + time_dir + "/" + name + ".csv");
        if (!extra_option.empty()) extra.push_back(extra_option);
        start = Clock::now();
        const std::string source = recipe.source();
        const double specialize_ms = ms_since(start);
        const CompileResult r = compile_cuda(
            source, recipe.template_name, recipe.compile_target("sm_90"), extra, kernel_headers());
        json +=
            ",\"" + name + "_ms\":" + std::to_string(ms_since(start)) + ",\"" + name +
            "_specialize_ms\":" + std::to_string(specialize_ms) + ",\"" + name +
            "_bytes\":" + std::to_string(r.binary.size()) + ",\"" + name + "_hash\":" +
            std::to_string(std::hash<std::string>{}(std::string(r.binary.begin(), r.binary.end())));
    }
    json += "}";
    std::printf("%s\n", json.c_str());
}
