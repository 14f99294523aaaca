// An attention call after its arguments are checked: every tensor validated and normalized to
// one view per role, the dimensions named. Both backends execute an AttentionProblem, so the
// checks live in one place (make_attention_problem) and the backends trust it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rope_jit/rope_jit.h"
#include "common/tensor_ref.h"

namespace rope_jit {

enum class AttentionMaskKind { None, Bool, Additive };

struct AttentionProblem {
    bool backward = false;
    int64_t batch = 0, heads_q = 0, heads_k = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
    DType dtype = DType::F32;

    // [B, H, S, D] views. out is written by the forward and read by the backward.
    TensorRef q, k, v, out;
    // [B, Hq, Sq] float32, as a 3-dim view; absent in a forward without lse.
    TensorRef lse;
    bool has_lse = false;

    // Rotation: absent tables mean no rotation (rotary_dim is then 0).
    bool rotate = false;
    int64_t rotary_dim = 0;
    rope_jit_style style = ROPE_JIT_STYLE_HALF;
    TensorRef cos, sin;
    bool table_full = false;  // [P, R] rather than [P, R/2]

    // pos_mask as a [B, N] view (a 1-dim pos_mask arrives with batch stride 0).
    TensorRef pos_mask;
    bool has_pos_mask = false;

    // attn_mask as a [B, Sq, Sk] view: a [B, Sk] mask has query stride 0, a leading 1 has
    // batch stride 0. Bool masks are uint8.
    AttentionMaskKind mask_kind = AttentionMaskKind::None;
    TensorRef attn_mask;

    bool causal = false;
    double scale = 0;  // resolved: never 0 unless the caller's was
    // Backward: bitwise-reproducible results asked for (rope_jit_attention_args).
    bool deterministic = false;
    // Kernels that need a workspace (the sm_90 backward, rotated keys by TMA) are not to be
    // chosen: set by the CUDA backend when the workspace could not be allocated.
    bool no_workspace = false;
    // The caller's workspace (rope_jit_attention_args.workspace, 256-byte aligned), or NULL:
    // the CUDA backend allocates one where its kernels need it.
    char* workspace = nullptr;
    size_t workspace_bytes = 0;

    // Backward tensors ([B, H, S, D] views).
    TensorRef dout, dq, dk, dv;

    DLDevice device{kDLCPU, 0};

    int64_t group() const { return heads_q / heads_k; }
    // Column of pair i in the cos/sin tables.
    int64_t table_column(int64_t i) const {
        if (!table_full) return i;
        return style == ROPE_JIT_STYLE_INTERLEAVED ? 2 * i : i;
    }
    // Nothing to compute (and nothing to write except possibly lse/out rows, see backends).
    bool empty() const { return batch == 0 || heads_q == 0 || seqlen_q == 0; }
};

// Checks every argument of a forward (backward = false) or backward call and builds the
// problem. Throws Error(INVALID_ARGUMENT) with a message naming the argument.
AttentionProblem make_attention_problem(const rope_jit_attention_args& args, bool backward);

}  // namespace rope_jit
