// Background builds (a compiled forward's backward kernels, built off the caller's thread)
// and parallel prewarming: both run the shared builder, so they are tested with recipes and
// NVRTC alone, no GPU. Jobs whose source() blocks until the test releases them make
// "running" and "queued" states deterministic.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/prewarm_specs.h"
#include "attention_test_support.h"
#include "cache/disk_cache.h"
#include "common/error.h"
#include "env_guard.h"
#include "gpu_rope_problem.h"
#include "kernel_spec_variants.h"
#include "gpu_test_support.h"
#include "jit/background_builds.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_loader.h"
#include "jit/parallel_builds.h"
#include "ops/attention/attention_recipe.h"
#include "ops/attention/cuda_attention.h"
#include "ops/rope/rope_cuda.h"
#include "ops/rope/rope_recipe.h"

using rope_jit::BackgroundBuilds;
using rope_jit::DiskCache;
using rope_jit::KernelBinary;
using rope_jit::KernelRecipe;
using rope_jit::KernelSpec;
using rope_jit::KernelStats;

namespace {

// A gate the test opens: jobs whose source() waits on it stay "running" until then.
class Gate {
public:
    void open() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            open_ = true;
        }
        changed_.notify_all();
    }
    void wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        ++waiting_;
        changed_.notify_all();
        changed_.wait(lock, [&] { return open_; });
    }
    // Blocks until `n` callers wait (or have waited) at the gate.
    void wait_for_waiters(int n) {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return waiting_ >= n; });
    }
    // The same, giving up after `timeout`: whether they came (a test that would otherwise hang
    // fails instead).
    bool waiters_within(int n, std::chrono::seconds timeout) {
        std::unique_lock<std::mutex> lock(mutex_);
        return changed_.wait_for(lock, timeout, [&] { return waiting_ >= n; });
    }

private:
    std::mutex mutex_;
    std::condition_variable changed_;
    bool open_ = false;
    int waiting_ = 0;
};

// A tiny kernel's recipe, distinct per `n` (its spec JSON and its source); with `gate`, its
// source() waits there first; `valid` false: a source NVRTC rejects.
KernelRecipe tiny_recipe(int n, Gate* gate = nullptr, bool valid = true) {
    KernelRecipe recipe;
    recipe.spec_json = "{\"op\":\"background-test\",\"n\":" + std::to_string(n) + "}";
    recipe.template_name = "tiny.cu";
    recipe.entry = "tiny_kernel";
    recipe.source = [n, gate, valid] {
        if (gate != nullptr) gate->wait();
        if (!valid) return std::string("this is not CUDA;");
        return "extern \"C\" __global__ void tiny_kernel(float* x) { x[0] = " + std::to_string(n) +
               ".0f; }\n";
    };
    return recipe;
}

// Whether `disk` holds the entry of `recipe` for sm_90, and its payload.
std::optional<rope_jit::CacheEntry> entry_of(const DiskCache& disk, const KernelRecipe& recipe) {
    return disk.load(
        rope_jit::plan_compile(recipe.spec_json, recipe.compile_target("sm_90")).entry);
}

KernelSpec llama_rope_spec() {
    KernelSpec spec = rope_test::llama_like_kernel_spec();
    spec.validate();
    return spec;
}

}  // namespace

