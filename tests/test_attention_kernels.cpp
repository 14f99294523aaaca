// The attention kernel specs: every family of variants the runtime can choose compiles with
// NVRTC for sm_80 and sm_90 (no GPU needed), the specs render, validate and hash as the cache
// needs, and the kernel choice follows the problem (tensor cores where they apply).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"
#include "ops/attention/cuda_attention.h"
#include "env_guard.h"
#include "common/error.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "attention_test_support.h"
#include "sanitizer_builds.h"

using namespace rope_jit;

namespace {

// A spec of the given kind with the common fields of the headline shape.
AttentionSpec spec_of(AttentionKernelKind kind, int dtype, int head_dim, int rotary_dim,
                      bool tensor_cores) {
    AttentionSpec s;
    s.kind = int32_t(kind);
    s.dtype = dtype;
    s.head_dim = head_dim;
    s.rotary_dim = rotary_dim;
    s.tensor_cores = tensor_cores;
    s.warps = tensor_cores ? 8 : 4;
    s.block_n = tensor_cores ? (head_dim <= 128 ? 64 : 32) : 0;
    s.write_lse = kind == AttentionKernelKind::Forward;
    return s;
}

// The variants a compile check covers: each feature of the template at least once per kernel.
std::vector<AttentionSpec> representative_specs() {
    std::vector<AttentionSpec> specs;
    using K = AttentionKernelKind;
    for (K kind : {K::Forward, K::BackwardDq, K::BackwardDkDv}) {
        // The headline: bf16, D128, half-style rotation from staged fp32 tables, causal, GQA 4.
        AttentionSpec headline = spec_of(kind, 2, 128, 128, true);
        headline.causal = 1;
        headline.gqa_group = 4;
        headline.table_async = 1;
        if (kind == K::BackwardDkDv) headline.block_n = 32;
        specs.push_back(headline);
        // fp16, D64, partial interleaved rotation from a full table read in place, pos_mask, bool mask.
        AttentionSpec registers = spec_of(kind, 1, 64, 32, true);
        registers.interleaved = 1;
        registers.table_full = 1;
        registers.pos_mask = 1;
        registers.mask_kind = 1;
        registers.warps = 4;
        specs.push_back(registers);
        // bf16, D256, additive bf16 mask, no rotation.
        AttentionSpec wide = spec_of(kind, 2, 256, 0, true);
        wide.mask_kind = 2;
        wide.mask_dtype = 2;
        wide.warps = 4;
        wide.block_n = 32;
        if (kind == K::BackwardDkDv) wide.compute_dk = 0;  // the dv pass of a split backward
        specs.push_back(wide);
        // CUDA cores: float32, D72 (not a multiple of 8), half-style R24, pos_mask, additive fp32 mask.
        AttentionSpec simt = spec_of(kind, 0, 72, 24, false);
        simt.pos_mask = 1;
        simt.mask_kind = 2;
        simt.causal = 1;
        simt.gqa_group = 2;
        specs.push_back(simt);
    }
    AttentionSpec two_tiles = spec_of(K::Forward, 2, 128, 128, true);  // FlashAttention-2's layout
    two_tiles.m_tiles = 2;
    two_tiles.warps = 4;
    two_tiles.causal = 1;
    two_tiles.table_async = 1;
    specs.push_back(two_tiles);
    AttentionSpec dk_pass =
        spec_of(K::BackwardDkDv, 2, 128, 128, true);  // the dk pass with pos_mask
    dk_pass.pos_mask = 1;
    dk_pass.compute_dv = 0;
    dk_pass.warps = 4;
    dk_pass.block_n = 32;
    dk_pass.table_async = 1;
    specs.push_back(dk_pass);
    return specs;
}

// The wgmma forwards (sm_90a only): the headline (three warpgroups, three 64-key tiles), and
// fp16 D64 with interleaved partial rotation from a half bf16 table (8-byte table pieces), a
// bool mask and two 64-key tiles; each also with a producer warpgroup, and in a cluster. Then
// the sm_90 backward proper at the headline, at head_dim 64, and with masks.
std::vector<AttentionSpec> wgmma_specs() {
    AttentionSpec headline = spec_of(AttentionKernelKind::Forward, 2, 128, 128, true);
    headline.wgmma = 1;
    headline.warps = 12;
    headline.stages = 3;
    headline.causal = 1;
    headline.gqa_group = 4;
    headline.table_async = 1;
    AttentionSpec narrow = spec_of(AttentionKernelKind::Forward, 1, 64, 32, true);
    narrow.wgmma = 1;
    narrow.interleaved = 1;
    narrow.table_full = 0;  // four pairs' columns of a bf16 half table: 8-byte pieces
    narrow.table_dtype = 2;
    narrow.table_async = 1;
    narrow.mask_kind = 1;
    AttentionSpec specialized = headline;  // two consumer warpgroups and a producer warpgroup
    specialized.warps = 8;
    specialized.producer_warps = 4;
    AttentionSpec specialized_narrow = narrow;
    specialized_narrow.warps = 4;
    specialized_narrow.producer_warps = 4;
    AttentionSpec clustered = specialized;  // four blocks of a GQA group sharing their tiles
    clustered.cluster = 4;
    AttentionSpec clustered_narrow = specialized_narrow;
    clustered_narrow.gqa_group = 2;
    clustered_narrow.cluster = 2;
    // The sm_90 backward at the headline (dQ by 16-byte atomic adds).
    AttentionSpec backward = headline;
    backward.kind = int32_t(AttentionKernelKind::Backward);
    backward.warps = 8;
    backward.block_n = 128;
    backward.write_lse = 0;
    backward.table_async = 0;
    // ... and at head_dim 64 without GQA (issue 19's third shape): backward_narrow's other size.
    AttentionSpec backward_d64 = backward;
    backward_d64.head_dim = backward_d64.rotary_dim = 64;
    backward_d64.gqa_group = 1;
    // With a mask (more registers: one or none to spare of 255 at head_dim 128): head_dim
    // 120 (padded to 128) with partial rotary and a bf16 additive mask, and fp16 interleaved
    // at head_dim 128, causal, with a float32 additive mask.
    AttentionSpec backward_d120_mask = backward;
    backward_d120_mask.head_dim = 120;
    backward_d120_mask.rotary_dim = 64;
    backward_d120_mask.causal = 0;
    backward_d120_mask.gqa_group = 1;
    backward_d120_mask.mask_kind = 2;
    backward_d120_mask.mask_dtype = 2;
    AttentionSpec backward_fp16_mask = backward;
    backward_fp16_mask.dtype = 1;
    backward_fp16_mask.interleaved = 1;
    backward_fp16_mask.mask_kind = 2;
    backward_fp16_mask.mask_dtype = 0;
    // The consumer-schedule experiments on the head_dim 128 default (keys by TMA, two 128-key
    // tiles): turns for S, turns for both products with registers moved to the consumers.
    AttentionSpec by_tma = specialized;
    by_tma.keys_by_tma = 1;
    by_tma.table_async = 0;
    by_tma.block_n = 128;
    by_tma.stages = 2;
    AttentionSpec pingpong = by_tma;
    pingpong.pingpong = 1;
    AttentionSpec pingpong_registers = by_tma;
    pingpong_registers.pingpong = 2;
    pingpong_registers.setmaxnreg = 1;
    pingpong_registers.exp2_fma = 1;
    // Each warpgroup's softmax beside its previous O += P V (setmaxnreg's registers).
    AttentionSpec overlap = by_tma;
    overlap.setmaxnreg = 1;
    overlap.overlap = 1;
    overlap.stages = 3;
    return {headline,           narrow,       specialized,    specialized_narrow,
            clustered,          clustered_narrow, backward,   backward_d64,
            backward_d120_mask, backward_fp16_mask, pingpong, pingpong_registers,
            overlap};
}

}  // namespace

