// rope.cu's flat path (RopePlan::flat_rows, rope_flat_kernel: plain RoPE of dense rows, in
// [B, H, S, D] memory or 16-bit [B, S, H, D] rotated whole, walked as one array of rotation
// items) against the CPU backend, through
// the public C API. Each GPU call first checks that the launcher takes that path for it, or
// not (flat_rows_of on the call's own RopeProblem). The GPU cases are in TEST_SUITE("gpu"); one
// CPU case checks their calls and compiles their kernels without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_rope_problem.h"
#include "common/error.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_plan.h"
#include "ops/rope/rope_problem.h"
#include "ops/rope/rope_recipe.h"
#include "sanitizer_builds.h"

using namespace rope_test;
using namespace gpu_test;
using namespace gpu_rope_test;

namespace {

// Runs `c` on both backends and compares; `flat` whether the GPU call must take the flat path.
void check_against_cpu(GpuFixture& f, const Spec& c, bool flat, uint32_t seed) {
    const std::string spec = describe(c);
    CAPTURE(spec);
    std::mt19937 rng(seed);
    const Problem p = make_problem(c, rng);
    const Problem from_cpu = run_with_host_tensors(f.cpu_runtime.get(), p);
    DeviceProblem device(p);
    const rope_jit_rope_args args = make_args(p.spec, device.views(), nullptr);
    CHECK(takes_flat_path(args) == flat);
    require_ok(call_rope(f.cuda_runtime.get(), args), "device tensors");
    synchronize(nullptr);
    check_gpu_matches_cpu(p, device.download(p), from_cpu, gpu_tolerance(c));
}

Spec dense_spec(Dt dt, int64_t D, Layout layout = Layout::BHSD) {
    Spec c;
    c.dt = c.table_dt = dt;
    c.layout = layout;
    c.angles = Angles::FullTable;
    c.D = c.R = D;
    return c;
}

// The calls of the tests below: a spec, whether its call takes the flat path, its seed, and
// its group (one test case each).
enum class Group { Sweep, Large, Copies, Others };
struct FlatCase {
    Spec spec;
    bool flat;
    uint32_t seed;
    Group group;
};

std::vector<FlatCase> flat_cases() {
    std::vector<FlatCase> cases;
    uint32_t seed = 1;
    // Small problems (the last block partly idle): both row orders, every dtype, pair style and
    // head size, the directions, position sources, outputs and q alone spread over them.
    // [B, S, H, D] float32 stays on the direct path (it is faster there).
    for (Layout layout : {Layout::BHSD, Layout::BSHD})
        for (Dt dt : {Dt::F32, Dt::F16, Dt::BF16})
            for (int style = 0; style < 3; ++style)
                for (int64_t D : {64, 80, 128}) {
                    Spec c = dense_spec(dt, D, layout);
                    c.interleaved = style == 1;
                    c.proportional = style == 2;
                    c.angles = style == 0 ? Angles::HalfTable : Angles::FullTable;
                    c.table_dt = style == 0 ? Dt::F32 : dt;
                    c.positions = seed % 4 == 0   ? Positions::SeqlenOffsets
                                  : seed % 4 == 1 ? Positions::PerBatchToken
                                  : seed % 4 == 2 ? Positions::PerToken
                                                  : Positions::Implicit;
                    c.index_dt = seed % 8 < 4 ? Dt::I64 : Dt::I32;
                    c.position_offset = c.positions == Positions::Implicit ? seed % 4 : 0;
                    c.backward = seed % 2 == 0;
                    c.in_place = seed % 4 != 1;
                    c.has_k = seed % 5 != 0;
                    c.B = 2, c.S = 37, c.Hk = 3, c.group = 2;
                    const bool flat = layout == Layout::BHSD || dt != Dt::F32;
                    cases.push_back({c, flat, seed++, Group::Sweep});
                }
    // In-place partial rotary (only the rotated spans), at an offset; k with more (cached)
    // tokens than q, so that k reads angles of its own rows (RopePlan::roles 2).
    Spec partial = dense_spec(Dt::BF16, 128);
    partial.R = 64;
    partial.offset = 32;
    partial.interleaved = true;
    cases.push_back({partial, true, seed++, Group::Sweep});
    for (Layout layout : {Layout::BHSD, Layout::BSHD}) {
        Spec longer_k = dense_spec(Dt::F16, 64, layout);
        longer_k.q_extra = 3;
        longer_k.S = 29;
        longer_k.position_offset = 2;
        cases.push_back({longer_k, true, seed++, Group::Sweep});
    }
    // Many blocks: Llama-3-8B's heads over 1024 tokens (bf16, half style and interleaved, both
    // row orders; a positions tensor in [B, S, H, D]), and D64 interleaved over 2048.
    for (Layout layout : {Layout::BHSD, Layout::BSHD})
        for (const bool interleaved : {false, true}) {
            Spec large = dense_spec(Dt::BF16, 128, layout);
            large.interleaved = interleaved;
            large.B = 1, large.S = 1024, large.Hk = 8, large.group = 4;
            if (layout == Layout::BSHD && interleaved) large.positions = Positions::PerToken;
            cases.push_back({large, true, seed++, Group::Large});
        }
    Spec d64 = dense_spec(Dt::BF16, 64);
    d64.interleaved = true;
    d64.B = 2, d64.S = 2048, d64.Hk = 4, d64.group = 1;
    cases.push_back({d64, true, seed++, Group::Large});
    // Out-of-place partial rotary of interleaved pairs in 16-bit rows with 8-element vectors
    // (RopePlan::flat_copies): every vector of an output row rotated or copied. ChatGLM2-6B's
    // 64/128 with two k heads, backward in [B, H, S, D] at an offset, GPT-J's 64/256 with q
    // alone and positions, k longer than q, and ChatGLM2 over 1024 tokens.
    {
        Spec chatglm = dense_spec(Dt::BF16, 128, Layout::BSHD);
        chatglm.R = 64;
        chatglm.interleaved = true;
        chatglm.in_place = false;
        chatglm.Hk = 2, chatglm.group = 4;
        cases.push_back({chatglm, true, seed++, Group::Copies});
        Spec offset = chatglm;
        offset.dt = Dt::F16;
        offset.layout = Layout::BHSD;
        offset.offset = 32;
        offset.backward = true;
        offset.angles = Angles::HalfTable;
        offset.table_dt = Dt::F32;
        cases.push_back({offset, true, seed++, Group::Copies});
        Spec q_alone = dense_spec(Dt::F16, 256, Layout::BSHD);
        q_alone.R = 64;
        q_alone.interleaved = true;
        q_alone.in_place = false;
        q_alone.has_k = false;
        q_alone.positions = Positions::PerToken;
        q_alone.index_dt = Dt::I32;
        cases.push_back({q_alone, true, seed++, Group::Copies});
        Spec longer_k = dense_spec(Dt::BF16, 64, Layout::BSHD);
        longer_k.R = 32;
        longer_k.interleaved = true;
        longer_k.in_place = false;
        longer_k.q_extra = 3;
        longer_k.S = 29;
        longer_k.position_offset = 2;
        cases.push_back({longer_k, true, seed++, Group::Copies});
        Spec large = chatglm;
        large.B = 1, large.S = 1024, large.Hk = 2, large.group = 16;
        cases.push_back({large, true, seed++, Group::Copies});
    }
    // The same in half style in rows of 4 or 8 vectors, each rotated vector's partner taken
    // from another lane of its warp (RopePlan::flat_shuffles): Persimmon-8B's 32/64 (4 rows a
    // warp; 222 rows, so the last warp is half past the last item, its lanes in the shuffles
    // all the same), 32/64 with seqlen offsets over 21 rows, 16/64 at an offset backward in
    // [B, H, S, D] fp16 with a float32 table, 16/32 of q alone with positions (rows of 4
    // vectors), and Persimmon over 2048 tokens.
    {
        Spec persimmon = dense_spec(Dt::BF16, 64, Layout::BSHD);
        persimmon.R = 32;
        persimmon.in_place = false;
        persimmon.B = 1, persimmon.Hk = 3, persimmon.group = 1, persimmon.S = 37;
        cases.push_back({persimmon, true, seed++, Group::Copies});
        Spec offsets = persimmon;
        offsets.positions = Positions::SeqlenOffsets;
        offsets.S = 7, offsets.Hk = 1, offsets.group = 2;
        cases.push_back({offsets, true, seed++, Group::Copies});
        Spec offset = dense_spec(Dt::F16, 64, Layout::BHSD);
        offset.R = 16;
        offset.offset = 32;
        offset.in_place = false;
        offset.backward = true;
        offset.angles = Angles::HalfTable;
        offset.table_dt = Dt::F32;
        offset.Hk = 2, offset.group = 4;
        cases.push_back({offset, true, seed++, Group::Copies});
        Spec q_alone = dense_spec(Dt::BF16, 32, Layout::BSHD);
        q_alone.R = 16;
        q_alone.in_place = false;
        q_alone.has_k = false;
        q_alone.positions = Positions::PerToken;
        cases.push_back({q_alone, true, seed++, Group::Copies});
        Spec large = persimmon;
        large.B = 2, large.S = 2048, large.Hk = 4;
        cases.push_back({large, true, seed++, Group::Copies});
    }
    // Calls the flat path leaves to the others: [B, S, H, D] memory rotated in part in place,
    // rows with padding, angles from inv_freq, one token a sequence, out-of-place partial
    // rotary (the bulk or staged path), a packed batch.
    Spec tokens_partial = dense_spec(Dt::BF16, 128, Layout::BSHD);
    tokens_partial.R = 64;
    cases.push_back({tokens_partial, false, seed++, Group::Others});
    Spec padded = dense_spec(Dt::BF16, 64);
    padded.layout = Layout::Padded;
    cases.push_back({padded, false, seed++, Group::Others});
    Spec packed = dense_spec(Dt::BF16, 64, Layout::Packed);
    cases.push_back({packed, false, seed++, Group::Others});
    Spec inv_freq = dense_spec(Dt::F32, 64);
    inv_freq.angles = Angles::InvFreq;
    cases.push_back({inv_freq, false, seed++, Group::Others});
    for (Layout layout : {Layout::BHSD, Layout::BSHD}) {
        Spec one_token = dense_spec(Dt::BF16, 128, layout);
        one_token.S = 1;
        one_token.B = 8;
        cases.push_back({one_token, false, seed++, Group::Others});
    }
    // Out-of-place partial rotary the bulk or staged path keeps: half style in vectors under 8
    // elements (GPT-NeoX's 24/96), in rows of other than 4 or 8 vectors (Phi-2's 32/80 in fp16,
    // D128 64/128, which lost on the flat path: run EY), proportional pairs, and interleaved
    // float32.
    Spec partial_out = dense_spec(Dt::BF16, 96);
    partial_out.R = 24;
    partial_out.in_place = false;
    cases.push_back({partial_out, false, seed++, Group::Others});
    Spec phi2 = dense_spec(Dt::F16, 80, Layout::BSHD);
    phi2.R = 32;
    phi2.in_place = false;
    cases.push_back({phi2, false, seed++, Group::Others});
    Spec half128 = dense_spec(Dt::BF16, 128, Layout::BSHD);
    half128.R = 64;
    half128.in_place = false;
    half128.S = 9;
    cases.push_back({half128, false, seed++, Group::Others});
    Spec proportional = dense_spec(Dt::BF16, 64, Layout::BSHD);
    proportional.R = 32;
    proportional.proportional = true;
    proportional.in_place = false;
    proportional.S = 9;
    cases.push_back({proportional, false, seed++, Group::Others});
    Spec partial_f32 = dense_spec(Dt::F32, 128, Layout::BSHD);
    partial_f32.R = 64;
    partial_f32.interleaved = true;
    partial_f32.in_place = false;
    cases.push_back({partial_f32, false, seed++, Group::Others});
    return cases;
}

void check_group(GpuFixture& f, Group group) {
    for (const FlatCase& c : flat_cases())
        if (c.group == group) check_against_cpu(f, c.spec, c.flat, c.seed);
}

}  // namespace