TEST_CASE("a compiled RoPE forward's backward is built in the background into the disk cache") {
    if (rope_jit::nvrtc_api() == nullptr) return;  // NVRTC is needed to compile
    gpu_test::TempDir dir("rope_jit_background_");
    DiskCache disk(dir.path(), {});
    KernelStats stats;
    BackgroundBuilds background(&disk, stats);
    const KernelSpec forward = llama_rope_spec();
    KernelSpec backward = forward;
    backward.backward = 1;

    // The forward compiles on the caller's thread; its follow-up (the backward) is queued.
    const KernelBinary binary =
        background.build_now(rope_jit::rope_recipe_with_backward(forward), "sm_90");
    CHECK(binary.compiled);
    CHECK(binary.image.size() > 4);
    background.wait_idle();
    CHECK(stats.background_builds.load() == 1);
    CHECK(stats.background_failures.load() == 0);
    CHECK(stats.disk_writes.load() == 2);
    // Not counted as a compile until a call takes it.
    CHECK(stats.compiles.load() == 1);
    // The backward's entry is on disk, for other processes.
    const KernelRecipe backward_recipe = rope_jit::rope_recipe(backward);
    REQUIRE(entry_of(disk, backward_recipe));
    // The backward call takes the binary from memory: one compile more, no disk hit.
    const KernelBinary taken =
        background.build_now(rope_jit::rope_recipe_with_backward(backward), "sm_90");
    CHECK(taken.compiled);
    CHECK(taken.image == entry_of(disk, backward_recipe)->payload);
    CHECK(stats.compiles.load() == 2);
    CHECK(stats.disk_hits.load() == 0);
    CHECK(background.pending() == 0);
    // Another process's backward call is a disk hit.
    KernelStats later;
    const KernelBinary loaded =
        rope_jit::build_kernel_binary(backward_recipe, "sm_90", &disk, later);
    CHECK_FALSE(loaded.compiled);
    CHECK(later.disk_hits.load() == 1);
    CHECK(later.compiles.load() == 0);

    // A forward read from the disk cache (not compiled) queues nothing.
    KernelStats fresh_stats;
    BackgroundBuilds fresh(&disk, fresh_stats);
    const KernelBinary hit = fresh.build_now(rope_jit::rope_recipe_with_backward(forward), "sm_90");
    CHECK_FALSE(hit.compiled);
    CHECK(fresh.pending() == 0);
    CHECK(fresh_stats.background_builds.load() == 0);
    // A backward names no follow-up.
    CHECK_FALSE(rope_jit::rope_recipe_with_backward(backward).follow_ups);
}

TEST_CASE("an attention forward that writes lse names its problem's dq and dk/dv kernels") {
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 1;
    c.Hq = 8;
    c.Hk = 2;
    c.Sq = c.Sk = 16;
    c.D = c.R = 128;
    c.causal = true;
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    const rope_jit::AttentionDevice h200{90, 232448, true, true};
    const rope_jit::AttentionProblem forward = rope_jit::make_attention_problem(args, false);
    REQUIRE(forward.has_lse);
    const std::vector<rope_jit::AttentionSpec> forward_specs =
        choose_attention_specs(forward, h200);
    const std::vector<rope_jit::AttentionSpec> backward_specs =
        choose_attention_specs(rope_jit::make_attention_problem(args, true), h200);
    // The prepare kernel (rotated keys), then the forward: both name the follow-ups, so that
    // they are queued as soon as the first of them compiles (the prepare, which the backward
    // shares: BackgroundBuilds does not queue what a caller builds itself).
    REQUIRE(forward_specs.size() == 2);
    CHECK(backward_specs.size() == 3);
    CHECK(backward_specs[0].to_json() == forward_specs[0].to_json());
    for (const rope_jit::AttentionSpec& spec : forward_specs) {
        CAPTURE(spec.describe());
        const KernelRecipe recipe = rope_jit::attention_recipe_with_backward(spec, forward, h200);
        REQUIRE(recipe.follow_ups);
        const std::vector<KernelRecipe> follow_ups = recipe.follow_ups();
        REQUIRE(follow_ups.size() == backward_specs.size());
        for (size_t i = 0; i < follow_ups.size(); ++i) {
            CAPTURE(i);
            CHECK(follow_ups[i].spec_json == backward_specs[i].to_json());
        }
    }
    // Without lse there is no backward to expect (inference), and backward kernels name none.
    rope_jit::AttentionProblem inference = forward;
    inference.has_lse = false;
    CHECK_FALSE(
        rope_jit::attention_recipe_with_backward(forward_specs[1], inference, h200).follow_ups);
    const rope_jit::AttentionProblem backward = rope_jit::make_attention_problem(args, true);
    for (const rope_jit::AttentionSpec& spec : backward_specs)
        CHECK_FALSE(rope_jit::attention_recipe_with_backward(spec, backward, h200).follow_ups);
}

