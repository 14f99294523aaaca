// Several GPUs in one process: calls with tensors on each device run there (that device's
// context, stream and module), calls that mix devices are refused, and one thread per device
// calling at once for a few seconds gets the CPU reference's results throughout. Every test is
// in TEST_SUITE("gpu") and needs two devices: with fewer it says so and checks nothing.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_driver.h"
#include "gpu_rope_problem.h"

using namespace rope_test;
using namespace gpu_test;
using namespace gpu_rope_test;
using rope_jit::check_cu;

namespace {

// The counters of a runtime, read through the C API.
rope_jit_stats stats_of(rope_jit_runtime* runtime) {
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    REQUIRE(rope_jit_get_stats(runtime, &stats) == ROPE_JIT_OK);
    return stats;
}

// Kernels made ready for a launch: compiled, or read from the disk cache, then loaded.
uint64_t kernels_loaded(const rope_jit_stats& stats) {
    return stats.compiles + stats.disk_hits;
}

bool have_two_devices() {
    const int count = device_count();
    if (count >= 2) return true;
    MESSAGE("skipped: this machine has ", count, " CUDA device(s), the multi-device tests need 2");
    return false;
}

// An out-of-place bf16 problem, so that every call on the same inputs writes the same outputs.
Spec out_of_place_spec(int variant) {
    Spec c;
    c.in_place = false;
    if (variant == 0) {  // Llama-like: bshd, GQA, per-token positions [B, S]
        c.dt = Dt::BF16;
        c.layout = Layout::BSHD;
        c.positions = Positions::PerBatchToken;
        c.B = 2, c.S = 64, c.Hk = 2, c.group = 4, c.D = 128, c.R = 128;
    } else {  // GPT-J-like: interleaved, partial rotary, inv_freq angles, fp16, padded rows
        c.dt = Dt::F16;
        c.interleaved = true;
        c.angles = Angles::InvFreq;
        c.layout = Layout::Padded;
        c.B = 3, c.S = 41, c.Hk = 4, c.group = 1, c.D = 256, c.R = 64;
    }
    return c;
}

// How long the threads of the concurrency test call, and how often they check a result.
constexpr std::chrono::seconds kDuration(3);
constexpr int kCheckEvery = 64;

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "tensors on GPU 0 and on GPU 1 run on their own device, stream and module") {
        if (!have_two_devices()) return;
        const Spec c = out_of_place_spec(0);
        const std::string spec = describe(c);
        CAPTURE(spec);
        std::mt19937 rng(900);
        const Problem p = make_problem(c, rng);
        const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);

        for (int ordinal : {0, 1}) {
            CAPTURE(ordinal);
            make_primary_context_current(ordinal);
            Stream stream;  // created in device `ordinal`'s context
            DeviceProblem device(p, ordinal);
            const rope_jit_stats before = stats_of(cuda_runtime.get());
            require_ok(call_rope(cuda_runtime.get(), make_args(c, device.views(), stream.get())),
                       "device tensors");
            const rope_jit_stats after = stats_of(cuda_runtime.get());
            synchronize(stream.get());
            check_gpu_matches_cpu(p, device.download(p), from_cpu, gpu_tolerance(c));
            // A module belongs to one context: the first call on each device loads the kernel
            // there (from NVRTC or the disk cache), it does not reuse the other device's module.
            CHECK(kernels_loaded(after) == kernels_loaded(before) + 1);
            CHECK(after.memory_hits == before.memory_hits);
            CHECK(after.launches == before.launches + 1);
        }

        SUBCASE(
            "the NULL stream with the other device's context current runs on the tensors' device") {
            make_primary_context_current(0);
            DeviceProblem device(p, 0);
            make_primary_context_current(1);  // a framework left device 1 current
            const rope_jit_stats before = stats_of(cuda_runtime.get());
            require_ok(call_rope(cuda_runtime.get(), make_args(c, device.views(), nullptr)),
                       "NULL stream");
            const rope_jit_stats after = stats_of(cuda_runtime.get());
            CHECK(after.memory_hits == before.memory_hits + 1);  // device 0's module, loaded above
            rope_jit::CUcontext current = nullptr;
            check_cu(driver().cuCtxGetCurrent(&current), "cuCtxGetCurrent");
            CHECK(current == primary_context(1));  // the call restored what was current
            make_primary_context_current(0);
            synchronize_context();
            check_gpu_matches_cpu(p, device.download(p), from_cpu, gpu_tolerance(c));
        }
    }

    TEST_CASE_FIXTURE(
        GpuFixture,
        "a call mixing GPU 0 and GPU 1 is refused naming the argument, and nothing is written") {
        if (!have_two_devices()) return;
        const Spec c = out_of_place_spec(0);
        std::mt19937 rng(901);
        const Problem p = make_problem(c, rng);
        make_primary_context_current(0);
        DeviceProblem on_0(p, 0);
        make_primary_context_current(1);
        DeviceProblem on_1(p, 1);
        Stream stream_1;
        make_primary_context_current(0);
        Stream stream_0;

        Views views = on_1.views();
        rope_jit::CUstream stream = stream_1.get();
        std::string needle;
        SUBCASE("k on GPU 0, everything else on GPU 1") {
            views[kK] = on_0.views()[kK];
            needle = "k: lives on CUDA device 0";
        }
        SUBCASE("cos and sin on GPU 0, q and k on GPU 1") {
            views[kCos] = on_0.views()[kCos];
            views[kSin] = on_0.views()[kSin];
            needle = "cos: lives on CUDA device 0";
        }
        SUBCASE("q_out on GPU 0, the inputs on GPU 1") {
            views[kQOut] = on_0.views()[kQOut];
            needle = "q_out: lives on CUDA device 0";
        }
        SUBCASE("every tensor on GPU 1, the stream of GPU 0") {
            stream = stream_0.get();
            needle =
                "stream: the stream belongs to CUDA device 0, but the tensors live on device 1";
        }
        CAPTURE(needle);
        const CallResult result = call_rope(cuda_runtime.get(), make_args(c, views, stream));
        CAPTURE(result.message);
        CHECK(result.status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(result.message.find(needle) != std::string::npos);
        for (int ordinal : {0, 1}) {
            make_primary_context_current(ordinal);
            synchronize_context();
        }
        make_primary_context_current(0);
        check_nothing_written(p, on_0.download(p));
        check_nothing_written(p, on_1.download(p));
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "one thread per GPU calling at once for three seconds matches the CPU "
                      "reference throughout") {
        if (!have_two_devices()) return;

        // Each thread alternates between two specs; the threads start on different ones, so both
        // devices build both kernels while the other thread launches.
        struct Worker {
            int ordinal = 0;
            std::array<Problem, 2> problems, expected;
            int64_t calls = 0, checked = 0, mismatches = 0;
            rope_jit_status status = ROPE_JIT_OK;
            std::string message, failure;
        };
        std::array<Worker, 2> workers;
        for (int w = 0; w < 2; ++w) {
            Worker& worker = workers[size_t(w)];
            worker.ordinal = w;
            for (int v = 0; v < 2; ++v) {
                std::mt19937 rng(910 + uint32_t(w * 2 + v));
                worker.problems[size_t(v)] = make_problem(out_of_place_spec((v + w) % 2), rng);
                worker.expected[size_t(v)] =
                    run_with_host_tensors(cpu_runtime.get(), worker.problems[size_t(v)]);
            }
        }

        std::atomic<int> ready{0};
        std::vector<std::thread> threads;
        for (Worker& worker : workers)
            threads.emplace_back([&worker, &ready, this] {
                try {
                    make_primary_context_current(worker.ordinal);
                    Stream stream;
                    std::array<std::unique_ptr<DeviceProblem>, 2> device;
                    std::array<rope_jit_rope_args, 2> args;
                    std::array<Problem, 2> poisoned;
                    for (size_t v = 0; v < 2; ++v) {
                        device[v] =
                            std::make_unique<DeviceProblem>(worker.problems[v], worker.ordinal);
                        args[v] =
                            make_args(worker.problems[v].spec, device[v]->views(), stream.get());
                        poisoned[v] = worker.problems[v];
                        for (size_t s : {kQOut, kKOut})
                            poisoned[v].t[s].for_each([&](const std::vector<int64_t>& i) {
                                poisoned[v].t[s].set(i, std::numeric_limits<double>::quiet_NaN());
                            });
                    }
                    ++ready;
                    while (ready.load() < 2) std::this_thread::yield();
                    const auto end = std::chrono::steady_clock::now() + kDuration;
                    while (std::chrono::steady_clock::now() < end) {
                        const size_t v = size_t(worker.calls % 2);
                        const bool check = worker.calls % kCheckEvery < 2;
                        if (check) {  // NaN outputs first: a call that writes nothing shows
                            synchronize(stream.get());
                            for (size_t s : {kQOut, kKOut})
                                (*device[v])[s].upload(poisoned[v].t[s]);
                        }
                        const rope_jit_status status = rope_jit_rope(cuda_runtime.get(), &args[v]);
                        if (status != ROPE_JIT_OK) {
                            worker.status = status;
                            worker.message = rope_jit_last_error();
                            break;
                        }
                        ++worker.calls;
                        if (check) {
                            synchronize(stream.get());
                            const Problem got = device[v]->download(worker.problems[v]);
                            ++worker.checked;
                            // Within the tolerance of the single-call tests: these are the same
                            // inputs every time, so any drift is a wrong launch, not rounding.
                            for (size_t s : {kQOut, kKOut}) {
                                const std::vector<double> g = got.t[s].values(),
                                                          e = worker.expected[v].t[s].values();
                                const double tol = gpu_tolerance(worker.problems[v].spec);
                                for (size_t i = 0; i < g.size(); ++i)
                                    if (!(std::fabs(g[i] - e[i]) <= tol * (1 + std::fabs(e[i])))) {
                                        ++worker.mismatches;
                                        break;
                                    }
                            }
                        }
                    }
                    synchronize(stream.get());
                } catch (const std::exception& e) {
                    worker.failure = e.what();
                    ++ready;  // never leave the other thread waiting
                }
            });
        for (std::thread& thread : threads) thread.join();

        for (const Worker& worker : workers) {
            CAPTURE(worker.ordinal);
            INFO("thread failure: ", worker.failure);
            REQUIRE(worker.failure.empty());
            const std::string status = rope_jit_status_name(worker.status);
            INFO("rope_jit_rope -> ", status, ": ", worker.message);
            REQUIRE(worker.status == ROPE_JIT_OK);
            MESSAGE("GPU ", worker.ordinal, ": ", worker.calls, " calls in 3 s, ", worker.checked,
                    " checked against the CPU reference");
            CHECK(worker.calls > 1000);
            CHECK(worker.checked > 20);
            CHECK(worker.mismatches == 0);
        }
    }

}  // TEST_SUITE("gpu")
