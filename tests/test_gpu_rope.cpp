// The CUDA backend against the CPU backend, through the public C API: a randomized sweep of the
// spec space, large shapes for the vectorized paths, strided views without copies, streams,
// CUDA graphs, concurrent launches and errors. The problems and comparisons are in
// gpu_rope_problem.h. Every test is in TEST_SUITE("gpu"): CPU-only runs skip them with
// --test-suite-exclude=gpu.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cmath>
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

// A DLTensor view into a buffer owned elsewhere (shape and strides in elements).
struct StridedView {
    Dt dt = Dt::F32;
    std::vector<int64_t> shape, strides;
    uint64_t byte_offset = 0;
    DLTensor tensor{};

    const DLTensor* on(void* data, DLDevice device) {
        tensor.data = data;
        tensor.device = device;
        tensor.ndim = int32_t(shape.size());
        tensor.dtype = dl_type(dt);
        tensor.shape = shape.data();
        tensor.strides = strides.data();
        tensor.byte_offset = byte_offset;
        return &tensor;
    }
};

constexpr uint32_t kSweepSeed = 20261130;

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(
        GpuFixture,
        "the CUDA backend matches the CPU backend over a randomized sweep of the spec space") {
        // 100 random kernels (NVRTC compiles dominate the run time), each run with 3 random sizes.
        // Every (family, variant) has its own seed, so a failure replays alone.
        for (uint32_t family = 0; family < 100; ++family) {
            std::mt19937 family_rng(kSweepSeed + family);
            const Spec base = random_spec(family_rng);
            for (uint32_t variant = 0; variant < 3; ++variant) {
                std::mt19937 rng(kSweepSeed + 7919 * (variant + 1) + family);
                Spec c = base;
                if (variant > 0) redraw_sizes(c, rng);
                const std::string spec = describe(c);
                CAPTURE(family);
                CAPTURE(variant);
                CAPTURE(spec);
                const Problem p = make_problem(c, rng);
                const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p);
                check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
            }
        }
    }

    TEST_CASE_FIXTURE(
        GpuFixture,
        "large bfloat16 shapes, as the vectorized paths see them, match the CPU backend") {
        for (Layout layout : {Layout::BHSD, Layout::BSHD})
            for (bool backward : {false, true})
                for (Angles angles : {Angles::HalfTable, Angles::InvFreq}) {
                    Spec c;
                    c.dt = Dt::BF16;
                    c.table_dt =
                        Dt::BF16;  // tables in the model's dtype, as HF and Unsloth pass them
                    c.layout = layout;
                    c.backward = backward;
                    c.angles = angles;
                    c.in_place = !backward;  // forward in place, backward out of place
                    c.B = 2, c.S = 257, c.Hk = 8, c.group = 4, c.D = 128, c.R = 128;
                    c.position_offset = 3;
                    const std::string spec = describe(c);
                    CAPTURE(spec);
                    std::mt19937 rng(uint32_t(int(layout) * 4 + int(backward) * 2 + int(angles)));
                    const Problem p = make_problem(c, rng);
                    const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                    const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p);
                    check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
                }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "out-of-place partial rotary matches the CPU backend with wide tokens, "
                      "every pair style, and q and k of different lengths") {
        // 80 heads of 1 KB (bf16 D=512) or 2 KB (fp32) a token, more than a block's items;
        // GPT-NeoX's 24 of 96 (copy vectors straddling the halves); k longer than q.
        struct Shape {
            Dt dt;
            int64_t D, R, offset;
            bool interleaved, proportional;
            Layout layout;
            Positions positions;
        };
        const Shape shapes[] = {
            {Dt::BF16, 512, 128, 0, false, false, Layout::BSHD, Positions::Implicit},
            {Dt::BF16, 512, 128, 0, false, true, Layout::BHSD, Positions::Implicit},
            {Dt::F32, 512, 64, 64, true, false, Layout::BSHD, Positions::PerToken},
            {Dt::BF16, 96, 24, 0, false, false, Layout::BSHD, Positions::Implicit},
            {Dt::F16, 80, 32, 16, false, false, Layout::Packed, Positions::Implicit},
        };
        for (const Shape& shape : shapes)
            for (bool backward : {false, true}) {
                Spec c;
                c.dt = c.table_dt = shape.dt;
                c.interleaved = shape.interleaved;
                c.proportional = shape.proportional;
                c.layout = shape.layout;
                c.positions = shape.positions;
                c.backward = backward;
                c.in_place = false;
                c.B = 2, c.S = 9, c.Hk = 16, c.group = 4;
                c.D = shape.D, c.R = shape.R, c.offset = shape.offset;
                c.q_extra = is_packed(c.layout) || c.positions != Positions::Implicit ? 0 : 3;
                const std::string spec = describe(c);
                CAPTURE(spec);
                std::mt19937 rng(uint32_t(shape.D * 7 + shape.R + int(backward)));
                const Problem p = make_problem(c, rng);
                const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p);
                check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
            }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "decode shapes match the CPU backend on both sides of the tiny-launch "
                      "bound (one item a thread while tokens <= multiprocessors)") {
        // B = 1 and 64: 320 threads of one item; 300: the measured shape (160 threads of two).
        // Out of place with partial rotary too: the copy of unrotated features at 320 threads.
        for (int64_t B : {1, 64, 300})
            for (bool partial : {false, true}) {
                Spec c;
                c.dt = c.table_dt = Dt::BF16;
                c.layout = Layout::BSHD;
                c.positions = Positions::SeqlenOffsets;
                c.B = B, c.S = 1, c.Hk = 8, c.group = 4, c.D = 128, c.R = partial ? 64 : 128;
                c.in_place = !partial;
                const std::string spec = describe(c);
                CAPTURE(spec);
                std::mt19937 rng(uint32_t(B * 2 + int(partial)));
                const Problem p = make_problem(c, rng);
                const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p);
                check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
            }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "q and k as strided slices of a packed qkv buffer are rotated in place, and "
                      "v is untouched") {
        for (Dt dt : {Dt::F16, Dt::BF16, Dt::F32}) {
            const int64_t B = 2, S = 37, H = 4, D = 64;
            const std::string dtype = dt_name(dt);
            CAPTURE(dtype);
            CAPTURE(B);
            CAPTURE(S);
            CAPTURE(H);
            CAPTURE(D);
            std::mt19937 rng(31 + uint32_t(dt));
            HostTensor qkv(dt, {B, S, 3, H, D});  // [:, :, 0] = q, [:, :, 1] = k, [:, :, 2] = v
            qkv.fill_uniform(rng, -2, 2);
            Spec table_spec;  // half tables in float32, implicit positions 0..S-1
            table_spec.dt = dt;
            table_spec.D = D;
            table_spec.R = D;
            Problem tables;
            tables.spec = table_spec;
            fill_angles(tables, S + 1, rng);

            // q and k as [B, H, S, D] views of the [B, S, 3, H, D] buffer: no copies.
            auto slice = [&](int64_t slot) {
                StridedView v;
                v.dt = dt;
                v.shape = {B, H, S, D};
                v.strides = {S * 3 * H * D, D, 3 * H * D, 1};
                v.byte_offset = uint64_t(slot * H * D) * dt_size(dt);
                return v;
            };
            StridedView q_host = slice(0), k_host = slice(1), q_device = slice(0),
                        k_device = slice(1);

            HostTensor from_cpu = qkv;
            rope_jit_rope_args args;
            rope_jit_rope_args_init(&args);
            args.q = q_host.on(from_cpu.bytes().data(), {kDLCPU, 0});
            args.k = k_host.on(from_cpu.bytes().data(), {kDLCPU, 0});
            args.cos = tables.t[kCos].dl();
            args.sin = tables.t[kSin].dl();
            require_ok(call_rope(cpu_runtime.get(), args), "CPU");

            DeviceTensor device(qkv);
            DeviceTensor cos_device(tables.t[kCos]), sin_device(tables.t[kSin]);
            args.q = q_device.on(as_pointer(device.pointer()), {kDLCUDA, 0});
            args.k = k_device.on(as_pointer(device.pointer()), {kDLCUDA, 0});
            args.cos = cos_device.dl();
            args.sin = sin_device.dl();
            require_ok(call_rope(cuda_runtime.get(), args), "CUDA");
            synchronize(nullptr);
            HostTensor from_gpu = qkv;
            device.download(from_gpu);

            // Each slot as its own tensor, to compare slot by slot.
            auto slot_of = [&](const HostTensor& buffer, int64_t slot) {
                HostTensor out(dt, {B, S, H, D});
                out.for_each([&](const std::vector<int64_t>& i) {
                    out.set(i, buffer.get({i[0], i[1], slot, i[2], i[3]}));
                });
                return out;
            };
            const double tol = gpu_tolerance(table_spec);
            check_close(slot_of(from_gpu, 0), slot_of(from_cpu, 0), tol, "q slice (GPU vs CPU)");
            check_close(slot_of(from_gpu, 1), slot_of(from_cpu, 1), tol, "k slice (GPU vs CPU)");
            size_t v_changed = 0;
            const size_t element = dt_size(dt);
            qkv.for_each([&](const std::vector<int64_t>& i) {
                if (i[2] != 2) return;
                const size_t at = size_t(qkv.offset(i)) * element;
                v_changed += std::memcmp(&from_gpu.bytes()[at], &bytes_of(qkv)[at], element) != 0;
            });
            INFO("v slice elements changed on the device: ", v_changed);
            CHECK(v_changed == 0);
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "a call on a non-default stream runs there and matches the CPU backend") {
        Stream stream;
        Spec c;
        c.dt = Dt::F16;
        c.interleaved = true;
        c.layout = Layout::BSHD;
        c.positions = Positions::PerBatchToken;
        c.index_dt = Dt::I64;
        c.in_place = false;
        c.B = 3, c.S = 29, c.Hk = 2, c.group = 4, c.D = 128, c.R = 64, c.offset = 32;
        const std::string spec = describe(c);
        CAPTURE(spec);
        std::mt19937 rng(4);
        const Problem p = make_problem(c, rng);
        const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
        const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p, stream.get());
        check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "a call captured in a CUDA graph reads the data present at each replay") {
        Stream stream;
        Spec c;
        c.dt = Dt::BF16;
        c.layout = Layout::Padded;
        c.positions = Positions::PerBatchToken;
        c.index_dt = Dt::I32;
        c.in_place = false;  // the warm-up call leaves the inputs as they are
        c.B = 2, c.S = 21, c.Hk = 2, c.group = 4, c.D = 128, c.R = 128;
        const std::string spec = describe(c);
        CAPTURE(spec);
        std::mt19937 rng(5);
        const Problem p = make_problem(c, rng);
        DeviceProblem device(p);
        const rope_jit_rope_args args = make_args(c, device.views(), stream.get());

        // Warm-up outside the capture: compiles and loads the kernel.
        require_ok(call_rope(cuda_runtime.get(), args), "warm-up");
        synchronize(stream.get());

        Graph graph;
        check_cu(
            driver().cuStreamBeginCapture(stream.get(), rope_jit::CU_STREAM_CAPTURE_MODE_GLOBAL),
            "cuStreamBeginCapture");
        const CallResult captured = call_rope(cuda_runtime.get(), args);
        const rope_jit::CUresult ended =
            driver().cuStreamEndCapture(stream.get(), &graph.graph);  // always end it
        require_ok(captured, "during capture");
        check_cu(ended, "cuStreamEndCapture");
        check_cu(driver().cuGraphInstantiate(&graph.exec, graph.graph, 0), "cuGraphInstantiate");

        // Each replay gets new q, k and positions, and poisoned outputs: a replay that reuses
        // captured data, or writes nothing, shows.
        for (int replay = 0; replay < 2; ++replay) {
            CAPTURE(replay);
            Problem next = p;
            next.t[kQ].fill_uniform(rng, -2, 2);
            next.t[kK].fill_uniform(rng, -2, 2);
            std::uniform_int_distribution<int64_t> row(0, next.table_rows() - 1);
            next.t[kPositions].for_each([&](const std::vector<int64_t>& i) {
                next.t[kPositions].set(i, double(row(rng)));
            });
            for (size_t s : {kQ, kK, kQOut, kKOut, kPositions}) device[s].upload(next.t[s]);

            check_cu(driver().cuGraphLaunch(graph.exec, stream.get()), "cuGraphLaunch");
            synchronize(stream.get());
            const Problem from_gpu = device.download(next);
            const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), next);
            check_gpu_matches_cpu(next, from_gpu, from_cpu, gpu_tolerance(c));
        }
    }

    TEST_CASE_FIXTURE(
        GpuFixture, "two threads launching on their own streams at once both get correct results") {
        constexpr int kCalls = 200;  // forward, backward, ...: an even number returns to the input

        std::array<Spec, 2> specs;
        // float32 tables: rounded to 16 bits, cos^2 + sin^2 drifts from 1 enough that 100 round
        // trips no longer return the input.
        specs[0].dt = Dt::BF16;  // bf16, half style, tables, bshd
        specs[0].table_dt = Dt::F32;
        specs[0].layout = Layout::BSHD;
        specs[0].position_offset = 2;
        specs[0].B = 2, specs[0].S = 33, specs[0].Hk = 2, specs[0].group = 4, specs[0].D = 128,
        specs[0].R = 128;
        specs[1].dt =
            Dt::F32;  // f32, interleaved, inv_freq, partial rotary, padded rows, positions [S]
        specs[1].interleaved = true;
        specs[1].angles = Angles::InvFreq;
        specs[1].layout = Layout::Padded;
        specs[1].positions = Positions::PerToken;
        specs[1].index_dt = Dt::I32;
        specs[1].B = 3, specs[1].S = 17, specs[1].Hk = 3, specs[1].group = 1, specs[1].D = 64,
        specs[1].R = 32;
        specs[1].offset = 16;

        struct Worker {
            Problem original;
            std::unique_ptr<DeviceProblem> device;
            rope_jit_status status = ROPE_JIT_OK;
            std::string message, failure;
        };
        std::array<Worker, 2> workers;
        for (size_t w = 0; w < workers.size(); ++w) {
            std::mt19937 rng(600 + uint32_t(w));
            workers[w].original = make_problem(specs[w], rng);
            workers[w].device = std::make_unique<DeviceProblem>(workers[w].original);
        }

        std::atomic<int> ready{0};
        std::vector<std::thread> threads;
        for (size_t w = 0; w < workers.size(); ++w)
            threads.emplace_back([&, w] {
                Worker& worker = workers[w];
                ++ready;
                while (ready.load() < int(workers.size())) std::this_thread::yield();
                try {
                    make_primary_context_current();
                    Stream stream;
                    rope_jit_rope_args args =
                        make_args(worker.original.spec, worker.device->views(), stream.get());
                    for (int call = 0; call < kCalls; ++call) {
                        args.backward = call % 2;
                        const rope_jit_status status = rope_jit_rope(cuda_runtime.get(), &args);
                        if (status != ROPE_JIT_OK) {
                            worker.status = status;
                            worker.message = rope_jit_last_error();
                            break;
                        }
                    }
                    synchronize(stream.get());
                } catch (const std::exception& e) {
                    worker.failure = e.what();
                }
            });
        for (std::thread& thread : threads) thread.join();

        for (size_t w = 0; w < workers.size(); ++w) {
            const Worker& worker = workers[w];
            const std::string spec = describe(worker.original.spec);
            CAPTURE(w);
            CAPTURE(spec);
            INFO("thread failure: ", worker.failure);
            REQUIRE(worker.failure.empty());
            const std::string status = rope_jit_status_name(worker.status);
            INFO("rope_jit_rope -> ", status, ": ", worker.message);
            REQUIRE(worker.status == ROPE_JIT_OK);
            // Rounding accumulates over the calls like a random walk.
            const double tol = gpu_tolerance(worker.original.spec) * std::sqrt(double(kCalls));
            const Problem from_gpu = worker.device->download(worker.original);
            const Problem from_cpu =
                run_with_host_tensors(cpu_runtime.get(), worker.original, kCalls);
            check_gpu_matches_cpu(worker.original, from_gpu, from_cpu, tol);
            check_close(from_gpu.t[kQ], worker.original.t[kQ], tol,
                        "q after forward/backward pairs vs the original q");
            check_close(from_gpu.t[kK], worker.original.t[kK], tol,
                        "k after forward/backward pairs vs the original k");
        }
    }

    TEST_CASE_FIXTURE(
        GpuFixture,
        "a CUDA runtime runs a call whose tensors all live in host memory on the CPU reference") {
        Spec c;
        c.dt = Dt::F16;
        c.layout = Layout::Packed;
        c.angles = Angles::FullTable;
        c.B = 3, c.S = 11, c.Hk = 2, c.group = 2, c.D = 80, c.R = 80;
        const std::string spec = describe(c);
        CAPTURE(spec);
        std::mt19937 rng(7);
        const Problem p = make_problem(c, rng);
        const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
        const Problem via_cuda_runtime = run_with_host_tensors(cuda_runtime.get(), p);
        check_gpu_matches_cpu(p, via_cuda_runtime, from_cpu, 0.0);  // the same code: bit for bit
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "a q with no heads and 2^40 tokens beside a k of few tokens rotates k "
                      "alone, as the CPU does") {
        // The grid covered q's 2^40 tokens of nothing (adversarial pass, session 38): the
        // tokens covered are those of tensors with heads (RopeProblem::rotated_seqlen).
        Spec c;
        c.dt = Dt::BF16;
        c.angles = Angles::InvFreq;
        c.B = 2, c.S = 7, c.Hk = 2, c.group = 1, c.D = 64, c.R = 64;
        std::mt19937 rng(10);
        const Problem original = make_problem(c, rng);
        Problem host = original;
        DLTensor headless = *host.t[kQ].dl();
        int64_t shape[4] = {c.B, 0, int64_t(1) << 40, c.D};
        headless.shape = shape;
        headless.strides = nullptr;
        headless.data = nullptr;
        Views host_side = host_views(host);
        host_side[kQ] = &headless;
        require_ok(call_rope(cpu_runtime.get(), make_args(c, host_side, nullptr)), "CPU");
        Problem unrotated = original;
        CHECK(host.t[kK].bytes() != unrotated.t[kK].bytes());  // (k was rotated)
        DeviceProblem device(original);
        Views device_side = device.views();
        DLTensor device_headless = headless;
        device_headless.device = device_side[kK]->device;
        device_side[kQ] = &device_headless;
        require_ok(call_rope(cuda_runtime.get(), make_args(c, device_side, nullptr)), "CUDA");
        synchronize_context();
        check_gpu_matches_cpu(original, device.download(original), host, gpu_tolerance(c));
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "tensors on different devices are rejected with a message naming the "
                      "argument, and nothing is written") {
        Spec c;
        c.B = 2, c.S = 9, c.Hk = 2, c.group = 2, c.D = 64, c.R = 64;
        std::mt19937 rng(8);
        Problem host = make_problem(c, rng);
        const Problem original = host;
        DeviceProblem device(original);
        Views views = device.views();
        std::string needle;
        SUBCASE("cos and sin in host memory, q and k on the GPU") {
            views[kCos] = host.t[kCos].dl();
            views[kSin] = host.t[kSin].dl();
            needle = "cos:";
        }
        SUBCASE("k in host memory, q on the GPU") {
            views[kK] = host.t[kK].dl();
            needle = "k:";
        }
        SUBCASE("q in host memory, everything else on the GPU") {
            views[kQ] = host.t[kQ].dl();
            needle = "k:";
        }
        CAPTURE(needle);
        const CallResult result = call_rope(cuda_runtime.get(), make_args(c, views, nullptr));
        CAPTURE(result.message);
        CHECK(result.status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(result.message.find(needle) != std::string::npos);
        synchronize_context();
        check_nothing_written(original, device.download(original));
        check_nothing_written(original, host);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "with debug_checks, a device position outside the table is rejected naming "
                      "positions, and nothing is written") {
        const RuntimeHandle debug_runtime(ROPE_JIT_BACKEND_CUDA, /*debug_checks=*/true);
        for (Positions mode : {Positions::PerToken, Positions::PerBatchToken})
            for (bool past_the_end : {true, false}) {
                Spec c;
                c.dt = Dt::F16;
                c.positions = mode;
                c.index_dt = mode == Positions::PerToken ? Dt::I32 : Dt::I64;
                c.B = 2, c.S = 9, c.Hk = 2, c.group = 2, c.D = 64, c.R = 64;
                const std::string spec = describe(c);
                CAPTURE(spec);
                CAPTURE(past_the_end);
                std::mt19937 rng(9);
                const Problem p = make_problem(c, rng);

                // Valid positions pass the check and give the CPU's result.
                const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                const Problem from_gpu = run_with_device_tensors(debug_runtime.get(), p);
                check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));

                // One token (the last) at row P, or at row -1.
                Problem bad = p;
                bad.t[kPositions].set_at(bad.t[kPositions].numel() - 1,
                                         past_the_end ? double(p.table_rows()) : -1.0);
                DeviceProblem device(bad);
                const CallResult result =
                    call_rope(debug_runtime.get(), make_args(c, device.views(), nullptr));
                CAPTURE(result.message);
                CHECK(result.status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
                CHECK(result.message.find("positions") != std::string::npos);
                synchronize_context();
                check_nothing_written(bad, device.download(bad));
            }
    }

}  // TEST_SUITE("gpu")