TEST_CASE("a forward's follow-ups are queued before its own compile and build beside it") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    gpu_test::TempDir dir("rope_jit_background_");
    DiskCache disk(dir.path(), {});
    KernelStats stats;
    BackgroundBuilds::Limits limits;
    limits.threads = 2;
    BackgroundBuilds background(&disk, stats, limits);
    // The forward's compile cannot finish until the gate opens (its source() waits there);
    // its follow-ups: two kernels, and the forward itself (as the attention backward names
    // the prepare kernel its forward also runs), which must not be queued.
    Gate forward_gate;
    KernelRecipe forward = tiny_recipe(50, &forward_gate);
    forward.follow_ups = [] {
        return std::vector<KernelRecipe>{tiny_recipe(51), tiny_recipe(52), tiny_recipe(50)};
    };
    KernelBinary forward_binary;
    std::thread caller([&] { forward_binary = background.build_now(forward, "sm_90"); });
    forward_gate.wait_for_waiters(1);  // the caller is inside the forward's compile
    // Both follow-ups finish while the forward's compile is still held at the gate.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (stats.background_builds.load() + stats.background_failures.load() < 2 &&
           std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    CHECK(stats.background_builds.load() == 2);
    CHECK(stats.background_failures.load() == 0);
    CHECK(stats.compiles.load() == 0);  // the forward has not compiled yet
    CHECK(background.pending() == 0);   // the forward itself was never queued
    CHECK_FALSE(background.submit(tiny_recipe(50), "sm_90"));  // nor can be, uncounted
    CHECK(stats.background_dropped.load() == 0);
    forward_gate.open();
    caller.join();
    CHECK(forward_binary.compiled);
    CHECK(stats.compiles.load() == 1);
    CHECK(stats.disk_writes.load() == 3);
    for (int n = 50; n <= 52; ++n) {
        CAPTURE(n);
        CHECK(entry_of(disk, tiny_recipe(n)));
    }
    // The follow-ups' calls take their binaries: compiled, counted now, no disk read.
    for (int n = 51; n <= 52; ++n) CHECK(background.build_now(tiny_recipe(n), "sm_90").compiled);
    CHECK(stats.compiles.load() == 3);
    CHECK(stats.disk_hits.load() == 0);
}

TEST_CASE("a memory-only runtime queues a forward's follow-ups before compiling it") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    KernelStats stats;
    BackgroundBuilds::Limits limits;
    limits.threads = 1;
    BackgroundBuilds background(nullptr, stats, limits);
    Gate forward_gate, follow_up_gate;
    KernelRecipe forward = tiny_recipe(60, &forward_gate);
    forward.follow_ups = [&] {
        return std::vector<KernelRecipe>{tiny_recipe(61, &follow_up_gate)};
    };
    std::thread caller([&] { background.build_now(forward, "sm_90"); });
    // Both compiles are under way at once: the follow-up's started before the forward's ended.
    forward_gate.wait_for_waiters(1);
    CHECK(follow_up_gate.waiters_within(1, std::chrono::seconds(30)));
    CHECK(background.pending() == 1);
    forward_gate.open();
    follow_up_gate.open();
    caller.join();
    background.wait_idle();
    CHECK(stats.compiles.load() == 1);
    CHECK(stats.background_builds.load() == 1);
    CHECK(background.take(tiny_recipe(61).spec_json, "sm_90"));
}

namespace {

// Set by the child below; a global keeps it reachable, so LeakSanitizer reports no leak.
BackgroundBuilds* exiting_background = nullptr;
KernelStats exiting_stats;

}  // namespace

// Run only as the child of the next test (doctest skips it otherwise): a fresh process whose
// first NVRTC compiles are a tiny forward on this thread and, queued before it, a slow
// attention kernel in the background; it exits while that one still compiles, without
// freeing the service, as Python's default runtime does.
TEST_CASE("background exit child: exits while a background compile runs" * doctest::skip()) {
    BackgroundBuilds::Limits limits;
    limits.threads = 1;
    exiting_background = new BackgroundBuilds(nullptr, exiting_stats, limits);
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 1;
    c.Hq = 8;
    c.Hk = 2;
    c.Sq = c.Sk = 16;
    c.D = c.R = 128;
    c.causal = true;
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit::AttentionDevice h200{90, 232448, true, true};
    const std::vector<rope_jit::AttentionSpec> backward =
        choose_attention_specs(rope_jit::make_attention_problem(p.args(), true), h200);
    KernelRecipe forward = tiny_recipe(80);
    forward.follow_ups = [backward] {
        std::vector<KernelRecipe> recipes;
        for (const rope_jit::AttentionSpec& spec : backward)
            recipes.push_back(rope_jit::attention_recipe(spec));
        return recipes;
    };
    exiting_background->build_now(forward, "sm_90");
    std::exit(exiting_background->pending() > 0 ? 0 : 3);  // 3: nothing left running
}

