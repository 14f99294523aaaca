// rope.cu's bulk path (RopePlan::bulk_rows, rope_bulk_kernel: out-of-place partial rotary whose
// rows move through shared memory by the bulk copy engine) against the CPU backend, through the
// public C API. Each GPU call first checks that the launcher takes that path for it
// (bulk_rows_of on the call's own RopeProblem) on sm_90 and later; elsewhere the same calls run
// the staged path and are still compared. The GPU cases are in TEST_SUITE("gpu"); one CPU case
// checks their calls and compiles their kernels without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_rope_problem.h"
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
using rope_jit::check_cu;

namespace {

// Device 0's compute capability (90 for 9.0).
int compute_capability() {
    rope_jit::CUdevice device = 0;
    check_cu(driver().cuDeviceGet(&device, 0), "cuDeviceGet");
    int major = 0, minor = 0;
    check_cu(driver().cuDeviceGetAttribute(
                 &major, rope_jit::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
             "cuDeviceGetAttribute");
    check_cu(driver().cuDeviceGetAttribute(
                 &minor, rope_jit::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
             "cuDeviceGetAttribute");
    return major * 10 + minor;
}

// Whether the launcher takes the bulk path for the call `args` describes, and how many tiles.
bool takes_bulk_path(const rope_jit_rope_args& args, long long* tiles) {
    const rope_jit::RopeProblem problem = rope_jit::make_rope_problem(args);
    const auto bulk =
        rope_jit::bulk_rows_of(rope_jit::make_kernel_spec(problem), problem, compute_capability());
    *tiles = bulk ? bulk->tiles : 0;
    return bulk.has_value();
}

// Runs `c` on both backends and compares; `bulk` whether the GPU call must take the bulk path
// (on a device without the bulk copy engine: that it does not).
void check_against_cpu(GpuFixture& f, const Spec& c, bool bulk, uint32_t seed) {
    const std::string spec = describe(c);
    CAPTURE(spec);
    std::mt19937 rng(seed);
    const Problem p = make_problem(c, rng);
    const Problem from_cpu = run_with_host_tensors(f.cpu_runtime.get(), p);
    DeviceProblem device(p);
    const rope_jit_rope_args args = make_args(p.spec, device.views(), nullptr);
    long long tiles = 0;
    CHECK(takes_bulk_path(args, &tiles) == (bulk && compute_capability() >= 90));
    INFO("tiles: ", tiles);
    require_ok(call_rope(f.cuda_runtime.get(), args), "device tensors");
    synchronize(nullptr);
    check_gpu_matches_cpu(p, device.download(p), from_cpu, gpu_tolerance(c));
}

Spec partial_out_of_place(Dt dt, int64_t D, int64_t R) {
    Spec c;
    c.dt = c.table_dt = dt;
    c.in_place = false;
    c.layout = Layout::BSHD;
    c.angles = Angles::FullTable;
    c.D = D;
    c.R = R;
    return c;
}

// The calls of the tests below: a spec, whether its call takes the bulk path (on sm_90 and
// later), its seed, and its group (one test case each).
enum class Group { Sweep, ManyTiles, Staged };
struct BulkCase {
    Spec spec;
    bool bulk;
    uint32_t seed;
    Group group;
};

std::vector<BulkCase> bulk_cases() {
    std::vector<BulkCase> cases;
    uint32_t seed = 1;
    // Small problems (a tile or a few, the last one short): every layout, dtype and pair style,
    // the position sources and directions spread over them.
    for (Layout layout : {Layout::BSHD, Layout::BHSD, Layout::Packed, Layout::PackedHeadMajor})
        for (Dt dt : {Dt::F32, Dt::F16, Dt::BF16})
            for (int style = 0; style < 3; ++style) {
                Spec c = partial_out_of_place(dt, 96, 32);
                c.layout = layout;
                c.interleaved = style == 1;
                c.proportional = style == 2;
                c.angles = style == 0 ? Angles::HalfTable : Angles::FullTable;
                c.table_dt = style == 0 ? Dt::F32 : dt;
                c.positions = is_packed(layout) ? Positions::PerToken : Positions::PerBatchToken;
                if (seed % 3 == 0) c.positions = Positions::SeqlenOffsets;
                if (seed % 4 == 0) c.positions = Positions::Implicit;
                c.position_offset = c.positions == Positions::Implicit ? 5 : 0;
                c.backward = seed % 2 == 0;
                c.has_k = seed % 5 != 0;
                c.B = 3, c.S = 41, c.Hk = 3, c.group = 2;
                // Interleaved 16-bit dense rows take the flat path (RopePlan::flat_copies).
                const bool flat = c.interleaved && dt != Dt::F32 && !is_packed(layout);
                cases.push_back({c, !flat, seed++, Group::Sweep});
            }
    // The models' shapes, rotary at an offset, and q alone; wide heads take the staged path
    // (RopePlan::bulk_rows: up to 128 features), 16-bit interleaved pairs the flat path
    // (GPT-J, ChatGLM2: RopePlan::flat_copies), and so do 16-bit half-style rows of 8 vectors
    // (16 of 64 at an offset: RopePlan::flat_shuffles).
    struct Shape {
        Dt dt;
        int64_t D, R, offset, Hk, group;
        bool interleaved, has_k, bulk;
    };
    for (const Shape& s : {Shape{Dt::BF16, 96, 24, 0, 4, 1, false, true, true},    // GPT-NeoX
                           Shape{Dt::BF16, 80, 32, 0, 4, 1, false, true, true},    // Phi-2
                           Shape{Dt::BF16, 80, 20, 0, 4, 1, false, true, true},    // StableLM-3B
                           Shape{Dt::F16, 256, 64, 0, 2, 1, true, true, false},    // GPT-J
                           Shape{Dt::BF16, 128, 64, 0, 2, 8, true, true, false},   // ChatGLM2
                           Shape{Dt::BF16, 128, 64, 0, 2, 4, false, true, true},   // half, D128
                           Shape{Dt::BF16, 64, 16, 48, 2, 4, false, true, false},  // at an offset
                           Shape{Dt::F32, 64, 32, 16, 2, 2, true, false, true}}) {  // q alone
        Spec c = partial_out_of_place(s.dt, s.D, s.R);
        c.offset = s.offset;
        c.interleaved = s.interleaved;
        c.has_k = s.has_k;
        c.Hk = s.Hk, c.group = s.group, c.B = 2, c.S = 77;
        cases.push_back({c, s.bulk, seed++, Group::Sweep});
    }
    // Many tiles a block: 4 x 1536 tokens of 16 + 8 heads of 96 features (bf16) are 147456
    // rows, 85 a tile, 1157 + 579 tiles over at most 4 blocks a multiprocessor: several rounds of
    // both stages and both barrier phases. Then proportional pairs, 32 of 80 features in f32
    // (320-byte rows, 51 a tile).
    Spec many = partial_out_of_place(Dt::BF16, 96, 24);
    many.B = 4, many.S = 1536, many.Hk = 8, many.group = 2;
    many.positions = Positions::PerBatchToken;
    cases.push_back({many, true, 7001, Group::ManyTiles});
    many.layout = Layout::BHSD;
    many.backward = true;
    many.positions = Positions::Implicit;
    cases.push_back({many, true, 7002, Group::ManyTiles});
    Spec proportional = partial_out_of_place(Dt::F32, 80, 32);
    proportional.proportional = true;
    proportional.B = 2, proportional.S = 1500, proportional.Hk = 4, proportional.group = 2;
    cases.push_back({proportional, true, 7003, Group::ManyTiles});
    // Calls the bulk path cannot take: rows with padding between them, angles from inv_freq,
    // in place, k's own angles.
    Spec padded = partial_out_of_place(Dt::BF16, 96, 24);
    padded.layout = Layout::Padded;
    padded.B = 2, padded.S = 50, padded.Hk = 2, padded.group = 2;
    cases.push_back({padded, false, 8001, Group::Staged});
    Spec inv_freq = padded;
    inv_freq.layout = Layout::BSHD;
    inv_freq.angles = Angles::InvFreq;
    cases.push_back({inv_freq, false, 8002, Group::Staged});
    Spec in_place = inv_freq;
    in_place.angles = Angles::FullTable;
    in_place.in_place = true;
    cases.push_back({in_place, false, 8003, Group::Staged});
    // k longer than q (cached tokens before q's): q's implicit rows move, so k reads angles of
    // its own (RopePlan::roles 2).
    Spec longer_k = padded;
    longer_k.layout = Layout::BSHD;
    longer_k.q_extra = 3;
    cases.push_back({longer_k, false, 8004, Group::Staged});
    return cases;
}

void check_group(GpuFixture& f, Group group) {
    for (const BulkCase& c : bulk_cases())
        if (c.group == group) check_against_cpu(f, c.spec, c.bulk, c.seed);
}

}  // namespace

TEST_CASE("the bulk path's GPU calls run on the CPU backend, take that path on sm_90, and their "
          "kernels compile") {
    // The calls of the gpu suite's cases below, checked without a GPU: each is valid, takes
    // the bulk path on an sm_90 device exactly where its case says so (and on no device before
    // sm_90), and the kernel it selects compiles for sm_90 with the bulk entry.
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    CpuRuntime runtime;
    rope_jit::KernelStats stats;
    SweepCompiles compiles;
    std::vector<rope_jit::KernelSpec> compiled;
    for (const BulkCase& c : bulk_cases()) {
        std::mt19937 rng(c.seed);
        Problem p = make_problem(c.spec, rng);
        const std::string spec_text = describe(c.spec);
        CAPTURE(spec_text);
        run_with_host_tensors(runtime.handle, p);
        const rope_jit_rope_args args = make_args(c.spec, host_views(p), nullptr);
        const rope_jit::RopeProblem problem = rope_jit::make_rope_problem(args);
        const rope_jit::KernelSpec spec = rope_jit::make_kernel_spec(problem);
        // Host tensors: addresses as the allocator gave them; the rows' order and density
        // are what a device copy has (DeviceTensor keeps the layout), alignment aside.
        rope_jit::RopeProblem aligned = problem;
        for (rope_jit::TensorRef* t : {&aligned.q, &aligned.q_out, &aligned.k, &aligned.k_out})
            t->data = reinterpret_cast<char*>(uintptr_t(1) << 20);
        CHECK(rope_jit::bulk_rows_of(spec, aligned, 90).has_value() == c.bulk);
        CHECK_FALSE(rope_jit::bulk_rows_of(spec, aligned, 86).has_value());
        if (std::find(compiled.begin(), compiled.end(), spec) != compiled.end()) continue;
        compiled.push_back(spec);
        const rope_jit::KernelRecipe recipe = rope_jit::rope_recipe(spec);
        const RopePlan plan = rope_jit::rope_plan(spec);
        CHECK(recipe.second_entry == (plan.bulk_rows   ? "rope_bulk_kernel"
                                      : plan.flat_rows ? "rope_flat_kernel"
                                                       : ""));
        if (!compiles.next()) continue;
        const rope_jit::KernelBinary binary =
            rope_jit::build_kernel_binary(recipe, "sm_90", nullptr, stats);
        CHECK(std::string(binary.image.data(), 4) ==
              "\x7f"
              "ELF");
        CHECK(binary.arch == 90);  // the launcher's bulk path needs a module of sm_90 or later
    }
    MESSAGE(compiled.size() << " kernels, " << compiles.taken() << " compiled");
}

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "out-of-place partial rotary through the bulk path matches the CPU backend: "
                      "every layout, dtype, pair style, position source and direction") {
        check_group(*this, Group::Sweep);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "the bulk path over many tiles a block: every stage reused, both barrier "
                      "phases, matches the CPU backend") {
        check_group(*this, Group::ManyTiles);
    }

    TEST_CASE_FIXTURE(GpuFixture,
                      "calls the bulk path cannot take run the staged path and match the CPU "
                      "backend") {
        check_group(*this, Group::Staged);
    }
}
