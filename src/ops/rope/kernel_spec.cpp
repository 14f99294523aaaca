#include "ops/rope/kernel_spec.h"

#include <stdexcept>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/byte_hash.h"
#include "common/error.h"
#include "common/raw_enum.h"
#include "common/spec_fields.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_plan.h"
#include "rope_norm_params.h"

namespace rope_jit {

namespace {

int32_t dtype_code(DType dtype) {
    switch (dtype) {
        case DType::F16: return 1;
        case DType::BF16: return 2;
        default: return 0;
    }
}

int32_t position_mode_code(PositionMode mode) {
    switch (mode) {
        case PositionMode::Indices: return 1;
        case PositionMode::SeqlenOffsets: return 2;
        case PositionMode::Implicit: return 0;
    }
    return 0;
}

const char* dtype_short(int32_t code) {
    const char* const names[] = {"f32", "f16", "bf16"};
    return code >= 0 && code < 3 ? names[code] : "?";
}

// Whether a view of `rank` dims allows vector accesses of n elements along its last dim: unit
// stride there, every other stride a multiple of n, and the base aligned to n elements.
bool vectors_fit(const TensorRef& t, int rank, int64_t n) {
    if (t.shape[rank - 1] > 1 && t.strides[rank - 1] != 1) return false;
    for (int d = 0; d < rank - 1; ++d)
        if (t.shape[d] > 1 && t.strides[d] % n != 0) return false;
    const uintptr_t alignment = uintptr_t(n) * dtype_size(t.dtype);
    return reinterpret_cast<uintptr_t>(t.data) % alignment == 0;
}

// A [B, H, S, D] view read n features at a time.
bool vector_friendly(const TensorRef& t, int64_t n) {
    return vectors_fit(t, 4, n);
}

// Whether aligned vectors of n features tile the rotated chunks: the first features of the
// pairs and, in the half and proportional styles, their partners (at R/2, or at D/2).
bool rotation_tiles(const KernelSpec& spec, int64_t n) {
    const int64_t pairs = spec.rotary_dim / 2;
    return spec.rotary_offset % n == 0 &&
           (spec.interleaved ? spec.rotary_dim % n == 0 : pairs % n == 0) &&
           (!spec.proportional || (spec.head_dim / 2) % n == 0);
}

// Whether aligned vectors of n features tile the unrotated features: [0, o) and [o + R, D),
// or, proportional, [R/2, D/2) and [D/2 + R/2, D).
bool copy_tiles(const KernelSpec& spec, int64_t n) {
    if (spec.proportional) return (spec.rotary_dim / 2) % n == 0 && (spec.head_dim / 2) % n == 0;
    return spec.rotary_offset % n == 0 &&
           (int64_t(spec.rotary_offset) + spec.rotary_dim) % n == 0 && spec.head_dim % n == 0;
}

// Sets spec.vec/vec_loads to the widest vector (at most 16 bytes) that the pair layout and
// the tensors (tensors_allow(n)) permit; scalar accesses otherwise.
template <typename TensorsAllow>
void choose_vector_width(KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    spec.vec_loads = 0;
    spec.vec = spec.interleaved ? 2 : 1;
    for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2) {
        if (rotation_tiles(spec, n) && tensors_allow(n)) {
            spec.vec = int32_t(n);
            spec.vec_loads = 1;
            return;
        }
    }
}

// The copy's vector width (see KernelSpec::copy_vec): the widest n (16 bytes at most) that
// tiles both unrotated ranges (copy_tiles) and that the tensors allow (tensors_allow(n)); 1
// when the call copies nothing.
template <typename TensorsAllow>
int32_t choose_copy_width(const KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    const bool copies = spec.rotary_dim < spec.head_dim && (!spec.in_place_q || !spec.in_place_k);
    if (!copies) return 1;
    for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2)
        if (copy_tiles(spec, n) && tensors_allow(n)) return int32_t(n);
    return 1;
}

// v's copy width (KernelSpec::v_vec): the widest n (16 bytes at most) dividing v's head_dim
// that the tensors allow; 1 without v.
template <typename TensorsAllow>
int32_t choose_v_width(const KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    if (spec.v_dim == 0) return 1;
    for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2)
        if (spec.v_dim % n == 0 && tensors_allow(n)) return int32_t(n);
    return 1;
}

