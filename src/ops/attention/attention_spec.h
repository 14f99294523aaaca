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

enum class AttentionKernelKind : int32_t { Forward = 0, BackwardDq = 1, BackwardDkDv = 2 };

struct AttentionSpec {
    int32_t kind = 0;                                  // AttentionKernelKind
    int32_t dtype = 0, table_dtype = 0, mask_dtype = 0;  // 0 f32, 1 f16, 2 bf16
    int32_t head_dim = 0;
    int32_t rotary_dim = 0;  // 0: no rotation
    int32_t interleaved = 0, table_full = 0;
    int32_t pos_mask = 0;
    int32_t mask_kind = 0;  // 0 none, 1 bool, 2 additive
    int32_t causal = 0;
    int32_t gqa_group = 1;
    int32_t write_lse = 0;
    int32_t tensor_cores = 0;  // mma.sync kernels; else one warp per row
    int32_t wgmma = 0;         // the forward on warpgroup matrix products (sm_90a), with tensor_cores
    int32_t stages = 2;        // wgmma: key/value tiles held in shared memory (2 or 3)
    int32_t producer_warps = 0;  // wgmma: 4 warps that only load and rotate tiles (beside `warps`), or 0
    int32_t cluster = 1;         // producer warps: blocks of a GQA group sharing their tiles (1, 2 or 4)
    int32_t table_async = 0;   // tables staged with cp.async
    int32_t warps = 4;         // warps per block that compute (16 query rows each on tensor cores)
    int32_t m_tiles = 1;       // 16-row tiles each warp owns (forward: 1 or 2)
    int32_t block_n = 0;       // rows of a streamed tile (tensor cores)
    int32_t compute_dk = 1, compute_dv = 1;

    bool operator==(const AttentionSpec& other) const { return std::memcmp(this, &other, sizeof *this) == 0; }
    bool operator!=(const AttentionSpec& other) const { return !(*this == other); }

    // The constexpr block prepended to attention.cu.
    std::string preamble() const;
    // Canonical JSON (fixed key order), with "op": "attention".
    std::string to_json() const;
    // The spec whose to_json() gave `text` (what a disk-cache entry stores); nullopt for any
    // other text, with the reason in *error when error is not NULL.
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

struct AttentionSpecHash {
    size_t operator()(const AttentionSpec& spec) const noexcept;
};

// The largest head_dim any attention kernel takes (the CUDA-core kernels: 16 features a lane).
constexpr int64_t kAttentionMaxHeadDim = 512;

}  // namespace rope_jit