TEST_CASE(
    "every family of attention kernels compiles with NVRTC for sm_80 and sm_90 (wgmma: sm_90a)") {
    if (nvrtc_api() == nullptr) {
        MESSAGE("NVRTC not available (" << nvrtc_load_error() << "): compile check skipped");
        return;
    }
    KernelStats stats;
    SweepCompiles compiles;
    for (const AttentionSpec& spec : representative_specs()) {
        for (const std::string target : {"sm_80", "sm_90"}) {
            CAPTURE(spec.describe());
            CAPTURE(target);
            REQUIRE_NOTHROW(spec.validate());
            if (!compiles.next()) continue;
            KernelBinary binary;
            try {
                binary = build_attention_binary(spec, target, nullptr, stats);
            } catch (const std::exception& e) {
                FAIL(std::string(e.what()));
            }
            CHECK(binary.image.size() > 4);
            CHECK_FALSE(binary.is_ptx);
        }
    }
    SweepCompiles wgmma_compiles;
    for (const AttentionSpec& spec : wgmma_specs()) {
        CAPTURE(spec.describe());
        REQUIRE_NOTHROW(spec.validate());
        if (wgmma_compiles.next()) {
            KernelBinary binary;
            try {
                binary = build_attention_binary(spec, "sm_90", nullptr, stats);
            } catch (const std::exception& e) {
                FAIL(std::string(e.what()));
            }
            CHECK(binary.image.size() > 4);
            CHECK_FALSE(binary.is_ptx);
        }
        CHECK(attention_target(spec, "sm_90") == "sm_90a");
        CHECK(attention_target(spec, "sm_90a") == "sm_90a");
        AttentionSpec mma = spec;
        mma.wgmma = 0;
        CHECK(attention_target(mma, "sm_90") == "sm_90");
        // wgmma exists on sm_90 alone: any other target is refused, naming it.
        for (const char* other : {"sm_80", "sm_100", "sm_100a"}) {
            CAPTURE(other);
            try {
                build_attention_binary(spec, other, nullptr, stats);
                FAIL("no error");
            } catch (const Error& e) {
                CHECK(e.status() == ROPE_JIT_ERROR_UNSUPPORTED);
                CHECK(std::string(e.what()).find(std::string("sm_90 only, not ") + other) !=
                      std::string::npos);
            }
        }
    }
}

namespace {

// A ptxas -v log says, per function, "Function properties for <name>" and then "<n> bytes
// stack frame, <n> bytes spill stores, <n> bytes spill loads".
int occurrences(const std::string& log, const std::string& what) {
    int n = 0;
    for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
    return n;
}

// The numbers written right before `what` in `log`: how many, and their sum.
struct Counts {
    int found = 0;
    int sum = 0;
};
Counts counts_before(const std::string& log, const std::string& what) {
    Counts c;
    for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) {
        size_t digits = at;
        while (digits > 0 && log[digits - 1] >= '0' && log[digits - 1] <= '9') --digits;
        if (digits == at) continue;  // no number: not a count
        c.found += 1;
        c.sum += std::atoi(log.substr(digits, at - digits).c_str());
    }
    return c;
}

}  // namespace

TEST_CASE(
    "ptxas keeps the wgmma products of every sm_90 kernel family in flight together, without "
    "spills") {
    // ptxas waits after each product of a kernel whose wgmma pipeline it judges ill-formed (a
    // "Potential Performance Loss: wgmma.mma_async instructions are serialized" note in its
    // verbose log): correct results at a fraction of the speed. The tile-0 peel of the
    // overlap schedule and the backward's warpgroup index broadcast from lane 0 exist for this
    // reason.
    if (nvrtc_api() == nullptr) {
        MESSAGE("NVRTC not available (" << nvrtc_load_error() << "): check skipped");
        return;
    }
    SweepCompiles compiles;
    for (const AttentionSpec& spec : wgmma_specs()) {
        if (!compiles.next()) break;
        CAPTURE(spec.describe());
        const std::string source = specialize_template(spec.preamble(), "attention.cu");
        const CompileResult r = compile_cuda(source, "attention.cu", "sm_90a",
                                             {"--ptxas-options=-v"}, kernel_headers());
        CHECK(r.log.find("ptxas info") != std::string::npos);  // the verbose log is there
        CHECK(r.log.find("serialized") == std::string::npos);
        // Nor spill: backward_narrow's descriptors hoisted out of its loop spilled 40 bytes at
        // head_dim 128, reloaded on every query tile. Every function's counts must be read, so
        // that a change of ptxas's wording fails here rather than passing as no spills.
        CAPTURE(r.log);
        const int functions = occurrences(r.log, "Function properties for ");
        const Counts stores = counts_before(r.log, " bytes spill stores");
        const Counts loads = counts_before(r.log, " bytes spill loads");
        CHECK(functions >= 1);
        CHECK(stores.found == functions);
        CHECK(loads.found == functions);
        CHECK(stores.sum == 0);
        CHECK(loads.sum == 0);
    }
}

namespace {

// The kernels chosen for a problem built from `c` on an H100/H200-like device (or `device`),
// under the ROPE_JIT_ATTENTION_KERNELS override the environment holds now (as a runtime
// created now would read it).
std::vector<AttentionSpec> chosen(const attention_test::Config& c, bool backward,
                                  AttentionDevice device = AttentionDevice{90, 232448, true,
                                                                           true}) {
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    std::vector<AttentionSpec> specs =
        choose_attention_specs(make_attention_problem(args, backward), device,
                               attention_kernel_override_from_environment());
    // A forward's prepare kernel (rotated keys for TMA) is checked where it matters; the rest
    // of this file looks at the forward itself.
    if (!backward && specs.size() == 2 &&
        specs[0].kind == int32_t(AttentionKernelKind::BackwardPrepare))
        specs.erase(specs.begin());
    return specs;
}

attention_test::Config headline_config() {
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 1;
    c.Hq = 4;
    c.Hk = 1;
    c.Sq = c.Sk = 16;
    c.D = c.R = 128;
    c.causal = true;
    return c;
}

}  // namespace

