#include "ops/rope/kernel_spec.h"

#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/byte_hash.h"
#include "common/error.h"
#include "common/raw_enum.h"
#include "ops/rope/rope_plan.h"

namespace rope_jit {

namespace {

const char* const kDtypeNames[] = {"float32", "float16", "bfloat16"};
const char* const kPositionModeNames[] = {"implicit", "indices", "seqlen_offsets"};

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

// Whether a [B, H, S, D] view allows vector accesses of n elements: unit feature stride,
// every other stride a multiple of n, and the base address aligned to n elements.
bool vector_friendly(const TensorRef& t, int64_t n) {
    if (t.shape[3] > 1 && t.strides[3] != 1) return false;
    for (int d = 0; d < 3; ++d)
        if (t.shape[d] > 1 && t.strides[d] % n != 0) return false;
    const uintptr_t alignment = uintptr_t(n) * dtype_size(t.dtype);
    return reinterpret_cast<uintptr_t>(t.data) % alignment == 0;
}

// Sets spec.vec/vec_loads to the widest vector (at most 16 bytes) that the pair layout and
// the tensors (tensors_allow(n)) permit; scalar accesses otherwise.
template <typename TensorsAllow>
void choose_vector_width(KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    const int64_t pairs = spec.rotary_dim / 2;
    spec.vec_loads = 0;
    spec.vec = spec.interleaved ? 2 : 1;
    for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2) {
        const bool layout_ok =
            spec.rotary_offset % n == 0 && (spec.interleaved ? spec.rotary_dim % n == 0 : pairs % n == 0);
        if (layout_ok && tensors_allow(n)) {
            spec.vec = int32_t(n);
            spec.vec_loads = 1;
            return;
        }
    }
}

// The copy's vector width (see KernelSpec::copy_vec): the widest n (16 bytes at most) that
// tiles both unrotated ranges [0, offset) and [offset + R, D) and that the tensors allow
// (tensors_allow(n)); 1 when the call copies nothing.
template <typename TensorsAllow>
int32_t choose_copy_width(const KernelSpec& spec, size_t element_size, TensorsAllow tensors_allow) {
    const bool copies = spec.rotary_dim < spec.head_dim && (!spec.in_place_q || !spec.in_place_k);
    if (!copies) return 1;
    for (int64_t n = 16 / int64_t(element_size); n >= 2; n /= 2)
        if (spec.rotary_offset % n == 0 && (spec.rotary_offset + spec.rotary_dim) % n == 0 &&
            spec.head_dim % n == 0 && tensors_allow(n))
            return int32_t(n);
    return 1;
}

// Table columns one work item reads (see TABLE_SPAN in rope.cu).
int64_t table_span(const KernelSpec& spec) { return rope_plan(spec).table_span; }

// Whether a [P, C] table allows reading spans of n columns as one aligned vector.
bool table_friendly(const TensorRef& t, int64_t n) {
    if (t.shape[1] > 1 && t.strides[1] != 1) return false;
    if (t.shape[0] > 1 && t.strides[0] % n != 0) return false;
    const uintptr_t alignment = uintptr_t(n) * dtype_size(t.dtype);
    return reinterpret_cast<uintptr_t>(t.data) % alignment == 0;
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
    spec.k_own_angles = p.has_k && (p.has_xpos || (p.position_mode == PositionMode::Implicit &&
                                                   p.q_position_offset != 0));
    spec.in_place_q = p.q_in_place;
    spec.in_place_k = !p.has_k || p.k_in_place;

    spec.mrope_axes = p.multi_section() ? int32_t(p.num_position_axes) : 0;
    spec.freq_grad = p.has_freq_grad;
    const auto tensors_allow = [&](int64_t n) {
        bool ok = vector_friendly(p.q, n) && vector_friendly(p.q_out, n);
        if (p.has_k) ok = ok && vector_friendly(p.k, n) && vector_friendly(p.k_out, n);
        if (p.has_freq_grad) {
            ok = ok && vector_friendly(p.q_saved, n);
            if (p.has_k) ok = ok && vector_friendly(p.k_saved, n);
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
    if (style != ROPE_JIT_STYLE_HALF && style != ROPE_JIT_STYLE_INTERLEAVED)
        fail_argument(fmt::format("style: unknown value {}", style));
    spec.interleaved = style == ROPE_JIT_STYLE_INTERLEAVED;
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
    spec.validate();
    return spec;
}

void KernelSpec::validate() const {
    auto require = [](bool ok, const std::string& message) {
        if (!ok) fail_argument("kernel spec: " + message);
    };
    require(op == 0, fmt::format("op must be 0 (rope), got {}", op));
    for (int32_t code : {dtype, table_dtype, xpos_dtype, inv_freq_dtype})
        require(code >= 0 && code <= 2, fmt::format("dtype code {} is not 0, 1 or 2", code));
    require(head_dim > 0 && head_dim % 2 == 0, fmt::format("head_dim must be even and positive, got {}", head_dim));
    require(rotary_dim > 0 && rotary_dim % 2 == 0, fmt::format("rotary_dim must be even and positive, got {}", rotary_dim));
    require(rotary_offset >= 0 && rotary_offset + rotary_dim <= head_dim,
            fmt::format("rotary_offset {} + rotary_dim {} exceeds head_dim {}", rotary_offset, rotary_dim, head_dim));
    require(gqa_group >= 1, fmt::format("gqa_group must be >= 1, got {}", gqa_group));
    require(position_mode >= 0 && position_mode <= 2, fmt::format("position_mode {} unknown", position_mode));
    require(vec >= 1 && vec <= 8 && (vec & (vec - 1)) == 0, fmt::format("vec must be 1, 2, 4 or 8, got {}", vec));
    // The kernel's own static_assert on its plan (rope_params.h).
    require(rope_plan(*this).problem != kRopePlanVecSplitsPairs,
            fmt::format("vec {} does not divide the {} pairs", vec, rotary_dim / 2));
    require(!vec_loads || rotary_offset % vec == 0, "vector loads need rotary_offset % vec == 0");
    require(!table_vec_loads || !angles_from_inv_freq, "table_vec_loads needs tables");
    require(copy_vec >= 1 && copy_vec <= (dtype == 0 ? 4 : 8) && (copy_vec & (copy_vec - 1)) == 0 &&
                rotary_offset % copy_vec == 0 && (rotary_offset + rotary_dim) % copy_vec == 0 &&
                head_dim % copy_vec == 0,
            fmt::format("copy_vec {} must be a power of 2 of at most 16 bytes that tiles the unrotated features",
                        copy_vec));
    require(mrope_axes >= 0 && mrope_axes <= ROPE_JIT_MAX_MROPE_SECTIONS,
            fmt::format("mrope_axes must be in [0, {}], got {}", ROPE_JIT_MAX_MROPE_SECTIONS, mrope_axes));
    require(mrope_axes == 0 || (position_mode == 1 && rotary_dim / 2 <= 256),
            "mrope_axes needs per-token positions and at most 256 pairs");
    require(!freq_grad || (angles_from_inv_freq && backward), "freq_grad needs inv_freq angles and backward");
    require(block_threads >= 32 && block_threads <= 1024 && block_threads % 32 == 0,
            fmt::format("block_threads must be a multiple of 32 in [32, 1024], got {}", block_threads));
}

std::string KernelSpec::preamble() const {
    // One constexpr per specialization constant: the template reads only these names.
    std::string text = "// Specialization of rope.cu: " + describe() + "\n";
    auto define = [&](const char* type, const char* name, long long value) {
        text += fmt::format("constexpr {} {} = {};\n", type, name, value);
    };
    auto flag = [&](const char* name, int32_t value) {
        text += fmt::format("constexpr bool {} = {};\n", name, value ? "true" : "false");
    };
    define("int", "DTYPE", dtype);
    define("int", "TABLE_DTYPE", table_dtype);
    define("int", "XPOS_DTYPE", xpos_dtype);
    define("int", "INV_FREQ_DTYPE", inv_freq_dtype);
    flag("BACKWARD_PASS", backward);
    define("int", "HEAD_DIM", head_dim);
    define("int", "ROTARY_DIM", rotary_dim);
    define("int", "ROTARY_OFFSET", rotary_offset);
    flag("INTERLEAVED", interleaved);
    flag("HAS_K", has_k);
    define("int", "GQA_GROUP", gqa_group);
    define("int", "POSITION_MODE", position_mode);
    flag("HAS_ROPE_INDICES", position_mode == 1);
    flag("PACKED", packed);
    flag("POSITIONS_INT64", positions_int64);
    flag("SEQLEN_OFFSETS_INT64", seqlen_offsets_int64);
    flag("CU_SEQLENS_INT64", cu_seqlens_int64);
    flag("ANGLES_FROM_INV_FREQ", angles_from_inv_freq);
    flag("TABLE_FULL", table_full);
    flag("HAS_XPOS", has_xpos);
    flag("K_OWN_ANGLES", k_own_angles);
    flag("IN_PLACE_Q", in_place_q);
    flag("IN_PLACE_K", in_place_k);
    define("int", "VEC", vec);
    flag("VEC_LOADS", vec_loads);
    define("int", "COPY_VEC", copy_vec);
    flag("TABLE_VEC_LOADS", table_vec_loads);
    define("int", "MROPE_AXES", mrope_axes);
    flag("FREQ_GRAD", freq_grad);
    define("int", "BLOCK_THREADS", block_threads);
    return text;
}

std::string KernelSpec::to_json() const {
    nlohmann::json j;  // keys are sorted on output, so the text is canonical
    j["op"] = "rope";
    j["dtype"] = kDtypeNames[dtype];
    j["table_dtype"] = kDtypeNames[table_dtype];
    j["xpos_dtype"] = kDtypeNames[xpos_dtype];
    j["inv_freq_dtype"] = kDtypeNames[inv_freq_dtype];
    j["backward"] = bool(backward);
    j["head_dim"] = head_dim;
    j["rotary_dim"] = rotary_dim;
    j["rotary_offset"] = rotary_offset;
    j["style"] = interleaved ? "interleaved" : "half";
    j["has_k"] = bool(has_k);
    j["gqa_group"] = gqa_group;
    j["positions"] = kPositionModeNames[position_mode];
    j["packed"] = bool(packed);
    j["positions_int64"] = bool(positions_int64);
    j["seqlen_offsets_int64"] = bool(seqlen_offsets_int64);
    j["cu_seqlens_int64"] = bool(cu_seqlens_int64);
    j["angles"] = angles_from_inv_freq ? "inv_freq" : table_full ? "table_full" : "table_half";
    j["xpos"] = bool(has_xpos);
    j["k_own_angles"] = bool(k_own_angles);
    j["in_place_q"] = bool(in_place_q);
    j["in_place_k"] = bool(in_place_k);
    j["vec"] = vec;
    j["vec_loads"] = bool(vec_loads);
    j["copy_vec"] = copy_vec;
    j["table_vec_loads"] = bool(table_vec_loads);
    j["mrope_axes"] = mrope_axes;
    j["freq_grad"] = bool(freq_grad);
    j["block_threads"] = block_threads;
    return j.dump();
}

std::optional<KernelSpec> KernelSpec::from_json(const std::string& text, std::string* error) {
    auto fail = [&](const std::string& message) -> std::optional<KernelSpec> {
        if (error) *error = message;
        return std::nullopt;
    };
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
    KernelSpec spec;
    try {
        auto name_index = [&](const char* key, const char* const* names, int count, int32_t fallback) -> int32_t {
            if (!j.contains(key)) return fallback;
            const std::string value = j.at(key).get<std::string>();
            for (int i = 0; i < count; ++i)
                if (value == names[i]) return i;
            throw std::runtime_error(fmt::format("{}: unknown value '{}'", key, value));
        };
        auto flag = [&](const char* key, int32_t fallback) -> int32_t {
            return j.contains(key) ? int32_t(j.at(key).get<bool>()) : fallback;
        };
        auto number = [&](const char* key, int32_t fallback) -> int32_t {
            return j.contains(key) ? j.at(key).get<int32_t>() : fallback;
        };
        if (j.value("op", std::string("rope")) != "rope") return fail("op: only 'rope' is supported");
        spec.dtype = name_index("dtype", kDtypeNames, 3, 0);
        spec.table_dtype = name_index("table_dtype", kDtypeNames, 3, 0);
        spec.xpos_dtype = name_index("xpos_dtype", kDtypeNames, 3, 0);
        spec.inv_freq_dtype = name_index("inv_freq_dtype", kDtypeNames, 3, 0);
        spec.backward = flag("backward", 0);
        spec.head_dim = number("head_dim", 0);
        spec.rotary_dim = number("rotary_dim", spec.head_dim);
        spec.rotary_offset = number("rotary_offset", 0);
        const char* const styles[] = {"half", "interleaved"};
        spec.interleaved = name_index("style", styles, 2, 0);
        spec.has_k = flag("has_k", 0);
        spec.gqa_group = number("gqa_group", 1);
        spec.position_mode = name_index("positions", kPositionModeNames, 3, 0);
        spec.packed = flag("packed", 0);
        spec.positions_int64 = flag("positions_int64", 0);
        spec.seqlen_offsets_int64 = flag("seqlen_offsets_int64", 0);
        spec.cu_seqlens_int64 = flag("cu_seqlens_int64", 0);
        const char* const angles[] = {"table_half", "table_full", "inv_freq"};
        const int32_t angle_source = name_index("angles", angles, 3, 0);
        spec.angles_from_inv_freq = angle_source == 2;
        spec.table_full = angle_source == 1;
        spec.has_xpos = flag("xpos", 0);
        spec.k_own_angles = flag("k_own_angles", spec.has_k && spec.has_xpos);
        spec.in_place_q = flag("in_place_q", 1);
        spec.in_place_k = flag("in_place_k", 1);
        spec.vec = number("vec", spec.interleaved ? 2 : 1);
        spec.vec_loads = flag("vec_loads", 0);
        spec.copy_vec = number("copy_vec", 1);
        spec.table_vec_loads = flag("table_vec_loads", 0);
        spec.mrope_axes = number("mrope_axes", 0);
        spec.freq_grad = flag("freq_grad", 0);
        spec.block_threads = number("block_threads", kRopeMaxBlockThreads);
        spec.validate();
    } catch (const std::exception& e) {
        return fail(e.what());
    }
    return spec;
}

std::string KernelSpec::describe() const {
    const char* positions[] = {"implicit", "indices", "offsets"};
    return fmt::format("rope {} {} D{} R{}@{} {} {}gqa{} {}{} {}{}{} v{}{}", dtype_short(dtype),
                       backward ? "bwd" : "fwd", head_dim, rotary_dim, rotary_offset,
                       interleaved ? "interleaved" : "half", has_k ? "qk " : "q ", gqa_group,
                       positions[position_mode], packed ? "+packed" : "",
                       angles_from_inv_freq ? "inv_freq" : table_full ? "table/full" : "table/half",
                       has_xpos ? " xpos" : mrope_axes ? fmt::format(" mrope{}", mrope_axes) : std::string(),
                       in_place_q && in_place_k ? " inplace" : " outofplace", vec,
                       vec_loads ? "" : "(scalar)") +
           (freq_grad ? " +freq_grad" : "");
}

size_t KernelSpecHash::operator()(const KernelSpec& spec) const noexcept {
    static_assert(std::has_unique_object_representations_v<KernelSpec>, "hashed as plain bytes: no padding");
    return hash_bytes(&spec, sizeof spec);
}

}  // namespace rope_jit
