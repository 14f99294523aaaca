#include "ops/rope/rope_problem.h"

#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "common/index_reader.h"
#include "ops/rope/mrope_sections.h"
#include "common/raw_enum.h"

namespace rope_jit {

bool host_accessible(const DLDevice& device) {
    const int type = raw_enum(device.device_type);
    return type == kDLCPU || type == kDLCUDAHost || type == kDLCUDAManaged;
}

TensorRef RopeProblem::position_axis(int64_t axis) const {
    if (!multi_section()) return positions;
    TensorRef view = positions;
    // An empty positions tensor may have NULL data, which no offset may be applied to.
    if (positions.data != nullptr)
        view.data =
            positions.data + axis * positions.strides[0] * int64_t(dtype_size(positions.dtype));
    view.ndim = positions.ndim - 1;
    for (int d = 0; d < view.ndim; ++d) {
        view.shape[d] = positions.shape[d + 1];
        view.strides[d] = positions.strides[d + 1];
    }
    view.shape[view.ndim] = 0;
    view.strides[view.ndim] = 0;
    return view;
}

namespace {

// The last table row of `tokens` (>= 1) rows from `first`; INT64_MAX when that overflows
// (a caller's offset near the top of int64), which no table reaches either.
int64_t last_table_row(int64_t first, int64_t tokens) {
    return first > std::numeric_limits<int64_t>::max() - (tokens - 1)
               ? std::numeric_limits<int64_t>::max()
               : first + (tokens - 1);
}

// Whether a table (cos/sin, or xpos_scale with inv_freq) bounds the positions to its rows.
bool bounds_by_table(const RopeProblem& p) {
    return p.angles == AngleSource::Table || p.has_xpos;
}

// The table whose rows bound the positions (see bounds_by_table), as errors name it.
const char* bounding_table(const RopeProblem& p) {
    return p.angles == AngleSource::Table ? "cos" : "xpos_scale";
}

// Positions must lie in [0, limit): the table's rows, or, with angles from inv_freq and no
// table, every int64 the last position of a sequence can be computed as without overflow.
int64_t position_limit(const RopeProblem& p) {
    return bounds_by_table(p) ? p.table_rows : std::numeric_limits<int64_t>::max();
}

constexpr const char* kInvFreqPositions =
    "positions must be >= 0 (and below 2^63 - 1) with inv_freq";

// Lifts a packed [T, H, D] view to [1, H, T, D] so both backends index one layout.
TensorRef lift_packed(TensorRef t) {
    TensorRef lifted = t;
    lifted.ndim = 4;
    lifted.shape[0] = 1;
    lifted.strides[0] = 0;
    lifted.shape[1] = t.shape[1];
    lifted.strides[1] = t.strides[1];
    lifted.shape[2] = t.shape[0];
    lifted.strides[2] = t.strides[0];
    lifted.shape[3] = t.shape[2];
    lifted.strides[3] = t.strides[2];
    return lifted;
}

void require_float(const TensorRef& t) {
    if (!is_float(t.dtype))
        fail_argument(fmt::format("{}: dtype must be float32, float16 or bfloat16, got {}", t.name,
                                  dtype_name(t.dtype)));
}

void require_index(const TensorRef& t) {
    if (!is_index(t.dtype))
        fail_argument(
            fmt::format("{}: dtype must be int32 or int64, got {}", t.name, dtype_name(t.dtype)));
}

void require_same_shape(const TensorRef& out, const TensorRef& in) {
    bool same = out.ndim == in.ndim;
    for (int i = 0; same && i < in.ndim; ++i) same = out.shape[i] == in.shape[i];
    if (!same)
        fail_argument(fmt::format("{}: shape {} does not match {} {}", out.name, out.shape_string(),
                                  in.name, in.shape_string()));
    if (out.dtype != in.dtype)
        fail_argument(fmt::format("{}: dtype {} does not match {} {}", out.name,
                                  dtype_name(out.dtype), in.name, dtype_name(in.dtype)));
}

// An output (or an input rotated in place) is written: its elements must be distinct, and
// an out-of-place output may not share memory with its input unless it is the same view.
void check_output(const TensorRef& out, const TensorRef& in, bool in_place) {
    require_distinct_elements(out, in_place ? in.name : out.name);
    if (!in_place && shares_memory(out, in))
        fail_argument(
            fmt::format("{}: overlaps {} without being the same view; pass the same "
                        "view (or NULL) for in place, or a separate buffer",
                        out.name, in.name));
}

void check_table(const TensorRef& t, int64_t rotary_dim) {
    require_float(t);
    if (t.ndim != 2 || (t.shape[1] != rotary_dim / 2 && t.shape[1] != rotary_dim)) {
        // rotary_dim is 0 only where q's head_dim is (a call on empty heads).
        if (rotary_dim == 0)
            fail_argument(fmt::format("{}: expected [P, 0] for q's head_dim 0, got {}", t.name,
                                      t.shape_string()));
        fail_argument(
            fmt::format("{}: expected [P, {}] (half table) or [P, {}] (full table) for "
                        "rotary_dim {}, got {}",
                        t.name, rotary_dim / 2, rotary_dim, rotary_dim, t.shape_string()));
    }
}

void check_same_device(const TensorRef& t, const DLDevice& device, const TensorRef& reference) {
    if (!t.present()) return;
    if (t.device.device_type != device.device_type || t.device.device_id != device.device_id)
        fail_argument(
            fmt::format("{}: lives on {} device {}, but {} lives on {} device {}; every "
                        "tensor of a call must be on one device",
                        t.name, device_name(t.device.device_type), t.device.device_id,
                        reference.name, device_name(device.device_type), device.device_id));
}

// The call's angle, index and frequency-gradient tensors as the caller gave them, used by the
// spec or not: an inv_freq beside cos and sin, or seqlen_offsets beside positions, is still the
// caller's memory, which no output may land on (p holds only those the spec uses).
struct GivenTensors {
    const TensorRef& cos;
    const TensorRef& sin;
    const TensorRef& inv_freq;
    const TensorRef& xpos;
    const TensorRef& positions;
    const TensorRef& offsets;
    const TensorRef& cu_seqlens;
    const TensorRef& freq_grad;
    const TensorRef& q_saved;
    const TensorRef& k_saved;
};

// QK-norm (rope_jit_rope_args' q_norm_weight ... k_norm_weight_grad): weights [D] of one float
// dtype, a finite positive eps, and in the backward the pre-norm inputs and optional weight
// gradients. q and k are the call's tensors as given (3-D when packed); q_write and k_write
// what it writes (no k_write with a KV cache, whose own checks keep it off the weights).
// Fills p's norm fields.
void check_qk_norm(const rope_jit_rope_args& args, const TensorRef& q, const TensorRef& k,
                   const TensorRef& q_write, const TensorRef& k_write, const GivenTensors& given,
                   RopeProblem& p) {
    TensorRef q_weight = make_tensor_ref(args.q_norm_weight, "q_norm_weight", 1);
    TensorRef k_weight = make_tensor_ref(args.k_norm_weight, "k_norm_weight", 1);
    TensorRef q_input = make_tensor_ref(args.q_norm_input, "q_norm_input");
    TensorRef k_input = make_tensor_ref(args.k_norm_input, "k_norm_input");
    TensorRef q_grad = make_tensor_ref(args.q_norm_weight_grad, "q_norm_weight_grad", 1);
    TensorRef k_grad = make_tensor_ref(args.k_norm_weight_grad, "k_norm_weight_grad", 1);
    if (!q_weight.present()) {
        for (const TensorRef* t : {&k_weight, &q_input, &k_input, &q_grad, &k_grad})
            if (t->present())
                fail_argument(fmt::format("{}: given without q_norm_weight (no QK-norm)", t->name));
        return;
    }
    for (const TensorRef* t : {&k_weight, &q_input, &k_input, &q_grad, &k_grad})
        check_same_device(*t, p.device, q);
    check_same_device(q_weight, p.device, q);
    require_float(q_weight);
    if (q_weight.shape[0] != p.head_dim)
        fail_argument(fmt::format("q_norm_weight: expected [{}] (head_dim), got {}", p.head_dim,
                                  q_weight.shape_string()));
    if (p.has_k) {
        if (!k_weight.present())
            fail_argument("k_norm_weight: required when k is given with q_norm_weight");
        if (k_weight.shape[0] != p.head_dim || k_weight.dtype != q_weight.dtype)
            fail_argument(
                fmt::format("k_norm_weight: expected {} [{}] like q_norm_weight, got {} {}",
                            dtype_name(q_weight.dtype), p.head_dim, dtype_name(k_weight.dtype),
                            k_weight.shape_string()));
    } else if (k_weight.present()) {
        fail_argument("k_norm_weight: given without k");
    }
    // The CUDA kernels add float(norm_eps): below float32's smallest normal number it is 0 (or
    // a subnormal flushed to 0), and a head of zeros (padding) came out NaN; the CPU reference
    // did below about 8.6e-78, where its float(1 / sqrt(eps)) is inf. Compared as the kernels
    // read it, so that the header's FLT_MIN (1.17549435e-38) itself is taken; past FLT_MAX
    // that conversion would be undefined.
    if (!(args.norm_eps <= std::numeric_limits<float>::max()) ||
        !(float(args.norm_eps) >= std::numeric_limits<float>::min()))
        fail_argument(fmt::format(
            "norm_eps: must be in [FLT_MIN, FLT_MAX] = [{}, {}] (float32's normal numbers), "
            "got {}",
            std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), args.norm_eps));
    if (p.has_freq_grad) fail_argument("inv_freq_grad: not available with QK-norm (q_norm_weight)");