TEST_CASE("the flat path's GPU calls run on the CPU backend, take that path where their case "
          "says, and their kernels compile") {
    // The calls of the gpu suite's cases below, checked without a GPU: each is valid, takes the
    // flat path exactly where its case says so, and the kernel it selects compiles for sm_90
    // and sm_80 with the flat entry where its plan has one.
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    CpuRuntime runtime;
    rope_jit::KernelStats stats;
    SweepCompiles compiles;
    std::vector<rope_jit::KernelSpec> compiled;
    for (const FlatCase& c : flat_cases()) {
        std::mt19937 rng(c.seed);
        Problem p = make_problem(c.spec, rng);
        const std::string spec_text = describe(c.spec);
        CAPTURE(spec_text);
        run_with_host_tensors(runtime.handle, p);
        const rope_jit_rope_args args = make_args(c.spec, host_views(p), nullptr);
        CHECK(takes_flat_path(args) == c.flat);
        const rope_jit::KernelSpec spec =
            rope_jit::make_kernel_spec(rope_jit::make_rope_problem(args));
        if (std::find(compiled.begin(), compiled.end(), spec) != compiled.end()) continue;
        compiled.push_back(spec);
        const rope_jit::KernelRecipe recipe = rope_jit::rope_recipe(spec);
        if (c.flat) CHECK(recipe.second_entry == "rope_flat_kernel");
        if (!compiles.next()) continue;
        for (const char* target : {"sm_90", "sm_80"}) {
            CAPTURE(target);
            const rope_jit::KernelBinary binary =
                rope_jit::build_kernel_binary(recipe, target, nullptr, stats);
            CHECK(std::string(binary.image.data(), 4) ==
                  "\x7f"
                  "ELF");
        }
    }
    MESSAGE(compiled.size() << " kernels, " << compiles.taken() << " compiled");
}

