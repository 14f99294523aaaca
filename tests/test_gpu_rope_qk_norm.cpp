// QK-norm + RoPE (rope_jit_rope_args.q_norm_weight ...) on the CUDA backend against the CPU
// backend (itself checked against a float64 definition and finite differences in
// test_rope_qk_norm.cpp): a randomized sweep of forward and backward calls with the weight
// gradients, M-RoPE sections, and Qwen3-sized bfloat16 shapes. The rope part of each call comes
// from gpu_rope_problem.h, the norm part from gpu_rope_norm_problem.h. Every test is in
// TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_rope_norm_problem.h"

using namespace rope_test;
using namespace gpu_test;
using namespace gpu_rope_test;

namespace {

// Runs the call on both backends and compares every written tensor (rope part:
// check_gpu_matches_cpu) and the weight gradients.
void run_and_compare(GpuFixture& fixture, const Problem& p, NormTensors n, double tol) {
    // CPU, on copies.
    Problem cpu = p;
    NormTensors cpu_norm = n;
    std::vector<const DLTensor*> cpu_views;
    for (HostTensor* t : norm_slots(cpu_norm))
        cpu_views.push_back(t->shape().empty() ? nullptr : t->dl());
    rope_jit_rope_args cpu_args = make_args(p.spec, host_views(cpu), nullptr);
    add_norm_args(cpu_args, cpu_norm, cpu_views);
    require_ok(call_rope(fixture.cpu_runtime.get(), cpu_args), "cpu");

    // GPU, from device copies of the untouched inputs.
    DeviceProblem device(p);
    std::vector<std::unique_ptr<DeviceTensor>> norm_device;
    std::vector<const DLTensor*> gpu_views;
    for (HostTensor* t : norm_slots(n)) {
        norm_device.push_back(t->shape().empty() ? nullptr : std::make_unique<DeviceTensor>(*t));
        gpu_views.push_back(norm_device.back() ? norm_device.back()->dl() : nullptr);
    }
    rope_jit_rope_args gpu_args = make_args(p.spec, device.views(), nullptr);
    add_norm_args(gpu_args, n, gpu_views);
    require_ok(call_rope(fixture.cuda_runtime.get(), gpu_args), "gpu");
    synchronize(nullptr);
    const Problem gpu = device.download(p);
    check_gpu_matches_cpu(p, gpu, cpu, tol);

    // dL/dw: sums over every row of g * xh, in float32 with atomics on the GPU; compared at
    // the scale of the largest sum.
    for (int slot : {kQGrad, kKGrad}) {
        HostTensor& expected = *norm_slots(cpu_norm)[size_t(slot)];
        if (expected.shape().empty()) continue;
        HostTensor got = expected;
        norm_device[size_t(slot)]->download(got);
        const std::vector<double> g = got.values(), e = expected.values();
        double scale = 0;
        for (double v : e) scale = std::max(scale, std::fabs(v));
        for (size_t i = 0; i < e.size(); ++i) {
            CAPTURE(slot);
            CAPTURE(i);
            CHECK(std::fabs(g[i] - e[i]) <= 2e-4 * (scale + 1));
        }
    }
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "QK-norm + RoPE: the CUDA backend matches the CPU backend over a randomized "
                      "sweep, forward and backward with weight gradients") {
        for (uint32_t family = 0; family < kNormFamilies; ++family) {
            const NormFamily f = norm_family(family);
            const std::string spec = describe(f.problem.spec);
            CAPTURE(family);
            CAPTURE(spec);
            CAPTURE(f.norm.unit_offset);
            CAPTURE(f.norm.weight_grad);
            run_and_compare(*this, f.problem, f.norm, norm_tolerance(f.problem.spec));
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "QK-norm + RoPE at Qwen3-8B sizes (bfloat16, D128, 32/8 heads) matches the "
                      "CPU backend") {
        int index = 0;
        for (bool backward : {false, true})
            for (Layout layout : {Layout::BSHD, Layout::BHSD}) {
                Spec c;
                c.dt = Dt::BF16, c.table_dt = Dt::BF16, c.angles = Angles::FullTable;
                c.layout = layout;
                c.backward = backward;
                c.in_place = !backward;
                c.B = 2, c.S = 129, c.Hk = 8, c.group = 4, c.D = 128, c.R = 128;
                c.position_offset = 7;
                const std::string spec = describe(c);
                CAPTURE(spec);
                std::mt19937 rng(kNormSeed + 1000 + uint32_t(index++));
                const Problem p = make_problem(c, rng);
                run_and_compare(*this, p, make_norm(p, Dt::BF16, false, true, rng),
                                norm_tolerance(c));
            }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "QK-norm + RoPE over many rows (the forward's blocks of runs) matches the "
                      "CPU backend") {
        // 2 x 1031 tokens x 40 heads = 82480 rows: more than the 2 blocks x 8 warps x 4 rows a
        // multiprocessor of one pass, so the forward's lane groups take runs of rows, a block
        // per set of runs (runs of 4 heads at 32/8 heads; of 2 at 6/2, 2 x 1031 x 8 = 16496
        // rows; of 1 at 5/1).
        struct Variant {
            bool interleaved, in_place;
            Layout layout;
            Positions positions;
            Angles angles;
            Dt table_dt;
            int64_t R, Hk = 8, group = 4;
        };
        const Variant variants[] = {
            {false, true, Layout::BSHD, Positions::Implicit, Angles::FullTable, Dt::BF16, 128},
            {false, false, Layout::BSHD, Positions::PerBatchToken, Angles::HalfTable, Dt::F32, 128},
            {true, true, Layout::BHSD, Positions::SeqlenOffsets, Angles::FullTable, Dt::BF16, 128},
            {false, false, Layout::Packed, Positions::Implicit, Angles::InvFreq, Dt::F32, 128},
            {false, true, Layout::BSHD, Positions::PerToken, Angles::FullTable, Dt::BF16, 64},
            {false, true, Layout::BSHD, Positions::Implicit, Angles::FullTable, Dt::BF16, 128, 2, 3},
            {false, false, Layout::BHSD, Positions::PerToken, Angles::FullTable, Dt::F32, 128, 1, 5},
        };
        int index = 0;
        for (const Variant& v : variants) {
            Spec c;
            c.dt = Dt::BF16, c.table_dt = v.table_dt, c.angles = v.angles;
            c.interleaved = v.interleaved;
            c.in_place = v.in_place;
            c.layout = v.layout;
            c.positions = v.positions;
            c.B = 2, c.S = 1031, c.Hk = v.Hk, c.group = v.group, c.D = 128, c.R = v.R;
            c.position_offset = 5;
            const std::string spec = describe(c);
            CAPTURE(spec);
            std::mt19937 rng(kNormSeed + 2000 + uint32_t(index++));
            const Problem p = make_problem(c, rng);
            run_and_compare(*this, p, make_norm(p, Dt::BF16, index % 2 == 0, false, rng),
                            norm_tolerance(c));
        }
    }

    TEST_CASE_FIXTURE(GpuFixture, "QK-norm + RoPE with M-RoPE sections matches the CPU backend") {
        for (int variant = 0; variant < 4; ++variant) {
            const Dt dt = variant % 2 ? Dt::BF16 : Dt::F32;
            const int64_t B = 2, S = 9, Hk = 2, Hq = 4, D = 128, R = 128, P = 32;
            const bool backward = variant >= 2;
            CAPTURE(variant);
            std::mt19937 rng(kNormSeed + 2000 + uint32_t(variant));
            HostTensor q(dt, {B, Hq, S, D}), k(dt, {B, Hk, S, D}), x_q(dt, {B, Hq, S, D}),
                x_k(dt, {B, Hk, S, D}), positions(Dt::I64, {3, B, S}), cos_t(Dt::F32, {P, R}),
                sin_t(Dt::F32, {P, R}), w_q(Dt::F32, {D}), w_k(Dt::F32, {D}), dw_q(Dt::F32, {D}),
                dw_k(Dt::F32, {D});
            for (HostTensor* t : {&q, &k, &x_q, &x_k}) t->fill_uniform(rng, -2, 2);
            for (HostTensor* t : {&w_q, &w_k}) t->fill_uniform(rng, 0.5, 1.5);
            positions.for_each(
                [&](const std::vector<int64_t>& i) { positions.set(i, double(rng() % P)); });
            std::uniform_real_distribution<double> angle(-3, 3);
            cos_t.for_each([&](const std::vector<int64_t>& i) {
                const double a = angle(rng);
                cos_t.set(i, std::cos(a));
                sin_t.set(i, std::sin(a));
            });
            // Interleaved sections give axis a >= 1 the pairs a, a+3, ...: axis 0 is the largest.
            const int32_t sections_contiguous[3] = {16, 24, 24};
            const int32_t sections_interleaved[3] = {24, 20, 20};
            const int32_t* sections = variant % 2 ? sections_interleaved : sections_contiguous;
            std::vector<HostTensor*> tensors = {&q,   &k,   &positions, &cos_t, &sin_t, &w_q,
                                                &w_k, &x_q, &x_k,       &dw_q,  &dw_k};
            auto args_for = [&](const std::vector<const DLTensor*>& v) {
                rope_jit_rope_args args;
                rope_jit_rope_args_init(&args);
                args.q = v[0], args.k = v[1], args.positions = v[2], args.cos = v[3];
                args.sin = v[4], args.q_norm_weight = v[5], args.k_norm_weight = v[6];
                if (backward) {
                    args.q_norm_input = v[7], args.k_norm_input = v[8];
                    args.q_norm_weight_grad = v[9], args.k_norm_weight_grad = v[10];
                }
                args.backward = backward;
                args.mrope_sections = sections;
                args.num_mrope_sections = 3;
                args.mrope_interleaved = variant % 2;
                return args;
            };
            std::vector<std::unique_ptr<DeviceTensor>> device;
            std::vector<const DLTensor*> gpu_views, cpu_views;
            for (HostTensor* t : tensors) {
                device.push_back(std::make_unique<DeviceTensor>(*t));
                gpu_views.push_back(device.back()->dl());
                cpu_views.push_back(t->dl());
            }
            require_ok(call_rope(cuda_runtime.get(), args_for(gpu_views)), "gpu");
            synchronize(nullptr);
            require_ok(call_rope(cpu_runtime.get(), args_for(cpu_views)), "cpu");
            for (size_t slot : {size_t(0), size_t(1), size_t(9), size_t(10)}) {
                if (!backward && slot >= 9) continue;
                HostTensor got = *tensors[slot];
                device[slot]->download(got);
                const double tol = slot >= 9 ? 2e-4 : dt == Dt::F32 ? 3e-5 : 1.6e-2;
                double scale = 0;
                if (slot >= 9)
                    for (double v : tensors[slot]->values()) scale = std::max(scale, std::fabs(v));
                check_close(got, *tensors[slot], slot >= 9 ? tol * (scale + 1) : tol,
                            std::string("tensor ") + std::to_string(slot));
            }
        }
    }
}  // TEST_SUITE("gpu")