TEST_CASE(
    "aligned 16-bit problems run on tensor cores: one kernel forward; backward, three on sm_90 "
    "(prepare, wgmma, dq finish) or two (dq, dk/dv)") {
    const attention_test::Config c = headline_config();
    const std::vector<AttentionSpec> forward = chosen(c, false);
    REQUIRE(forward.size() == 1);
    CAPTURE(forward[0].describe());
    CHECK(forward[0].kind == int32_t(AttentionKernelKind::Forward));
    CHECK(forward[0].tensor_cores == 1);
    CHECK(forward[0].table_async == 1);
    CHECK(forward[0].gqa_group == 4);
    CHECK(forward[0].causal == 1);
    CHECK(forward[0].write_lse == 1);
    // sm_90 with TMA: two warpgroups on warpgroup matrix products fed by a producer warpgroup,
    // three 64-key tiles in flight; without TMA three warpgroups loading their own tiles;
    // sm_80: two 16-row tiles per warp.
    CHECK(forward[0].wgmma == 1);
    CHECK(forward[0].block_n == 64);
    CHECK(forward[0].warps == 8);
    CHECK(forward[0].producer_warps == 4);
    CHECK(forward[0].cluster == 1);
    CHECK(forward[0].stages == 3);
    CHECK(forward[0].shared_bytes() <= 232448);
    // Its keys come by TMA, rotated first by the backward's prepare kernel (the same spec).
    CHECK(forward[0].keys_by_tma == 1);
    {
        std::mt19937 rng(1);
        attention_test::Problem p(c, rng);
        const rope_jit_attention_args args = p.args();
        const AttentionDevice h200{90, 232448, true, true};
        const std::vector<AttentionSpec> both =
            choose_attention_specs(make_attention_problem(args, false), h200);
        const std::vector<AttentionSpec> backward_kernels =
            choose_attention_specs(make_attention_problem(args, true), h200);
        REQUIRE(both.size() == 2);
        CHECK(both[0].kind == int32_t(AttentionKernelKind::BackwardPrepare));
        CHECK(both[0] == backward_kernels[0]);
        CHECK(both[1] == forward[0]);
        // Without a workspace (allocation failed) the producers rotate the keys themselves.
        AttentionProblem without = make_attention_problem(args, false);
        without.no_workspace = true;
        const std::vector<AttentionSpec> alone = choose_attention_specs(without, h200);
        REQUIRE(alone.size() == 1);
        CHECK((alone[0].producer_warps == 4 && alone[0].keys_by_tma == 0));
        // Nor with an empty sequence: nothing to put in one (and no TMA box over no rows).
        for (const bool backward : {false, true})
            for (const bool empty_keys : {false, true}) {
                AttentionProblem empty = make_attention_problem(args, backward);
                (empty_keys ? empty.seqlen_k : empty.seqlen_q) = 0;
                for (const AttentionSpec& s : choose_attention_specs(empty, h200)) {
                    CHECK(s.kind != int32_t(AttentionKernelKind::BackwardPrepare));
                    CHECK(s.keys_by_tma == 0);
                }
            }
        CHECK(choose_attention_specs(make_attention_problem(args, true), h200)[0].kind ==
              int32_t(AttentionKernelKind::BackwardPrepare));
    }
    const AttentionSpec no_tma = chosen(c, false, AttentionDevice{90, 232448, true, false})[0];
    CHECK((no_tma.wgmma == 1 && no_tma.warps == 12 && no_tma.producer_warps == 0 &&
           no_tma.stages == 3));
    attention_test::Config unstaged = c;
    unstaged.table_dt = attention_test::Dt::BF16;
    unstaged.R = 8;  // 4 bf16 columns: 8-byte table rows, not staged
    unstaged.interleaved = true;
    // Tables the producers cannot read in pieces: keys by TMA (rotated by the prepare kernel)
    // need no table reads there; without a workspace no producer warps then.
    CHECK(chosen(unstaged, false)[0].keys_by_tma == 1);
    {
        std::mt19937 rng(1);
        attention_test::Problem p(unstaged, rng);
        const rope_jit_attention_args args = p.args();
        AttentionProblem without = make_attention_problem(args, false);
        without.no_workspace = true;
        CHECK(choose_attention_specs(without, AttentionDevice{90, 232448, true, true})[0]
                  .producer_warps == 0);
    }
    const AttentionSpec ampere = chosen(c, false, AttentionDevice{80, 166912})[0];
    CHECK(ampere.wgmma == 0);
    CHECK(ampere.m_tiles == 2);
    // head_dim 64: 128-key producer tiles from 4096 keys on (not at the threshold's edge below),
    // three of them, the softmax beside the previous product (overlap, setmaxnreg).
    attention_test::Config d64 = c;
    d64.D = d64.R = 64;
    d64.Sq = 8;
    d64.Sk = 4095;
    const AttentionSpec short_keys = chosen(d64, false)[0];
    CHECK((short_keys.block_n == 64 && short_keys.overlap == 0));
    d64.Sk = 4096;
    const AttentionSpec long_keys = chosen(d64, false)[0];
    CHECK((long_keys.wgmma == 1 && long_keys.producer_warps == 4 && long_keys.block_n == 128 &&
           long_keys.stages == 3 && long_keys.setmaxnreg == 1 && long_keys.overlap == 1));
    // head_dim 128 likewise.
    attention_test::Config d128 = d64;
    d128.D = d128.R = 128;
    const AttentionSpec long_128 = chosen(d128, false)[0];
    CHECK((long_128.block_n == 128 && long_128.stages == 3 && long_128.overlap == 1 &&
           long_128.keys_by_tma == 1));
    CHECK(chosen(d64, false, AttentionDevice{80, 166912})[0].wgmma == 0);
    // head_dim 256: wgmma on sm_90 (see the test of its own below); without it 8 warps over
    // 64-key tiles; with pos_mask 32-key tiles.
    attention_test::Config d256 = c;
    d256.D = d256.R = 256;
    CHECK(chosen(d256, false)[0].wgmma == 1);
    const AttentionSpec wide = chosen(d256, false, AttentionDevice{90, 232448, false})[0];
    CHECK((wide.tensor_cores == 1 && wide.wgmma == 0 && wide.warps == 8 && wide.block_n == 64));
    CHECK(chosen(d256, false, AttentionDevice{80, 166912})[0].tensor_cores == 1);
    d256.pos_mask = true;
    CHECK(chosen(d256, false)[0].block_n == 32);
    // sm_90 with TMA: the wgmma backward's three kernels.
    const std::vector<AttentionSpec> sm90 = chosen(c, true);
    REQUIRE(sm90.size() == 3);
    CHECK(sm90[0].kind == int32_t(AttentionKernelKind::BackwardPrepare));
    CHECK(sm90[1].kind == int32_t(AttentionKernelKind::Backward));
    CHECK(sm90[2].kind == int32_t(AttentionKernelKind::BackwardDqFinish));
    for (const AttentionSpec& s : sm90) {
        CAPTURE(s.describe());
        CHECK((s.wgmma == 1 && s.warps == 8 && s.block_n == 128 && s.stages == 3));
        CHECK(s.shared_bytes() <= 232448);
    }
    CHECK(sm90[0].shared_bytes() == 0);
    CHECK(sm90[1].shared_bytes() > 0);
    // Deterministic, without TMA, on sm_80, with pos_mask or at head_dim 256: dq, then dk/dv.
    attention_test::Config deterministic = c;
    deterministic.deterministic = true;
    attention_test::Config masked = c;
    masked.pos_mask = true;
    attention_test::Config wide_backward = c;
    wide_backward.D = wide_backward.R = 256;
    // (dk/dv may be split into a dk and a dv pass.)
    const auto dq_first = [](const std::vector<AttentionSpec>& specs) {
        return specs.size() >= 2 && specs[0].kind == int32_t(AttentionKernelKind::BackwardDq) &&
               specs[1].kind == int32_t(AttentionKernelKind::BackwardDkDv);
    };
    CHECK(dq_first(chosen(deterministic, true)));
    CHECK(dq_first(chosen(c, true, AttentionDevice{90, 232448, true, false})));
    CHECK(dq_first(chosen(masked, true)));
    // head_dim 256: the sm_90 backward over 64-key blocks with two stages.
    const std::vector<AttentionSpec> wide_kernels = chosen(wide_backward, true);
    REQUIRE(wide_kernels.size() == 3);
    const AttentionSpec& wide_main = wide_kernels[1];
    CHECK(wide_main.kind == int32_t(AttentionKernelKind::Backward));
    CHECK((wide_main.block_n == 64 && wide_main.stages == 2 && wide_main.warps == 8));
    CHECK(wide_main.shared_bytes() <= 232448);
    CHECK(dq_first(chosen(wide_backward, true, AttentionDevice{80, 166912})));
    const std::vector<AttentionSpec> backward = chosen(c, true, AttentionDevice{80, 166912});
    REQUIRE(backward.size() == 2);
    CHECK(backward[0].kind == int32_t(AttentionKernelKind::BackwardDq));
    CHECK(backward[1].kind == int32_t(AttentionKernelKind::BackwardDkDv));
    for (const AttentionSpec& s : backward) {
        CAPTURE(s.describe());
        CHECK(s.tensor_cores == 1);
        CHECK(s.compute_dk == 1);
        CHECK(s.compute_dv == 1);
        CHECK(s.shared_bytes() <= 232448);
    }
}

TEST_CASE(
    "head_dim 256 forwards on sm_90 run on warpgroup matrix products: two consumer warpgroups "
    "beside producers (TMA) or two warpgroups loading (no TMA), over two 64-key tiles of keys "
    "rotated beforehand") {
    attention_test::Config c = headline_config();
    c.D = c.R = 256;
    // Loading warps: query rows of 528 bytes (256 features + 8 pad), two key and two value
    // tiles of 64 rows of 512 bytes, 128 + 64 flags; float32 half tables (512-byte rows)
    // would add 64 KiB and do not fit: the rotation reads them in place.
    constexpr int kBase = 128 * 528 + 2 * 2 * 64 * 512 + 128 + 64;
    // Producers: the key and value tiles, the flags (to 1024 bytes), the swizzled query rows
    // (128 of 512 bytes) and 3 x 2 barriers; no padded query rows.
    constexpr int kProducer = 2 * 2 * 64 * 512 + 1024 + 128 * 512 + 48;
    for (const AttentionDevice& device :
         {AttentionDevice{90, 232448, true, true}, AttentionDevice{90, 232448, true, false}}) {
        CAPTURE(device.tma);
        const std::vector<AttentionSpec> specs = chosen(c, false, device);
        REQUIRE(specs.size() == 1);
        const AttentionSpec& s = specs[0];
        CAPTURE(s.describe());
        CHECK((s.kind == int32_t(AttentionKernelKind::Forward) && s.tensor_cores == 1));
        CHECK((s.wgmma == 1 && s.warps == 8 && s.block_n == 64 && s.stages == 2));
        // Keys rotated beforehand by the prepare kernel: by TMA to the consumers of producer
        // warps that give them their registers, or copied by the loading warps as they copy
        // values.
        CHECK((s.keys_by_tma == 1 && s.cluster == 1));
        if (device.tma) {
            CHECK((s.producer_warps == 4 && s.setmaxnreg == 1));
            CHECK(s.shared_bytes() == kProducer);
            CHECK(s.threads() == 384);
        } else {
            CHECK((s.producer_warps == 0 && s.setmaxnreg == 0));
            CHECK(s.table_async == 0);
            CHECK(s.shared_bytes() == kBase);
            CHECK(s.threads() == 256);
        }
        CHECK_NOTHROW(s.validate());
        std::mt19937 rng(1);
        attention_test::Problem p(c, rng);
        const rope_jit_attention_args args = p.args();
        AttentionProblem problem = make_attention_problem(args, false);
        const std::vector<AttentionSpec> with_prepare =
            choose_attention_specs(problem, device, AttentionKernelOverride{});
        REQUIRE(with_prepare.size() == 2);
        CHECK(with_prepare[0].kind == int32_t(AttentionKernelKind::BackwardPrepare));
        CHECK(with_prepare[0].block_n == 64);
        // Without a workspace (none could be allocated), loading warps rotate each tile.
        problem.no_workspace = true;
        const std::vector<AttentionSpec> own =
            choose_attention_specs(problem, device, AttentionKernelOverride{});
        REQUIRE(own.size() == 1);
        CHECK((own[0].wgmma == 1 && own[0].keys_by_tma == 0 && own[0].block_n == 64 &&
               own[0].producer_warps == 0));
    }
    {
        // Without rotation there is nothing to do beforehand: producers copy k itself.
        attention_test::Config plain = c;
        plain.R = 0;
        const std::vector<AttentionSpec> specs = chosen(plain, false);
        REQUIRE(specs.size() == 1);
        CHECK((specs[0].wgmma == 1 && specs[0].keys_by_tma == 1 && specs[0].producer_warps == 4));
        const AttentionSpec loading =
            chosen(plain, false, AttentionDevice{90, 232448, true, false})[0];
        CHECK((loading.wgmma == 1 && loading.keys_by_tma == 0 && loading.producer_warps == 0));
    }
    // bf16 tables: loading warps stage their rows (256 bytes of cos and of sin per key): they
    // fit, just.
    const AttentionDevice no_tma{90, 232448, true, false};
    c.table_dt = attention_test::Dt::BF16;
    AttentionProblem no_workspace = [&] {
        std::mt19937 rng(1);
        attention_test::Problem p(c, rng);
        const rope_jit_attention_args args = p.args();
        return make_attention_problem(args, false);
    }();
    no_workspace.no_workspace = true;
    const AttentionSpec staged =
        choose_attention_specs(no_workspace, no_tma, AttentionKernelOverride{})[0];
    CAPTURE(staged.describe());
    CHECK((staged.wgmma == 1 && staged.table_async == 1 && staged.keys_by_tma == 0));
    CHECK(staged.shared_bytes() == kBase + 2 * 64 * 256);
    CHECK(staged.shared_bytes() <= 232448);
    // Partial interleaved rotary with an additive mask, fp16, no GQA: the same kernel family.
    attention_test::Config partial = c;
    partial.dt = attention_test::Dt::F16;
    partial.R = 128;
    partial.interleaved = true;
    partial.mask = attention_test::Mask::AddFull;
    partial.Hk = partial.Hq;
    const AttentionSpec p = chosen(partial, false)[0];
    CAPTURE(p.describe());
    CHECK((p.wgmma == 1 && p.warps == 8 && p.producer_warps == 4 && p.mask_kind == 2));
    // sm_80, pos_mask and sm_90 without wgmma keep the mma.sync forward.
    CHECK(chosen(c, false, AttentionDevice{80, 166912})[0].wgmma == 0);
    CHECK(chosen(c, false, AttentionDevice{90, 232448, false})[0].wgmma == 0);
    c.pos_mask = true;
    CHECK(chosen(c, false)[0].wgmma == 0);
}

