// ROPE_JIT_NVRTC_EXTRA_OPTIONS: per-kernel NVRTC options from the environment, for A/B runs of
// options that change the code (--Ofast-compile). Rules are matched against a spec's JSON;
// the options reach NVRTC and the cache key.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cache/cache_maintenance.h"
#include "cache/disk_cache.h"
#include "common/error.h"
#include "env_guard.h"
#include "gpu_test_support.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_extra_options.h"
#include "jit/nvrtc_loader.h"

using rope_jit::nvrtc_extra_options_for;
using Options = std::vector<std::string>;

namespace {

const std::string kAttentionBackward =
    R"({"op":"attention","kind":"backward","head_dim":128,"causal":true})";
const std::string kAttentionForward =
    R"({"op":"attention","kind":"forward","head_dim":128,"causal":true})";
const std::string kRope = R"({"op":"rope","head_dim":64,"style":"half"})";

rope_jit::KernelRecipe tiny_recipe() {
    rope_jit::KernelRecipe recipe;
    recipe.spec_json = R"({"op":"extra-options-test","n":1})";
    recipe.template_name = "tiny.cu";
    recipe.entry = "tiny_kernel";
    recipe.source = [] {
        return std::string(
            "extern \"C\" __global__ void tiny_kernel(float* x) { x[0] += 1.0f; }\n");
    };
    return recipe;
}

}  // namespace

TEST_CASE("extra NVRTC option rules select kernels by their spec's fields") {
    const std::string rules =
        "op=attention kind=backward: --Ofast-compile=min; op=rope: --Ofast-compile=mid -G0;"
        " head_dim=128 causal=true : -DEXTRA=1";
    CHECK(nvrtc_extra_options_for(kAttentionBackward, rules) ==
          Options{"--Ofast-compile=min", "-DEXTRA=1"});
    CHECK(nvrtc_extra_options_for(kAttentionForward, rules) == Options{"-DEXTRA=1"});
    CHECK(nvrtc_extra_options_for(kRope, rules) == Options{"--Ofast-compile=mid", "-G0"});
    // No conditions: every kernel. Empty rules and stray separators are no rules.
    CHECK(nvrtc_extra_options_for(kRope, " --Ofast-compile=min ;; ") ==
          Options{"--Ofast-compile=min"});
    CHECK(nvrtc_extra_options_for(kRope, "").empty());
    CHECK(nvrtc_extra_options_for(kRope, " ; ").empty());
    // A field the spec lacks, or a spec that is not JSON, matches no condition.
    CHECK(nvrtc_extra_options_for(kRope, "kind=backward: -DX").empty());
    CHECK(nvrtc_extra_options_for("not json", "op=rope: -DX").empty());
    CHECK(nvrtc_extra_options_for("not json", "-DX") == Options{"-DX"});
}

TEST_CASE("a malformed extra NVRTC option rule is an error naming the variable and the rule") {
    const auto error_of = [](const std::string& rules) {
        try {
            nvrtc_extra_options_for(kRope, rules);
        } catch (const rope_jit::Error& e) {
            CHECK(e.status() == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            return std::string(e.what());
        }
        return std::string("no error");
    };
    CHECK(error_of("op=rope: Ofast") ==
          "ROPE_JIT_NVRTC_EXTRA_OPTIONS: rule 1 ('op=rope: Ofast'): option 'Ofast' does not "
          "start with '-'");
    CHECK(error_of("-DX; op=rope:") ==
          "ROPE_JIT_NVRTC_EXTRA_OPTIONS: rule 2 (' op=rope:'): names no option");
    CHECK(error_of("rope: -DX") ==
          "ROPE_JIT_NVRTC_EXTRA_OPTIONS: rule 1 ('rope: -DX'): condition 'rope' is not "
          "FIELD=VALUE");
    CHECK(error_of("=rope: -DX").find("condition '=rope' is not FIELD=VALUE") !=
          std::string::npos);
}

TEST_CASE("extra NVRTC options reach the compile and the cache key") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    const rope_jit::KernelRecipe recipe = tiny_recipe();
    EnvGuard env;
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", nullptr);
    const rope_jit::CompilePlan plain = rope_jit::plan_compile(recipe.spec_json, "sm_90");
    CHECK(plain.extra_options == Options{"-lineinfo"});
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", "op=rope: -DNOT_THIS_ONE; --Ofast-compile=min");
    const rope_jit::CompilePlan fast = rope_jit::plan_compile(recipe.spec_json, "sm_90");
    CHECK(fast.extra_options == Options{"-lineinfo", "--Ofast-compile=min"});
    CHECK(fast.options.back() == "--Ofast-compile=min");
    CHECK(fast.entry.key_hex != plain.entry.key_hex);

    // Built with the option into a cache: its own entry; without it, another (no disk hit).
    gpu_test::TempDir dir("rope_jit_extra_options_");
    rope_jit::DiskCache disk(dir.path(), {});
    rope_jit::KernelStats stats;
    CHECK(rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats).compiled);
    CHECK(disk.load(fast.entry));
    CHECK_FALSE(disk.load(plain.entry));
    // An option NVRTC rejects is a compile error that names it.
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", "--no-such-nvrtc-option");
    try {
        rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats);
        FAIL("no error");
    } catch (const rope_jit::Error& e) {
        CHECK(e.status() == ROPE_JIT_ERROR_COMPILE);
        CHECK(std::string(e.what()).find("--no-such-nvrtc-option") != std::string::npos);
    }
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", nullptr);
    CHECK(rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats).compiled);
    CHECK(disk.load(plain.entry));
    CHECK(stats.compiles.load() == 2);
}

TEST_CASE("cache maintenance judges entries by the build's options and the variable's, never "
          "by a malformed variable") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    const rope_jit::KernelRecipe recipe = tiny_recipe();
    EnvGuard env;
    gpu_test::TempDir dir("rope_jit_extra_options_scan_");
    rope_jit::DiskCache disk(dir.path(), {});
    rope_jit::KernelStats stats;
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", nullptr);
    REQUIRE(rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats).compiled);
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", "--Ofast-compile=min");
    REQUIRE(rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats).compiled);
    auto states = [&] {
        std::vector<rope_jit::CacheItemState> found;
        for (const rope_jit::CacheItem& item : rope_jit::scan_cache(disk))
            found.push_back(item.state);
        return found;
    };
    using State = rope_jit::CacheItemState;
    // With the rule set: both current (a prune in an A/B shell loses nothing).
    CHECK(states() == std::vector<State>{State::Ok, State::Ok});
    // A malformed variable: the defaults' entry stays current, the A/B one is judged stale.
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", "op=rope");
    std::vector<State> malformed = states();
    std::sort(malformed.begin(), malformed.end());
    CHECK(std::count(malformed.begin(), malformed.end(), State::Ok) == 1);
    // Unset: the same.
    env.set("ROPE_JIT_NVRTC_EXTRA_OPTIONS", nullptr);
    std::vector<State> unset = states();
    CHECK(std::count(unset.begin(), unset.end(), State::Ok) == 1);
}