TEST_CASE("a process that exits while a background compile runs exits cleanly") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    // The child's first submit comes before its first compile, so before NVRTC registers its
    // exit-time destructors: the exit hook must also be registered after a compile to run
    // before them (a compile running inside a half-destroyed NVRTC crashed such exits).
    for (int attempt = 0; attempt < 2; ++attempt) {
        CAPTURE(attempt);
        const pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            execl("/proc/self/exe", "rope_jit_tests", "--no-skip", "--no-version",
                  "-tc=background exit child*", static_cast<char*>(nullptr));
            _exit(127);
        }
        // A hang at exit (a deadlock between the hook and a finishing worker) fails too.
        int status = 0;
        pid_t done = 0;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
        while ((done = waitpid(child, &status, WNOHANG)) == 0 &&
               std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (done == 0) {
            kill(child, SIGKILL);
            waitpid(child, &status, 0);
            FAIL("the child hung at exit");
        }
        REQUIRE(done == child);
        CHECK(WIFEXITED(status));
        if (WIFSIGNALED(status)) MESSAGE("child killed by signal ", WTERMSIG(status));
        if (WIFEXITED(status)) CHECK(WEXITSTATUS(status) == 0);
    }
}

TEST_CASE("background builds take every core but the caller's, at least one, at most four") {
    CHECK(rope_jit::background_build_threads(0) == 1);  // hardware_concurrency() unknown
    CHECK(rope_jit::background_build_threads(1) == 1);
    CHECK(rope_jit::background_build_threads(2) == 1);
    CHECK(rope_jit::background_build_threads(3) == 2);
    CHECK(rope_jit::background_build_threads(4) == 3);
    CHECK(rope_jit::background_build_threads(16) == 4);
    CHECK(rope_jit::background_build_threads(192) == rope_jit::kMaxBackgroundBuildThreads);
}

TEST_CASE("a memory-only runtime's background binary is handed to the loader once") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    KernelStats stats;
    BackgroundBuilds background(nullptr, stats);
    const KernelRecipe recipe = tiny_recipe(1);
    CHECK(background.submit(recipe, "sm_90"));
    background.wait_idle();
    CHECK(stats.background_builds.load() == 1);
    CHECK(stats.compiles.load() == 0);
    const std::optional<KernelBinary> kept = background.take(recipe.spec_json, "sm_90");
    REQUIRE(kept);
    CHECK(stats.compiles.load() == 1);
    CHECK(kept->compiled);
    CHECK(kept->image.size() > 4);
    CHECK_FALSE(background.take(recipe.spec_json, "sm_90"));
    // build_now then compiles it itself.
    CHECK(background.build_now(recipe, "sm_90").compiled);
    CHECK(stats.compiles.load() == 2);
}

TEST_CASE("the background queue is bounded, refuses duplicates and drops what it cannot run") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    Gate gate;
    KernelStats stats;
    BackgroundBuilds::Limits limits;
    limits.threads = 1;
    limits.max_queued = 2;
    BackgroundBuilds background(nullptr, stats, limits);
    CHECK(background.submit(tiny_recipe(1, &gate), "sm_90"));
    gate.wait_for_waiters(1);  // job 1 runs (blocked in source()), the queue is empty
    CHECK(background.submit(tiny_recipe(2), "sm_90"));
    CHECK(background.submit(tiny_recipe(3), "sm_90"));
    CHECK(background.pending() == 3);
    // Full: refused and counted; a duplicate of a queued or running job: refused, not counted.
    CHECK_FALSE(background.submit(tiny_recipe(4), "sm_90"));
    CHECK(stats.background_dropped.load() == 1);
    CHECK_FALSE(background.submit(tiny_recipe(2), "sm_90"));
    CHECK_FALSE(background.submit(tiny_recipe(1), "sm_90"));
    CHECK(stats.background_dropped.load() == 1);
    // The same spec for another target is another job... but the queue is full.
    CHECK_FALSE(background.submit(tiny_recipe(2), "sm_80"));
    // A caller about to build job 3 itself takes it off the queue.
    CHECK_FALSE(background.take(tiny_recipe(3).spec_json, "sm_90"));
    CHECK(background.pending() == 2);
    gate.open();
    background.wait_idle();
    CHECK(stats.background_builds.load() == 2);  // jobs 1 and 2
    CHECK(background.pending() == 0);
}

