// KV cache write and FP8 outputs on the CUDA backend against the CPU backend (itself checked
// against the definitions in test_rope_kv_cache.cpp): the randomized families of
// gpu_rope_kv_problem.h, a decode-sized and a prefill-sized bfloat16 call, FP8 edge values
// (NaN, infinities, saturation, subnormals) and extreme scales. Copies (v, unrotated features,
// everything not written) must match bit for bit; rotated values within fp32 rounding, and for
// FP8 within one e4m3 step (the GPU's fused multiply-adds may move a value across a rounding
// midpoint).
// Every test is in TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_rope_kv_problem.h"
#include "gpu_test_support.h"

using namespace rope_test;
using namespace gpu_test;
using namespace kv_test;

namespace {

// Whether element i of the FP8 or float tensor `got` matches `expected`: FP8 codes equal, or
// (rotated values only) one e4m3 step apart; floats within tol.
void compare(const HostTensor& got_tensor, const HostTensor& expected_tensor, bool exact,
             double tol, const char* what) {
    HostTensor got = got_tensor, expected = expected_tensor;
    CAPTURE(what);
    if (exact) {
        CHECK(got.bytes() == expected.bytes());
        return;
    }
    int64_t failures = 0;
    got.for_each([&](const std::vector<int64_t>& index) {
        const int64_t o = got.offset(index);
        const double g = got.get_at(o), e = expected.get_at(o);
        bool ok;
        if (got.dtype() == Dt::F8)
            ok = got.bytes()[size_t(o)] == expected.bytes()[size_t(o)] ||
                 (!std::isnan(g) && !std::isnan(e) &&
                  std::fabs(g - e) <= 2.001 * e4m3_half_step(std::max(std::fabs(g), std::fabs(e))));
        else
            ok = (std::isnan(g) && std::isnan(e)) || g == e || std::fabs(g - e) <= tol;
        if (!ok && failures++ < 5) {
            std::string where;
            for (int64_t i : index) where += std::to_string(i) + " ";
            CAPTURE(where);
            CAPTURE(g);
            CAPTURE(e);
            CHECK(ok);
        }
    });
    CHECK(failures == 0);
}

void require_ok(rope_jit_runtime* runtime, const rope_jit_rope_args& args, const char* where) {
    const rope_jit_status status = rope_jit_rope(runtime, &args);
    const std::string message = rope_jit_last_error();
    INFO(where, ": ", message);
    REQUIRE(status == ROPE_JIT_OK);
}

// Runs the problem on both backends and compares every tensor the call may write.
void run_and_compare(GpuFixture& fixture, KvProblem& p) {
    KvProblem cpu = p;
    const rope_jit_rope_args cpu_args = kv_args(cpu, host_views(cpu));
    require_ok(fixture.cpu_runtime.get(), cpu_args, "cpu");

    std::vector<std::unique_ptr<DeviceTensor>> device;
    std::vector<const DLTensor*> views;
    for (HostTensor* t : slots_of(p)) {
        device.push_back(t->shape().empty() ? nullptr : std::make_unique<DeviceTensor>(*t));
        views.push_back(device.back() ? device.back()->dl() : nullptr);
    }
    require_ok(fixture.cuda_runtime.get(), kv_args(p, views), "gpu");
    synchronize(nullptr);
    KvProblem gpu = p;
    const std::vector<HostTensor*> gpu_slots = slots_of(gpu);
    for (size_t i = 0; i < gpu_slots.size(); ++i)
        if (device[i]) device[i]->download(*gpu_slots[i]);

    const double tol = tolerance_for(p.c.dt);
    compare(gpu.q, cpu.q, p.c.q_fp8 || !p.c.in_place_q, tol, "q");
    if (!gpu.q_out.shape().empty()) compare(gpu.q_out, cpu.q_out, false, tol, "q_out");
    compare(gpu.k, cpu.k, true, 0, "k");
    compare(gpu.v, cpu.v, true, 0, "v");
    compare(gpu.k_cache, cpu.k_cache, false, tol, "k_cache");
    compare(gpu.v_cache, cpu.v_cache, true, 0, "v_cache");
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "KV cache write + FP8: the CUDA backend matches the CPU backend over the "
                      "randomized families") {
        std::mt19937 rng(kKvSeed + 100);
        for (int family = 0; family < kKvFamilies; ++family) {
            const KvCase c = kv_case(family);
            const std::string name = describe(c);
            CAPTURE(family);
            CAPTURE(name);
            KvProblem p = make_kv_problem(c, rng);
            run_and_compare(*this, p);
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "KV cache write + FP8 at Llama/Qwen3 sizes (bf16, D128, 32/8 heads): decode "
                      "with block tables and prefill with slot_mapping, each with and without "
                      "QK-norm, match the CPU backend") {
        int index = 0;
        // With QK-norm (variants 2, 3, 6, 7) both decode and prefill take rope.cu's direct path
        // (RopePlan::norm_items): one token a block, its heads' items and v's.
        for (int variant = 0; variant < 8; ++variant) {
            const bool decode = variant < 4, norm = variant % 4 >= 2;
            const rope_jit_kv_cache_layout layout =
                variant % 2 ? ROPE_JIT_KV_CACHE_PAGED_HND : ROPE_JIT_KV_CACHE_PAGED_NHD;
            {
                KvCase c;
                c.dt = Dt::BF16;
                c.D = c.R = c.Dv = 128;
                c.Hk = 8, c.group = 4;
                c.B = decode ? 64 : 2;
                c.S = decode ? 1 : 300;
                c.layout = layout;
                c.index = decode ? KvIndex::BlockTables : KvIndex::SlotMapping;
                c.block_size = 16;
                c.fp8 = c.scales = true;
                c.offsets = decode;
                c.q_fp8 = decode;
                c.in_place_q = !decode;
                c.norm = norm;  // Qwen3's QK-norm + RoPE + paged KV + FP8 in one launch
                const std::string name = describe(c);
                CAPTURE(name);
                std::mt19937 rng(kKvSeed + 200 + uint32_t(index++));
                KvProblem p = make_kv_problem(c, rng);
                run_and_compare(*this, p);
            }
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "QK-norm + KV cache on rope.cu's direct path (head_dim 512, interleaved, "
                      "fp32, odd heads, every weight dtype, strided weights, many tokens, packed, "
                      "FP8 q) matches the CPU backend") {
        std::mt19937 rng(kKvSeed + 300);
        for (const KvCase& c : norm_direct_cases()) {
            const std::string name = describe(c);
            CAPTURE(name);
            KvProblem p = make_kv_problem(c, rng);
            run_and_compare(*this, p);
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "FP8 edge values: NaN, infinities, saturation and subnormals convert "
                      "bit for bit as on the CPU") {
        for (Dt dt : {Dt::F32, Dt::BF16, Dt::F16}) {
            KvCase c;
            c.dt = dt;
            c.fp8 = c.scales = true;
            c.S = 8;
            c.D = c.R = c.Dv = 64;
            std::mt19937 rng(kKvSeed + 300 + uint32_t(dt));
            KvProblem p = make_kv_problem(c, rng);
            const double specials[] = {NAN,   -NAN,  INFINITY, -INFINITY, 1e6,         -1e6,
                                       448.0, 464.0, 480.0,    -464.0,    1e-3,        -1e-3,
                                       0.0,   -0.0,  2e-3,     3e-3,      0.0087890625};
            int64_t i = 0;
            p.v.for_each([&](const std::vector<int64_t>& index) {
                p.v.set(index, specials[size_t(i++ % 17)]);
            });
            p.v_scale.set({0}, 1.0);
            CAPTURE(dt_name(dt));
            run_and_compare(*this, p);
        }
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "FP8 quotients at extreme and uneven scales match the CPU's fp32 division "
                      "bit for bit (the kernel multiplies by a reciprocal and corrects)") {
        // v / scale over quotients from 5e-4 to 500 in magnitude, at scales from 2^-100 (the
        // kernel then rescales both by 2^64) to 7.3e25; with full rotary (the one-token path)
        // and with partial rotary out of place (the staged path, which copies features).
        std::mt19937 rng(kKvSeed + 400);
        std::uniform_real_distribution<double> unit(-1.0, 1.0), decades(-6.0, 0.0);
        int index = 0;
        for (Dt dt : {Dt::F32, Dt::BF16})
            for (double scale : {std::ldexp(1.0, -100), 3.1e-30, 0.37, 7.3e25}) {
                KvCase c;
                c.dt = dt;
                c.fp8 = c.scales = true;
                c.S = 8;
                c.D = c.Dv = 64;
                c.R = index++ % 2 ? 32 : 64;
                KvProblem p = make_kv_problem(c, rng);
                p.v.for_each([&](const std::vector<int64_t>& at) {
                    p.v.set(at, 500.0 * unit(rng) * std::pow(10.0, decades(rng)) * scale);
                });
                p.k.for_each([&](const std::vector<int64_t>& at) {
                    p.k.set(at, 100.0 * unit(rng) * scale);
                });
                p.k_scale.set({0}, scale);
                p.v_scale.set({0}, scale);
                CAPTURE(dt_name(dt));
                CAPTURE(scale);
                CAPTURE(c.R);
                run_and_compare(*this, p);
            }
    }
}  // TEST_SUITE("gpu")
