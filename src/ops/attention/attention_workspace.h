// The workspace of the sm_90 kernels that take q and k rotated beforehand (the backward of
// kernels_templates/attention_wgmma_backward.h, the forward whose producers copy rotated keys):
// rotated q and k, the float32 dq accumulator and the per-row lse and delta, carved out of one
// block per call, the caller's (rope_jit_attention_args.workspace) or a stream-ordered
// allocation. Sizes, offsets and checks only; cuda_attention.cpp allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"

namespace rope_jit {

// What a workspace's address must be a multiple of (the public header promises it to callers
// who pass their own), and each part's offset: TMA copies need 128-byte aligned rows, and
// cuMemAllocAsync gives at least this much.
constexpr size_t kAttentionWorkspaceAlignment = 256;

struct AttentionWorkspaceLayout {
    int64_t seqlen_q_padded = 0;  // Sq rounded up to the backward's query tile (64)
    int64_t seqlen_k_padded = 0;  // Sk rounded up to the backward's key block (128)
    // Byte offsets of [B, Hq, Sq_padded, DP] rotated q (16-bit), [B, Hk, Sk_padded, DP]
    // rotated k, [B, Hq, Sq_padded, DP] float32 dq, and [B, Hq, Sq_padded] float32 lse (base 2)
    // and delta; each kAttentionWorkspaceAlignment-aligned.
    size_t q_rot = 0, k_rot = 0, dq_accum = 0, row_lse2 = 0, row_delta = 0;
    size_t dq_accum_bytes = 0;  // what the host zeroes before the backward
    size_t bytes = 0;           // the whole block; 0: the kernels need no workspace
};

// The layout for `problem` with head_dim padded to `head_dim_padded`: everything for the
// backward, only the rotated keys (Sq_padded 0) for a forward whose producers take them by TMA.
AttentionWorkspaceLayout attention_workspace_layout(const AttentionProblem& problem,
                                                    int head_dim_padded, bool backward);

// The workspace that `kernels` (choose_attention_specs for `problem`, in launch order) need:
// the layout above when they begin with the prepare kernel, which fills it, else all zeros.
// The one computation behind both the run and rope_jit_attention_workspace_size.
AttentionWorkspaceLayout attention_workspace_for(const AttentionProblem& problem,
                                                 const std::vector<AttentionSpec>& kernels);

// Throws INVALID_ARGUMENT, naming workspace_bytes with both numbers, when the caller gave a
// workspace smaller than `layout` needs. (Its alignment is checked with the other arguments.)
void check_caller_workspace(const AttentionProblem& problem,
                            const AttentionWorkspaceLayout& layout);

}  // namespace rope_jit
