// A kernel spec: everything fixed for one compiled kernel (direction, dtypes, head_dim,
// rotary range, pair style, GQA group, position and angle sources, vector width...). Sizes
// and strides stay run-time arguments. One table, ROPE_JIT_ROPE_SPEC_FIELDS, lists the fields
// once; from it come the struct's members, the constexpr preamble that specializes
// kernels_templates/rope.cu, the JSON (stored in cache entries, part of the disk-cache key,
// printed by `rope-jit-cache list --json` and read back by manifests and
// rope_jit_prewarm_json) and the range checks; describe() is a short label, not the
// identity. All fields are int32 so two specs compare and hash as plain bytes on the launch
// path (the in-memory key).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "ops/rope/rope_problem.h"

namespace rope_jit {

// Threads of the widest RoPE block: three such blocks fill 75% of a multiprocessor's threads.
constexpr int32_t kRopeMaxBlockThreads = 512;

// The fields of a RoPE kernel spec, in member order. Columns:
//   member, default (also a manifest's, as rope_jit_kernel_spec_init's), JSON key (nullptr:
//   set through the composite key "angles", see kernel_spec.cpp), values (Integer, Boolean,
//   or a vocabulary of names whose index is stored), minimum, maximum, the template's
//   constexpr name (nullptr: none), and whether a JSON object may leave the field out: PLAIN
//   (the default), DERIVED (computed from the others in from_json) or REQUIRED.
// A new field is one line here (and its use in rope.cu). The disk-cache key hashes the JSON,
// not the member order; the in-memory key hashes the members as bytes.
#define ROPE_JIT_ROPE_SPEC_FIELDS(X)                                                               \
    X(op, 0, nullptr, Integer, 0, 0, nullptr, PLAIN)                                               \
    X(dtype, 0, "dtype", FloatTypes, 0, 2, "DTYPE", PLAIN)                                         \
    X(table_dtype, 0, "table_dtype", FloatTypes, 0, 2, "TABLE_DTYPE", PLAIN)                       \
    X(xpos_dtype, 0, "xpos_dtype", FloatTypes, 0, 2, "XPOS_DTYPE", DERIVED)                        \
    X(inv_freq_dtype, 0, "inv_freq_dtype", FloatTypes, 0, 2, "INV_FREQ_DTYPE", PLAIN)              \
    X(backward, 0, "direction", Directions, 0, 1, "BACKWARD_PASS", PLAIN)                          \
    X(head_dim, 0, "head_dim", Integer, 2, 1 << 20, "HEAD_DIM", REQUIRED)                          \
    X(rotary_dim, 0, "rotary_dim", Integer, 2, 1 << 20, "ROTARY_DIM", DERIVED)                     \
    X(rotary_offset, 0, "rotary_offset", Integer, 0, 1 << 20, "ROTARY_OFFSET", PLAIN)              \
    /* interleaved and proportional: set through the composite key "style" */                      \
    X(interleaved, 0, nullptr, Boolean, 0, 1, "INTERLEAVED", PLAIN)                                \
    X(has_k, 1, "has_k", Boolean, 0, 1, "HAS_K", PLAIN)                                            \
    X(gqa_group, 1, "gqa_group", Integer, 0, 1 << 20, "GQA_GROUP", PLAIN)                          \
    X(position_mode, 0, "positions", PositionModes, 0, 2, "POSITION_MODE", PLAIN)                  \
    X(packed, 0, "packed", Boolean, 0, 1, "PACKED", PLAIN)                                         \
    X(positions_int64, 0, "positions_int64", Boolean, 0, 1, "POSITIONS_INT64", DERIVED)            \
    X(seqlen_offsets_int64, 0, "seqlen_offsets_int64", Boolean, 0, 1, "SEQLEN_OFFSETS_INT64",      \
      DERIVED)                                                                                     \
    X(cu_seqlens_int64, 0, "cu_seqlens_int64", Boolean, 0, 1, "CU_SEQLENS_INT64", DERIVED)         \
    X(angles_from_inv_freq, 0, nullptr, Boolean, 0, 1, "ANGLES_FROM_INV_FREQ", PLAIN)              \
    X(table_full, 1, nullptr, Boolean, 0, 1, "TABLE_FULL", PLAIN)                                  \
    X(has_xpos, 0, "xpos", Boolean, 0, 1, "HAS_XPOS", PLAIN)                                       \
    X(k_own_angles, 0, "k_own_angles", Boolean, 0, 1, "K_OWN_ANGLES", DERIVED)                     \
    X(in_place_q, 1, "in_place_q", Boolean, 0, 1, "IN_PLACE_Q", PLAIN)                             \
    X(in_place_k, 1, "in_place_k", Boolean, 0, 1, "IN_PLACE_K", DERIVED)                           \
    X(vec, 1, "vec", Integer, 1, 8, "VEC", DERIVED)                                                \
    X(vec_loads, 0, "vec_loads", Boolean, 0, 1, "VEC_LOADS", DERIVED)                              \
    /* Elements per access of the out-of-place copy of unrotated features: a vector (unit */       \
    /* stride, aligned) when > 1. 1 when nothing is copied. */                                     \
    X(copy_vec, 1, "copy_vec", Integer, 1, 8, "COPY_VEC", DERIVED)                                 \
    /* cos/sin item spans read as aligned vectors */                                               \
    X(table_vec_loads, 0, "table_vec_loads", Boolean, 0, 1, "TABLE_VEC_LOADS", DERIVED)            \
    /* position axes of multi-section (M-RoPE) positions; 0 = one */                               \
    X(mrope_axes, 0, "mrope_axes", Integer, 0, ROPE_JIT_MAX_MROPE_SECTIONS, "MROPE_AXES", PLAIN)   \
    /* also accumulate d(loss)/d(inv_freq) */                                                      \
    X(freq_grad, 0, "freq_grad", Boolean, 0, 1, "FREQ_GRAD", PLAIN)                                \
    /* The most threads a block may have (the kernel's launch bound); the launcher sizes each */   \
    /* block to its tokens' work items (src/ops/rope/rope_cuda.cpp). */                            \
    X(block_threads, kRopeMaxBlockThreads, "block_threads", Integer, 32, 1024, "BLOCK_THREADS",    \
      DERIVED)                                                                                     \
    /* Half-style pairs (i, i + HEAD_DIM/2) (Gemma-4 proportional partial rotary). Fields */       \
    /* added from here on are enumerators in the preamble (older specs keep their PTX). */         \
    X(proportional, 0, nullptr, BooleanEnumerator, 0, 1, "PROPORTIONAL", PLAIN)                    \
    /* QK-norm: RMSNorm of every head before the rotation (kernels_templates/rope_norm.cu; */      \
    /* rope.cu for RopePlan::norm_items), with weights w or 1 + w (unit offset) of */              \
    /* norm_weight_dtype; backward: also dL/dw */                                                  \
    X(qk_norm, 0, "qk_norm", BooleanEnumerator, 0, 1, "QK_NORM", PLAIN)                            \
    X(norm_unit_offset, 0, "norm_unit_offset", BooleanEnumerator, 0, 1, "NORM_UNIT_OFFSET", PLAIN) \
    X(norm_weight_dtype, 0, "norm_weight_dtype", FloatTypesEnumerator, 0, 2, "NORM_WEIGHT_DTYPE",  \
      PLAIN)                                                                                       \
    X(norm_weight_grad, 0, "norm_weight_grad", BooleanEnumerator, 0, 1, "NORM_WEIGHT_GRAD", PLAIN) \
    /* KV cache write (inference): k's rotated rows into a cache at slots found by */              \
    /* kv_cache = 1 contiguous rows (positions), 2 slot_mapping, 3 block_tables + positions; */    \
    /* NHD and HND differ in strides only. kv_index_int64: slot_mapping/block_tables int64; */     \
    /* kv_seqlen_offsets: cache positions from seqlen_offsets (also beside positions). */          \
    X(kv_cache, 0, "kv_cache", KvCacheKinds, 0, 3, "KV_CACHE", PLAIN)                              \
    X(kv_index_int64, 0, "kv_index_int64", BooleanEnumerator, 0, 1, "KV_INDEX_INT64", DERIVED)     \
    X(kv_seqlen_offsets, 0, "kv_seqlen_offsets", BooleanEnumerator, 0, 1, "KV_SEQLEN_OFFSETS",     \
      DERIVED)                                                                                     \
    /* the caches hold float8 e4m3fn (else q's dtype) */                                           \
    X(kv_fp8, 0, "kv_fp8", BooleanEnumerator, 0, 1, "KV_FP8", PLAIN)                               \
    /* v's head_dim (v copied into v_cache by the same launch); 0 = no v */                        \
    X(v_dim, 0, "v_head_dim", IntegerEnumerator, 0, 1 << 20, "V_DIM", PLAIN)                       \
    /* elements per access of v's copy: a vector (unit stride, aligned) when > 1 */                \
    X(v_vec, 1, "v_vec", IntegerEnumerator, 1, 8, "V_VEC", DERIVED)                                \
    /* q_out holds float8 e4m3fn */                                                                \
    X(q_fp8, 0, "q_fp8", BooleanEnumerator, 0, 1, "Q_FP8", PLAIN)                                  \
    /* QK-norm weights read as aligned vectors (both contiguous and 16-byte aligned) */            \
    X(norm_weight_vec_loads, 0, "norm_weight_vec_loads", BooleanEnumerator, 0, 1,                  \
      "NORM_WEIGHT_VEC_LOADS", DERIVED)                                                            \
    /* q and k (and their outputs) each one dense run of rows of a call the flat path takes */  \
    /* (flat_rows_call in rope_dense_rows.h): [B, H, S, D] memory, or 16-bit [B, S, H, D] */      \
    /* rotated whole over more than one token; not packed. The flat path (RopePlan::flat_rows) */ \
    /* walks them. Kept only where the plan has that path (else 0: one key for every layout); */ \
    /* left out of JSON, 0 (the kernel of decode and of other layouts) */                         \
    X(dense_rows, 0, "dense_rows", BooleanEnumerator, 0, 1, "DENSE_ROWS", DERIVED)

struct KernelSpec {
#define ROPE_JIT_SPEC_MEMBER(member, init, ...) int32_t member = init;
    ROPE_JIT_ROPE_SPEC_FIELDS(ROPE_JIT_SPEC_MEMBER)
#undef ROPE_JIT_SPEC_MEMBER

    bool operator==(const KernelSpec& other) const {
        return std::memcmp(this, &other, sizeof *this) == 0;
    }
    bool operator!=(const KernelSpec& other) const {
        return !(*this == other);
    }

    // The constexpr block prepended to the template.
    std::string preamble() const;
    // Canonical JSON (every field, sorted keys, names for enumerations: "direction":
    // "backward", "angles": "table-full", "dtype": "bfloat16"): part of the disk-cache key
    // and stored in each entry.
    std::string to_json() const;
    // The spec of a JSON object in to_json's vocabulary (what cache entries store, what
    // `rope-jit-cache list --json` prints and what manifests and rope_jit_prewarm_json take):
    // "op" may be left out or "rope"; fields marked DERIVED or PLAIN may be left out (DERIVED
    // ones then take what a call with contiguous, 16-byte-aligned tensors gets; dense_rows 0);
    // unknown keys, wrong types and values out of range are errors. from_json(s.to_json()) == s. nullopt on
    // any error, with the reason (naming the field) in *error when error is not NULL.
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
