// The workspace of the sm_90 backward (kernels_templates/attention_wgmma_backward.h): rotated
// q and k, the float32 dq accumulator and the per-row lse and delta, carved out of one
// stream-ordered allocation per call. Sizes and offsets only; cuda_attention.cpp allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/attention/attention_problem.h"

namespace rope_jit {

struct AttentionWorkspaceLayout {
    int64_t seqlen_q_padded = 0;  // Sq rounded up to the backward's query tile (64)
    int64_t seqlen_k_padded = 0;  // Sk rounded up to the backward's key block (128)
    // Byte offsets of [B, Hq, Sq_padded, DP] rotated q (16-bit), [B, Hk, Sk_padded, DP]
    // rotated k, [B, Hq, Sq_padded, DP] float32 dq, and [B, Hq, Sq_padded] float32 lse (base 2)
    // and delta; each 256-byte aligned.
    size_t q_rot = 0, k_rot = 0, dq_accum = 0, row_lse2 = 0, row_delta = 0;
    size_t dq_accum_bytes = 0;  // what the host zeroes before the backward
    size_t bytes = 0;           // the whole allocation
};

// The layout for `problem` with head_dim padded to `head_dim_padded`: everything for the
// backward, only the rotated keys (Sq_padded 0) for a forward whose producers take them by TMA.
AttentionWorkspaceLayout attention_workspace_layout(const AttentionProblem& problem,
                                                    int head_dim_padded, bool backward);

}  // namespace rope_jit