    if (p.backward) {
        if (!q_input.present())
            fail_argument(
                "q_norm_input: required in the backward with q_norm_weight (the "
                "forward's q before the norm)");
        require_same_shape(q_input, q);
        if (p.has_k) {
            if (!k_input.present())
                fail_argument(
                    "k_norm_input: required in the backward with k_norm_weight (the "
                    "forward's k before the norm)");
            require_same_shape(k_input, k);
        } else if (k_input.present()) {
            fail_argument("k_norm_input: given without k");
        }
        for (TensorRef* grad : {&q_grad, &k_grad}) {
            if (!grad->present()) continue;
            if (grad->dtype != DType::F32 || grad->shape[0] != p.head_dim)
                fail_argument(fmt::format("{}: expected float32 [{}] (head_dim), got {} {}",
                                          grad->name, p.head_dim, dtype_name(grad->dtype),
                                          grad->shape_string()));
        }
        if (k_grad.present() && !p.has_k) fail_argument("k_norm_weight_grad: given without k");
        // The inputs are read while the outputs are written; the gradients are written too.
        for (const TensorRef* written : {&q_write, &k_write})
            for (const TensorRef* read : {&q_input, &k_input})
                if (written->present() && read->present() && extents_overlap(*written, *read))
                    fail_argument(
                        fmt::format("{}: overlaps {}, which the call writes; keep the "
                                    "forward's inputs in their own memory",
                                    read->name, written->name));
        for (const TensorRef* grad : {&q_grad, &k_grad}) {
            if (!grad->present()) continue;
            check_written(*grad,
                          {&q, &k, &q_write, &k_write, &q_input, &k_input, &q_weight, &k_weight,
                           &q_grad, &k_grad, &given.cos, &given.sin, &given.inv_freq, &given.xpos,
                           &given.positions, &given.offsets, &given.cu_seqlens, &given.freq_grad,
                           &given.q_saved, &given.k_saved},
                          MemoryRule::ByteRanges);
        }
    } else {
        for (const TensorRef* t : {&q_input, &k_input, &q_grad, &k_grad})
            if (t->present())
                fail_argument(fmt::format("{}: only used in the backward (backward = 1)", t->name));
    }
    // The weights are read while q and k are written.
    for (const TensorRef* written : {&q_write, &k_write})
        for (const TensorRef* weight : {&q_weight, &k_weight})
            if (written->present() && weight->present() && extents_overlap(*written, *weight))
                fail_argument(fmt::format("{}: overlaps {}, which the call writes", weight->name,
                                          written->name));

