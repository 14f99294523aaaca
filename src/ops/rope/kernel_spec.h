// A kernel spec: everything fixed for one compiled kernel (direction, dtypes, head_dim,
// rotary range, pair style, GQA group, position and angle sources, vector width...). Sizes
// and strides stay run-time arguments. The spec renders to the constexpr preamble that
// specializes kernels_templates/rope.cu, to a JSON description stored in cache entries, and
// (hashed) to the in-memory cache key. All fields are int32 so two specs compare and hash
// as plain bytes on the launch path.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "ops/rope/rope_problem.h"

namespace rope_jit {

// Threads of the widest RoPE block: three such blocks fill 75% of a multiprocessor's threads.
constexpr int32_t kRopeMaxBlockThreads = 512;

struct KernelSpec {
    int32_t op = 0;  // 0 = rope
    int32_t dtype = 0, table_dtype = 0, xpos_dtype = 0, inv_freq_dtype = 0;  // 0 f32, 1 f16, 2 bf16
    int32_t backward = 0;
    int32_t head_dim = 0, rotary_dim = 0, rotary_offset = 0;
    int32_t interleaved = 0;
    int32_t has_k = 0, gqa_group = 1;
    int32_t position_mode = 0;  // PositionMode: 0 implicit, 1 per-token, 2 seqlen offsets
    int32_t packed = 0;
    int32_t positions_int64 = 0, seqlen_offsets_int64 = 0, cu_seqlens_int64 = 0;
    int32_t angles_from_inv_freq = 0, table_full = 0;
    int32_t has_xpos = 0, k_own_angles = 0;
    int32_t in_place_q = 1, in_place_k = 1;
    int32_t vec = 1, vec_loads = 0;
    // Elements per access of the out-of-place copy of unrotated features: a vector (unit
    // stride, aligned) when > 1. 1 when nothing is copied.
    int32_t copy_vec = 1;
    int32_t table_vec_loads = 0;  // cos/sin item spans read as aligned vectors
    int32_t mrope_axes = 0;       // position axes of multi-section (M-RoPE) positions; 0 = one
    int32_t freq_grad = 0;        // also accumulate d(loss)/d(inv_freq)
    // The most threads a block may have (the kernel's launch bound); the launcher sizes each
    // block to its tokens' work items (src/ops/rope/cuda_backend.cpp).
    int32_t block_threads = kRopeMaxBlockThreads;

    bool operator==(const KernelSpec& other) const { return std::memcmp(this, &other, sizeof *this) == 0; }
    bool operator!=(const KernelSpec& other) const { return !(*this == other); }

    // The constexpr block prepended to the template.
    std::string preamble() const;
    // Canonical JSON (fixed key order): part of the disk-cache key and stored in each entry.
    std::string to_json() const;
    // Parses to_json's output (and the manifest form of rope-jit-cache); nullopt on any error.
    static std::optional<KernelSpec> from_json(const std::string& text, std::string* error);
    // A short human-readable name: "rope bf16 fwd D128 R128@0 half gqa4 implicit table/full v8".
    std::string describe() const;
    // Throws Error(INVALID_ARGUMENT) when the fields cannot describe a kernel (odd dims...).
    void validate() const;
};

struct KernelSpecHash {
    size_t operator()(const KernelSpec& spec) const noexcept;
};

// The spec of the kernel that executes `problem`. The vector width is the widest 16-byte-
// or-less access that every tensor's alignment and strides allow.
KernelSpec make_kernel_spec(const RopeProblem& problem);

// The spec a call with these public parameters and contiguous, 16-byte-aligned tensors uses
// (what prewarming compiles). Throws Error(INVALID_ARGUMENT) naming a bad field.
KernelSpec kernel_spec_from_public(const rope_jit_kernel_spec& spec);

}  // namespace rope_jit
