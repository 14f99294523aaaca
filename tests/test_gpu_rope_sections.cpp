// The CUDA backend against the CPU backend for multi-section positions (M-RoPE) and the
// frequency gradient, and the accuracy of angles computed in the kernel at large positions.
// Every test is in TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.h"
#include "rope_test_support.h"

using namespace rope_test;
using namespace gpu_test;

namespace {

// Runs args on the CPU runtime with host tensors and on the CUDA runtime with device copies of
// the same tensors; returns (cpu outputs, gpu outputs) for the tensors named in `outputs`.
struct TwoRuns {
    std::vector<std::vector<double>> cpu, gpu;
};

// `tensors` are every tensor of the call; `slots` point at the fields of `args` holding them
// (the GPU call uses a copy of args with those fields re-pointed at device copies); `outputs`
// are indices into tensors whose results are compared.
TwoRuns run_both(GpuFixture& fixture, const rope_jit_rope_args& args,
                 std::vector<HostTensor*> tensors, std::vector<const DLTensor**> slots,
                 std::vector<size_t> outputs) {
    TwoRuns runs;
    // GPU first, from device copies of the untouched inputs.
    std::vector<std::unique_ptr<DeviceTensor>> device;
    rope_jit_rope_args gpu_args = args;
    for (size_t i = 0; i < tensors.size(); ++i) {
        device.push_back(std::make_unique<DeviceTensor>(*tensors[i]));
        // Re-point the matching field of gpu_args at the device copy.
        const ptrdiff_t offset =
            reinterpret_cast<const char*>(slots[i]) - reinterpret_cast<const char*>(&args);
        *reinterpret_cast<const DLTensor**>(reinterpret_cast<char*>(&gpu_args) + offset) =
            device.back()->dl();
    }
    rope_jit_status status = rope_jit_rope(fixture.cuda_runtime.get(), &gpu_args);
    const std::string cuda_message = rope_jit_last_error();
    INFO("cuda: ", cuda_message);
    REQUIRE(status == ROPE_JIT_OK);
    synchronize_context();
    for (size_t index : outputs) {
        HostTensor copy = *tensors[index];
        device[index]->download(copy);
        runs.gpu.push_back(copy.values());
    }
    status = rope_jit_rope(fixture.cpu_runtime.get(), &args);
    const std::string cpu_message = rope_jit_last_error();
    INFO("cpu: ", cpu_message);
    REQUIRE(status == ROPE_JIT_OK);
    for (size_t index : outputs) runs.cpu.push_back(tensors[index]->values());
    return runs;
}

void check_close(const std::vector<double>& gpu, const std::vector<double>& cpu, double tol,
                 const std::string& what) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
        const double ratio = std::fabs(gpu[i] - cpu[i]) / (tol * (1 + std::fabs(cpu[i])));
        if (!(ratio <= worst)) worst = ratio, at = i;
    }
    INFO(what, ": worst element ", at, " gpu ", gpu[at], " cpu ", cpu[at]);
    CHECK(worst <= 1.0);
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "multi-section positions (M-RoPE) on the GPU match the CPU backend") {
        std::mt19937 rng(31);
        // Variants 24..29: proportional pairs (i, i + D/2) over half the features (Gemma-4).
        for (int variant = 0; variant < 30; ++variant) {
            const Dt dt = variant % 3 == 0 ? Dt::F32 : variant % 3 == 1 ? Dt::BF16 : Dt::F16;
            const bool proportional = variant >= 24;
            const bool interleaved_style = variant % 2 && !proportional;
            const int angles = variant % 4 < 2    ? 0
                               : variant % 4 == 2 ? 1
                                                  : 2;  // full, half, inv_freq
            const bool sections_interleaved = variant % 5 == 0;
            const bool batched_positions = variant % 3 != 2;
            const int64_t B = 2, S = 19, Hk = 2, Hq = 8, D = variant % 2 ? 128 : 80,
                          R = proportional ? D / 2 : D, half = R / 2;
            // Interleaved sections (Qwen3-VL) give axis a >= 1 the pairs a, a+3, ...: axis 0 must be
            // the largest for those to fit.
            std::vector<int32_t> sections =
                D == 128 ? (sections_interleaved ? std::vector<int32_t>{24, 20, 20}
                                                 : std::vector<int32_t>{16, 24, 24})
                         : (sections_interleaved ? std::vector<int32_t>{16, 12, 12}
                                                 : std::vector<int32_t>{10, 10, 20});
            if (proportional)
                sections = D == 128 ? (sections_interleaved ? std::vector<int32_t>{12, 10, 10}
                                                            : std::vector<int32_t>{8, 12, 12})
                                    : (sections_interleaved ? std::vector<int32_t>{8, 6, 6}
                                                            : std::vector<int32_t>{5, 5, 10});
            CAPTURE(variant);
            CAPTURE(D);
            CAPTURE(proportional);
            const int64_t P = 64;
            HostTensor q(dt, {B, Hq, S, D}, {0, 2, 1, 3}), k(dt, {B, Hk, S, D});
            q.fill_uniform(rng, -2, 2);
            k.fill_uniform(rng, -2, 2);
            HostTensor positions =
                batched_positions ? HostTensor(Dt::I64, {3, B, S}) : HostTensor(Dt::I32, {3, S});
            std::uniform_int_distribution<int64_t> row(0, P - 1);
            positions.for_each(
                [&](const std::vector<int64_t>& i) { positions.set(i, double(row(rng))); });
            const int64_t columns = angles == 0 ? R : half;
            HostTensor cos_t(Dt::F32, {P, columns}), sin_t(Dt::F32, {P, columns}),
                inv_freq(Dt::F32, {half});
            std::uniform_real_distribution<double> angle(-3, 3);
            cos_t.for_each([&](const std::vector<int64_t>& i) {
                const double a = angle(rng);
                cos_t.set(i, std::cos(a));
                sin_t.set(i, std::sin(a));
            });
            for (int64_t i = 0; i < half; ++i)
                inv_freq.set({i}, std::pow(10000.0, -2.0 * double(i) / double(R)));

            rope_jit_rope_args args;
            rope_jit_rope_args_init(&args);
            args.style = proportional        ? ROPE_JIT_STYLE_PROPORTIONAL
                         : interleaved_style ? ROPE_JIT_STYLE_INTERLEAVED
                                             : ROPE_JIT_STYLE_HALF;
            args.rotary_dim = int32_t(R);
            args.backward = variant % 7 == 3;
            args.mrope_sections = sections.data();
            args.num_mrope_sections = 3;
            args.mrope_interleaved = sections_interleaved;
            std::vector<HostTensor*> tensors = {&q, &k, &positions};
            std::vector<const DLTensor**> slots = {&args.q, &args.k, &args.positions};
            if (angles == 2) {
                tensors.push_back(&inv_freq);
                slots.push_back(&args.inv_freq);
            } else {
                tensors.push_back(&cos_t);
                slots.push_back(&args.cos);
                tensors.push_back(&sin_t);
                slots.push_back(&args.sin);
            }
            for (size_t i = 0; i < tensors.size(); ++i) *slots[i] = tensors[i]->dl();
            const TwoRuns runs = run_both(*this, args, tensors, slots, {0, 1});
            const double tol = dt == Dt::F32 ? 2e-5 : tolerance_for(dt);
            check_close(runs.gpu[0], runs.cpu[0], tol, "q");
            check_close(runs.gpu[1], runs.cpu[1], tol, "k");
        }
    }

    TEST_CASE_FIXTURE(GpuFixture, "the frequency gradient on the GPU matches the CPU backend") {
        std::mt19937 rng(47);
        // Variants 8..11: proportional pairs (i, i + D/2) over a quarter or half of D.
        for (int variant = 0; variant < 12; ++variant) {
            const Dt dt = variant % 2 ? Dt::BF16 : Dt::F32;
            const bool proportional = variant >= 8;
            const int64_t B = 2, S = 33, Hk = 2, Hq = 4, D = 64,
                          R = proportional ? (variant % 4 < 2 ? 16 : 32)
                                           : (variant % 4 < 2 ? 64 : 32),
                          half = R / 2;
            CAPTURE(variant);
            CAPTURE(proportional);
            HostTensor g_q(dt, {B, Hq, S, D}), g_k(dt, {B, Hk, S, D}), y_q(dt, {B, Hq, S, D}),
                y_k(dt, {B, Hk, S, D});
            for (HostTensor* t : {&g_q, &g_k, &y_q, &y_k}) t->fill_uniform(rng, -1, 1);
            HostTensor inv_freq(Dt::F32, {half}), grad(Dt::F32, {half});
            for (int64_t i = 0; i < half; ++i)
                inv_freq.set({i}, std::pow(10000.0, -2.0 * double(i) / double(R)));
            HostTensor positions(Dt::I64, {B, S});
            std::uniform_int_distribution<int64_t> position(0, 4000);
            positions.for_each(
                [&](const std::vector<int64_t>& i) { positions.set(i, double(position(rng))); });
            HostTensor q_out(dt, {B, Hq, S, D}), k_out(dt, {B, Hk, S, D});

            rope_jit_rope_args args;
            rope_jit_rope_args_init(&args);
            args.style = proportional  ? ROPE_JIT_STYLE_PROPORTIONAL
                         : variant % 3 ? ROPE_JIT_STYLE_HALF
                                       : ROPE_JIT_STYLE_INTERLEAVED;
            args.backward = 1;
            args.rotary_dim = int32_t(R);
            std::vector<HostTensor*> tensors = {&g_q,      &g_k,  &y_q,   &y_k,
                                                &inv_freq, &grad, &q_out, &k_out};
            std::vector<const DLTensor**> slots = {&args.q,        &args.k,
                                                   &args.q_saved,  &args.k_saved,
                                                   &args.inv_freq, &args.inv_freq_grad,
                                                   &args.q_out,    &args.k_out};
            if (variant >= 4) {
                tensors.push_back(&positions);
                slots.push_back(&args.positions);
            } else {
                args.position_offset = 1000;
            }
            for (size_t i = 0; i < tensors.size(); ++i) *slots[i] = tensors[i]->dl();
            const TwoRuns runs = run_both(*this, args, tensors, slots, {5, 6, 7});
            // The gradient is a sum of B*S*(Hq+Hk) terms of size position * |g| * |y|: compare
            // against that scale, as float32 accumulation allows.
            double scale = 0;
            for (double v : runs.cpu[0]) scale = std::max(scale, std::fabs(v));
            const double tol = dt == Dt::F32 ? 1e-4 : 3e-3;
            for (size_t i = 0; i < runs.cpu[0].size(); ++i) {
                CAPTURE(i);
                CHECK(std::fabs(runs.gpu[0][i] - runs.cpu[0][i]) <= tol * (scale + 1));
            }
            check_close(runs.gpu[1], runs.cpu[1], tolerance_for(dt) * 2, "dq");
            check_close(runs.gpu[2], runs.cpu[2], tolerance_for(dt) * 2, "dk");
        }
    }

    TEST_CASE_FIXTURE(
        GpuFixture,
        "angles computed in the kernel match exact tables at positions up to 1,000,000") {
        // The reference: float32 tables of exactly computed cos/sin at the token positions. The
        // kernel computes position * inv_freq itself; fp32 would be off by ~0.06 rad at 1e6.
        const int64_t S = 64, D = 128, half = D / 2;
        std::mt19937 rng(5);
        HostTensor q(Dt::F32, {1, 4, S, D});
        q.fill_uniform(rng, -1, 1);
        HostTensor inv_freq(Dt::F32, {half}), positions(Dt::I64, {S});
        for (int64_t i = 0; i < half; ++i)
            inv_freq.set({i}, std::pow(500000.0, -2.0 * double(i) / double(D)));
        std::uniform_int_distribution<int64_t> position(900000, 1000000);
        for (int64_t s = 0; s < S; ++s)
            positions.set({s}, double(s == 0 ? 1000000 : position(rng)));
        HostTensor cos_t(Dt::F32, {S, half}), sin_t(Dt::F32, {S, half}), row_index(Dt::I64, {S});
        for (int64_t s = 0; s < S; ++s) {
            row_index.set({s}, double(s));
            for (int64_t i = 0; i < half; ++i) {
                const double a = positions.get({s}) * inv_freq.get({i});
                cos_t.set({s, i}, std::cos(a));
                sin_t.set({s, i}, std::sin(a));
            }
        }
        HostTensor from_inv_freq(Dt::F32, {1, 4, S, D}), from_table(Dt::F32, {1, 4, S, D});

        rope_jit_rope_args args;
        rope_jit_rope_args_init(&args);
        DeviceTensor dq(q), dout(from_inv_freq), dinv(inv_freq), dpos(positions);
        args.q = dq.dl();
        args.q_out = dout.dl();
        args.inv_freq = dinv.dl();
        args.positions = dpos.dl();
        REQUIRE(rope_jit_rope(cuda_runtime.get(), &args) == ROPE_JIT_OK);
        synchronize_context();
        dout.download(from_inv_freq);

        // The table path on the CPU (exact by construction) is the reference.
        rope_jit_rope_args table_args;
        rope_jit_rope_args_init(&table_args);
        table_args.q = q.dl();
        table_args.q_out = from_table.dl();
        table_args.cos = cos_t.dl();
        table_args.sin = sin_t.dl();
        table_args.positions = row_index.dl();
        REQUIRE(rope_jit_rope(cpu_runtime.get(), &table_args) == ROPE_JIT_OK);

        const std::vector<double> got = from_inv_freq.values(), want = from_table.values();
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i)
            worst = std::max(worst, std::fabs(got[i] - want[i]));
        MESSAGE("max |on-the-fly - exact table| at positions up to 1e6: " << worst);
        CHECK(worst <= 1e-5);  // the fp32 golden cases' tolerance
    }

}  // TEST_SUITE