TEST_CASE("destroying the background builds drops queued jobs and waits for the running one") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    gpu_test::TempDir dir("rope_jit_background_");
    DiskCache disk(dir.path(), {});
    KernelStats stats;
    Gate gate;
    std::vector<KernelRecipe> recipes;
    for (int n = 0; n < 5; ++n) recipes.push_back(tiny_recipe(10 + n, n == 0 ? &gate : nullptr));
    {
        BackgroundBuilds::Limits limits;
        limits.threads = 1;
        BackgroundBuilds background(&disk, stats, limits);
        for (const KernelRecipe& recipe : recipes) CHECK(background.submit(recipe, "sm_90"));
        gate.wait_for_waiters(1);  // job 0 is running: the other four are queued
        // Opened only once the destructor is under way, so the running job outlives it.
        std::thread opener([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            gate.open();
        });
        background.stop();
        opener.join();
        CHECK_FALSE(background.submit(tiny_recipe(99), "sm_90"));  // stopped: refused
    }
    // The running job finished and stored its entry; the queued ones never ran.
    CHECK(stats.background_builds.load() == 1);
    CHECK(stats.background_dropped.load() == 5);  // four queued, one refused after stop
    CHECK(entry_of(disk, recipes[0]));
    for (size_t n = 1; n < recipes.size(); ++n) CHECK_FALSE(entry_of(disk, recipes[n]));

    // Destroyed with jobs queued: each job was built or dropped, none lost, and no hang.
    KernelStats idle_stats;
    const auto start = std::chrono::steady_clock::now();
    {
        Gate never;
        BackgroundBuilds::Limits limits;
        limits.threads = 1;
        BackgroundBuilds background(nullptr, idle_stats, limits);
        CHECK(background.submit(tiny_recipe(20, &never), "sm_90"));
        for (int n = 21; n < 25; ++n) CHECK(background.submit(tiny_recipe(n), "sm_90"));
        never.wait_for_waiters(1);
        never.open();
    }
    CHECK(idle_stats.background_dropped.load() + idle_stats.background_builds.load() == 5);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("a failing background compile is swallowed and counted; the real call reports it") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    KernelStats stats;
    BackgroundBuilds background(nullptr, stats);
    const KernelRecipe broken = tiny_recipe(7, nullptr, false);
    CHECK(background.submit(broken, "sm_90"));
    // follow_ups that throw are counted too, and the forward still gets its binary.
    KernelRecipe forward = tiny_recipe(8);
    forward.follow_ups = []() -> std::vector<KernelRecipe> {
        throw rope_jit::Error(ROPE_JIT_ERROR_UNSUPPORTED, "no backward here");
    };
    CHECK(background.build_now(forward, "sm_90").compiled);
    background.wait_idle();
    CHECK(stats.background_failures.load() == 2);
    CHECK(stats.background_builds.load() == 0);
    CHECK_FALSE(background.take(broken.spec_json, "sm_90"));
    try {
        background.build_now(broken, "sm_90");
        FAIL("no error");
    } catch (const rope_jit::Error& e) {
        CHECK(e.status() == ROPE_JIT_ERROR_COMPILE);
    }
}

TEST_CASE("parallel prewarming stores the same entries as building one after the other") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    std::vector<KernelRecipe> recipes;
    for (int n = 0; n < 5; ++n) recipes.push_back(tiny_recipe(30 + n));
    KernelSpec backward = llama_rope_spec();
    backward.backward = 1;
    recipes.push_back(rope_jit::rope_recipe(llama_rope_spec()));
    recipes.push_back(rope_jit::rope_recipe(backward));

    gpu_test::TempDir serial_dir("rope_jit_serial_"), parallel_dir("rope_jit_parallel_");
    DiskCache serial(serial_dir.path(), {}), parallel(parallel_dir.path(), {});
    KernelStats serial_stats, parallel_stats;
    for (const KernelRecipe& recipe : recipes)
        rope_jit::build_kernel_binary(recipe, "sm_90", &serial, serial_stats);
    rope_jit::build_binaries_parallel(recipes, "sm_90", &parallel, parallel_stats, 4);
    CHECK(parallel_stats.compiles.load() == recipes.size());
    CHECK(parallel_stats.disk_writes.load() == serial_stats.disk_writes.load());
    for (const KernelRecipe& recipe : recipes) {
        CAPTURE(recipe.spec_json);
        const auto a = entry_of(serial, recipe), b = entry_of(parallel, recipe);
        REQUIRE(a);
        REQUIRE(b);
        CHECK(a->payload == b->payload);
        CHECK(a->spec_json == b->spec_json);
    }
    // Again: every entry is a disk hit.
    KernelStats again;
    rope_jit::build_binaries_parallel(recipes, "sm_90", &parallel, again, 0);
    CHECK(again.disk_hits.load() == recipes.size());
    CHECK(again.compiles.load() == 0);
}

