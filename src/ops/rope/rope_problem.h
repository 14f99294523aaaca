// A RoPE call after its arguments are checked: every tensor validated and classified, the
// dimensions named, the position and angle sources decided. Both backends execute a
// RopeProblem, so the checks live in one place (make_rope_problem) and backends trust it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "rope_jit/rope_jit.h"
#include "common/tensor_ref.h"
#include "host_device.h"

namespace rope_jit {

// Where a token's table row comes from (the rules of rope_jit_rope_args, in order).
enum class PositionMode {
    Indices,        // positions[...] given
    SeqlenOffsets,  // s + seqlen_offsets[b]
    Implicit,       // s + position_offset (+ q_position_offset for q)
};

enum class AngleSource { Table, InvFreq };

struct RopeProblem {
    // Packed inputs ([T, H, D]) are seen as one batch row of T tokens: batch = 1, seqlen = T,
    // and the sequences inside it come from cu_seqlens (num_sequences of them).
    bool packed = false;
    int64_t batch = 0;
    int64_t seqlen_q = 0, seqlen_k = 0;
    int64_t heads_q = 0, heads_k = 0;
    int64_t head_dim = 0;
    int64_t num_sequences = 0;  // batch, or cu_seqlens' B when packed

    int64_t rotary_dim = 0, rotary_offset = 0;
    rope_jit_style style = ROPE_JIT_STYLE_HALF;
    bool backward = false;
    DType dtype = DType::F32;

    // 4-D views [B, H, S, D] (packed tensors are lifted to [1, H, T, D]). The outputs are
    // always set: equal to the inputs when in place.
    TensorRef q, q_out, k, k_out;
    bool has_k = false;
    bool q_in_place = true, k_in_place = true;

    AngleSource angles = AngleSource::Table;
    TensorRef cos, sin, inv_freq;
    bool table_full = false;  // [P, R] rather than [P, R/2]
    int64_t table_rows = 0;   // P
    TensorRef xpos_scale;
    bool has_xpos = false;

    PositionMode position_mode = PositionMode::Implicit;
    TensorRef positions;       // [S], [B, S] or [T]
    TensorRef seqlen_offsets;  // [num_sequences]
    TensorRef cu_seqlens;      // [num_sequences + 1], packed only
    int64_t position_offset = 0, q_position_offset = 0;

    // Multi-section positions (M-RoPE): positions has a leading axis of num_position_axes,
    // and pair i reads axis pair_axis[i]. Empty pair_axis: one position per token.
    int64_t num_position_axes = 0;
    std::vector<int32_t> pair_axis;  // [R/2] when M-RoPE

    // Learned frequencies (backward with inv_freq only): d(loss)/d(inv_freq) into
    // inv_freq_grad [R/2] float32, from the forward outputs q_saved/k_saved (lifted to 4-D
    // like q and k).
    bool has_freq_grad = false;
    TensorRef inv_freq_grad, q_saved, k_saved;

    // QK-norm (RMSNorm of every head before the rotation; see qk_norm.h): weights [D], and in
    // the backward the forward's pre-norm inputs (lifted to 4-D like q and k) and the optional
    // weight gradients [D] float32.
    bool has_norm = false, norm_unit_offset = false, has_norm_weight_grad = false;
    double norm_eps = 1e-6;
    TensorRef q_norm_weight, k_norm_weight, q_norm_input, k_norm_input;
    TensorRef q_norm_weight_grad, k_norm_weight_grad;

    // KV cache write (forward only; see rope_jit_rope_args.kv_layout): k's rotated rows go
    // to k_cache (then k_out above is that cache's view and k_in_place false), v's rows to
    // v_cache. The caches are seen as [blocks, Hk, slots, D] views (contiguous: [B, Hk, S_max,
    // D], a sequence's rows as one block), so a token's row is at (block, h, slot, :) as q's
    // is at (b, h, s, :). kv_block_tables: paged with block_tables, else with slot_mapping
    // (paged) or positions (contiguous). kv_seqlen_offsets: the cache position of a token is
    // s + seqlen_offsets[sequence] even where positions give the table row.
    rope_jit_kv_cache_layout kv_layout = ROPE_JIT_KV_CACHE_NONE;
    bool has_kv_cache = false, has_v = false, kv_block_tables = false, kv_seqlen_offsets = false;
    TensorRef v;        // [B, Hk, Sk, Dv] (packed lifted like k)
    TensorRef v_cache;  // [blocks, Hk, slots, Dv]
    int64_t v_head_dim = 0;
    TensorRef slot_mapping, block_tables;

