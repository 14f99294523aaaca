// The sm_90 kernels' workspace (ops/attention/attention_workspace.h): its layout, which kernel
// choices need one (the one computation behind both the run and
// rope_jit_attention_workspace_size), and the check of a caller's workspace against it. The
// kernel choice runs for an H200-like device without a GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention_test_support.h"
#include "common/error.h"
#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_workspace.h"

using namespace rope_jit;

namespace {

const AttentionDevice kH200{90, 232448, true, true};
const AttentionDevice kA100{80, 166912};

// bf16, head_dim 128, causal, GQA 4: what the sm_90 wgmma kernels run.
attention_test::Config wgmma_config() {
    attention_test::Config c;
    c.dt = rope_test::Dt::BF16;
    c.B = 2;
    c.Hq = 4;
    c.Hk = 1;
    c.Sq = c.Sk = 100;
    c.D = c.R = 128;
    c.causal = true;
    return c;
}

// The workspace the kernels chosen for `c` (forward or backward) on `device` need.
AttentionWorkspaceLayout workspace_of(const attention_test::Config& c, bool backward,
                                      const AttentionDevice& device, bool no_workspace = false) {
    std::mt19937 rng(1);
    attention_test::Problem p(c, rng);
    const rope_jit_attention_args args = p.args();
    AttentionProblem problem = make_attention_problem(args, backward);
    problem.no_workspace = no_workspace;
    return attention_workspace_for(problem, choose_attention_specs(problem, device));
}

}  // namespace

TEST_CASE(
    "the sm_90 backward's workspace holds rotated q and k, dq's float32 accumulator and two "
    "float32 rows per query, padded to the tiles, each part 256-byte aligned") {
    const AttentionWorkspaceLayout w = workspace_of(wgmma_config(), true, kH200);
    // 100 queries padded to 128 (64-query tiles), 100 keys to 128 (128-key blocks); D 128.
    CHECK(w.seqlen_q_padded == 128);
    CHECK(w.seqlen_k_padded == 128);
    const size_t query_rows = 2 * 4 * 128, key_rows = 2 * 1 * 128;
    CHECK(w.q_rot == 0);
    CHECK(w.k_rot == query_rows * 128 * 2);
    CHECK(w.dq_accum == w.k_rot + key_rows * 128 * 2);
    CHECK(w.dq_accum_bytes == query_rows * 128 * 4);
    CHECK(w.row_lse2 == w.dq_accum + query_rows * 128 * 4);
    CHECK(w.row_delta == w.row_lse2 + query_rows * 4);
    CHECK(w.bytes == w.row_delta + query_rows * 4);
    for (const size_t offset : {w.q_rot, w.k_rot, w.dq_accum, w.row_lse2, w.row_delta, w.bytes})
        CHECK(offset % kAttentionWorkspaceAlignment == 0);
}

TEST_CASE(
    "the sm_90 forward's workspace holds only the rotated keys; kernels without one need 0 "
    "bytes") {
    const attention_test::Config c = wgmma_config();
    const AttentionWorkspaceLayout forward = workspace_of(c, false, kH200);
    CHECK(forward.seqlen_q_padded == 0);
    CHECK(forward.bytes == 2 * 1 * 128 * 128 * 2);  // B * Hk * Sk_padded * D, 16-bit
    CHECK(forward.dq_accum_bytes == 0);
    // sm_80, no TMA, as if the allocation failed, the deterministic backward, float32 (CUDA
    // cores): no prepare kernel, no workspace.
    CHECK(workspace_of(c, true, kA100).bytes == 0);
    CHECK(workspace_of(c, false, kA100).bytes == 0);
    CHECK(workspace_of(c, true, AttentionDevice{90, 232448, true, false}).bytes == 0);
    CHECK(workspace_of(c, true, kH200, true).bytes == 0);
    CHECK(workspace_of(c, false, kH200, true).bytes == 0);
    attention_test::Config deterministic = c;
    deterministic.deterministic = true;
    CHECK(workspace_of(deterministic, true, kH200).bytes == 0);
    attention_test::Config f32 = c;
    f32.dt = rope_test::Dt::F32;
    CHECK(workspace_of(f32, true, kH200).bytes == 0);
    CHECK(workspace_of(f32, false, kH200).bytes == 0);
}

TEST_CASE(
    "a caller's workspace smaller than the kernels need is refused, naming workspace_bytes and "
    "both sizes; one large enough, or none, passes") {
    std::mt19937 rng(1);
    attention_test::Problem host(wgmma_config(), rng);
    const rope_jit_attention_args args = host.args();
    AttentionProblem p = make_attention_problem(args, true);
    const AttentionWorkspaceLayout w = attention_workspace_for(p, choose_attention_specs(p, kH200));
    REQUIRE(w.bytes > 0);
    CHECK_NOTHROW(check_caller_workspace(p, w));  // none: the library allocates
    // An address is all the check looks at (the memory is never touched here).
    p.workspace = reinterpret_cast<char*>(uintptr_t(1) << 20);
    for (const size_t bytes : {size_t(0), w.bytes - 1, w.bytes - 256}) {
        CAPTURE(bytes);
        p.workspace_bytes = bytes;
        try {
            check_caller_workspace(p, w);
            FAIL("accepted a workspace that is too small");
        } catch (const Error& e) {
            const std::string message = e.what();
            CAPTURE(message);
            CHECK(e.status() == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(message.rfind("workspace_bytes: " + std::to_string(bytes) + " bytes", 0) == 0);
            CHECK(message.find("backward needs a workspace of " + std::to_string(w.bytes) +
                               " bytes") != std::string::npos);
        }
    }
    for (const size_t bytes : {w.bytes, w.bytes + 1, w.bytes * 2}) {
        p.workspace_bytes = bytes;
        CHECK_NOTHROW(check_caller_workspace(p, w));
    }
    // Kernels that need none take any workspace (it goes unused).
    p.workspace_bytes = 0;
    CHECK_NOTHROW(check_caller_workspace(p, AttentionWorkspaceLayout{}));
}
