// Run-time arguments of the rope kernel, passed by value as its single parameter, and the
// layout of its shared memory. This file is compiled twice: into the host launcher
// (src/ops/rope/cuda_backend.cpp) and, embedded, into every kernel by NVRTC, so the two sides cannot
// disagree on either. Plain C++ only: the kernels compile without any toolkit header.
#ifndef ROPE_JIT_ROPE_PARAMS_H
#define ROPE_JIT_ROPE_PARAMS_H

#include "host_device.h"

struct RopeKernelParams {
    // q, k and their outputs as [B, H, S, D] views; strides in elements. Packed [T, H, D]
    // tensors arrive lifted to [1, H, T, D].
    const void* q;
    void* q_out;
    const void* k;
    void* k_out;
    long long q_stride[4];
    long long q_out_stride[4];
    long long k_stride[4];
    long long k_out_stride[4];

    // Angle sources: cos/sin tables [P, C], or inv_freq [R/2]; xPos scales like the tables.
    const void* cos;
    const void* sin;
    const void* inv_freq;
    const void* xpos;
    long long cos_stride[2];
    long long sin_stride[2];
    long long xpos_stride[2];
    long long inv_freq_stride;

    // Position sources. positions is [B, S] or [S] (batch stride 0) or, packed, [T].
    const void* positions;
    long long positions_stride[2];
    const void* seqlen_offsets;
    long long seqlen_offsets_stride;
    const void* cu_seqlens;
    long long cu_seqlens_stride;

    long long batch;
    long long seqlen_q;
    long long seqlen_k;
    long long seqlen_max;  // max(seqlen_q, seqlen_k): tokens per batch row the grid covers
    long long heads_q;
    long long heads_k;
    long long num_sequences;
    long long position_offset;
    long long q_position_offset;
    long long units;  // batch * seqlen_max
    int tokens_per_block;
    int unused_;

    // Multi-section positions (M-RoPE): positions carry a leading axis of this stride, and
    // pair i reads axis pair_axis[i].
    long long positions_axis_stride;
    unsigned char pair_axis[256];

    // Learned frequencies (backward with inv_freq): the forward outputs, and the gradient
    // [R/2] float32 the kernel adds into (the launcher zeroes it first on the same stream).
    const void* q_saved;
    const void* k_saved;
    long long q_saved_stride[4];
    long long k_saved_stride[4];
    float* inv_freq_grad;
    long long inv_freq_grad_stride;
};

// Where one token's rows start in q, q_out, k, k_out (element offsets of head 0); -1 when the
// token has no q (s >= Sq) or no k (s >= Sk) or lies past the end.
struct RopeTokenBases {
    long long q_in, q_out, k_in, k_out;
    long long q_saved, k_saved;  // the forward outputs (frequency gradient only)
};

// Work items per head of the rope kernel (ROT_ITEMS in rope.cu): interleaved, one per vector of
// `vec` features; half style, one per vector of first halves and its partner vector, or, with
// chunk_items (out-of-place partial rotary), one per output vector.
ROPE_JIT_HOST_DEVICE constexpr int rope_items_per_head(bool interleaved, bool chunk_items, int rotary_dim, int vec) {
    return interleaved || chunk_items ? rotary_dim / vec : rotary_dim / 2 / vec;
}

// Byte offsets of a block's shared memory: per token, cos and sin of each angle set when the
// kernel computes them once per token, the table row of each row set, and the row bases; the
// block's frequency-gradient sums.
struct RopeSmemLayout {
    int cos, sin, rows, bases, grad;
    int bytes;
};

// Reserves `bytes` (rounded up to 16) at *at and returns their offset.
ROPE_JIT_HOST_DEVICE constexpr int rope_take(int* at, int bytes) {
    const int offset = *at;
    *at += (bytes + 15) / 16 * 16;
    return offset;
}

ROPE_JIT_HOST_DEVICE constexpr RopeSmemLayout rope_smem_layout(int tokens, int angle_sets, int shared_pairs,
                                                              int row_sets, int grad_pairs) {
    RopeSmemLayout l{};
    int at = 0;
    int* const cursor = &at;
    l.cos = rope_take(cursor, tokens * angle_sets * shared_pairs * 4);
    l.sin = rope_take(cursor, tokens * angle_sets * shared_pairs * 4);
    l.rows = rope_take(cursor, tokens * row_sets * 8);
    l.bases = rope_take(cursor, tokens * static_cast<int>(sizeof(RopeTokenBases)));
    l.grad = rope_take(cursor, grad_pairs * 4);
    l.bytes = at;
    return l;
}

#endif
