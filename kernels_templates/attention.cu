// Attention with rotary embeddings fused in (the flash_attn_with_rotary contract): the forward
// and the two kernels of the backward. The runtime prepends constexpr specialization constants
// (src/ops/attention/attention_spec.cpp, AttentionSpec::preamble) and compiles this file with NVRTC, without
// any CUDA toolkit header. The constants:
//   KIND                      0 forward, 1 backward dq, 2 backward dk/dv; the sm_90 backward:
//                             3 prepare, 4 backward, 5 dq finish (attention_wgmma_backward.h)
//   DTYPE, TABLE_DTYPE        0 float32, 1 float16, 2 bfloat16 (q/k/v/out/grads; cos/sin)
//   HEAD_DIM, ROTARY_DIM      features; the first ROTARY_DIM rotate (0: no rotation)
//   INTERLEAVED, TABLE_FULL   pairs (2i, 2i+1) else (i, i + R/2); tables [P, R] vs [P, R/2]
//   HAS_POS_MASK              tokens without a position score unrotated (see rope_jit.h)
//   MASK_KIND, MASK_DTYPE     attn_mask: 0 none, 1 bool (uint8), 2 additive (of MASK_DTYPE)
//   CAUSAL, GQA_GROUP         top-left causal mask; Hq = GQA_GROUP * Hk
//   WRITE_LSE                 the forward writes the log-sum-exp
//   TENSOR_CORES              1: mma.sync (16-bit dtypes, sm_80+); 0: one warp per row
//   WGMMA, STAGES             the forward on warpgroup matrix products (sm_90a; see wg::),
//                             with STAGES key/value tiles in shared memory (2 or 3)
//   PRODUCER_WARPS            wgmma forward: 4 warps after the WARPS consumer warps load and
//                             rotate the tiles (forward_specialized), or 0: every warp does
//   CLUSTER                   forward_specialized: blocks per thread-block cluster sharing
//                             their key/value tiles (1: none)
//   KEYS_BY_TMA               the wgmma forwards take keys rotated beforehand by the prepare
//                             kernel (the workspace's k_rot): forward_specialized by TMA from
//                             k_map, not through the producers' registers; forward (head_dim
//                             256) by cp.async, as values, rather than rotating each tile
//   TABLE_ASYNC               tables are staged with cp.async (aligned, unit column stride)
//   WARPS, M_TILES, BLOCK_N   warps per block, 16-row tiles each warp owns; streamed tile rows
//   COMPUTE_DK, COMPUTE_DV    which gradients a dk/dv kernel accumulates
//
// Scores are computed in base 2: s = (q . k) * scale * log2(e) + bias * log2(e), so the
// softmax uses exp2. A query that sees no key gets out = 0 and lse = -inf; the backward reads
// that lse as "P = 0" for the whole row.
//
// Tensor-core kernels (FlashAttention-2 style): a block keeps 16 * WARPS rows resident in
// shared memory (queries for the forward and dq, keys and values for dk/dv), each warp owning
// 16 of them, and streams tiles of BLOCK_N rows of the other side. A streamed tile of keys
// (or queries) arrives raw through cp.async into a staging buffer, with the table rows of its
// tokens, one tile ahead; between tiles every thread rotates a few 16-byte chunks of it in
// registers into the buffer the tensor cores read. Rotated q and k exist only in shared memory.
//
// The kernels live in role headers, included in this order (each uses those before it).

#include "attention_params.h"
#include "attention_common.h"
#include "attention_mma.h"
#include "attention_rotary.h"
#include "attention_softmax.h"
#include "attention_simt.h"
#include "attention_mma_forward.h"
#include "attention_mma_backward.h"
#include "attention_wgmma.h"
#include "attention_wgmma_producer.h"
#include "attention_wgmma_backward.h"

// The preamble defines ROPE_JIT_CLUSTER_DIMS as __cluster_dims__(CLUSTER, 1, 1) for clusters
// of more than one block (sm_90 only).
#ifndef ROPE_JIT_CLUSTER_DIMS
#define ROPE_JIT_CLUSTER_DIMS
#endif

// Two blocks per multiprocessor for the FlashAttention-2 layout of the forward (up to 255
// registers at 128 threads); no constraint otherwise.
extern "C" __global__ void ROPE_JIT_CLUSTER_DIMS
__launch_bounds__(PLAN.threads, TENSOR_CORES&& KIND == 0 && M_TILES == 2 && WARPS <= 4 ? 2 : 1)
    attention_kernel(const __grid_constant__ AttentionKernelParams p) {
    if constexpr (TENSOR_CORES) {
        extern __shared__ __align__(1024) char smem[];  // swizzled TMA boxes land 1024-byte aligned
        if constexpr (KIND == 3)
            tc::wg::prepare(p);
        else if constexpr (KIND == 4)
            tc::wg::backward(p, smem);
        else if constexpr (KIND == 5)
            tc::wg::finish_dq(p);
        else if constexpr (KIND == 0 && WGMMA && PRODUCER_WARPS > 0)
            tc::wg::forward_specialized(p, smem);
        else if constexpr (KIND == 0 && WGMMA)
            tc::wg::forward(p, smem);
        else if constexpr (KIND == 0)
            tc::forward(p, smem);
        else if constexpr (KIND == 1)
            tc::backward_dq(p, smem);
        else
            tc::backward_dkdv(p, smem);
    } else {
        if constexpr (KIND == 0)
            simt::forward(p);
        else if constexpr (KIND == 1)
            simt::backward_dq(p);
        else
            simt::backward_dkdv(p);
    }
}