    p.has_norm = true;
    p.norm_unit_offset = args.norm_unit_offset != 0;
    p.norm_eps = args.norm_eps;
    p.q_norm_weight = q_weight;
    p.k_norm_weight = k_weight;
    if (p.backward) {
        p.q_norm_input = p.packed ? lift_packed(q_input) : q_input;
        if (p.has_k) p.k_norm_input = p.packed ? lift_packed(k_input) : k_input;
        p.q_norm_weight_grad = q_grad;
        p.k_norm_weight_grad = k_grad;
        p.has_norm_weight_grad = q_grad.present() || k_grad.present();
    }
}

// A float32 scale of one element, or absent; only for an FP8 output.
TensorRef check_scale(const DLTensor* tensor, const char* name, bool fp8, const char* output,
                      const RopeProblem& p, const TensorRef& q) {
    TensorRef scale = make_one_element_ref(tensor, name);
    if (!scale.present()) return scale;
    if (!fp8)
        fail_argument(
            fmt::format("{}: given, but {} is not float8_e4m3fn (a scale quantizes "
                        "an FP8 output only)",
                        name, output));
    check_same_device(scale, p.device, q);
    if (scale.dtype != DType::F32 || scale.numel() != 1)
        fail_argument(fmt::format("{}: expected a float32 tensor of one element, got {} {}", name,
                                  dtype_name(scale.dtype), scale.shape_string()));
    return scale;
}

// A cache as the [blocks, Hk, slots, D] view both backends index (see RopeProblem), from the
// layout the caller gave: [B, S_max, Hk, D], [N, block_size, Hk, D] or [N, Hk, block_size, D].
TensorRef cache_view(const TensorRef& cache, rope_jit_kv_cache_layout layout) {
    if (layout == ROPE_JIT_KV_CACHE_PAGED_HND) return cache;
    TensorRef view = cache;  // swap dims 1 and 2
    view.shape[1] = cache.shape[2], view.strides[1] = cache.strides[2];
    view.shape[2] = cache.shape[1], view.strides[2] = cache.strides[1];
    return view;
}

const char* layout_dims(rope_jit_kv_cache_layout layout) {
    switch (layout) {
        case ROPE_JIT_KV_CACHE_CONTIGUOUS: return "[B, S_max, Hk, D]";
        case ROPE_JIT_KV_CACHE_PAGED_NHD: return "[num_blocks, block_size, Hk, D]";
        case ROPE_JIT_KV_CACHE_PAGED_HND: return "[num_blocks, Hk, block_size, D]";
        default: return "?";
    }
}

// The KV cache fields of rope_jit_rope_args (kv_layout ... v_scale): checks them and fills p's
// cache fields; k_out becomes the k cache's view. `offsets` is seqlen_offsets as given.
void check_kv_cache(const rope_jit_rope_args& args, const TensorRef& k, const TensorRef& k_out,
                    const TensorRef& offsets, const TensorRef& q, RopeProblem& p) {
    TensorRef v = make_tensor_ref(args.v, "v");
    TensorRef k_cache = make_tensor_ref(args.k_cache, "k_cache");
    TensorRef v_cache = make_tensor_ref(args.v_cache, "v_cache");
    TensorRef slots = make_tensor_ref(args.slot_mapping, "slot_mapping", 1);
    TensorRef tables = make_tensor_ref(args.block_tables, "block_tables", 2);
    const int layout_value = raw_enum(args.kv_layout);
    if (layout_value < ROPE_JIT_KV_CACHE_NONE || layout_value > ROPE_JIT_KV_CACHE_PAGED_HND)
        fail_argument(fmt::format("kv_layout: unknown value {}", layout_value));
    const auto layout = static_cast<rope_jit_kv_cache_layout>(layout_value);
    if (layout == ROPE_JIT_KV_CACHE_NONE) {
        for (const TensorRef* t : {&v, &k_cache, &v_cache, &slots, &tables})
            if (t->present())
                fail_argument(
                    fmt::format("{}: given with kv_layout ROPE_JIT_KV_CACHE_NONE (no "
                                "KV cache); set kv_layout",
                                t->name));
        return;
    }
    if (!k_cache.present()) fail_argument("k_cache: required with kv_layout set");
    if (!p.has_k) fail_argument("k: required with a KV cache (k_cache)");
    if (k_out.present())
        fail_argument(
            "k_out: must be NULL with a KV cache: the rotated k is written to k_cache "
            "only (k is not modified)");
    if (p.backward) fail_argument("backward: a KV cache write is forward only");
    if (args.inv_freq_grad != nullptr)
        fail_argument("inv_freq_grad: not with a KV cache write (forward only)");
    for (const TensorRef* t : {&v, &k_cache, &v_cache, &slots, &tables})
        check_same_device(*t, p.device, q);

    const bool paged = layout != ROPE_JIT_KV_CACHE_CONTIGUOUS;
    if (paged && slots.present() == tables.present())
        fail_argument(slots.present()
                          ? "block_tables: give slot_mapping or block_tables, not both"
                          : "slot_mapping: a paged KV cache needs slot_mapping or block_tables");
    if (!paged && (slots.present() || tables.present()))
        fail_argument(
            fmt::format("{}: not used by ROPE_JIT_KV_CACHE_CONTIGUOUS (rows come "
                        "from seqlen_offsets or positions)",
                        slots.present() ? "slot_mapping" : "block_tables"));

    // The caches: their dtype, layout and heads.
    if (k_cache.dtype != p.dtype && k_cache.dtype != DType::F8E4M3)
        fail_argument(fmt::format("k_cache: dtype must be k's ({}) or float8_e4m3fn, got {}",
                                  dtype_name(p.dtype), dtype_name(k_cache.dtype)));
    const TensorRef k_view = cache_view(k_cache, layout);
    auto check_cache_shape = [&](const TensorRef& cache, const TensorRef& view, int64_t dim) {
        if (cache.ndim != 4 || view.shape[1] != p.heads_k || view.shape[3] != dim)
            fail_argument(fmt::format("{}: expected {} with Hk = {} and D = {}, got {}", cache.name,
                                      layout_dims(layout), p.heads_k, dim, cache.shape_string()));
    };
    check_cache_shape(k_cache, k_view, p.head_dim);
    if (!paged && k_view.shape[0] != p.num_sequences)
        fail_argument(fmt::format("k_cache: expected {} sequences (dimension 0 of {}), got {}",
                                  p.num_sequences, layout_dims(layout), k_cache.shape_string()));
    if (paged && k_view.shape[2] < 1)
        fail_argument(
            fmt::format("k_cache: block_size must be >= 1, got {}", k_cache.shape_string()));
    if (v.present() != v_cache.present())
        fail_argument(v.present() ? "v_cache: required when v is given"
                                  : "v: required when v_cache is given");
    TensorRef v_view;
    if (v.present()) {
        // head_dim 0 makes the call empty (RopeProblem::empty): v would be left uncopied.
        if (p.head_dim == 0)
            fail_argument(
                "v: a KV cache call with head_dim 0 (q and k without features) cannot copy v");
        if (v.ndim != k.ndim)
            fail_argument(fmt::format("v: expected {} dimensions like k ({}), got {}", k.ndim,
                                      k.shape_string(), v.shape_string()));
        if (v.dtype != p.dtype)
            fail_argument(fmt::format("v: dtype {} differs from k's {}", dtype_name(v.dtype),
                                      dtype_name(p.dtype)));
        const TensorRef v4 = p.packed ? lift_packed(v) : v;
        if (v4.shape[0] != p.k.shape[0] || v4.shape[1] != p.heads_k || v4.shape[2] != p.seqlen_k ||
            v4.shape[3] < 1)
            fail_argument(
                fmt::format("v: expected k's batch, heads and tokens ({}) with any "
                            "head_dim, got {}",
                            k.shape_string(), v.shape_string()));
        p.v = v4;
        p.v_head_dim = v4.shape[3];
        if (v_cache.dtype != k_cache.dtype)
            fail_argument(fmt::format("v_cache: dtype {} differs from k_cache's {}",
                                      dtype_name(v_cache.dtype), dtype_name(k_cache.dtype)));
        v_view = cache_view(v_cache, layout);
        check_cache_shape(v_cache, v_view, p.v_head_dim);
        if (v_view.shape[0] != k_view.shape[0] || v_view.shape[2] != k_view.shape[2])
            fail_argument(
                fmt::format("v_cache: {} has other blocks or block size than k_cache "
                            "{}",
                            v_cache.shape_string(), k_cache.shape_string()));
    }

    // The indices.
    const int64_t tokens = p.packed ? p.seqlen_k : p.batch * p.seqlen_k;
    if (slots.present()) {
        require_index(slots);
        if (slots.shape[0] != tokens)
            fail_argument(fmt::format("slot_mapping: expected [{}] (one per token of k), got {}",
                                      tokens, slots.shape_string()));
    }
    if (tables.present()) {
        require_index(tables);
        if (tables.ndim != 2 || tables.shape[0] != p.num_sequences || tables.shape[1] < 1)
            fail_argument(
                fmt::format("block_tables: expected [{}, max_blocks_per_seq >= 1], "
                            "got {}",
                            p.num_sequences, tables.shape_string()));
    }
    const bool positional = !paged || tables.present();  // the cache row is the position
    if (positional && p.multi_section() && !offsets.present())
        fail_argument(
            "seqlen_offsets: required for the KV cache rows with M-RoPE positions "
            "(a token's several positions give no cache row)");
    if (offsets.present() && p.position_mode == PositionMode::Indices) {
        // Positions give the table rows; seqlen_offsets still places the tokens in the cache.
        if (positional) {
            p.seqlen_offsets = offsets;
            p.kv_seqlen_offsets = true;
        }
    }
    p.kv_seqlen_offsets =
        p.kv_seqlen_offsets || (positional && p.position_mode == PositionMode::SeqlenOffsets);

    // FP8.
    p.kv_fp8 = k_cache.dtype == DType::F8E4M3;
    p.k_scale = check_scale(args.k_scale, "k_scale", p.kv_fp8, "k_cache", p, q);
    p.v_scale = check_scale(args.v_scale, "v_scale", p.kv_fp8 && v.present(), "v_cache", p, q);

    p.kv_layout = layout;
    p.has_kv_cache = true;
    p.has_v = v.present();
    p.kv_block_tables = tables.present();
    p.slot_mapping = slots;
    p.block_tables = tables;
    p.k_out = k_view;
    p.k_in_place = false;
    p.v_cache = v_view;
}

}  // namespace