// A QK-norm spec's block size: rope.cu's for the forwards it takes (RopePlan::norm_items), else
// rope_norm.cu's kRopeNormMaxWarps warps.
int32_t norm_block_threads(const KernelSpec& spec) {
    return rope_plan(spec).norm_items ? kRopeMaxBlockThreads : 32 * kRopeNormMaxWarps;
}

// The QK-norm kernels take rope.cu's access widths of the rotation (vec, vec_loads), the tables
// (table_vec_loads) and v (v_vec) as they are. rope_norm.cu rewrites every feature, the
// unrotated ones too (the norm scales them), so its copy width tiles them even in place; its
// blocks are at most kRopeNormMaxWarps warps. The forwards rope.cu takes (RopePlan::norm_items)
// have its blocks.
template <typename TensorsAllow>
void set_norm_access(KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    if (!spec.qk_norm) return;
    spec.copy_vec = 1;
    if (spec.rotary_dim < spec.head_dim) {
        for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2) {
            if (copy_tiles(spec, n) && tensors_allow(n)) {
                spec.copy_vec = int32_t(n);
                break;
            }
        }
    }
    spec.block_threads = norm_block_threads(spec);
}

// Table columns one work item reads (see TABLE_SPAN in rope.cu).
int64_t table_span(const KernelSpec& spec) {
    return rope_plan(spec).table_span;
}

// Whether a [P, C] table allows reading spans of n columns as one aligned vector.
bool table_friendly(const TensorRef& t, int64_t n) {
    return vectors_fit(t, 2, n);
}

// Whether QK-norm weights [D] allow 16-byte vectors (the kernel reads vectors only where runs
// tile the row). A decode row's chain then has no run-time choice between the vector and the
// scalar path to wait on (H200, B=64 32/8 heads D128: QK-norm decode 2.87 -> 2.62 us in a graph).
bool weights_friendly(const TensorRef& w) {
    return vectors_fit(w, 1, 16 / int64_t(dtype_size(w.dtype)));
}

// dense_rows only where the kernel uses it (its plan has the flat path): every other spec keeps
// the one key that calls on any layout share, and prewarms of it keep matching them.
void drop_unused_dense_rows(KernelSpec& spec) {
    if (spec.dense_rows && !rope_plan(spec).flat_rows) spec.dense_rows = 0;
}

}  // namespace

