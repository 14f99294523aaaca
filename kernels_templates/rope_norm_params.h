// Run-time arguments of the QK-norm RoPE kernel (rope_norm.cu) and its block layout, compiled
// into the host launcher (src/ops/rope/rope_cuda.cpp) and, embedded, into every such kernel, so
// both sides size shared memory alike. Plain C++ only.
#ifndef ROPE_JIT_ROPE_NORM_PARAMS_H
#define ROPE_JIT_ROPE_NORM_PARAMS_H

#include "host_device.h"
#include "rope_params.h"

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
    float eps;
    int warps;  // warps per block, each normalizing one (token, head) row at a time
};

// QK-norm kernels with a KV cache write or FP8 outputs take the cache arguments after these
// (as rope.cu's do, so that the other norm kernels keep their parameter block).
struct RopeNormCacheParams {
    RopeNormParams norm;
    RopeCacheParams cache;
};

// Warps a block has at most (the kernel's launch bound is 32 times this).
enum { kRopeNormMaxWarps = 8 };

// Dynamic shared memory of a block: per warp, its row and (backward) the row's gradient after
// the inverse rotation, as float; per block, with weight gradients, the sums of q's and k's.
ROPE_JIT_HOST_DEVICE constexpr int rope_norm_smem_bytes(int head_dim, int warps, bool weight_grad) {
    return (warps * 2 * head_dim + (weight_grad ? 2 * head_dim : 0)) * 4;
}

#endif