    // FP8 outputs: the caches (kv_fp8) and q_out (q_fp8) store float8 e4m3fn of value / scale;
    // the scales are float32 tensors of one element, absent for 1.
    bool kv_fp8 = false, q_fp8 = false;
    TensorRef k_scale, v_scale, q_scale;

    DLDevice device{kDLCPU, 0};  // where every tensor lives

    int64_t pairs() const { return rotary_dim / 2; }
    bool proportional() const { return style == ROPE_JIT_STYLE_PROPORTIONAL; }
    // The head feature of rotated element e in [0, R): the pairs' first features are elements
    // [0, R/2) and their partners [R/2, R) (half and proportional styles), or pair i is
    // elements (2i, 2i+1) (interleaved). Offset o + e except for proportional pairs, whose
    // partners sit head_dim/2 after them.
    int64_t rotated_feature(int64_t e) const {
        if (!proportional()) return rotary_offset + e;
        return e < pairs() ? e : head_dim / 2 + (e - pairs());
    }
    // Column of pair i in the cos/sin/xpos tables: host_device.h's rule, which is linear in the
    // pair, so its step serves 64-bit indices. Proportional tables are laid out as half ones.
    int64_t table_column(int64_t i) const {
        return i * ::table_column(table_full, style == ROPE_JIT_STYLE_INTERLEAVED, 1);
    }
    // No element to rotate (q with no tokens or no heads, and no k with tokens): a no-op,
    // however large the other dimensions (a [2^31, 0, S, D] q must not loop 2^31 times).
    bool empty() const {
        return batch == 0 || head_dim == 0 ||
               ((seqlen_q == 0 || heads_q == 0) && (!has_k || seqlen_k == 0));
    }
    // The tokens a sequence holds for the rotation: the longer of q's and k's, counting only
    // a tensor with heads (a [1, 0, 2^40, D] q beside a k of 4 tokens walked 2^40 tokens
    // of nothing: adversarial pass, session 38). The CPU loop and the kernels' grid cover
    // batch times this.
    int64_t rotated_seqlen() const {
        const int64_t q_tokens = heads_q > 0 ? seqlen_q : 0;
        const int64_t k_tokens = has_k && heads_k > 0 ? seqlen_k : 0;
        return std::max(q_tokens, k_tokens);
    }
    bool multi_section() const { return !pair_axis.empty(); }
    // The positions of one axis as a plain [S], [B, S] or [T] view (M-RoPE); `positions`
    // itself otherwise.
    TensorRef position_axis(int64_t axis) const;
    int64_t cache_blocks() const { return k_out.shape[0]; }  // with a cache: its blocks (B)
    int64_t cache_slots() const { return k_out.shape[2]; }   // rows a block (S_max)
};

// Checks every argument (shapes, dtypes, devices, overlaps, implicit position ranges) and
// builds the problem. Throws Error(INVALID_ARGUMENT) with a message naming the argument.
RopeProblem make_rope_problem(const rope_jit_rope_args& args);

// Reads the index tensors (which must be in host memory) and checks them: cu_seqlens
// well-formed, every position inside the table, every KV cache slot inside the cache.
// Throws Error(INVALID_ARGUMENT).
void check_positions_on_host(const RopeProblem& problem);

// Whether a tensor's memory can be read by the CPU.
bool host_accessible(const DLDevice& device);

// Where token (b, s) of k goes in the KV cache (b, s as in the lifted [B, H, S, D] views;
// `sequence` and `index` its sequence and place in it, from cu_seqlens when packed): its block
// and slot in the [blocks, Hk, slots, D] cache views. False when the token is skipped (a
// negative slot_mapping entry). Reads host memory; throws INVALID_ARGUMENT for an index out of
// range, naming it.
struct CacheSlot {
    int64_t block, slot;
};
bool cache_slot_on_host(const RopeProblem& problem, int64_t b, int64_t s, int64_t sequence,
                        int64_t index, CacheSlot* out);

}  // namespace rope_jit