RopeProblem make_rope_problem(const rope_jit_rope_args& args) {
    RopeProblem p;
    TensorRef q = make_tensor_ref(args.q, "q");
    if (!q.present()) fail_argument("q: required, got NULL");
    if (q.ndim != 4 && q.ndim != 3)
        fail_argument(
            fmt::format("q: expected 4 dimensions [B, H, S, D] or 3 dimensions [T, H, D], "
                        "got {} with shape {}",
                        q.ndim, q.shape_string()));
    require_float(q);
    p.packed = q.ndim == 3;
    p.dtype = q.dtype;
    p.device = q.device;

    TensorRef k = make_tensor_ref(args.k, "k");
    TensorRef q_out = make_tensor_ref(args.q_out, "q_out");
    TensorRef k_out = make_tensor_ref(args.k_out, "k_out");
    p.has_k = k.present();
    if (!p.has_k && k_out.present()) fail_argument("k_out: given without k");
    // An FP8 q_out (quantized, so never in place) has q's shape and its own dtype.
    p.q_fp8 = q_out.present() && q_out.dtype == DType::F8E4M3;
    if (q_out.present()) {
        TensorRef shape_only = q_out;
        if (p.q_fp8) shape_only.dtype = q.dtype;
        require_same_shape(shape_only, q);
    }
    if (p.has_k) {
        if (k.ndim != q.ndim)
            fail_argument(fmt::format("k: has {} dimensions {} but q has {} {}", k.ndim,
                                      k.shape_string(), q.ndim, q.shape_string()));
        if (k.dtype != q.dtype)
            fail_argument(fmt::format("k: dtype {} differs from q's {}", dtype_name(k.dtype),
                                      dtype_name(q.dtype)));
        if (k_out.present()) require_same_shape(k_out, k);
    }

    // Dimensions, in the lifted 4-D form.
    TensorRef q4 = p.packed ? lift_packed(q) : q;
    p.batch = q4.shape[0];
    p.heads_q = q4.shape[1];
    p.seqlen_q = q4.shape[2];
    p.head_dim = q4.shape[3];
    if (p.head_dim % 2 != 0)
        fail_argument(fmt::format("q: head_dim (last dimension) must be even, got {}", p.head_dim));
    TensorRef k4;
    if (p.has_k) {
        k4 = p.packed ? lift_packed(k) : k;
        p.heads_k = k4.shape[1];
        p.seqlen_k = k4.shape[2];
        if (k4.shape[3] != p.head_dim)
            fail_argument(
                fmt::format("k: head_dim {} differs from q's {}", k4.shape[3], p.head_dim));
        if (k4.shape[0] != p.batch)
            fail_argument(fmt::format("k: batch {} differs from q's {}", k4.shape[0], p.batch));
        // (Even beside a q with no heads: a k of no heads has no group to share, and it was
        // told that 0 heads are no multiple of 0 heads.)
        if (p.heads_k == 0)
            fail_argument(fmt::format(
                "k: has no heads ({}); GQA/MQA needs Hq = group * Hk with Hk >= 1 (k NULL "
                "rotates q alone)",
                k.shape_string()));
        if (p.heads_q % p.heads_k != 0)
            fail_argument(
                fmt::format("k: q has {} heads, which is not a multiple of k's {} heads "
                            "(GQA/MQA needs Hq = group * Hk)",
                            p.heads_q, p.heads_k));
        if (p.packed && p.seqlen_k != p.seqlen_q)
            fail_argument(
                fmt::format("k: packed k has {} tokens but q has {}", p.seqlen_k, p.seqlen_q));
    }

    p.rotary_dim = args.rotary_dim == 0 ? p.head_dim : args.rotary_dim;
    p.rotary_offset = args.rotary_offset;
    if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0)
        fail_argument(fmt::format("rotary_dim: must be even and positive (0 = head_dim), got {}",
                                  args.rotary_dim));
    if (p.rotary_offset < 0)
        fail_argument(fmt::format("rotary_offset: must be >= 0, got {}", args.rotary_offset));
    if (p.rotary_offset + p.rotary_dim > p.head_dim)
        fail_argument(
            fmt::format("rotary_dim: rotary_offset {} + rotary_dim {} exceeds head_dim {}",
                        p.rotary_offset, p.rotary_dim, p.head_dim));
    const int style = raw_enum(args.style);
    if (style != ROPE_JIT_STYLE_HALF && style != ROPE_JIT_STYLE_INTERLEAVED &&
        style != ROPE_JIT_STYLE_PROPORTIONAL)
        fail_argument(
            fmt::format("style: must be ROPE_JIT_STYLE_HALF, ROPE_JIT_STYLE_INTERLEAVED "
                        "or ROPE_JIT_STYLE_PROPORTIONAL, got {}",
                        style));
    // Proportional pairs are (i, i + D/2) from feature 0: an offset has no meaning there.
    if (style == ROPE_JIT_STYLE_PROPORTIONAL && p.rotary_offset != 0)
        fail_argument(
            fmt::format("rotary_offset: must be 0 with ROPE_JIT_STYLE_PROPORTIONAL "
                        "(pairs (i, i + head_dim/2)), got {}",
                        p.rotary_offset));
    p.style = args.style;
    p.backward = args.backward != 0;

    // Outputs and in-place checks (what else they may not meet is checked once every tensor
    // is known, below).
    p.q_in_place = !q_out.present() || same_view(q_out, q);
    const TensorRef q_write = q_out.present() ? q_out : q;
    check_output(q_write, q, p.q_in_place);
    p.q = q4;
    p.q_out = p.packed ? lift_packed(q_write) : q_write;
    // What the call writes of k: k_out, or k in place; nothing with a KV cache, where k is
    // only read (the cache is written, checked as an output by check_kv_cache, and k_out
    // becomes its view there): then any strides do, and check_written names q where k is q's
    // memory.
    TensorRef k_write;
    if (p.has_k) {
        p.k_in_place = !k_out.present() || same_view(k_out, k);
        p.k = k4;
        if (raw_enum(args.kv_layout) == ROPE_JIT_KV_CACHE_NONE) {
            k_write = k_out.present() ? k_out : k;
            check_output(k_write, k, p.k_in_place);
            if (p.q_in_place && p.k_in_place && q.numel() > 0 && same_view(k, q))
                fail_argument("k: is the same memory as q; it would be rotated twice");
            p.k_out = p.packed ? lift_packed(k_write) : k_write;
        }
    }

    // Angle source.
    TensorRef cos = make_tensor_ref(args.cos, "cos");
    TensorRef sin = make_tensor_ref(args.sin, "sin");
    TensorRef inv_freq = make_tensor_ref(args.inv_freq, "inv_freq");
    if (cos.present() != sin.present())
        fail_argument(cos.present() ? "sin: NULL while cos is given; pass both tables or neither"
                                    : "cos: NULL while sin is given; pass both tables or neither");
    if (cos.present()) {
        p.angles = AngleSource::Table;
        check_table(cos, p.rotary_dim);
        check_table(sin, p.rotary_dim);
        if (sin.shape[0] != cos.shape[0] || sin.shape[1] != cos.shape[1])
            fail_argument(fmt::format("sin: shape {} differs from cos {}", sin.shape_string(),
                                      cos.shape_string()));
        // One table dtype specializes the kernel, which reads both tables as it.
        if (sin.dtype != cos.dtype)
            fail_argument(fmt::format("sin: dtype {} differs from cos's {}", dtype_name(sin.dtype),
                                      dtype_name(cos.dtype)));
        p.table_full = cos.shape[1] == p.rotary_dim;
        p.table_rows = cos.shape[0];
        p.cos = cos;
        p.sin = sin;
    } else if (inv_freq.present()) {
        p.angles = AngleSource::InvFreq;
        require_float(inv_freq);
        if (inv_freq.ndim != 1 || inv_freq.shape[0] != p.rotary_dim / 2)
            fail_argument(fmt::format("inv_freq: expected [{}] (rotary_dim / 2), got {}",
                                      p.rotary_dim / 2, inv_freq.shape_string()));
        p.inv_freq = inv_freq;
    } else {
        fail_argument("cos/sin: no angles given: pass cos and sin tables, or inv_freq");
    }

    TensorRef xpos = make_tensor_ref(args.xpos_scale, "xpos_scale");
    if (xpos.present()) {
        check_table(xpos, p.rotary_dim);
        if (p.angles == AngleSource::Table &&
            (xpos.shape[0] != p.table_rows || xpos.shape[1] != cos.shape[1]))
            fail_argument(fmt::format("xpos_scale: shape {} differs from cos {}",
                                      xpos.shape_string(), cos.shape_string()));
        if (p.angles == AngleSource::InvFreq) {
            p.table_full = xpos.shape[1] == p.rotary_dim;
            p.table_rows = xpos.shape[0];
        }
        p.xpos_scale = xpos;
        p.has_xpos = true;
    }

    // Positions. With M-RoPE sections they carry a leading axis, one per section.
    const bool multi_section = args.num_mrope_sections != 0;
    if (args.num_mrope_sections < 0)
        fail_argument(fmt::format("num_mrope_sections: must be >= 0 (0 = none), got {}",
                                  args.num_mrope_sections));
    if (!multi_section && args.mrope_sections != nullptr)
        fail_argument(
            "mrope_sections: given with num_mrope_sections = 0; set the number of sections");
    if (multi_section) {
        p.pair_axis =
            pair_axes_from_sections(args.mrope_sections, args.num_mrope_sections,
                                    args.mrope_interleaved != 0, p.pairs(), "mrope_sections");
        p.num_position_axes = args.num_mrope_sections;
        if (args.positions == nullptr)
            fail_argument(fmt::format(
                "positions: required with mrope_sections ([{}, S], [{}, B, S] or [{}, T]: "
                "one position per section and token)",
                p.num_position_axes, p.num_position_axes, p.num_position_axes));
    }
    TensorRef positions = make_tensor_ref(args.positions, "positions", multi_section ? 3 : 2);
    TensorRef offsets = make_tensor_ref(args.seqlen_offsets, "seqlen_offsets", 1);
    TensorRef cu_seqlens = make_tensor_ref(args.cu_seqlens, "cu_seqlens", 1);
    p.num_sequences = p.batch;
    if (cu_seqlens.present()) {
        if (!p.packed)
            fail_argument(fmt::format("cu_seqlens: only valid with packed q [T, H, D]; q is {}",
                                      q.shape_string()));
        require_index(cu_seqlens);
        if (cu_seqlens.shape[0] < 2)
            fail_argument(fmt::format("cu_seqlens: expected [B + 1] with B >= 1, got {}",
                                      cu_seqlens.shape_string()));
        p.num_sequences = cu_seqlens.shape[0] - 1;
        p.cu_seqlens = cu_seqlens;
    }
    // Checked wherever given, also beside positions (which then give the table rows).
    if (offsets.present()) {
        require_index(offsets);
        if (offsets.shape[0] != p.num_sequences)
            fail_argument(fmt::format("seqlen_offsets: expected [{}] (one per sequence), got {}",
                                      p.num_sequences, offsets.shape_string()));
    }
    if (positions.present()) {
        require_index(positions);
        p.position_mode = PositionMode::Indices;
        // With sections, the leading axis counts them and the rest is shaped as usual.
        const int lead = multi_section ? 1 : 0;
        const int64_t* dims = positions.shape + lead;
        const int token_ndim = positions.ndim - lead;
        bool ok = token_ndim == 1   ? dims[0] == p.seqlen_q
                  : token_ndim == 2 ? !p.packed && dims[0] == p.batch && dims[1] == p.seqlen_q
                                    : false;
        if (multi_section && positions.shape[0] != p.num_position_axes) ok = false;
        const std::string axes =
            multi_section ? fmt::format("{}, ", p.num_position_axes) : std::string();
        const std::string axes_name = multi_section ? "A, " : "";
        if (!ok)
            fail_argument(fmt::format(
                "positions: expected {}, got {}{}",
                p.packed ? fmt::format("[{}T] = [{}{}]", axes_name, axes, p.seqlen_q)
                         : fmt::format("[{}S] = [{}{}] or [{}B, S] = [{}{}, {}]", axes_name, axes,
                                       p.seqlen_q, axes_name, axes, p.batch, p.seqlen_q),
                positions.shape_string(), multi_section ? " (A = num_mrope_sections)" : ""));
        if (p.has_k && p.seqlen_k != p.seqlen_q)
            fail_argument(
                fmt::format("positions: q has {} tokens and k {}; per-token positions need "
                            "the same number",
                            p.seqlen_q, p.seqlen_k));
        p.positions = positions;
    } else if (offsets.present()) {
        p.position_mode = PositionMode::SeqlenOffsets;
        p.seqlen_offsets = offsets;
    } else {
        p.position_mode = PositionMode::Implicit;
    }
    p.position_offset = args.position_offset;
    p.q_position_offset = args.q_position_offset;
    // Token index plus offsets must not overflow: no table has 2^53 rows, and no angle is
    // exact beyond 2^53 either.
    constexpr int64_t kMaxOffset = int64_t(1) << 53;
    if (p.position_offset <= -kMaxOffset || p.position_offset >= kMaxOffset)
        fail_argument(fmt::format("position_offset: {} is out of range (|offset| < 2^53)",
                                  p.position_offset));
    if (p.q_position_offset <= -kMaxOffset || p.q_position_offset >= kMaxOffset)
        fail_argument(fmt::format("q_position_offset: {} is out of range (|offset| < 2^53)",
                                  p.q_position_offset));

    // Learned frequencies: d(loss)/d(inv_freq) from the gradients (q, k) and the forward
    // outputs (q_saved, k_saved).
    TensorRef freq_grad = make_tensor_ref(args.inv_freq_grad, "inv_freq_grad", 1);
    TensorRef q_saved = make_tensor_ref(args.q_saved, "q_saved");
    TensorRef k_saved = make_tensor_ref(args.k_saved, "k_saved");
    if (freq_grad.present()) {
        if (!p.backward)
            fail_argument(
                "inv_freq_grad: only defined for the backward pass (backward = 1, q and k holding "
                "gradients)");
        if (p.angles != AngleSource::InvFreq)
            fail_argument(
                "inv_freq_grad: needs angles from inv_freq (cos and sin NULL); there is no "
                "gradient "
                "with respect to a table");
        if (freq_grad.dtype != DType::F32 || freq_grad.shape[0] != p.pairs())
            fail_argument(
                fmt::format("inv_freq_grad: expected float32 [{}] (rotary_dim / 2), got {} {}",
                            p.pairs(), dtype_name(freq_grad.dtype), freq_grad.shape_string()));
        if (!q_saved.present())
            fail_argument("q_saved: required with inv_freq_grad (the forward pass's rotated q)");
        require_same_shape(q_saved, q);
        if (p.has_k) {
            if (!k_saved.present())
                fail_argument(
                    "k_saved: required with inv_freq_grad when k is given (the forward pass's "
                    "rotated k)");
            require_same_shape(k_saved, k);
        } else if (k_saved.present()) {
            fail_argument("k_saved: given without k");
        }
        p.q_saved = p.packed ? lift_packed(q_saved) : q_saved;
        if (p.has_k) p.k_saved = p.packed ? lift_packed(k_saved) : k_saved;
        // The saved outputs are read while q_out/k_out are written, and the gradient is
        // written last: none may share memory with what the call writes.
        for (const TensorRef* written : {&p.q_out, &p.k_out})
            for (const TensorRef* read : {&p.q_saved, &p.k_saved})
                if (written->present() && read->present() && extents_overlap(*written, *read))
                    fail_argument(fmt::format(
                        "{}: overlaps the output {} (in-place outputs are q and k); keep the "
                        "forward outputs in their own memory",
                        read->name, written->name));
        check_written(freq_grad,
                      {&p.q, &p.q_out, &p.k, &p.k_out, &p.q_saved, &p.k_saved, &cos, &sin,
                       &inv_freq, &xpos, &positions, &offsets, &cu_seqlens},
                      MemoryRule::ByteRanges);
        p.inv_freq_grad = freq_grad;
        p.has_freq_grad = true;
    } else if (q_saved.present() || k_saved.present()) {
        fail_argument(fmt::format("{}: only used with inv_freq_grad, which is NULL",
                                  q_saved.present() ? "q_saved" : "k_saved"));
    }

    // One device for everything.
    for (const TensorRef* t : {&k, &q_out, &k_out, &cos, &sin, &inv_freq, &xpos, &positions,
                               &offsets, &cu_seqlens, &freq_grad, &q_saved, &k_saved})
        check_same_device(*t, p.device, q);
    check_kv_cache(args, k, k_out, offsets, q, p);
    p.q_scale = check_scale(args.q_scale, "q_scale", p.q_fp8, "q_out", p, q);
    // A KV cache call writes the caches instead of k (k_out is the k cache's view then).
    const TensorRef no_tensor;
    const TensorRef& k_cache = p.has_kv_cache ? p.k_out : no_tensor;
    check_qk_norm(args, q, k, q_write, k_write,
                  {cos, sin, inv_freq, xpos, positions, offsets, cu_seqlens, freq_grad, q_saved,
                   k_saved},
                  p);
    if (p.q_fp8 && (p.backward || p.has_freq_grad))
        fail_argument("q_out: float8_e4m3fn only in the forward (backward = 0)");

    // What the call writes (q_out, or q in place; k likewise) shares no element with anything
    // else it reads or writes: a q_out on k's memory would change k before k is read, a k two
    // tokens into q would be rotated twice, positions under q would change while in use.
    // Views of one buffer that only interleave (q and k of a fused qkv) pass.
    check_written(q_write,
                  {&k, &k_write, &cos, &sin, &inv_freq, &xpos, &positions, &offsets, &cu_seqlens,
                   &p.v, &k_cache, &p.v_cache, &p.slot_mapping, &p.block_tables, &p.k_scale,
                   &p.v_scale, &p.q_scale},
                  MemoryRule::Elements);
    if (k_write.present())
        check_written(
            k_write,
            {&q, &cos, &sin, &inv_freq, &xpos, &positions, &offsets, &cu_seqlens, &p.q_scale},
            MemoryRule::Elements);
    for (const TensorRef* cache : {&k_cache, static_cast<const TensorRef*>(&p.v_cache)})
        if (cache->present())
            check_written(*cache,
                          {&q, &q_write, &k, &p.v, &k_cache, &p.v_cache, &cos, &sin, &inv_freq,
                           &xpos, &positions, &offsets, &cu_seqlens, &p.slot_mapping,
                           &p.block_tables, &p.k_scale, &p.v_scale, &p.q_scale,
                           &p.q_norm_weight, &p.k_norm_weight},
                          MemoryRule::Elements);

    // Implicit positions need no memory read: check their range here for every backend.
    if (p.position_mode == PositionMode::Implicit && !p.cu_seqlens.present()) {
        const int64_t limit = position_limit(p);
        auto check_range = [&](int64_t first, int64_t tokens, const char* who) {
            if (tokens == 0) return;
            const int64_t last = last_table_row(first, tokens);
            if (first >= 0 && last < limit) return;
            const bool q_offset = p.q_position_offset != 0 && who[0] == 'q';
            const std::string offset_text =
                fmt::format("position_offset {}{}", p.position_offset,
                            q_offset ? fmt::format(", q_position_offset {}", p.q_position_offset)
                                     : std::string());
            if (bounds_by_table(p))
                fail_argument(fmt::format("{}: {} uses table rows {}..{} ({}), but the table "
                                          "has {} rows",
                                          bounding_table(p), who, first, last, offset_text,
                                          p.table_rows));
            fail_argument(fmt::format("{}: {} uses positions {}..{} ({}), but {}",
                                      q_offset ? "q_position_offset" : "position_offset", who,
                                      first, last, offset_text, kInvFreqPositions));
        };
        check_range(p.position_offset + p.q_position_offset, p.seqlen_q, "q");
        if (p.has_k) check_range(p.position_offset, p.seqlen_k, "k");
    }
    return p;
}

