// Run-time arguments of the QK-norm RoPE kernel (rope_norm.cu) and its block layout, compiled
// into the host launcher (src/ops/rope/rope_cuda.cpp) and, embedded, into every such kernel, so
// both sides size shared memory alike. Plain C++ only.
#ifndef ROPE_JIT_ROPE_NORM_PARAMS_H
#define ROPE_JIT_ROPE_NORM_PARAMS_H

#include "host_device.h"
#include "rope_params.h"
#include "row_divisor.h"

struct RopeNormParams {
    // q and k (forward: the inputs x; backward: the incoming gradients dL/dy), their outputs,
    // angles, positions and sizes, as the plain rope kernel takes them (tokens_per_block unused).
    RopeKernelParams rope;
    // The norm weights [D] (NORM_WEIGHT_DTYPE).
    const void* q_weight;
    const void* k_weight;
    long long q_weight_stride, k_weight_stride;
    // Backward: the forward's inputs x before the norm, as [B, H, S, D] views.
    const void* q_input;
    const void* k_input;
    long long q_input_stride[4];
    long long k_input_stride[4];
    // Backward with NORM_WEIGHT_GRAD: dL/dw [D] float32, which the kernel adds into (the
    // launcher zeroes them first on the same stream).
    float* q_weight_grad;
    float* k_weight_grad;
    long long q_weight_grad_stride, k_weight_grad_stride;
    // Runs a token has (q's heads / run, k's heads / run, v's heads) and tokens a batch row
    // has (seqlen_max), prepared for row_divide; the kernel checks the divisors before it
    // uses them.
    RowDivisor heads_div, seqlen_div;
    float eps;
    int warps;  // warps per block, each normalizing 32 / rope_norm_lanes runs at a time
    // Rows a lane group takes at once: consecutive heads of one token and kind (1 up to the
    // kernel's rope_norm_max_run, dividing heads_q and heads_k; 1 with v's rows).
    int run;
};

// QK-norm kernels with a KV cache write or FP8 outputs take the cache arguments after these
// (as rope.cu's do, so that the other norm kernels keep their parameter block).
using RopeNormCacheParams = WithCache<RopeNormParams>;

// Warps a block has at most (the kernel's launch bound is 32 times this).
enum { kRopeNormMaxWarps = 8 };

// Rows a lane group may take at once (RopeNormParams::run): consecutive heads of one token and
// kind share the group's place, table spans and weights, so that the instructions that resolve
// them (about half of a lone row's, sm_90 SASS of the Qwen3-8B forward) are paid once a run,
// and the run's loads are in flight together. 4 rows of fully rotated heads up to 256
// features read from plain tables, 2 of partially rotated ones (at 4 their registers spilled
// at the forward's launch bound, sm_90, NVRTC 13.0); 1 for longer rows, angles computed per
// pair (inv_freq, xPos, M-RoPE: at 4 these reached 122-128 registers and larger stack frames,
// not measured), KV cache writes and FP8 outputs (their slots and scales take the registers),
// and in the backward (the forward's input doubles the row). H200 run AR, Qwen3-8B prefill:
// 1 row 101.8 us, runs of 2 91.7 us, runs of 4 90.7 us.
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_max_run(bool backward, bool fp8_or_cache,
                                                    bool table_spans, bool partial,
                                                    int head_dim) {
    if (backward || fp8_or_cache || !table_spans || head_dim > 256) return 1;
    return partial ? 2 : 4;
}

// Whether a lane reads its pairs' cos/sin as spans of a plain table (no inv_freq, xPos or
// M-RoPE, whose angles are computed per pair).
ROPE_JIT_HOST_DEVICE constexpr bool rope_norm_table_spans(bool inv_freq, bool xpos,
                                                         int mrope_axes) {
    return !inv_freq && !xpos && mrope_axes == 0;
}

// Blocks a multiprocessor holds at once in the forward: the kernel's launch bound (ptxas fits
// the registers to it, 128 at 2 blocks). Runs of 4 rows need 114-121 registers
// (sm_90, NVRTC 13.0): at 3 blocks (80) they spilled and took 143 us for the Qwen3-8B prefill,
// at 2 blocks 91 us (H200 run AR).
enum { kRopeNormForwardBlocks = 2 };

// Warps a block has in the forward with many rows (runs): at the launch bound's registers four
// such blocks are resident a multiprocessor (16 warps, as two of kRopeNormMaxWarps), and
// smaller blocks end and restart in finer steps (plan_rope_norm_launch, H200 run CM).
enum { kRopeNormRunWarps = 4 };

// How a row (one head of one token) lies in the lanes of a warp, from the specialization
// alone. Rotated items: VEC features and, in the half and proportional styles, their VEC
// partners (VEC pairs), or, interleaved, VEC features (VEC/2 pairs); unrotated items: COPY_VEC
// features. A group of `lanes` lanes (a power of 2) owns one row, so that each lane issues
// about two accesses of the row and a warp holds 32/lanes rows: enough bytes in flight per
// thread, and no lane idle at small head_dim.
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_rot_items(int rotary_dim, bool interleaved, int vec) {
    return interleaved ? rotary_dim / vec : rotary_dim / 2 / vec;
}
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_copy_items(int head_dim, int rotary_dim,
                                                        int copy_vec) {
    return (head_dim - rotary_dim) / copy_vec;
}
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_lanes(int head_dim, int rotary_dim,
                                                   bool interleaved, int vec, int copy_vec) {
    const int accesses = rope_norm_rot_items(rotary_dim, interleaved, vec) * (interleaved ? 1 : 2) +
                         rope_norm_copy_items(head_dim, rotary_dim, copy_vec);
    int lanes = 1;
    while (lanes < 32 && 2 * lanes < accesses) lanes *= 2;
    return lanes;
}

// Dynamic shared memory of a block: the rows live in registers; with weight gradients, the
// block's sums for q's and k's weights as float.
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_smem_bytes(int head_dim, bool weight_grad) {
    return weight_grad ? 2 * head_dim * 4 : 0;
}

#endif