TEST_CASE(
    "wgmma forwards at head_dim 256: 4 or 8 loading warps, or 8 consumer warps with producers "
    "that give them their registers, over two 64-key tiles") {
    AttentionSpec s;
    s.kind = int32_t(AttentionKernelKind::Forward);
    s.dtype = 2;
    s.head_dim = s.rotary_dim = 256;
    s.tensor_cores = s.wgmma = 1;
    s.warps = 8;
    s.block_n = 64;
    s.stages = 2;
    CHECK(wgmma_broken_rule(s) == WgmmaRule::None);
    CHECK_NOTHROW(s.validate());
    s.warps = 4;
    CHECK(wgmma_broken_rule(s) == WgmmaRule::None);
    s.warps = 8;
    AttentionSpec producers = s;
    producers.producer_warps = 4;
    producers.keys_by_tma = 1;
    producers.setmaxnreg = 1;
    CHECK(wgmma_broken_rule(producers) == WgmmaRule::None);
    CHECK_NOTHROW(producers.validate());
    s.head_dim = s.rotary_dim = 240;  // pads to 240
    CHECK(wgmma_broken_rule(s) == WgmmaRule::HeadDim);
    s.head_dim = s.rotary_dim = 256;
    AttentionSpec without_registers = producers;  // 168 registers: the accumulators spill
    without_registers.setmaxnreg = 0;
    AttentionSpec rotating_producers = producers;  // producers that rotate need registers
    rotating_producers.keys_by_tma = 0;
    AttentionSpec three_stages = producers;
    three_stages.stages = 3;
    AttentionSpec three_groups = s;
    three_groups.warps = 12;
    AttentionSpec long_tiles = s;
    long_tiles.block_n = 128;
    for (const AttentionSpec& broken :
         {without_registers, rotating_producers, three_stages, three_groups, long_tiles}) {
        CAPTURE(broken.describe());
        CHECK(wgmma_broken_rule(broken) == WgmmaRule::HeadDim);
        try {
            broken.validate();
            FAIL("validate() accepted " << broken.describe());
        } catch (const Error& e) {
            CHECK(std::string(e.what()).find("padded 256") != std::string::npos);
        }
    }
    // An override that asks for producers without setmaxnreg or three warpgroups at head_dim
    // 256 falls back to the table's first shape; one that asks for loading warps gets them.
    attention_test::Config c = headline_config();
    c.D = c.R = 256;
    for (const char* text : {"fwd=p8x64x2", "fwd=w12x64x2", "fwd=w8x128"}) {
        CAPTURE(text);
        EnvGuard env;
        env.set("ROPE_JIT_ATTENTION_KERNELS", text);
        const AttentionSpec chosen_spec = chosen(c, false)[0];
        CHECK((chosen_spec.wgmma == 1 && chosen_spec.warps == 8 && chosen_spec.block_n == 64 &&
               chosen_spec.producer_warps == 4 && chosen_spec.setmaxnreg == 1));
    }
    {
        EnvGuard env;
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=w8x64x2");
        const AttentionSpec loading = chosen(c, false)[0];
        CHECK((loading.wgmma == 1 && loading.producer_warps == 0 && loading.keys_by_tma == 1));
    }
}