KernelSpec make_kernel_spec(const RopeProblem& p) {
    KernelSpec spec;
    spec.op = 0;
    spec.dtype = dtype_code(p.dtype);
    spec.backward = p.backward;
    spec.head_dim = int32_t(p.head_dim);
    spec.rotary_dim = int32_t(p.rotary_dim);
    spec.rotary_offset = int32_t(p.rotary_offset);
    spec.interleaved = p.style == ROPE_JIT_STYLE_INTERLEAVED;
    spec.proportional = p.style == ROPE_JIT_STYLE_PROPORTIONAL;
    spec.has_k = p.has_k;
    spec.gqa_group = p.has_k ? int32_t(p.heads_q / p.heads_k) : 1;
    spec.position_mode = position_mode_code(p.position_mode);
    spec.packed = p.cu_seqlens.present();
    spec.positions_int64 = p.positions.present() && p.positions.dtype == DType::I64;
    spec.seqlen_offsets_int64 = p.seqlen_offsets.present() && p.seqlen_offsets.dtype == DType::I64;
    spec.cu_seqlens_int64 = p.cu_seqlens.present() && p.cu_seqlens.dtype == DType::I64;
    spec.angles_from_inv_freq = p.angles == AngleSource::InvFreq;
    spec.table_dtype = spec.angles_from_inv_freq ? 0 : dtype_code(p.cos.dtype);
    spec.inv_freq_dtype = spec.angles_from_inv_freq ? dtype_code(p.inv_freq.dtype) : 0;
    spec.table_full = p.table_full;
    spec.has_xpos = p.has_xpos;
    spec.xpos_dtype = p.has_xpos ? dtype_code(p.xpos_scale.dtype) : 0;
    // k reads its own cos/sin only when they differ from q's: xPos divides where q multiplies,
    // and q_position_offset moves q's implicit rows.
    spec.k_own_angles =
        p.has_k &&
        (p.has_xpos || (p.position_mode == PositionMode::Implicit && p.q_position_offset != 0));
    spec.in_place_q = p.q_in_place;
    spec.in_place_k = !p.has_k || p.k_in_place;

    spec.mrope_axes = p.multi_section() ? int32_t(p.num_position_axes) : 0;
    spec.freq_grad = p.has_freq_grad;
    if (p.has_kv_cache) {
        spec.kv_cache = p.kv_layout == ROPE_JIT_KV_CACHE_CONTIGUOUS ? 1 : p.kv_block_tables ? 3 : 2;
        const TensorRef& index = p.kv_block_tables ? p.block_tables : p.slot_mapping;
        spec.kv_index_int64 = index.present() && index.dtype == DType::I64;
        spec.kv_seqlen_offsets = p.kv_seqlen_offsets;
        spec.kv_fp8 = p.kv_fp8;
        spec.v_dim = p.has_v ? int32_t(p.v_head_dim) : 0;
        spec.v_vec = choose_v_width(spec, dtype_size(p.dtype), [&](int64_t n) {
            return vector_friendly(p.v, n) && vector_friendly(p.v_cache, n);
        });
    }
    spec.q_fp8 = p.q_fp8;
    const auto tensors_allow = [&](int64_t n) {
        bool ok = vector_friendly(p.q, n) && vector_friendly(p.q_out, n);
        if (p.has_k) ok = ok && vector_friendly(p.k, n) && vector_friendly(p.k_out, n);
        if (p.has_freq_grad) {
            ok = ok && vector_friendly(p.q_saved, n);
            if (p.has_k) ok = ok && vector_friendly(p.k_saved, n);
        }
        if (p.has_norm && p.backward) {  // the QK-norm backward reads the forward's inputs
            ok = ok && vector_friendly(p.q_norm_input, n);
            if (p.has_k) ok = ok && vector_friendly(p.k_norm_input, n);
        }
        return ok;
    };
    choose_vector_width(spec, dtype_size(p.dtype), tensors_allow);
    spec.copy_vec = choose_copy_width(spec, dtype_size(p.dtype), tensors_allow);
    if (p.angles == AngleSource::Table) {
        const int64_t span = table_span(spec);
        spec.table_vec_loads = table_friendly(p.cos, span) && table_friendly(p.sin, span);
    }
    spec.block_threads = kRopeMaxBlockThreads;
    spec.qk_norm = p.has_norm;
    if (p.has_norm) {
        spec.norm_unit_offset = p.norm_unit_offset;
        spec.norm_weight_dtype = dtype_code(p.q_norm_weight.dtype);
        spec.norm_weight_grad = p.has_norm_weight_grad;
        spec.norm_weight_vec_loads =
            weights_friendly(p.q_norm_weight) && (!p.has_k || weights_friendly(p.k_norm_weight));
    }
    set_norm_access(spec, dtype_size(p.dtype), tensors_allow);
    spec.dense_rows = flat_rows_call(p);
    drop_unused_dense_rows(spec);
    return spec;
}

