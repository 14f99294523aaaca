#include "ops/attention/attention_workspace.h"

#include "attention_params.h"

namespace rope_jit {

namespace {

int64_t round_up(int64_t n, int64_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
}

}  // namespace

AttentionWorkspaceLayout attention_workspace_layout(const AttentionProblem& p, int head_dim_padded,
                                                    bool backward) {
    AttentionWorkspaceLayout w;
    w.seqlen_q_padded = backward ? round_up(p.seqlen_q, kAttentionBackwardQueryTile) : 0;
    w.seqlen_k_padded = round_up(p.seqlen_k, kAttentionBackwardKeyBlock);
    const int64_t query_rows = p.batch * p.heads_q * w.seqlen_q_padded;
    const int64_t key_rows = p.batch * p.heads_k * w.seqlen_k_padded;
    size_t at = 0;
    auto take = [&](int64_t bytes) {
        const size_t offset = at;
        at += size_t(round_up(bytes, 256));
        return offset;
    };
    w.q_rot = take(query_rows * head_dim_padded * 2);
    w.k_rot = take(key_rows * head_dim_padded * 2);
    w.dq_accum_bytes = size_t(query_rows * head_dim_padded * 4);
    w.dq_accum = take(query_rows * head_dim_padded * 4);
    w.row_lse2 = take(query_rows * 4);
    w.row_delta = take(query_rows * 4);
    w.bytes = at;
    return w;
}

}  // namespace rope_jit
