// Proportional partial rotary (ROPE_JIT_STYLE_PROPORTIONAL, Gemma-4) on the CUDA backend against
// the CPU backend (itself checked against an independent reference in
// test_rope_proportional.cpp): a randomized sweep of the spec space with proportional pairs, and
// Gemma-4-sized bfloat16 shapes (head_dim 512 and 576) as the vectorized paths see them. M-RoPE
// and the frequency gradient with proportional pairs are variants of test_gpu_rope_sections.cpp.
// Every test is in TEST_SUITE("gpu"); the sweep's specs come from gpu_rope_problem.h.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "gpu_rope_problem.h"

using namespace rope_test;
using namespace gpu_test;
using namespace gpu_rope_test;

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "proportional rotary: the CUDA backend matches the CPU backend over a "
                      "randomized sweep") {
        // 40 random kernels, each run with 2 random sizes; every (family, variant) has its own
        // seed, so a failure replays alone.
        for (uint32_t family = 0; family < kProportionalFamilies; ++family) {
            std::mt19937 family_rng(kProportionalSeed + family);
            const Spec base = random_proportional_spec(family_rng);
            for (uint32_t variant = 0; variant < 2; ++variant) {
                std::mt19937 rng(kProportionalSeed + 7919 * (variant + 1) + family);
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

    TEST_CASE_FIXTURE(GpuFixture,
                      "proportional rotary at Gemma-4 sizes (head_dim 512 and 576, bfloat16) "
                      "matches the CPU backend") {
        int index = 0;
        for (int64_t D : {512, 576})
            for (Layout layout : {Layout::BHSD, Layout::BSHD})
                for (bool backward : {false, true})
                    for (Angles angles : {Angles::FullTable, Angles::InvFreq}) {
                        Spec c;
                        c.proportional = true;
                        c.dt = Dt::BF16;
                        c.table_dt = Dt::BF16;
                        c.layout = layout;
                        c.backward = backward;
                        c.angles = angles;
                        c.in_place = !backward;  // forward in place, backward out of place
                        c.B = 2, c.S = 97, c.Hk = 2, c.group = 8, c.D = D, c.R = D / 4;
                        c.position_offset = 5;
                        const std::string spec = describe(c);
                        CAPTURE(spec);
                        std::mt19937 rng(uint32_t(kProportionalSeed + index++));
                        const Problem p = make_problem(c, rng);
                        const Problem from_cpu = run_with_host_tensors(cpu_runtime.get(), p);
                        const Problem from_gpu = run_with_device_tensors(cuda_runtime.get(), p);
                        check_gpu_matches_cpu(p, from_gpu, from_cpu, gpu_tolerance(c));
                    }
    }
}  // TEST_SUITE("gpu")