KernelSpec kernel_spec_from_public(const rope_jit_kernel_spec& in) {
    KernelSpec spec;
    auto float_code = [](const DLDataType& type, const char* name) -> int32_t {
        if (type.lanes == 1 && type.code == kDLFloat && type.bits == 32) return 0;
        if (type.lanes == 1 && type.code == kDLFloat && type.bits == 16) return 1;
        if (type.lanes == 1 && type.code == kDLBfloat && type.bits == 16) return 2;
        fail_argument(fmt::format("{}: must be float32, float16 or bfloat16", name));
    };
    spec.dtype = float_code(in.dtype, "dtype");
    if (in.head_dim <= 0 || in.head_dim % 2 != 0)
        fail_argument(fmt::format("head_dim: must be even and positive, got {}", in.head_dim));
    spec.head_dim = in.head_dim;
    spec.rotary_dim = in.rotary_dim == 0 ? in.head_dim : in.rotary_dim;
    spec.rotary_offset = in.rotary_offset;
    const int style = raw_enum(in.style);
    if (style != ROPE_JIT_STYLE_HALF && style != ROPE_JIT_STYLE_INTERLEAVED &&
        style != ROPE_JIT_STYLE_PROPORTIONAL)
        fail_argument(fmt::format("style: unknown value {}", style));
    spec.interleaved = style == ROPE_JIT_STYLE_INTERLEAVED;
    spec.proportional = style == ROPE_JIT_STYLE_PROPORTIONAL;
    if (spec.proportional && in.rotary_offset != 0)
        fail_argument(fmt::format(
            "rotary_offset: must be 0 with ROPE_JIT_STYLE_PROPORTIONAL, got {}", in.rotary_offset));
    spec.backward = in.backward != 0;
    spec.has_k = in.has_k != 0;
    spec.gqa_group = spec.has_k ? in.gqa_group : 1;
    const int positions = raw_enum(in.positions);
    if (positions < ROPE_JIT_POSITIONS_IMPLICIT || positions > ROPE_JIT_POSITIONS_SEQLEN_OFFSETS)
        fail_argument(fmt::format("positions: unknown value {}", positions));
    spec.position_mode = positions;
    if (in.index_dtype.code != kDLInt || (in.index_dtype.bits != 32 && in.index_dtype.bits != 64) ||
        in.index_dtype.lanes != 1)
        fail_argument("index_dtype: must be int32 or int64");
    const int32_t index64 = in.index_dtype.bits == 64;
    spec.packed = in.packed != 0;
    spec.positions_int64 = spec.position_mode == 1 && index64;
    spec.seqlen_offsets_int64 = spec.position_mode == 2 && index64;
    spec.cu_seqlens_int64 = spec.packed && index64;
    const int angles = raw_enum(in.angles);
    if (angles < ROPE_JIT_ANGLES_TABLE_HALF || angles > ROPE_JIT_ANGLES_INV_FREQ)
        fail_argument(fmt::format("angles: unknown value {}", angles));
    spec.angles_from_inv_freq = angles == ROPE_JIT_ANGLES_INV_FREQ;
    spec.table_full = angles == ROPE_JIT_ANGLES_TABLE_FULL;
    const int32_t table_code = float_code(in.table_dtype, "table_dtype");
    spec.table_dtype = spec.angles_from_inv_freq ? 0 : table_code;
    spec.inv_freq_dtype = spec.angles_from_inv_freq ? table_code : 0;
    spec.has_xpos = in.xpos != 0;
    spec.xpos_dtype = spec.has_xpos ? table_code : 0;
    spec.k_own_angles = spec.has_k && spec.has_xpos;
    spec.in_place_q = in.in_place != 0;
    spec.in_place_k = !spec.has_k || in.in_place != 0;
    // Contiguous, aligned tensors: the layout alone limits the vector width.
    choose_vector_width(spec, spec.dtype == 0 ? 4 : 2, [](int64_t) { return true; });
    spec.copy_vec = choose_copy_width(spec, spec.dtype == 0 ? 4 : 2, [](int64_t) { return true; });
    spec.table_vec_loads = !spec.angles_from_inv_freq;
    spec.block_threads = kRopeMaxBlockThreads;
    spec.qk_norm = in.qk_norm != 0;
    if (spec.qk_norm) {
        spec.norm_unit_offset = in.norm_unit_offset != 0;
        spec.norm_weight_dtype = float_code(in.norm_weight_dtype, "norm_weight_dtype");
        spec.norm_weight_grad = spec.backward && in.norm_weight_grad != 0;
        spec.norm_weight_vec_loads = 1;  // contiguous, aligned weights
    }
    const int kv_layout = raw_enum(in.kv_layout);
    if (kv_layout < ROPE_JIT_KV_CACHE_NONE || kv_layout > ROPE_JIT_KV_CACHE_PAGED_HND)
        fail_argument(fmt::format("kv_layout: unknown value {}", kv_layout));
    if (kv_layout != ROPE_JIT_KV_CACHE_NONE) {
        spec.kv_cache = kv_layout == ROPE_JIT_KV_CACHE_CONTIGUOUS ? 1
                        : in.kv_block_tables != 0                 ? 3
                                                                  : 2;
        spec.kv_index_int64 = spec.kv_cache >= 2 && index64;  // slot_mapping or block_tables
        spec.kv_seqlen_offsets = spec.kv_cache != 2 && spec.position_mode == 2;
        spec.kv_fp8 = in.kv_fp8 != 0;
        spec.v_dim = in.v_head_dim;
        spec.in_place_k = 0;  // k goes to the cache
        spec.copy_vec =
            choose_copy_width(spec, spec.dtype == 0 ? 4 : 2, [](int64_t) { return true; });
        spec.v_vec = choose_v_width(spec, spec.dtype == 0 ? 4 : 2, [](int64_t) { return true; });
    }
    spec.q_fp8 = in.q_fp8 != 0;
    spec.dense_rows = in.dense_rows != 0;
    // Last: the norm kernel's access fields override the others.
    set_norm_access(spec, spec.dtype == 0 ? 4 : 2, [](int64_t) { return true; });
    spec.validate();
    drop_unused_dense_rows(spec);
    return spec;
}

