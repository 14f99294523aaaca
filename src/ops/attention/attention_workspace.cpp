#include "ops/attention/attention_workspace.h"

#include <fmt/format.h>

#include "attention_params.h"
#include "common/error.h"
#include "ops/attention/attention_kernel_choice.h"

namespace rope_jit {

namespace {

int64_t round_up(int64_t n, int64_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
}

// a * b, refused above 2^59 (broadcast views can describe more elements than any memory
// holds; the workspace's size must never wrap to a small number).
int64_t checked_product(int64_t a, int64_t b) {
    int64_t product = 0;
    if (__builtin_mul_overflow(a, b, &product) || product > (int64_t(1) << 59))
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("attention: these sizes need a workspace past 2^59 bytes ({} x {})",
                                a, b));
    return product;
}

}  // namespace

AttentionWorkspaceLayout attention_workspace_layout(const AttentionProblem& p, int head_dim_padded,
                                                    bool backward) {
    AttentionWorkspaceLayout w;
    w.seqlen_q_padded = backward ? round_up(p.seqlen_q, kAttentionBackwardQueryTile) : 0;
    w.seqlen_k_padded = round_up(p.seqlen_k, kAttentionBackwardKeyBlock);
    const int64_t query_rows = checked_product(checked_product(p.batch, p.heads_q),
                                               w.seqlen_q_padded);
    const int64_t key_rows = checked_product(checked_product(p.batch, p.heads_k),
                                             w.seqlen_k_padded);
    // Five parts of at most 2^59 bytes each (rounded up by 256): the sum stays below 2^63.
    size_t at = 0;
    auto take = [&](int64_t bytes) {
        const size_t offset = at;
        at += size_t(round_up(bytes, int64_t(kAttentionWorkspaceAlignment)));
        return offset;
    };
    const int64_t query_elements = checked_product(query_rows, head_dim_padded);
    const int64_t key_elements = checked_product(key_rows, head_dim_padded);
    w.q_rot = take(checked_product(query_elements, 2));
    w.k_rot = take(checked_product(key_elements, 2));
    w.dq_accum_bytes = size_t(checked_product(query_elements, 4));
    w.dq_accum = take(int64_t(w.dq_accum_bytes));
    w.row_lse2 = take(checked_product(query_rows, 4));
    w.row_delta = take(checked_product(query_rows, 4));
    w.bytes = at;
    return w;
}

AttentionWorkspaceLayout attention_workspace_for(const AttentionProblem& p,
                                                 const std::vector<AttentionSpec>& kernels) {
    // The prepare kernel comes first, then the kernel it prepares for: the sm_90 backward
    // (then dq's finish) or a forward whose producers take rotated keys by TMA.
    if (kernels.size() < 2 || kernels[0].kind != int32_t(AttentionKernelKind::BackwardPrepare))
        return {};
    const AttentionSpec& main = kernels[1];
    return attention_workspace_layout(p, attention_launch_plan(main).head_dim_padded,
                                      main.kind == int32_t(AttentionKernelKind::Backward));
}

void check_caller_workspace(const AttentionProblem& p, const AttentionWorkspaceLayout& layout) {
    if (p.workspace != nullptr && p.workspace_bytes < layout.bytes)
        fail_argument(fmt::format(
            "workspace_bytes: {} bytes, but this {} needs a workspace of {} bytes "
            "(rope_jit_attention_workspace_size)",
            p.workspace_bytes, p.backward ? "backward" : "forward", layout.bytes));
}

}  // namespace rope_jit