TEST_CASE("the CUDA-core kernels take what tensor cores cannot") {
    attention_test::Config c = headline_config();
    SUBCASE("float32") {
        c.dt = rope_test::Dt::F32;
        CHECK(chosen(c, false)[0].tensor_cores == 0);
    }
    SUBCASE("a GPU before sm_80") {
        CHECK(chosen(c, false, AttentionDevice{75, 65536})[0].tensor_cores == 0);
    }
    SUBCASE("a head_dim that is not a multiple of 8") {
        c.D = c.R = 72;
        CHECK(chosen(c, false)[0].tensor_cores == 0);
    }
    SUBCASE("rows that are not 16-byte aligned") {
        c.pad = 1;
        CHECK(chosen(c, false)[0].tensor_cores == 0);
        CHECK(chosen(c, true)[0].tensor_cores == 0);
    }
    SUBCASE("a half-style rotary_dim that splits a 16-byte chunk") {
        c.R = 24;
        CHECK(chosen(c, false)[0].tensor_cores == 0);
        c.interleaved = true;
        CHECK(chosen(c, false)[0].tensor_cores == 1);
    }
    SUBCASE("the backward of head_dim 256 with pos_mask") {
        c.D = c.R = 256;
        c.pos_mask = true;
        for (const AttentionSpec& s : chosen(c, true)) CHECK(s.tensor_cores == 0);
        CHECK(chosen(c, false)[0].tensor_cores == 1);
    }
    SUBCASE(
        "pos_mask keeps the sm_90 forward on mma.sync, and less shared memory gives fewer stages, "
        "then rows") {
        CHECK(chosen(c, false)[0].wgmma == 1);
        c.pos_mask = true;
        CHECK(chosen(c, false)[0].wgmma == 0);
        c.pos_mask = false;
        const AttentionSpec two_stages = chosen(c, false, AttentionDevice{90, 160 * 1024, true})[0];
        CHECK(two_stages.wgmma == 1);
        CHECK(two_stages.warps == 12);
        CHECK(two_stages.stages == 2);
        const AttentionSpec two_groups = chosen(c, false, AttentionDevice{90, 140 * 1024, true})[0];
        CHECK(two_groups.wgmma == 1);
        CHECK(two_groups.warps == 8);
        CHECK(two_groups.block_n == 64);
        // head_dim 256 needs 198848 bytes (and the wgmma forward's tables in place).
        c.D = c.R = 256;
        CHECK(chosen(c, false, AttentionDevice{90, 198848, true})[0].wgmma == 1);
        CHECK(chosen(c, false, AttentionDevice{90, 198847, true})[0].wgmma == 0);
    }
    SUBCASE("the override asks for wgmma in vain where it cannot run, and only for the forward") {
        EnvGuard env;
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=w8x64,dq=w4x32");
        const AttentionSpec forced = chosen(c, false)[0];
        CHECK(forced.wgmma == 1);
        CHECK(forced.warps == 8);
        CHECK(forced.stages == 2);
        CHECK(chosen(c, false, AttentionDevice{80, 166912})[0].wgmma == 0);
        CHECK(chosen(c, false, AttentionDevice{90, 232448, false})[0].wgmma == 0);
        // "dq=w..." is no shape: the backward keeps its default, the wgmma backward here and
        // the dq kernel's default shape where that runs.
        CHECK(chosen(c, true)[0].kind == int32_t(AttentionKernelKind::BackwardPrepare));
        c.deterministic = true;
        const AttentionSpec dq = chosen(c, true)[0];
        CHECK(dq.wgmma == 0);
        CHECK((dq.warps == 8 && dq.block_n == 64));
        // A dq or dk/dv shape asks for those kernels.
        c.deterministic = false;
        env.set("ROPE_JIT_ATTENTION_KERNELS", "dkdv=4x32");
        CHECK(chosen(c, true)[1].kind == int32_t(AttentionKernelKind::BackwardDkDv));
    }
    SUBCASE("the override's wgmma shapes: 4, 8 or 12 warps, the third number is the stages") {
        EnvGuard env;
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=w16x64");
        CHECK(chosen(c, false)[0].warps ==
              8);  // 16 warps refused: the default (8 + 4 producer warps)
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=w8x64x3");
        const AttentionSpec spec = chosen(c, false)[0];
        CHECK((spec.wgmma == 1 && spec.warps == 8 && spec.block_n == 64 && spec.stages == 3));
    }
    SUBCASE("the override's producer and cluster shapes, where the GQA group and tables allow") {
        EnvGuard env;
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=p8x64x3");
        AttentionSpec spec = chosen(c, false)[0];
        CHECK((spec.wgmma == 1 && spec.warps == 8 && spec.producer_warps == 4 &&
               spec.cluster == 1 && spec.stages == 3));
        CHECK(spec.threads() == 384);
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=c4x8x64x3");  // the headline's GQA group is 4
        spec = chosen(c, false)[0];
        CHECK((spec.wgmma == 1 && spec.warps == 8 && spec.producer_warps == 4 &&
               spec.cluster == 4 && spec.stages == 3));
        CHECK(spec.describe().find("+4 producer warps cluster4") != std::string::npos);
        CHECK(spec.preamble().find("__cluster_dims__(4, 1, 1)") != std::string::npos);
        env.set("ROPE_JIT_ATTENTION_KERNELS",
                "fwd=p12x64x3");  // four warpgroups: refused, the default
        CHECK((chosen(c, false)[0].warps == 8 && chosen(c, false)[0].producer_warps == 4));
        attention_test::Config no_keys = c;
        no_keys.Sk = 0;  // nothing for TMA to describe: the kernel without producers
        CHECK(chosen(no_keys, false)[0].producer_warps == 0);
        for (const int padded : {56, 120}) {  // head_dims that pad: producers too, also by default
            attention_test::Config odd = c;
            odd.D = odd.R = padded;
            odd.interleaved = true;  // half style needs rotary_dim % 16 == 0 on tensor cores
            CAPTURE(padded);
            env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=p8x64x3");
            const AttentionSpec forced = chosen(odd, false)[0];
            CHECK((forced.wgmma == 1 && forced.producer_warps == 4));
            env.set("ROPE_JIT_ATTENTION_KERNELS", "");
            CHECK(chosen(odd, false)[0].producer_warps == 4);
        }
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=p12x64x3");
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=c4x8x64x3");
        c.Hq = c.Hk * 2;  // GQA 2: four blocks would span two groups
        CHECK(chosen(c, false)[0].cluster == 1);
        env.set("ROPE_JIT_ATTENTION_KERNELS", "fwd=c2x8x64");
        CHECK(chosen(c, false)[0].cluster == 2);
        c.pad = 1;  // unaligned tables (and rows): no staging, so no cluster
        CHECK(chosen(c, false)[0].cluster == 1);
        c.pad = 0;
        for (const char* junk : {"fwd=c2x8", "fwd=cx8x64", "fwd=p8x64x3x1", "fwd=w8xx64",
                                 "fwd=c0x8x64", "dq=c2x8x64"}) {
            CAPTURE(junk);
            env.set("ROPE_JIT_ATTENTION_KERNELS", junk);
            CHECK(chosen(c, false)[0] ==
                  chosen(c, false, AttentionDevice{90, 232448, true, true})[0]);  // the default
            CHECK(chosen(c, false)[0].cluster == 1);
        }
    }
    SUBCASE("an NVRTC the wgmma forward was not validated with keeps sm_90 on mma.sync") {
        const AttentionSpec spec = chosen(c, false, AttentionDevice{90, 232448, false})[0];
        CHECK(spec.tensor_cores == 1);
        CHECK(spec.wgmma == 0);
        CHECK_FALSE(nvrtc_runs_wgmma_forward(""));
        CHECK_FALSE(nvrtc_runs_wgmma_forward("11.8"));
        CHECK_FALSE(nvrtc_runs_wgmma_forward("12.9"));
        CHECK(nvrtc_runs_wgmma_forward("13.0"));
        CHECK(nvrtc_runs_wgmma_forward("14.1"));
        // attention_device() takes the loaded NVRTC's version, and sm_90 alone.
        CHECK(attention_device(90, 232448).wgmma ==
              nvrtc_runs_wgmma_forward(nvrtc_version_string()));
        CHECK_FALSE(attention_device(80, 166912).wgmma);
        CHECK_FALSE(attention_device(100, 232448).wgmma);
    }
    SUBCASE("too little shared memory for any tile") {
        CHECK(chosen(c, false, AttentionDevice{90, 16 * 1024})[0].tensor_cores == 0);
    }
}

TEST_CASE("a backward that needs too many accumulators splits dk and dv into two passes") {
    attention_test::Config c = headline_config();
    c.pos_mask = true;
    const std::vector<AttentionSpec> specs = chosen(c, true);
    REQUIRE(specs.size() == 3);
    CHECK(specs[0].kind == int32_t(AttentionKernelKind::BackwardDq));
    CHECK((specs[1].compute_dk == 1 && specs[1].compute_dv == 0));
    CHECK((specs[2].compute_dk == 0 && specs[2].compute_dv == 1));
    c.pos_mask = false;
    c.D = c.R = 256;
    CHECK(chosen(c, true).size() == 3);
}

TEST_CASE("a head_dim above 512 is unsupported on the GPU") {
    attention_test::Config c = headline_config();
    c.D = c.R = 520;
    try {
        chosen(c, false);
        FAIL("no error");
    } catch (const Error& e) {
        CHECK(e.status() == ROPE_JIT_ERROR_UNSUPPORTED);
        CHECK(std::string(e.what()).find("head_dim 520") != std::string::npos);
    }
}

TEST_CASE("attention specs read back from their JSON, and nothing else does") {
    std::vector<AttentionSpec> specs = representative_specs();
    for (const AttentionSpec& w : wgmma_specs()) specs.push_back(w);
    for (const AttentionSpec& spec : specs) {
        CAPTURE(spec.describe());
        std::string error;
        const std::optional<AttentionSpec> back = AttentionSpec::from_json(spec.to_json(), &error);
        REQUIRE_MESSAGE(back.has_value(), error);
        CHECK(*back == spec);
    }
    const std::string json = specs[0].to_json();
    std::string error;
    CHECK_FALSE(AttentionSpec::from_json("not json", &error));
    CHECK(error.rfind("not valid JSON: ", 0) == 0);
    CHECK_FALSE(AttentionSpec::from_json("[1]", &error));
    CHECK(error == "not a JSON object");
    CHECK_FALSE(AttentionSpec::from_json(R"({"op":"rope"})", &error));
    CHECK(error == "not an attention spec");
    std::string missing = json;
    missing.replace(missing.find("\"warps\""), 7, "\"wrps\"");
    CHECK_FALSE(AttentionSpec::from_json(missing, &error));
    CHECK(error.rfind("unknown field 'wrps' (known: op, kind, dtype,", 0) == 0);
    std::string extra = json;
    extra.insert(1, "\"zz_future\":1,");
    CHECK_FALSE(AttentionSpec::from_json(extra, &error));
    CHECK(error.rfind("unknown field 'zz_future'", 0) == 0);
    CHECK_FALSE(AttentionSpec::from_json(R"({"op":1})", &error));
    CHECK(error == "not an attention spec");
    std::string huge = json;
    const size_t at = huge.find("\"warps\":") + 8;
    huge.replace(at, huge.find_first_of(",}", at) - at, "5000000000");
    CHECK_FALSE(AttentionSpec::from_json(huge, &error));
    CHECK(error == "warps: must be in [1, 16], got 5000000000");
}