TEST_CASE("parallel prewarming reports the lowest-indexed failure, named") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    std::vector<KernelRecipe> recipes = {tiny_recipe(40), tiny_recipe(41, nullptr, false),
                                         tiny_recipe(42), tiny_recipe(43, nullptr, false)};
    KernelStats stats;
    try {
        rope_jit::build_binaries_parallel(recipes, "sm_90", nullptr, stats, 4,
                                          {"specs[0]", "specs[1]", "specs[2]", "specs[3]"});
        FAIL("no error");
    } catch (const rope_jit::Error& e) {
        CHECK(e.status() == ROPE_JIT_ERROR_COMPILE);
        CHECK(std::string(e.what()).rfind("specs[1]: ", 0) == 0);
    }
    CHECK_NOTHROW(rope_jit::build_binaries_parallel({}, "sm_90", nullptr, stats, 4));
}

TEST_CASE("parallel prewarming starts the builds in the order asked, and checks that order") {
    if (rope_jit::nvrtc_api() == nullptr) return;
    std::mutex mutex;
    std::vector<int> started;
    std::vector<KernelRecipe> recipes;
    for (int n = 0; n < 4; ++n) {
        KernelRecipe recipe = tiny_recipe(70 + n);
        recipe.source = [n, &mutex, &started, source = recipe.source] {
            std::lock_guard<std::mutex> lock(mutex);
            started.push_back(n);
            return source();
        };
        recipes.push_back(recipe);
    }
    KernelStats stats;
    // One thread: the builds run exactly in the order given.
    rope_jit::build_binaries_parallel(recipes, "sm_90", nullptr, stats, 1, {}, {2, 0, 3, 1});
    CHECK(started == std::vector<int>{2, 0, 3, 1});
    CHECK(stats.compiles.load() == 4);
    for (const std::vector<size_t>& bad :
         {std::vector<size_t>{0, 1, 2}, {0, 1, 2, 2}, {0, 1, 2, 4}}) {
        CAPTURE(bad.size());
        try {
            rope_jit::build_binaries_parallel(recipes, "sm_90", nullptr, stats, 1, {}, bad);
            FAIL("no error");
        } catch (const rope_jit::Error& e) {
            CHECK(e.status() == ROPE_JIT_ERROR_INTERNAL);
        }
    }
    CHECK(stats.compiles.load() == 4);  // nothing built for a bad order
}

TEST_CASE("a prewarm starts the slowest kernels first: attention backward, forward, the rest") {
    if (rope_jit::nvrtc_api() == nullptr) return;  // the sm_90 choice asks NVRTC's version
    // A model's training set as rope-jit-cache's llama3-8b preset plans it: RoPE first.
    const std::string json = R"([
        {"op": "rope", "head_dim": 128, "gqa_group": 4, "dtype": "bfloat16"},
        {"op": "attention", "head_dim": 128, "gqa_group": 4, "dtype": "bfloat16",
         "causal": true, "write_lse": true, "direction": "forward"},
        {"op": "rope", "head_dim": 128, "gqa_group": 4, "dtype": "bfloat16",
         "direction": "backward"},
        {"op": "attention", "head_dim": 128, "gqa_group": 4, "dtype": "bfloat16",
         "causal": true, "direction": "backward"}])";
    const std::vector<rope_jit::PrewarmKernel> kernels =
        rope_jit::expand_prewarm_json(json, "sm_90");
    std::vector<std::string> kinds;
    for (const rope_jit::PrewarmKernel& kernel : kernels)
        kinds.push_back(kernel.attention ? nlohmann::json::parse(kernel.spec_json)["kind"]
                                               .get<std::string>()
                                         : std::string("rope"));
    // The forward call runs the prepare kernel and the forward; the backward adds two more.
    REQUIRE(kinds == std::vector<std::string>{"rope", "backward-prepare", "forward", "rope",
                                              "backward-wgmma", "backward-dq-finish"});
    CHECK(rope_jit::prewarm_start_order(kernels) == std::vector<size_t>{4, 2, 0, 1, 3, 5});
    CHECK(rope_jit::prewarm_start_order({}).empty());
}