namespace {

using nlohmann::json;

// ---- the field table, compiled: one row per ROPE_JIT_ROPE_SPEC_FIELDS line ----------------

const char* const kFloatTypeNames[] = {"float32", "float16", "bfloat16"};
const char* const kDirectionNames[] = {"forward", "backward"};
// The composite key "style" sets two members (interleaved, proportional).
const char* const kStyleNames[] = {"half", "interleaved", "proportional"};
const char* const kPositionModeNames[] = {"implicit", "indices", "seqlen-offsets"};
// The composite key "angles" sets two members (angles_from_inv_freq, table_full).
const char* const kAngleNames[] = {"table-half", "table-full", "inv-freq"};
const char* const kKvCacheNames[] = {"none", "contiguous", "slot-mapping", "block-tables"};

const SpecValues Integer{SpecValues::integer, nullptr, 0, false};
const SpecValues Boolean{SpecValues::boolean, nullptr, 0, true};
const SpecValues BooleanEnumerator{SpecValues::boolean, nullptr, 0, true, true};
const SpecValues FloatTypes{SpecValues::named, kFloatTypeNames, 3, false};
const SpecValues FloatTypesEnumerator{SpecValues::named, kFloatTypeNames, 3, false, true};
const SpecValues Directions{SpecValues::named, kDirectionNames, 2, true};
const SpecValues Styles{SpecValues::named, kStyleNames, 3, false};
const SpecValues PositionModes{SpecValues::named, kPositionModeNames, 3, false};
const SpecValues Angles{SpecValues::named, kAngleNames, 3, false};
const SpecValues IntegerEnumerator{SpecValues::integer, nullptr, 0, false, true};
const SpecValues KvCacheKinds{SpecValues::named, kKvCacheNames, 4, false, true};

constexpr SpecPresence PLAIN = SpecPresence::Plain, DERIVED = SpecPresence::Derived,
                       REQUIRED = SpecPresence::Required;

const SpecField<KernelSpec> kFields[] = {
#define ROPE_JIT_SPEC_ROW(member, init, key, values, min, max, constant, presence) \
    {&KernelSpec::member, #member, key, &values, min, max, constant, presence},
    ROPE_JIT_ROPE_SPEC_FIELDS(ROPE_JIT_SPEC_ROW)
#undef ROPE_JIT_SPEC_ROW
};

int32_t angles_of(const KernelSpec& s) {
    return s.angles_from_inv_freq ? 2 : s.table_full ? 1 : 0;
}

int32_t style_of(const KernelSpec& s) {
    return s.proportional ? 2 : s.interleaved ? 1 : 0;
}

}  // namespace

void KernelSpec::validate() const {
    auto require = [](bool ok, const std::string& message) {
        if (!ok) fail_argument("kernel spec: " + message);
    };
    // Ranges, from the table.
    const std::string out_of_range = spec_range_problem(*this, kFields);
    require(out_of_range.empty(), out_of_range);
    // What the template's static_asserts require of the fields together. Sums in int64: the
    // fields are int32 and may be near its top.
    require(head_dim % 2 == 0, fmt::format("head_dim must be even, got {}", head_dim));
    require(rotary_dim % 2 == 0, fmt::format("rotary_dim must be even, got {}", rotary_dim));
    require(int64_t(rotary_offset) + int64_t(rotary_dim) <= int64_t(head_dim),
            fmt::format("rotary_offset {} + rotary_dim {} exceeds head_dim {}", rotary_offset,
                        rotary_dim, head_dim));
    require(!(angles_from_inv_freq && table_full), "angles: inv-freq and table-full at once");
    require(has_k || gqa_group == 1, fmt::format("gqa_group {} needs has_k", gqa_group));
    require((vec & (vec - 1)) == 0, fmt::format("vec must be 1, 2, 4 or 8, got {}", vec));
    // The kernel's own static_assert on its plan (rope_params.h).
    require(rope_plan(*this).problem != kRopePlanVecSplitsPairs,
            fmt::format("vec {} does not divide the {} pairs", vec, rotary_dim / 2));
    require(!vec_loads || rotary_offset % vec == 0, "vector loads need rotary_offset % vec == 0");
    require(!(interleaved && proportional), "style: interleaved and proportional at once");
    require(!proportional || rotary_offset == 0,
            fmt::format("rotary_offset must be 0 with style proportional, got {}", rotary_offset));
    require(!proportional || !vec_loads || (head_dim / 2) % vec == 0,
            fmt::format("vector loads of style proportional need vec {} to divide head_dim/2 {}",
                        vec, head_dim / 2));
    require(!table_vec_loads || !angles_from_inv_freq, "table_vec_loads needs tables");
    require(!norm_weight_vec_loads || qk_norm, "norm_weight_vec_loads needs qk_norm");
    require(copy_vec <= (dtype == 0 ? 4 : 8) && (copy_vec & (copy_vec - 1)) == 0 &&
                copy_tiles(*this, copy_vec),
            fmt::format("copy_vec {} must be a power of 2 of at most 16 bytes that tiles the "
                        "unrotated features",
                        copy_vec));
    require(mrope_axes == 0 || (position_mode == 1 && rotary_dim / 2 <= 256),
            "mrope_axes needs per-token positions and at most 256 pairs");
    require(!freq_grad || (angles_from_inv_freq && backward),
            "freq_grad needs inv_freq angles and backward");
    require(block_threads % 32 == 0,
            fmt::format("block_threads must be a multiple of 32, got {}", block_threads));
    // One kernel, one spec: fields the kernel does not read keep their defaults.
    require(!angles_from_inv_freq || table_dtype == 0,
            "table_dtype: must be float32 with inv-freq angles (no table)");
    require(angles_from_inv_freq || inv_freq_dtype == 0,
            "inv_freq_dtype: must be float32 unless the angles are inv-freq");
    require(has_xpos || xpos_dtype == 0, "xpos_dtype: must be float32 without xpos");
    require(!positions_int64 || position_mode == 1, "positions_int64: needs positions \"indices\"");
    require(!seqlen_offsets_int64 || position_mode == 2 || kv_seqlen_offsets,
            "seqlen_offsets_int64: needs positions \"seqlen-offsets\" or kv_seqlen_offsets");
    require(!cu_seqlens_int64 || packed, "cu_seqlens_int64: needs packed");
    require(!dense_rows || !packed, "dense_rows: not with packed tensors");
    require(has_k || (in_place_k && !k_own_angles), "in_place_k and k_own_angles: need has_k");
    require(qk_norm || (!norm_unit_offset && norm_weight_dtype == 0 && !norm_weight_grad),
            "norm_unit_offset, norm_weight_dtype and norm_weight_grad: need qk_norm");
    require(!norm_weight_grad || backward, "norm_weight_grad: needs direction backward");
    require(!qk_norm || !freq_grad, "qk_norm: not with freq_grad");
    require(kv_cache == 0 || (has_k && !backward && !in_place_k),
            "kv_cache: needs has_k, direction forward and in_place_k false");
    require(kv_cache != 0 ||
                (!kv_index_int64 && !kv_seqlen_offsets && !kv_fp8 && v_dim == 0 && v_vec == 1),
            "kv_index_int64, kv_seqlen_offsets, kv_fp8, v_head_dim and v_vec: need kv_cache");
    require(!kv_index_int64 || kv_cache >= 2, "kv_index_int64: needs a paged kv_cache");
    require(!kv_seqlen_offsets || kv_cache == 1 || kv_cache == 3,
            "kv_seqlen_offsets: needs kv_cache contiguous or block-tables");
    require(v_vec <= (dtype == 0 ? 4 : 8) && (v_vec & (v_vec - 1)) == 0 &&
                (v_dim == 0 ? v_vec == 1 : v_dim % v_vec == 0),
            fmt::format("v_vec {} must be a power of 2 of at most 16 bytes dividing v_head_dim {}",
                        v_vec, v_dim));
    require(!q_fp8 || (!in_place_q && !backward),
            "q_fp8: needs in_place_q false and direction "
            "forward");
    require(!qk_norm || !interleaved || vec % 2 == 0,
            fmt::format("qk_norm: interleaved pairs need an even vec, got {}", vec));
    require(!qk_norm || block_threads == norm_block_threads(*this),
            fmt::format("qk_norm: this spec's kernel takes block_threads {}",
                        norm_block_threads(*this)));
}

std::string KernelSpec::preamble() const {
    // One constexpr per specialization constant: the template reads only these names.
    std::string text = "// Specialization of rope.cu: " + describe() + "\n";
    text += spec_constants(*this, kFields);
    // Derived for the template's convenience.
    text += fmt::format("constexpr bool HAS_ROPE_INDICES = {};\n",
                        position_mode == 1 ? "true" : "false");
    // rope.cu's entries with a body (rope_params.h, rope_module_kernels): macros, since they
    // decide what source the compiler sees at all.
    const RopeModuleKernels kernels = rope_module_kernels(rope_plan(*this));
    text += fmt::format(
        "#define ROPE_JIT_KERNEL_ROPE {:d}\n#define ROPE_JIT_KERNEL_DIRECT {:d}\n"
        "#define ROPE_JIT_KERNEL_BULK {:d}\n#define ROPE_JIT_KERNEL_FLAT {:d}\n",
        kernels.rope, kernels.direct, kernels.bulk, kernels.flat);
    return text;
}

std::string KernelSpec::to_json() const {
    json j;  // keys are sorted on output, so the text is canonical
    j["op"] = "rope";
    j["angles"] = kAngleNames[angles_of(*this)];
    j["style"] = kStyleNames[style_of(*this)];
    spec_write_fields(*this, kFields, j);
    return j.dump();
}

std::optional<KernelSpec> KernelSpec::from_json(const std::string& text, std::string* error) {
    auto fail = [&](const std::string& message) -> std::optional<KernelSpec> {
        if (error) *error = message;
        return std::nullopt;
    };
    std::string why;
    const json j = parse_bounded_json(text, &why);
    if (j.is_discarded()) return fail(why);
    if (!j.is_object()) return fail("not a JSON object");
    KernelSpec spec;
    try {
        if (j.contains("op") && j["op"] != json("rope"))
            throw std::runtime_error(fmt::format("op: expected \"rope\", got {}", j["op"].dump()));
        spec_read_fields(spec, kFields, j, {"op", "angles", "style"});
        if (j.contains("angles")) {
            const int32_t angles = spec_parse_value("angles", Angles, 0, 2, j["angles"]);
            spec.angles_from_inv_freq = angles == 2;
            spec.table_full = angles == 1;
        }
        if (j.contains("style")) {
            const int32_t style = spec_parse_value("style", Styles, 0, 2, j["style"]);
            spec.interleaved = style == 1;
            spec.proportional = style == 2;
        }
        // Derived fields left out: what a call with contiguous, 16-byte-aligned tensors (and
        // int64 indices, the C API's default) gets; see kernel_spec_from_public.
        auto absent = [&](const char* key) { return !j.contains(key); };
        if (absent("rotary_dim")) spec.rotary_dim = spec.head_dim;
        if (absent("xpos_dtype"))
            spec.xpos_dtype =
                spec.has_xpos ? (spec.angles_from_inv_freq ? spec.inv_freq_dtype : spec.table_dtype)
                              : 0;
        if (absent("positions_int64")) spec.positions_int64 = spec.position_mode == 1;
        if (absent("seqlen_offsets_int64")) spec.seqlen_offsets_int64 = spec.position_mode == 2;
        if (absent("cu_seqlens_int64")) spec.cu_seqlens_int64 = spec.packed;
        if (absent("k_own_angles")) spec.k_own_angles = spec.has_k && spec.has_xpos;
        if (absent("in_place_k")) spec.in_place_k = !spec.has_k || spec.in_place_q;
        const size_t element_size = spec.dtype == 0 ? 4 : 2;
        if (absent("vec") && absent("vec_loads"))
            choose_vector_width(spec, element_size, [](int64_t) { return true; });
        if (absent("copy_vec"))
            spec.copy_vec = choose_copy_width(spec, element_size, [](int64_t) { return true; });
        if (absent("table_vec_loads")) spec.table_vec_loads = !spec.angles_from_inv_freq;
        if (absent("block_threads")) spec.block_threads = kRopeMaxBlockThreads;
        if (spec.kv_cache != 0) {
            if (absent("in_place_k")) spec.in_place_k = 0;  // k goes to the cache
            if (absent("kv_index_int64")) spec.kv_index_int64 = spec.kv_cache >= 2;
            if (absent("kv_seqlen_offsets"))
                spec.kv_seqlen_offsets = spec.kv_cache != 2 && spec.position_mode == 2;
            if (absent("copy_vec"))
                spec.copy_vec = choose_copy_width(spec, element_size, [](int64_t) { return true; });
            if (absent("v_vec"))
                spec.v_vec = choose_v_width(spec, element_size, [](int64_t) { return true; });
        }
        if (absent("norm_weight_vec_loads")) spec.norm_weight_vec_loads = spec.qk_norm;
        if (spec.qk_norm) {
            const KernelSpec given = spec;
            set_norm_access(spec, element_size, [](int64_t) { return true; });
            // Values the JSON names stay as given (validate() then says what is wrong).
            if (!absent("copy_vec")) spec.copy_vec = given.copy_vec;
            if (!absent("block_threads")) spec.block_threads = given.block_threads;
        }
        spec.validate();
        drop_unused_dense_rows(spec);
    } catch (const std::exception& e) {
        return fail(e.what());
    }
    return spec;
}

std::string KernelSpec::describe() const {
    const char* positions[] = {"implicit", "indices", "offsets"};
    const auto name = [](int32_t index, const char* const* names, int count) {
        return index >= 0 && index < count ? names[index] : "?";
    };
    return fmt::format("rope {} {} D{} R{}@{} {} {}gqa{} {}{} {}{}{} v{}{}", dtype_short(dtype),
                       backward ? "bwd" : "fwd", head_dim, rotary_dim, rotary_offset,
                       name(style_of(*this), kStyleNames, 3), has_k ? "qk " : "q ", gqa_group,
                       name(position_mode, positions, 3), packed ? "+packed" : "",
                       angles_from_inv_freq ? "inv_freq"
                       : table_full         ? "table/full"
                                            : "table/half",
                       has_xpos     ? " xpos"
                       : mrope_axes ? fmt::format(" mrope{}", mrope_axes)
                                    : std::string(),
                       in_place_q && in_place_k ? " inplace" : " outofplace", vec,
                       vec_loads ? "" : "(scalar)") +
           (freq_grad ? " +freq_grad" : "") +
           (qk_norm ? fmt::format(" +qk_norm{}{}", norm_unit_offset ? "(1+w)" : "",
                                  norm_weight_grad ? " +dw" : "")
                    : std::string()) +
           (kv_cache ? fmt::format(" +kv:{}{}{}", kKvCacheNames[kv_cache & 3], kv_fp8 ? "/fp8" : "",
                                   v_dim ? fmt::format(" v{}x{}", v_dim, v_vec) : std::string())
                     : std::string()) +
           (q_fp8 ? " +q_fp8" : "") + (dense_rows ? " +dense_rows" : "");
}

size_t KernelSpecHash::operator()(const KernelSpec& spec) const noexcept {
    static_assert(std::has_unique_object_representations_v<KernelSpec>,
                  "hashed as plain bytes: no padding");
    return hash_bytes(&spec, sizeof spec);
}

}  // namespace rope_jit
