// An attention kernel spec: everything fixed in one compiled attention kernel (which kernel,
// dtypes, head_dim, rotation, masks, GQA group, tile shape...). Sizes and strides stay run-time
// arguments. Like KernelSpec it renders to the constexpr preamble of its template
// (kernels_templates/attention.cu), to canonical JSON (part of the disk-cache key, stored in
// each entry) and, hashed, to the in-memory cache key. All fields are int32 so two specs
// compare and hash as plain bytes on the launch path.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ops/attention/attention_problem.h"

namespace rope_jit {

// The kernels: the forward; the backward as dq and dk/dv kernels (mma.sync or CUDA cores);
// the sm_90 backward as prepare (rotated q and k, lse and delta rows into the workspace),
// the backward proper (wgmma; dq accumulated in float32) and dq finish.
enum class AttentionKernelKind : int32_t {
    Forward = 0,
    BackwardDq = 1,
    BackwardDkDv = 2,
    BackwardPrepare = 3,
    Backward = 4,
    BackwardDqFinish = 5,
};

// The fields of an attention kernel spec, in member order; columns as for
// ROPE_JIT_ROPE_SPEC_FIELDS (kernel_spec.h): member, default, JSON key, values, minimum,
// maximum, the template's constexpr name, and whether a JSON object may leave it out.
#define ROPE_JIT_ATTENTION_SPEC_FIELDS(X)                                                          \
    X(kind, 0, "kind", KernelKinds, 0, 5, "KIND", REQUIRED) /* AttentionKernelKind */              \
    X(dtype, 0, "dtype", FloatTypes, 0, 2, "DTYPE", PLAIN)                                         \
    X(table_dtype, 0, "table_dtype", FloatTypes, 0, 2, "TABLE_DTYPE", PLAIN)                       \
    X(mask_dtype, 0, "mask_dtype", FloatTypes, 0, 2, "MASK_DTYPE", PLAIN)                          \
    X(head_dim, 0, "head_dim", Integer, 1, kAttentionMaxHeadDim, "HEAD_DIM", REQUIRED)             \
    X(rotary_dim, 0, "rotary_dim", Integer, 0, kAttentionMaxHeadDim, "ROTARY_DIM",                 \
      PLAIN) /* 0: none */                                                                         \
    X(interleaved, 0, "style", Styles, 0, 1, "INTERLEAVED", PLAIN)                                 \
    X(table_full, 0, "table_full", Boolean, 0, 1, "TABLE_FULL", PLAIN)                             \
    X(pos_mask, 0, "pos_mask", Boolean, 0, 1, "HAS_POS_MASK", PLAIN)                               \
    X(mask_kind, 0, "mask", MaskKinds, 0, 2, "MASK_KIND", PLAIN)                                   \
    X(causal, 0, "causal", Boolean, 0, 1, "CAUSAL", PLAIN)                                         \
    X(gqa_group, 1, "gqa_group", Integer, 1, 1 << 20, "GQA_GROUP", PLAIN)                          \
    X(write_lse, 0, "write_lse", Boolean, 0, 1, "WRITE_LSE", PLAIN)                                \
    /* mma.sync kernels; else one warp per row */                                                  \
    X(tensor_cores, 0, "tensor_cores", Boolean, 0, 1, "TENSOR_CORES", PLAIN)                       \
    /* the forward on warpgroup matrix products (sm_90a), with tensor_cores */                     \
    X(wgmma, 0, "wgmma", Boolean, 0, 1, "WGMMA", PLAIN)                                            \
    /* wgmma: key/value tiles held in shared memory (2 or 3) */                                    \
    X(stages, 2, "stages", Integer, 2, 3, "STAGES", PLAIN)                                         \
    /* wgmma: 4 warps that only load and rotate tiles (beside `warps`), or 0 */                    \
    X(producer_warps, 0, "producer_warps", Integer, 0, 4, "PRODUCER_WARPS", PLAIN)                 \
    /* producer warps: blocks of a GQA group sharing their tiles (1, 2 or 4) */                    \
    X(cluster, 1, "cluster", Integer, 1, 4, "CLUSTER", PLAIN)                                      \
    /* producer warps: keys by TMA, rotated beforehand (prepare kernel) or unrotated */            \
    X(keys_by_tma, 0, "keys_by_tma", Boolean, 0, 1, "KEYS_BY_TMA", PLAIN)                          \
    X(table_async, 0, "table_async", Boolean, 0, 1, "TABLE_ASYNC", PLAIN) /* tables by cp.async */ \
    /* warps per block that compute (16 query rows each on tensor cores) */                        \
    X(warps, 4, "warps", Integer, 1, 16, "WARPS", PLAIN)                                           \
    X(m_tiles, 1, "m_tiles", Integer, 1, 2, "M_TILES", PLAIN)    /* 16-row tiles per warp */       \
    X(block_n, 0, "block_n", Integer, 0, 1024, "BLOCK_N", PLAIN) /* rows of a streamed tile */     \
    X(compute_dk, 1, "compute_dk", Boolean, 0, 1, "COMPUTE_DK", PLAIN)                             \
    X(compute_dv, 1, "compute_dv", Boolean, 0, 1, "COMPUTE_DV", PLAIN)                             \
    /* producer forward: the consumer warpgroups take turns issuing their products (named  */     \
    /* barriers): 0 no, 1 turns for S = Q K^T, 2 for S and for O += P V                     */     \
    X(pingpong, 0, "pingpong", IntegerEnumerator, 0, 2, "PINGPONG", PLAIN)                         \
    /* producer forward, keys by TMA: producers give registers to the consumers (setmaxnreg) */    \
    X(setmaxnreg, 0, "setmaxnreg", BooleanEnumerator, 0, 1, "SETMAXNREG", PLAIN)                   \
    /* producer forward: quarters of a mask-free tile's exponentials computed by a polynomial */  \
    /* on the FMA pipe rather than by ex2 (the multifunction unit)                            */  \
    X(exp2_fma, 0, "exp2_fma", IntegerEnumerator, 0, 3, "EXP2_FMA", PLAIN)                         \
    /* producer forward, setmaxnreg: each consumer warpgroup overlaps a tile's softmax with    */  \
    /* its own O += P V of the tile before (FlashAttention-3's intra-warpgroup overlap)       */  \
    X(overlap, 0, "overlap", BooleanEnumerator, 0, 1, "OVERLAP", PLAIN)

// The largest head_dim any attention kernel takes (the CUDA-core kernels: 16 features a lane).
constexpr int64_t kAttentionMaxHeadDim = 512;

struct AttentionSpec {
#define ROPE_JIT_ATTENTION_SPEC_MEMBER(member, init, ...) int32_t member = init;
    ROPE_JIT_ATTENTION_SPEC_FIELDS(ROPE_JIT_ATTENTION_SPEC_MEMBER)
#undef ROPE_JIT_ATTENTION_SPEC_MEMBER