TEST_CASE("every random call whose kernel has the flat path takes it, and only those get "
          "dense_rows") {
    // A dense_rows module's rope_kernel is empty (rope.cu): a call of such a spec that the
    // launcher did not send to the flat entry would leave its data unrotated. Random calls of
    // the GPU sweeps' spec space (every layout, dtype, position source, partial rotary, xPos,
    // inv_freq), and the same with outputs and layouts varied: dense_rows, the plan's flat
    // path and flat_rows_of agree on each.
    std::mt19937 rng(20261204);
    int valid = 0, dense = 0;
    for (int n = 0; n < 1500; ++n) {
        Spec c = random_spec(rng);
        if (n % 3 == 0) c.layout = pick(rng, {Layout::BHSD, Layout::BSHD});  // more dense calls
        const std::string spec_text = describe(c);
        CAPTURE(spec_text);
        Problem p = make_problem(c, rng);
        const rope_jit_rope_args args = make_args(c, host_views(p), nullptr);
        rope_jit::RopeProblem problem;
        try {
            problem = rope_jit::make_rope_problem(args);
        } catch (const rope_jit::Error&) {
            continue;  // a combination the C API refuses (its own tests cover those)
        }
        ++valid;
        const rope_jit::KernelSpec spec = rope_jit::make_kernel_spec(problem);
        const bool flat_plan = rope_jit::rope_plan(spec).flat_rows;
        CHECK(bool(spec.dense_rows) == flat_plan);
        CHECK(rope_jit::flat_rows_of(spec, problem).has_value() == flat_plan);
        dense += flat_plan ? 1 : 0;
    }
    CHECK(valid > 1000);
    CHECK(dense > 150);
    MESSAGE(valid << " valid calls, " << dense << " of them on the flat path");
}

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "plain RoPE of dense rows through the flat path matches the CPU backend: "
                      "both row orders, every dtype, pair style, head size, direction and output") {
        check_group(*this, Group::Sweep);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "the flat path over many blocks (Llama-3-8B and D64 shapes) matches the CPU "
                      "backend") {
        check_group(*this, Group::Large);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "out-of-place partial rotary through the flat path (rotated and copied "
                      "vectors) matches the CPU backend") {
        check_group(*this, Group::Copies);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "calls the flat path leaves to the other paths match the CPU backend") {
        check_group(*this, Group::Others);
    }
}