// The table-row checks of check_positions_on_host (defined after it).
void check_positions_on_host_rows(const RopeProblem& p);

bool cache_slot_on_host(const RopeProblem& p, int64_t b, int64_t s, int64_t sequence, int64_t index,
                        CacheSlot* out) {
    const int64_t slots = p.cache_slots(), blocks = p.cache_blocks();
    if (p.kv_layout != ROPE_JIT_KV_CACHE_CONTIGUOUS && !p.kv_block_tables) {
        const int64_t token = b * p.seqlen_k + s;
        const int64_t slot = IndexReader(p.slot_mapping)[token];
        if (slot < 0) return false;  // a padding token: skipped
        if (slot / slots >= blocks)
            fail_argument(
                fmt::format("slot_mapping: token {} has slot {}, outside the cache's {} "
                            "blocks of {} slots",
                            token, slot, blocks, slots));
        *out = CacheSlot{slot / slots, slot % slots};
        return true;
    }
    // The token's position in its sequence's cache (rope_jit_rope_args' rule).
    int64_t position;
    const char* source;
    if (p.kv_seqlen_offsets) {
        // Beside positions the offsets are not range-checked as table rows: check the sum.
        const int64_t offset = IndexReader(p.seqlen_offsets)[sequence];
        if (__builtin_add_overflow(index, offset, &position))
            fail_argument(fmt::format("seqlen_offsets: [{}] = {} overflows a cache position",
                                      sequence, offset));
        source = "seqlen_offsets";
    } else if (p.position_mode == PositionMode::Indices) {
        IndexReader positions(p.positions);
        position = p.positions.ndim == 2 ? positions(b, s) : positions[s];
        source = "positions";
    } else {
        position = index + p.position_offset;
        source = "position_offset";
    }
    if (p.kv_layout == ROPE_JIT_KV_CACHE_CONTIGUOUS) {
        if (position < 0 || position >= slots)
            fail_argument(
                fmt::format("k_cache: token {} of sequence {} goes to cache row {} "
                            "(from {}), outside the cache's {} rows (S_max)",
                            index, sequence, position, source, slots));
        *out = CacheSlot{sequence, position};
        return true;
    }
    const int64_t entry = position < 0 ? -1 : position / slots;
    if (entry < 0 || entry >= p.block_tables.shape[1])
        fail_argument(
            fmt::format("block_tables: token {} of sequence {} has cache position {} "
                        "(from {}), outside its {} blocks of {} slots",
                        index, sequence, position, source, p.block_tables.shape[1], slots));
    const int64_t block = IndexReader(p.block_tables)(sequence, entry);
    if (block < 0 || block >= blocks)
        fail_argument(fmt::format("block_tables: [{}, {}] = {} is outside the cache's {} blocks",
                                  sequence, entry, block, blocks));
    *out = CacheSlot{block, position % slots};
    return true;
}