TEST_CASE("attention specs render their constants, JSON and description, and compare as bytes") {
    AttentionSpec a = spec_of(AttentionKernelKind::Forward, 2, 128, 64, true);
    a.causal = 1;
    const AttentionSpec b = a;
    CHECK(a == b);
    CHECK(AttentionSpecHash{}(a) == AttentionSpecHash{}(b));
    AttentionSpec c = a;
    c.gqa_group = 2;
    CHECK(a != c);
    const std::string preamble = a.preamble();
    CHECK(preamble.find("constexpr int HEAD_DIM = 128;") != std::string::npos);
    CHECK(preamble.find("constexpr int ROTARY_DIM = 64;") != std::string::npos);
    CHECK(preamble.find("constexpr bool CAUSAL = true;") != std::string::npos);
    CHECK(preamble.find("constexpr bool TENSOR_CORES = true;") != std::string::npos);
    const std::string json = a.to_json();
    CHECK(json.find("\"op\":\"attention\"") != std::string::npos);
    CHECK(json.find("\"kind\":\"forward\"") != std::string::npos);
    CHECK(json != c.to_json());
    CHECK(a.describe() == "attention fwd bf16 D128 R64 half table/half causal gqa1 lse tc 8x64");
    AttentionSpec w = a;
    w.wgmma = 1;
    CHECK(w != a);
    CHECK(w.preamble().find("constexpr bool WGMMA = true;") != std::string::npos);
    CHECK(w.to_json().find("\"wgmma\":true") != std::string::npos);
    CHECK(w.describe() == "attention fwd bf16 D128 R64 half table/half causal gqa1 lse wgmma 8x64");
    CHECK_NOTHROW(w.validate());
    AttentionSpec bad_w = w;
    bad_w.kind = int32_t(AttentionKernelKind::BackwardDq);
    CHECK_THROWS_AS(bad_w.validate(), Error);
    bad_w = w;
    bad_w.pos_mask = 1;
    CHECK_THROWS_AS(bad_w.validate(), Error);
    bad_w = w;
    bad_w.warps = 6;
    CHECK_THROWS_AS(bad_w.validate(), Error);
    bad_w.warps = 16;  // four warpgroups: the registers spill
    CHECK_THROWS_AS(bad_w.validate(), Error);
    bad_w = w;
    bad_w.head_dim = 96;
    try {
        bad_w.validate();
        FAIL("no error");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("got 96 (padded 96)") != std::string::npos);
    }
    bad_w.head_dim = 56;  // padded to 64: taken
    bad_w.rotary_dim = 48;
    CHECK_NOTHROW(bad_w.validate());
    bad_w = w;
    bad_w.stages = 4;
    CHECK_THROWS_AS(bad_w.validate(), Error);
    AttentionSpec three = w;
    three.stages = 3;
    CHECK(three != w);
    CHECK(three.describe() ==
          "attention fwd bf16 D128 R64 half table/half causal gqa1 lse wgmma 8x64x3");
    CHECK(three.preamble().find("constexpr int STAGES = 3;") != std::string::npos);
    AttentionSpec mma_stages = a;
    mma_stages.stages = 3;
    CHECK_THROWS_AS(mma_stages.validate(), Error);
    AttentionSpec producer = w;
    producer.producer_warps = 4;
    CHECK_THROWS_AS(
        producer.validate(),
        Error);  // the producers read table columns in 16-byte pieces: stageable tables only
    producer.table_async = 1;
    CHECK_NOTHROW(producer.validate());
    CHECK(producer.threads() == 384);
    CHECK(producer.preamble().find("constexpr int PRODUCER_WARPS = 4;") != std::string::npos);
    producer.producer_warps = 2;
    CHECK_THROWS_AS(producer.validate(), Error);
    AttentionSpec mma_producer = a;
    mma_producer.producer_warps = 4;
    CHECK_THROWS_AS(mma_producer.validate(), Error);
    AttentionSpec clustered = w;
    clustered.producer_warps = 4;
    clustered.gqa_group = 4;
    clustered.table_async = 1;
    clustered.cluster = 4;
    CHECK_NOTHROW(clustered.validate());
    CHECK(clustered.shared_bytes() ==
          producer.shared_bytes());  // the same buffers, filled by several blocks
    // Each rule of clusters broken alone: four blocks over two GQA groups, no producer warps,
    // unstaged tables, eight blocks.
    for (void (*broken)(AttentionSpec&) :
         {+[](AttentionSpec& s) { s.gqa_group = 2; },
          +[](AttentionSpec& s) { s.producer_warps = 0; },
          +[](AttentionSpec& s) { s.table_async = 0; },
          +[](AttentionSpec& s) { s.cluster = s.gqa_group = 8; }}) {
        AttentionSpec bad_cluster = clustered;
        broken(bad_cluster);
        CHECK_THROWS_AS(bad_cluster.validate(), Error);
    }
    AttentionSpec mma_cluster = a;
    mma_cluster.cluster = 2;
    CHECK_THROWS_AS(mma_cluster.validate(), Error);
    AttentionSpec bad = a;
    bad.block_n = 24;
    CHECK_THROWS_AS(bad.validate(), Error);
    bad = a;
    bad.dtype = 0;
    CHECK_THROWS_AS(bad.validate(), Error);
    bad = a;
    bad.kind = int32_t(AttentionKernelKind::BackwardDq);
    bad.m_tiles = 2;
    CHECK_THROWS_AS(bad.validate(), Error);
}

TEST_CASE("the ROPE_JIT_ATTENTION_KERNELS text parses into tile shapes; anything else is ignored") {
    const AttentionKernelOverride none = parse_attention_kernel_override(nullptr);
    CHECK_FALSE(none.force_simt);
    for (const auto& shape : none.shape) CHECK_FALSE(shape.has_value());
    CHECK_FALSE(parse_attention_kernel_override("").shape[0].has_value());
    CHECK(parse_attention_kernel_override("simt").force_simt);
    CHECK_FALSE(none.no_workspace);
    const AttentionKernelOverride without =
        parse_attention_kernel_override("fwd=p8x128,workspace=0");
    CHECK(without.no_workspace);
    CHECK(without.shape[0].has_value());
    CHECK_FALSE(parse_attention_kernel_override("workspace=1").no_workspace);

    const AttentionKernelOverride o =
        parse_attention_kernel_override("fwd=8x64x2,dq=4x32,dkdv=8x16");
    CHECK_FALSE(o.force_simt);
    REQUIRE(o.shape[0].has_value());
    CHECK((o.shape[0]->warps == 8 && o.shape[0]->block_n == 64 && o.shape[0]->m_tiles == 2 &&
           !o.shape[0]->wgmma));
    REQUIRE(o.shape[1].has_value());
    CHECK((o.shape[1]->warps == 4 && o.shape[1]->block_n == 32 && o.shape[1]->m_tiles == 1));
    REQUIRE(o.shape[2].has_value());
    CHECK((o.shape[2]->warps == 8 && o.shape[2]->block_n == 16));

    const AttentionTileShape w = *parse_attention_kernel_override("fwd=w12x64x3").shape[0];
    CHECK((w.wgmma && w.warps == 12 && w.block_n == 64 && w.stages == 3 && w.producer_warps == 0 &&
           w.cluster == 1));
    const AttentionTileShape p = *parse_attention_kernel_override("fwd=p8x128").shape[0];
    CHECK((p.wgmma && p.warps == 8 && p.block_n == 128 && p.stages == 2 && p.producer_warps == 4 &&
           p.cluster == 1));
    const AttentionTileShape c = *parse_attention_kernel_override("fwd=c4x8x64x3").shape[0];
    CHECK((c.wgmma && c.warps == 8 && c.block_n == 64 && c.stages == 3 && c.producer_warps == 4 &&
           c.cluster == 4));

    // The consumer-schedule options of producer shapes, in any order.
    const AttentionTileShape plain = *parse_attention_kernel_override("fwd=p8x128x2").shape[0];
    CHECK((plain.pingpong == 0 && !plain.setmaxnreg));
    const AttentionTileShape turns =
        *parse_attention_kernel_override("fwd=p8x128x2:pingpong").shape[0];
    CHECK((turns.pingpong == 1 && !turns.setmaxnreg && turns.warps == 8 && turns.block_n == 128 &&
           turns.stages == 2 && turns.producer_warps == 4));
    const AttentionTileShape both =
        *parse_attention_kernel_override("fwd=p8x128x2:setmaxnreg:pingpong2").shape[0];
    CHECK((both.pingpong == 2 && both.setmaxnreg && both.block_n == 128));
    const AttentionTileShape registers =
        *parse_attention_kernel_override("fwd=p8x64x3:setmaxnreg").shape[0];
    CHECK((registers.pingpong == 0 && registers.setmaxnreg && registers.stages == 3 &&
           registers.exp2_fma == 0));
    for (int quarters = 1; quarters <= 3; ++quarters) {
        const std::string text = "fwd=p8x128x2:fma" + std::to_string(quarters);
        CAPTURE(text);
        const AttentionTileShape fma = *parse_attention_kernel_override(text.c_str()).shape[0];
        CHECK((fma.exp2_fma == quarters && fma.pingpong == 0 && !fma.setmaxnreg));
    }
    const AttentionTileShape overlap =
        *parse_attention_kernel_override("fwd=p8x128x3:overlap:setmaxnreg").shape[0];
    CHECK((overlap.overlap && overlap.setmaxnreg && overlap.pingpong == 0 &&
           overlap.stages == 3 && overlap.block_n == 128));
    CHECK_FALSE(plain.overlap);

    // Malformed items, unknown kinds and wgmma shapes for a backward kernel are left out; the
    // well-formed items beside them stay.
    for (const char* junk :
         {"fwd=c2x8", "fwd=cx8x64", "fwd=p8x64x3x1", "fwd=w8xx64", "fwd=c0x8x64", "dq=c2x8x64",
          "dkdv=w4x32", "fwd=8", "fwd=", "fwd=0x64", "fwd=8x64x2x2", "fwd=12345x64", "bwd=8x64",
          "fwd", "SIMT", "fwd=-8x64", "fwd=8x64 ", "fwd=p8x128:", "fwd=p8x128:pingpong3",
          "fwd=p8x128:Pingpong", "fwd=w8x128:pingpong", "fwd=8x64:setmaxnreg",
          "fwd=c2x8x128:pingpong", "dq=8x64:pingpong", "fwd=:pingpong", "fwd=pingpong",
          "fwd=p8x128:fma0", "fwd=p8x128:fma4", "fwd=w8x128:fma1", "dq=bulk", "dq=atomic",
          "fwd=w8x128:overlap", "fwd=p8x128:overlapped", "dkdv=8x64:overlap"}) {
        CAPTURE(junk);
        const AttentionKernelOverride bad = parse_attention_kernel_override(junk);
        CHECK_FALSE(bad.force_simt);
        for (const auto& shape : bad.shape) CHECK_FALSE(shape.has_value());
    }
    const AttentionKernelOverride mixed =
        parse_attention_kernel_override("fwd=w8xx64,dq=8x32,,junk");
    CHECK_FALSE(mixed.shape[0].has_value());
    REQUIRE(mixed.shape[1].has_value());
    CHECK(mixed.shape[1]->block_n == 32);
}