    bool operator==(const AttentionSpec& other) const {
        return std::memcmp(this, &other, sizeof *this) == 0;
    }
    bool operator!=(const AttentionSpec& other) const {
        return !(*this == other);
    }

    // The constexpr block prepended to attention.cu.
    std::string preamble() const;
    // Canonical JSON (every field, sorted keys, names for enumerations: "kind":
    // "backward-dq", "dtype": "bfloat16", "mask": "none"), with "op": "attention".
    std::string to_json() const;
    // The spec of a JSON object in to_json's vocabulary (what a disk-cache entry stores, what
    // `rope-jit-cache list --json` prints, a manifest's kernel-level entry): "op" must be
    // "attention", "kind" and "head_dim" must be there, other fields left out take the
    // struct's defaults; unknown keys, wrong types and values out of range are errors, and so
    // is a spec validate() rejects. from_json(s.to_json()) == s. nullopt on any error, with the
    // reason in *error when error is not NULL.
    static std::optional<AttentionSpec> from_json(const std::string& text, std::string* error);
    // "attention fwd bf16 D128 R128 half causal gqa4 tc 8x64".
    std::string describe() const;
    // Throws Error(INVALID_ARGUMENT) when the fields cannot describe a kernel.
    void validate() const;
    // Dynamic shared memory of one block, bytes (0 for the CUDA-core kernels). This and
    // threads() come from attention_launch_plan (attention_kernel_choice.h).
    int shared_bytes() const;
    // Threads of one block (computing and producer warps).
    int threads() const;
};

// An attention call as a prewarm entry describes it: an AttentionSpec JSON object without
// "kind" and the tile fields (tensor_cores, wgmma, stages, producer_warps, cluster,
// table_async, warps, m_tiles, block_n, compute_dk, compute_dv, pingpong, setmaxnreg,
// exp2_fma, overlap), which the kernel choice decides, plus "direction" ("forward", the
// default, or "backward") and "seqlen_k" (keys per sequence, default 1024: the choice depends
// on it only through classes, today 4096 keys and more at head_dim 64 and 128). "rotary_dim"
// left out means head_dim; 0 means no rotation.
struct AttentionCall {
    AttentionSpec fields;  // kind and tile fields at their defaults
    bool backward = false;
    int64_t seqlen_k = 1024;
};
// The call of a JSON object in that vocabulary; nullopt with the reason (naming the field) in
// *error when error is not NULL.
std::optional<AttentionCall> attention_call_from_json(const std::string& text, std::string* error);

struct AttentionSpecHash {
    size_t operator()(const AttentionSpec& spec) const noexcept;
};

}  // namespace rope_jit