TEST_CASE("background builds are on by default and off through the config or the environment") {
    rope_jit_config config;
    rope_jit_config_init(&config);
    CHECK(config.background_builds == 1);
    {
        EnvGuard env;
        env.set("ROPE_JIT_BACKGROUND_BUILDS", nullptr);
        CHECK_FALSE(rope_jit::background_builds_disabled_by_env());
        env.set("ROPE_JIT_BACKGROUND_BUILDS", "1");
        CHECK_FALSE(rope_jit::background_builds_disabled_by_env());
        env.set("ROPE_JIT_BACKGROUND_BUILDS", "0");
        CHECK(rope_jit::background_builds_disabled_by_env());
        // Any other value is refused by name, also by a CPU runtime ("off" read as on).
        rope_jit_config cpu;
        rope_jit_config_init(&cpu);
        cpu.backend = ROPE_JIT_BACKEND_CPU;
        cpu.disk_cache = 0;
        for (const char* value : {"off", "false", " 0", "00"}) {
            CAPTURE(value);
            env.set("ROPE_JIT_BACKGROUND_BUILDS", value);
            rope_jit_runtime* runtime = nullptr;
            CHECK(rope_jit_runtime_create(&cpu, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(runtime == nullptr);
            CHECK(std::string(rope_jit_last_error()).find("ROPE_JIT_BACKGROUND_BUILDS") !=
                  std::string::npos);
        }
    }
    // The counters start at zero and reach a caller through rope_jit_get_stats.
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    stats.background_dropped = 7;
    CHECK(rope_jit_get_stats(runtime, &stats) == ROPE_JIT_OK);
    CHECK(stats.background_builds == 0);
    CHECK(stats.background_failures == 0);
    CHECK(stats.background_dropped == 0);
    rope_jit_runtime_free(runtime);
}

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(gpu_test::GpuFixture,
                      "a RoPE forward compiled on the GPU leaves its backward ready for the first "
                      "backward call") {
        using namespace gpu_rope_test;
        gpu_test::TempDir dir("rope_jit_background_gpu_");
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CUDA;
        config.cache_dir = dir.path().c_str();
        rope_jit_runtime* runtime = nullptr;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        auto stats_now = [&] {
            rope_jit_stats stats;
            rope_jit_stats_init(&stats);
            REQUIRE(rope_jit_get_stats(runtime, &stats) == ROPE_JIT_OK);
            return stats;
        };

        Spec c;  // Llama-like: bf16, [B,S,H,D], GQA 4
        c.dt = Dt::BF16;
        c.layout = Layout::BSHD;
        c.B = 1, c.S = 64, c.Hk = 2, c.group = 4, c.D = 128, c.R = 128;
        std::mt19937 rng(2201);
        const Problem forward = make_problem(c, rng);
        const Problem forward_gpu = run_with_device_tensors(runtime, forward);
        check_gpu_matches_cpu(forward, forward_gpu,
                              run_with_host_tensors(cpu_runtime.get(), forward), gpu_tolerance(c));
        CHECK(stats_now().compiles == 1);

        // The backward compiles in the background meanwhile (a model runs its other layers).
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (stats_now().background_builds == 0 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        REQUIRE(stats_now().background_builds == 1);

        Spec b = c;
        b.backward = true;
        const Problem backward = make_problem(b, rng);
        const auto start = std::chrono::steady_clock::now();
        const Problem backward_gpu = run_with_device_tensors(runtime, backward);
        const double backward_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
        MESSAGE("first backward call after its background build: ", backward_ms, " ms");
        check_gpu_matches_cpu(backward, backward_gpu,
                              run_with_host_tensors(cpu_runtime.get(), backward), gpu_tolerance(b));
        // Taken from the background build: counted as this runtime's second compile, no disk read.
        const rope_jit_stats after = stats_now();
        CHECK(after.compiles == 2);
        CHECK(after.disk_hits == 0);
        // The forward's entry and the background's: the backward call wrote none of its own (it
        // would, had its spec differed from the one built in the background).
        CHECK(after.disk_writes == 2);
        CHECK(after.background_failures == 0);
        rope_jit_runtime_free(runtime);
    }

}  // TEST_SUITE("gpu")