TEST_CASE(
    "the consumer-schedule experiments of the attention forward run only where the override asks") {
    const attention_test::Config c = headline_config();
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    const AttentionProblem problem = make_attention_problem(args, false);
    const AttentionDevice h200{90, 232448, true, true};
    auto forward_of = [&](const AttentionProblem& problem_, const char* text) {
        return choose_attention_specs(problem_, h200, parse_attention_kernel_override(text))
            .back();
    };
    // Off by default.
    const AttentionSpec standard = choose_attention_specs(problem, h200).back();
    CHECK((standard.pingpong == 0 && standard.setmaxnreg == 0));
    // Asked for: the shape with the options.
    const AttentionSpec turns = forward_of(problem, "fwd=p8x128x2:pingpong");
    CHECK((turns.pingpong == 1 && turns.setmaxnreg == 0 && turns.block_n == 128 &&
           turns.producer_warps == 4 && turns.keys_by_tma == 1));
    const AttentionSpec both = forward_of(problem, "fwd=p8x128x2:pingpong2:setmaxnreg:fma2");
    CHECK((both.pingpong == 2 && both.setmaxnreg == 1 && both.exp2_fma == 2));
    CHECK(both.describe().find("pingpong2 setmaxnreg exp2-fma2/4") != std::string::npos);
    // Where they do not apply (one consumer warpgroup; setmaxnreg with producers that rotate
    // keys, as without a workspace) the shape falls back to the tables' default.
    CHECK(forward_of(problem, "fwd=p4x64x3:pingpong") == standard);
    CHECK(forward_of(problem, "fwd=p4x64x3:fma1") == standard);
    AttentionProblem without = problem;
    without.no_workspace = true;
    const AttentionSpec fallback = forward_of(without, "fwd=p8x128x2:setmaxnreg");
    CHECK(fallback == choose_attention_specs(without, h200).back());
    CHECK(fallback.setmaxnreg == 0);
    CHECK(forward_of(without, "fwd=p8x128x2:pingpong").pingpong == 1);  // turns need no TMA
    // The overlap: with setmaxnreg, without turns; otherwise the default.
    const AttentionSpec overlapped = forward_of(problem, "fwd=p8x128x3:setmaxnreg:overlap");
    CHECK((overlapped.overlap == 1 && overlapped.setmaxnreg == 1 && overlapped.stages == 3 &&
           overlapped.pingpong == 0));
    CHECK(overlapped.describe().find("setmaxnreg overlap") != std::string::npos);
    CHECK(forward_of(problem, "fwd=p8x128x3:overlap") == standard);
    CHECK(forward_of(problem, "fwd=p8x128x2:setmaxnreg:overlap:pingpong") == standard);

    // The rules, and validate's words.
    AttentionSpec rotating = turns;
    rotating.keys_by_tma = 0;
    rotating.table_async = 1;
    CHECK(wgmma_broken_rule(rotating) == WgmmaRule::None);
    rotating.setmaxnreg = 1;
    CHECK(wgmma_broken_rule(rotating) == WgmmaRule::Schedule);
    AttentionSpec loading = turns;  // warps that load their own tiles
    loading.producer_warps = 0;
    loading.keys_by_tma = 0;
    loading.table_async = 1;
    CHECK(wgmma_broken_rule(loading) == WgmmaRule::Schedule);
    try {
        loading.validate();
        FAIL("no error");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("pingpong (1)") != std::string::npos);
    }
    AttentionSpec backward = choose_attention_specs(make_attention_problem(args, true), h200)[1];
    REQUIRE(backward.kind == int32_t(AttentionKernelKind::Backward));
    CHECK(wgmma_broken_rule(backward) == WgmmaRule::None);
    backward.setmaxnreg = 1;
    CHECK(wgmma_broken_rule(backward) == WgmmaRule::Schedule);
    backward.setmaxnreg = 0;
    backward.exp2_fma = 1;
    CHECK(wgmma_broken_rule(backward) == WgmmaRule::Schedule);
    backward.exp2_fma = 0;
    backward.overlap = 1;
    CHECK(wgmma_broken_rule(backward) == WgmmaRule::Schedule);
    AttentionSpec unregistered = overlapped;  // a second score tile needs the registers
    unregistered.setmaxnreg = 0;
    CHECK(wgmma_broken_rule(unregistered) == WgmmaRule::Schedule);
    try {
        unregistered.validate();
        FAIL("no error");
    } catch (const Error& e) {
        CHECK(std::string(e.what()).find("overlap (1)") != std::string::npos);
    }
    AttentionSpec clustered_overlap = overlapped;
    clustered_overlap.cluster = 2;
    CHECK(wgmma_broken_rule(clustered_overlap) != WgmmaRule::None);
    AttentionSpec mma = standard;
    mma.wgmma = 0;
    mma.producer_warps = 0;
    mma.keys_by_tma = 0;
    mma.stages = 2;
    mma.pingpong = 2;
    CHECK_THROWS_AS(mma.validate(), Error);
    // JSON: the fields round-trip; a prewarm call may not set them.
    CHECK(AttentionSpec::from_json(both.to_json(), nullptr) == both);
    CHECK(both.to_json().find("\"pingpong\":2") != std::string::npos);
    std::string error;
    CHECK_FALSE(attention_call_from_json(
        R"({"op":"attention","head_dim":128,"pingpong":1})", &error));
    CHECK(error.find("pingpong") != std::string::npos);
}

TEST_CASE(
    "the choice without an override ignores ROPE_JIT_ATTENTION_KERNELS; the runtime reads it "
    "once") {
    const attention_test::Config c = headline_config();
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    const AttentionProblem problem = make_attention_problem(args, false);
    const AttentionDevice device{90, 232448, true, true};
    EnvGuard env;
    env.set("ROPE_JIT_ATTENTION_KERNELS", "simt");
    // What prewarming compiles: the default choice, whatever the environment says.
    CHECK(choose_attention_specs(problem, device)[0].tensor_cores == 1);
    CHECK(choose_attention_specs(problem, device)[0] ==
          choose_attention_specs(problem, device, AttentionKernelOverride{})[0]);
    CHECK(choose_attention_specs(problem, device, attention_kernel_override_from_environment())[0]
              .tensor_cores == 0);
}

