// Attention templates: the constants every kernel uses (with the launch plan), the storage
// type T of q/k/v/out and their rows, base-2 exponentials and warp sums, and the positioned
// test of pos_mask. Reads the specialization constants (see attention.cu).
#ifndef ROPE_JIT_ATTENTION_COMMON_H
#define ROPE_JIT_ATTENTION_COMMON_H

namespace {

constexpr bool ROTATE = ROTARY_DIM > 0;
constexpr int HALF_R = ROTARY_DIM / 2;
constexpr int THREADS = WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr unsigned FULL_MASK = 0xffffffffu;
// What the host sized this launch with (block threads, rows per block, shared memory), from
// the same function (attention_params.h).
constexpr AttentionLaunchPlan PLAN = attention_launch_plan(
    KIND, HEAD_DIM, ROTARY_DIM, INTERLEAVED, TABLE_FULL, TABLE_DTYPE, TABLE_ASYNC, HAS_POS_MASK,
    TENSOR_CORES, WGMMA, WARPS, M_TILES, BLOCK_N, STAGES, PRODUCER_WARPS);

__device__ __forceinline__ float pos_inf() {
    return __int_as_float(0x7f800000);
}
__device__ __forceinline__ float neg_inf() {
    return -pos_inf();
}

}  // namespace

#include "device_numeric.h"

namespace {

using T = typename StorageOf<DTYPE>::type;

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ bool positioned(const AttentionKernelParams& p, long long b,
                                           long long s) {
    if constexpr (!HAS_POS_MASK)
        return true;
    else
        return p.pos_mask[b * p.pos_mask_stride[0] + s * p.pos_mask_stride[1]] != 0;
}

__device__ __forceinline__ const T* head_row(const void* base, const long long* stride, long long b,
                                             long long h, long long s) {
    return static_cast<const T*>(base) + b * stride[0] + h * stride[1] + s * stride[2];
}

__device__ __forceinline__ T* head_row_out(void* base, const long long* stride, long long b,
                                           long long h, long long s) {
    return static_cast<T*>(base) + b * stride[0] + h * stride[1] + s * stride[2];
}

}  // namespace

#endif