namespace {

// Every token of k has a slot inside the cache (or is skipped): cache_slot_on_host throws for
// the first that does not.
void check_cache_slots(const RopeProblem& p) {
    std::vector<int64_t> starts;  // sequence starts of a packed batch
    if (p.cu_seqlens.present()) {
        IndexReader cu(p.cu_seqlens);
        for (int64_t i = 0; i <= p.num_sequences; ++i) starts.push_back(cu[i]);
    }
    int64_t sequence = 0;
    for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t s = 0; s < p.seqlen_k; ++s) {
            int64_t index = s;
            if (!starts.empty()) {
                while (sequence + 1 < p.num_sequences && starts[size_t(sequence + 1)] <= s)
                    ++sequence;
                index = s - starts[size_t(sequence)];
            } else {
                sequence = b;
            }
            CacheSlot slot{};
            cache_slot_on_host(p, b, s, sequence, index, &slot);
        }
}

}  // namespace

void check_positions_on_host(const RopeProblem& p) {
    check_positions_on_host_rows(p);
    if (p.has_kv_cache) check_cache_slots(p);
}

void check_positions_on_host_rows(const RopeProblem& p) {
    const bool bounded = bounds_by_table(p);
    const int64_t limit = position_limit(p);
    auto fail_row = [&](int64_t row, const char* source, const std::string& where) {
        if (bounded)
            fail_argument(fmt::format("{}: {} gives table row {}, outside {}'s {} rows", source,
                                      where, row, bounding_table(p), p.table_rows));
        fail_argument(
            fmt::format("{}: {} gives position {}, but {}", source, where, row, kInvFreqPositions));
    };

    if (p.cu_seqlens.present()) {
        IndexReader cu(p.cu_seqlens);
        if (cu[0] != 0) fail_argument(fmt::format("cu_seqlens: must start at 0, got {}", cu[0]));
        for (int64_t b = 0; b < p.num_sequences; ++b)
            if (cu[b + 1] < cu[b])
                fail_argument(fmt::format("cu_seqlens: decreases at index {} ({} then {})", b + 1,
                                          cu[b], cu[b + 1]));
        if (cu[p.num_sequences] != p.seqlen_q)
            fail_argument(fmt::format("cu_seqlens: ends at {} but q has {} tokens",
                                      cu[p.num_sequences], p.seqlen_q));
    }

    if (p.position_mode == PositionMode::Indices) {
        // Every axis of M-RoPE positions is checked like one-axis positions.
        const int64_t axes = p.multi_section() ? p.num_position_axes : 1;
        for (int64_t a = 0; a < axes; ++a) {
            const TensorRef view = p.position_axis(a);
            IndexReader pos(view);
            const int64_t rows = view.ndim == 2 ? p.batch : 1;
            for (int64_t b = 0; b < rows; ++b)
                for (int64_t s = 0; s < p.seqlen_q; ++s) {
                    const int64_t row = view.ndim == 2 ? pos(b, s) : pos[s];
                    if (row >= 0 && row < limit) continue;
                    // The message is built only for the row that fails.
                    const std::string axis =
                        p.multi_section() ? fmt::format("{}, ", a) : std::string();
                    fail_row(row, "positions",
                             view.ndim == 2 ? fmt::format("[{}{}, {}]", axis, b, s)
                                            : fmt::format("[{}{}]", axis, s));
                }
        }
        return;
    }

    // Per-sequence lengths: B sequences of S (or of the cu_seqlens lengths when packed).
    auto sequence_length = [&](int64_t b, bool is_q) -> int64_t {
        if (p.cu_seqlens.present()) {
            IndexReader cu(p.cu_seqlens);
            return cu[b + 1] - cu[b];
        }
        return is_q ? p.seqlen_q : p.seqlen_k;
    };
    auto check_sequence = [&](int64_t b, int64_t first, bool is_q, const char* source) {
        int64_t length = sequence_length(b, is_q);
        if (length == 0) return;
        const int64_t last = last_table_row(first, length);
        if (first >= 0 && last < limit) return;
        if (bounded)
            fail_argument(fmt::format(
                "{}: sequence {} of {} uses table rows {}..{}, but {} has {} rows", source, b,
                is_q ? "q" : "k", first, last, bounding_table(p), p.table_rows));
        fail_argument(fmt::format("{}: sequence {} of {} uses positions {}..{}, but {}", source, b,
                                  is_q ? "q" : "k", first, last, kInvFreqPositions));
    };
    if (p.position_mode == PositionMode::SeqlenOffsets) {
        IndexReader offsets(p.seqlen_offsets);
        for (int64_t b = 0; b < p.num_sequences; ++b) {
            check_sequence(b, offsets[b], true, "seqlen_offsets");
            if (p.has_k) check_sequence(b, offsets[b], false, "seqlen_offsets");
        }
    } else if (p.cu_seqlens.present()) {
        for (int64_t b = 0; b < p.num_sequences; ++b) {
            check_sequence(b, p.position_offset + p.q_position_offset, true, "position_offset");
            if (p.has_k) check_sequence(b, p.position_offset, false, "position_offset");
        }
    }
}

}  // namespace rope_jit