TEST_CASE("launch plans: block threads, rows per block and shared memory of each kernel family") {
    using K = AttentionKernelKind;
    // The headline forward on mma.sync, 8 warps of 16 query rows, 64-key tiles, staged fp32
    // tables of 64 columns. Rows of 128 + 8 elements (272 bytes): 128 query rows, 64 key rows,
    // 64 value rows, 64 cos and 64 sin rows of 256 bytes, 128 + 64 flags.
    AttentionSpec forward = spec_of(K::Forward, 2, 128, 128, true);
    forward.table_async = 1;
    AttentionLaunchPlan plan = attention_launch_plan(forward);
    CHECK(plan.head_dim_padded == 128);
    CHECK(plan.table_columns == 64);
    CHECK(plan.table_row_bytes == 256);
    CHECK(plan.rows_per_block == 128);
    CHECK(plan.threads == 256);
    CHECK(plan.shared_bytes == 128 * 272 + 64 * 272 * 2 + 64 * 256 * 2 + 128 + 64);
    CHECK(forward.shared_bytes() == plan.shared_bytes);
    CHECK(forward.threads() == 256);
    // Tables read in place are not staged; an interleaved full table spans 2 columns a pair.
    forward.table_async = 0;
    forward.interleaved = 1;
    forward.table_full = 1;
    CHECK(attention_launch_plan(forward).table_columns == 128);
    CHECK(attention_launch_plan(forward).table_row_bytes == 0);
    CHECK(attention_launch_plan(forward).shared_bytes == 128 * 272 + 64 * 272 * 2 + 128 + 64);
    // Two 16-row tiles per warp: 4 warps own 128 rows.
    AttentionSpec two_tiles = spec_of(K::Forward, 2, 128, 0, true);
    two_tiles.warps = 4;
    two_tiles.m_tiles = 2;
    CHECK(attention_launch_plan(two_tiles).rows_per_block == 128);
    CHECK(attention_launch_plan(two_tiles).threads == 128);
    // CUDA cores: a row per warp, no dynamic shared memory; head_dim 72 pads to 80 for nothing.
    const AttentionSpec simt = spec_of(K::Forward, 0, 72, 24, false);
    CHECK(attention_launch_plan(simt).rows_per_block == 4);
    CHECK(attention_launch_plan(simt).threads == 128);
    CHECK(simt.shared_bytes() == 0);
    // The producer-warp wgmma forward: 8 + 4 warps; no padded query rows, three 64-key tiles
    // of keys and of values, unpadded (256-byte rows: 6 x 16 KiB), the flags (128 + 64 bytes),
    // then (1024-aligned) the swizzled query rows and 3 x 3 barriers of 8 bytes.
    AttentionSpec producer = spec_of(K::Forward, 2, 128, 128, true);
    producer.wgmma = 1;
    producer.stages = 3;
    producer.producer_warps = 4;
    producer.table_async = 1;
    plan = attention_launch_plan(producer);
    CHECK(plan.threads == 384);
    CHECK(plan.rows_per_block == 128);
    CHECK(plan.smem.q == 0);
    CHECK(plan.smem.k == 0);
    CHECK(plan.smem.q_tile == 6 * 16384 + 1024);
    CHECK(plan.shared_bytes == 6 * 16384 + 1024 + 128 * 256 + 80);
    // dk/dv: 128 resident key and value rows, 32-query tiles (raw, rotated, out, two dout), the
    // staged tables of 32 rows, two lse halves and delta, and the flags.
    AttentionSpec dkdv = spec_of(K::BackwardDkDv, 2, 128, 128, true);
    dkdv.block_n = 32;
    dkdv.table_async = 1;
    plan = attention_launch_plan(dkdv);
    CHECK(plan.rows_per_block == 128);
    CHECK(plan.shared_bytes ==
          5 * 32 * 272 + 2 * 128 * 272 + 2 * 32 * 256 + 2 * 32 * 4 + 32 * 4 + 32 + 128);
    // The sm_90 backward at head_dim 128: 128 keys and values, three stages of 64 queries and
    // dout rows, two dS^T tiles, three lse and delta rows of 64 and four barriers (dQ goes to
    // the workspace by atomic adds from registers: no shared memory of its own).
    AttentionSpec main = spec_of(K::Backward, 2, 128, 128, true);
    main.wgmma = 1;
    main.block_n = 128;
    main.stages = 3;
    main.write_lse = 0;
    CHECK_NOTHROW(main.validate());
    plan = attention_launch_plan(main);
    CHECK(plan.rows_per_block == 128);
    CHECK(plan.smem.row_a == 2 * 32768 + 2 * 49152 + 32768);
    CHECK(plan.shared_bytes == 2 * 32768 + 2 * 49152 + 32768 + 2 * 768 + 32);
}

// On sm_86 (99 KiB of shared memory a block) the smallest dq or dk/dv tiles of head_dim 200
// and more do not fit: those backwards run (in part) on CUDA cores there.
TEST_CASE(
    "the tile tables give every head_dim multiple of 8 up to 256 tensor cores on sm_80 (sm_86: to "
    "192)") {
    for (const AttentionDevice device : {AttentionDevice{80, 166912}, AttentionDevice{86, 101376}})
        for (int64_t d = 8; d <= (device.compute_capability == 80 ? 256 : 192); d += 8) {
            attention_test::Config c = headline_config();
            c.D = c.R = d;
            c.interleaved = true;  // rotary_dim % 8 suffices
            CAPTURE(d);
            CAPTURE(device.compute_capability);
            const AttentionSpec forward = chosen(c, false, device)[0];
            CHECK(forward.tensor_cores == 1);
            CHECK(forward.shared_bytes() <= device.max_shared_bytes);
            // The backward: dq and dk/dv (one pass, or a dk and a dv pass past head_dim 128).
            const std::vector<AttentionSpec> backward = chosen(c, true, device);
            CHECK(backward.size() == (d <= 128 ? 2u : 3u));
            for (const AttentionSpec& s : backward) {
                CAPTURE(s.describe());
                CHECK(s.tensor_cores == 1);
                CHECK(s.shared_bytes() <= device.max_shared_bytes);
            }
        }
    attention_test::Config c = headline_config();
    c.D = c.R = 200;
    c.interleaved = true;
    CHECK(chosen(c, false, AttentionDevice{86, 101376})[0].tensor_cores == 1);
    const std::vector<AttentionSpec> backward = chosen(c, true, AttentionDevice{86, 101376});
    CHECK(std::any_of(backward.begin(), backward.end(),
                      [](const AttentionSpec& s) { return s.tensor_cores == 0; }));
}

TEST_CASE("the kernels compute the launch plan the host launches them with") {
    if (nvrtc_api() == nullptr) {
        MESSAGE("NVRTC not available (" << nvrtc_load_error() << "): compile check skipped");
        return;
    }
    using K = AttentionKernelKind;
    AttentionSpec forward = spec_of(K::Forward, 2, 128, 128, true);
    forward.table_async = 1;
    AttentionSpec dkdv = spec_of(K::BackwardDkDv, 1, 64, 32, true);
    dkdv.interleaved = 1;
    dkdv.table_full = 1;
    dkdv.pos_mask = 1;
    AttentionSpec producer = forward;
    producer.wgmma = 1;
    producer.stages = 3;
    producer.producer_warps = 4;
    // The kernel's PLAN (attention_common.h) checked at compile time against the host's.
    auto check = [](const AttentionSpec& spec, const AttentionLaunchPlan& plan) {
        return "\nstatic_assert(PLAN.shared_bytes == " + std::to_string(plan.shared_bytes) +
               " && PLAN.threads == " + std::to_string(plan.threads) +
               " && PLAN.rows_per_block == " + std::to_string(plan.rows_per_block) +
               " && PLAN.table_row_bytes == " + std::to_string(plan.table_row_bytes) + ", \"" +
               spec.describe() + "\");\n";
    };
    for (const AttentionSpec& spec : {forward, dkdv, producer}) {
        CAPTURE(spec.describe());
        REQUIRE_NOTHROW(spec.validate());
        const std::string target = spec.wgmma ? "compute_90a" : "compute_80";
        const std::string source = specialize_template(spec.preamble(), "attention.cu");
        const AttentionLaunchPlan plan = attention_launch_plan(spec);
        CHECK_NOTHROW(
            compile_cuda(source + check(spec, plan), "attention.cu", target, {}, kernel_headers()));
        AttentionLaunchPlan other = plan;
        other.shared_bytes += 16;  // a one-sided change: the kernel disagrees
        try {
            compile_cuda(source + check(spec, other), "attention.cu", target, {}, kernel_headers());
            FAIL("no error");
        } catch (const Error& e) {
            CHECK(e.status() == ROPE_JIT_ERROR_COMPILE);
            CHECK(std::string(e.what()).find(spec.describe()) != std::string::npos);
        }
    }
}
