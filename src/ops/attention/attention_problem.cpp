#include "ops/attention/attention_problem.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <fmt/format.h>

#include "common/error.h"
#include "common/raw_enum.h"
#include "ops/attention/attention_workspace.h"

namespace rope_jit {

namespace {

// Outputs are refused when their byte range meets another tensor's, even where the views only
// interleave: outputs packed into one buffer (a dqkv) are not supported.
constexpr MemoryRule kRule = MemoryRule::ByteRanges;

void require_float_dtype(const TensorRef& t) {
    if (!is_float(t.dtype))
        fail_argument(fmt::format("{}: dtype must be float32, float16 or bfloat16, got {}", t.name,
                                  dtype_name(t.dtype)));
}

// A [B, H, S, D] tensor with its expected dims (-1 = any); `like` names the tensor the
// expected dims come from, for the message.
void require_shape4(const TensorRef& t, int64_t b, int64_t h, int64_t s, int64_t d,
                    const char* like) {
    if (t.ndim != 4)
        fail_argument(fmt::format("{}: expected 4 dimensions [B, H, S, D], got {}", t.name,
                                  t.shape_string()));
    const int64_t expected[4] = {b, h, s, d};
    for (int i = 0; i < 4; ++i)
        if (expected[i] >= 0 && t.shape[i] != expected[i])
            fail_argument(fmt::format("{}: shape {} does not match {} (dimension {} should be {})",
                                      t.name, t.shape_string(), like, i, expected[i]));
}

void require_same_dtype(const TensorRef& t, const TensorRef& reference) {
    if (t.dtype != reference.dtype)
        fail_argument(fmt::format("{}: dtype {} differs from {}'s {}", t.name, dtype_name(t.dtype),
                                  reference.name, dtype_name(reference.dtype)));
}

void require_same_device(const TensorRef& t, const TensorRef& reference) {
    if (!t.present()) return;
    if (t.device.device_type != reference.device.device_type ||
        t.device.device_id != reference.device.device_id)
        fail_argument(fmt::format(
            "{}: lives on {} device {}, but {} lives on {} device {}; every tensor of a "
            "call must be on one device",
            t.name, device_name(t.device.device_type), t.device.device_id, reference.name,
            device_name(reference.device.device_type), reference.device.device_id));
}

// A view with the same data as `t` and explicit dims, for the normalized mask views.
TensorRef view3(const TensorRef& t, const int64_t shape[3], const int64_t strides[3]) {
    TensorRef v = t;
    v.ndim = 3;
    for (int i = 0; i < 3; ++i) {
        v.shape[i] = shape[i];
        v.strides[i] = strides[i];
    }
    v.shape[3] = v.strides[3] = 0;
    return v;
}

// The caller's workspace as far as it can be checked without the kernel choice (its size is
// checked against the kernels' need by the CUDA backend): every backend refuses the same
// arguments, whether or not it uses the memory.
void check_workspace_argument(const rope_jit_attention_args& args) {
    if (args.workspace == nullptr) {
        if (args.workspace_bytes != 0)
            fail_argument(fmt::format("workspace_bytes: {} with a NULL workspace (0 when the "
                                      "library is to allocate the workspace itself)",
                                      args.workspace_bytes));
        return;
    }
    const uintptr_t address = reinterpret_cast<uintptr_t>(args.workspace);
    if (address % kAttentionWorkspaceAlignment != 0)
        fail_argument(fmt::format("workspace: address {:#x} is not {}-byte aligned", address,
                                  kAttentionWorkspaceAlignment));
}

// The caller's workspace as a 1-D byte tensor (absent without one), for the overlap checks.
TensorRef workspace_ref(const AttentionProblem& p, DLDevice device) {
    TensorRef w;
    if (p.workspace == nullptr || p.workspace_bytes == 0) return w;
    w.name = "workspace";
    w.dtype = DType::U8;
    w.data = p.workspace;
    w.device = device;
    w.ndim = 1;
    w.shape[0] = int64_t(std::min<size_t>(p.workspace_bytes, size_t(INT64_MAX)));
    w.strides[0] = 1;
    return w;
}

// A backward-only tensor given to the forward, as a tensor whose memory the forward's outputs
// may not meet; an empty TensorRef where it is no valid tensor (the forward ignores it).
TensorRef given_to_forward(const DLTensor* tensor, const char* name) {
    try {
        return make_tensor_ref(tensor, name);
    } catch (const Error&) {
        return TensorRef();
    }
}

}  // namespace

AttentionProblem make_attention_problem(const rope_jit_attention_args& args, bool backward) {
    AttentionProblem p;
    p.backward = backward;

    TensorRef q = make_tensor_ref(args.q, "q");
    TensorRef k = make_tensor_ref(args.k, "k");
    TensorRef v = make_tensor_ref(args.v, "v");
    TensorRef out = make_tensor_ref(args.out, "out");
    for (const TensorRef* t : {&q, &k, &v, &out})
        if (!t->present()) fail_argument(fmt::format("{}: required, got NULL", t->name));
    require_shape4(q, -1, -1, -1, -1, "q");
    require_float_dtype(q);
    p.dtype = q.dtype;
    p.device = q.device;
    p.batch = q.shape[0];
    p.heads_q = q.shape[1];
    p.seqlen_q = q.shape[2];
    p.head_dim = q.shape[3];
    if (p.head_dim == 0) fail_argument("q: head_dim (last dimension) is 0");

    require_shape4(k, p.batch, -1, -1, p.head_dim, "q's batch and head_dim");
    p.heads_k = k.shape[1];
    p.seqlen_k = k.shape[2];
    if (p.heads_k == 0)
        fail_argument(
            fmt::format("k: has no heads ({}); GQA/MQA needs Hq = group * Hk with Hk >= 1",
                        k.shape_string()));
    if (p.heads_q % p.heads_k != 0)
        fail_argument(
            fmt::format("k: q has {} heads, which is not a multiple of k's {} heads (GQA/MQA needs "
                        "Hq = group * Hk)",
                        p.heads_q, p.heads_k));
    require_shape4(v, p.batch, p.heads_k, p.seqlen_k, p.head_dim, "k");
    require_shape4(out, p.batch, p.heads_q, p.seqlen_q, p.head_dim, "q");
    for (const TensorRef* t : {&k, &v, &out}) require_same_dtype(*t, q);

    // Rotation.
    TensorRef cos = make_tensor_ref(args.cos, "cos");
    TensorRef sin = make_tensor_ref(args.sin, "sin");
    if (cos.present() != sin.present())
        fail_argument(cos.present() ? "sin: NULL while cos is given; pass both tables or neither"
                                    : "cos: NULL while sin is given; pass both tables or neither");
    const int style = raw_enum(args.style);
    if (style != ROPE_JIT_STYLE_HALF && style != ROPE_JIT_STYLE_INTERLEAVED)
        fail_argument(fmt::format(
            "style: must be ROPE_JIT_STYLE_HALF or ROPE_JIT_STYLE_INTERLEAVED, got {}", style));
    p.style = args.style;
    const int64_t max_tokens = std::max(p.seqlen_q, p.seqlen_k);
    if (cos.present()) {
        p.rotate = true;
        p.rotary_dim = args.rotary_dim == 0 ? p.head_dim : args.rotary_dim;
        if (p.rotary_dim <= 0 || p.rotary_dim % 2 != 0)
            fail_argument(
                args.rotary_dim == 0
                    ? fmt::format(
                          "rotary_dim: 0 means head_dim, {}, which is odd; rotation needs an "
                          "even rotary_dim (pass one, or no cos/sin)",
                          p.head_dim)
                    : fmt::format("rotary_dim: must be even and positive (0 = head_dim), got {}",
                                  args.rotary_dim));
        if (p.rotary_dim > p.head_dim)
            fail_argument(
                fmt::format("rotary_dim: {} exceeds head_dim {}", p.rotary_dim, p.head_dim));
        for (const TensorRef* t : {&cos, &sin}) {
            require_float_dtype(*t);
            if (t->ndim != 2 || (t->shape[1] != p.rotary_dim / 2 && t->shape[1] != p.rotary_dim))
                fail_argument(fmt::format(
                    "{}: expected [P, {}] (half table) or [P, {}] (full table) for "
                    "rotary_dim {}, got {}",
                    t->name, p.rotary_dim / 2, p.rotary_dim, p.rotary_dim, t->shape_string()));
        }
        if (sin.shape[0] != cos.shape[0] || sin.shape[1] != cos.shape[1])
            fail_argument(fmt::format("sin: shape {} differs from cos {}", sin.shape_string(),
                                      cos.shape_string()));
        if (sin.dtype != cos.dtype)
            fail_argument(fmt::format("sin: dtype {} differs from cos's {}", dtype_name(sin.dtype),
                                      dtype_name(cos.dtype)));
        if (cos.shape[0] < max_tokens)
            fail_argument(
                fmt::format("cos: has {} rows, but token s reads row s and there are {} tokens "
                            "(max of Sq = {} and Sk = {})",
                            cos.shape[0], max_tokens, p.seqlen_q, p.seqlen_k));
        p.table_full = cos.shape[1] == p.rotary_dim;
        p.cos = cos;
        p.sin = sin;
    }

    TensorRef pos_mask = make_tensor_ref(args.pos_mask, "pos_mask", 2);
    if (pos_mask.present()) {
        if (!p.rotate) fail_argument("pos_mask: given without cos/sin; it selects rotated tokens");
        if (pos_mask.dtype != DType::U8)
            fail_argument(fmt::format("pos_mask: dtype must be bool or uint8, got {}",
                                      dtype_name(pos_mask.dtype)));
        const int64_t n = pos_mask.shape[pos_mask.ndim - 1];
        if (n < max_tokens)
            fail_argument(fmt::format(
                "pos_mask: has {} entries per sequence, fewer than the {} tokens", n, max_tokens));
        if (pos_mask.ndim == 2 && pos_mask.shape[0] != p.batch && pos_mask.shape[0] != 1)
            fail_argument(fmt::format("pos_mask: expected [N] or [B, N] with B = {}, got {}",
                                      p.batch, pos_mask.shape_string()));
        TensorRef view = pos_mask;
        view.ndim = 2;
        view.shape[0] = p.batch;
        view.shape[1] = n;
        view.strides[0] = pos_mask.ndim == 2 && pos_mask.shape[0] != 1 ? pos_mask.strides[0] : 0;
        view.strides[1] = pos_mask.strides[pos_mask.ndim - 1];
        p.pos_mask = view;
        p.has_pos_mask = true;
    }

    TensorRef mask = make_tensor_ref(args.attn_mask, "attn_mask");
    if (mask.present()) {
        if (mask.dtype == DType::U8)
            p.mask_kind = AttentionMaskKind::Bool;
        else if (is_float(mask.dtype))
            p.mask_kind = AttentionMaskKind::Additive;
        else
            fail_argument(fmt::format(
                "attn_mask: dtype must be bool/uint8 (keep where nonzero) or float (added "
                "to the scores), got {}",
                dtype_name(mask.dtype)));
        const bool per_query = mask.ndim == 3;
        const bool shape_ok = (mask.ndim == 2 || mask.ndim == 3) &&
                              (mask.shape[0] == p.batch || mask.shape[0] == 1) &&
                              mask.shape[mask.ndim - 1] == p.seqlen_k &&
                              (!per_query || mask.shape[1] == p.seqlen_q);
        if (!shape_ok)
            fail_argument(fmt::format(
                "attn_mask: expected [B, Sk] = [{}, {}] or [B, Sq, Sk] = [{}, {}, {}] (B may "
                "be 1), got {}{}",
                p.batch, p.seqlen_k, p.batch, p.seqlen_q, p.seqlen_k, mask.shape_string(),
                mask.ndim == 4 ? " (a [B, 1, Sq, Sk] mask as HF builds it passes as mask[:, 0])"
                               : ""));
        const int64_t shape[3] = {p.batch, p.seqlen_q, p.seqlen_k};
        const int64_t strides[3] = {mask.shape[0] == 1 ? 0 : mask.strides[0],
                                    per_query ? mask.strides[1] : 0, mask.strides[mask.ndim - 1]};
        p.attn_mask = view3(mask, shape, strides);
    }

    p.causal = args.causal != 0;
    p.deterministic = args.deterministic != 0;
    check_workspace_argument(args);
    p.workspace = static_cast<char*>(args.workspace);
    p.workspace_bytes = args.workspace_bytes;
    if (!std::isfinite(args.scale))
        fail_argument(
            fmt::format("scale: must be finite (0 = 1/sqrt(head_dim)), got {}", args.scale));
    p.scale = args.scale == 0.0 ? 1.0 / std::sqrt(double(p.head_dim)) : args.scale;

    TensorRef lse = make_tensor_ref(args.lse, "lse", 3);
    if (lse.present()) {
        if (lse.dtype != DType::F32)
            fail_argument(fmt::format("lse: dtype must be float32, got {}", dtype_name(lse.dtype)));
        if (lse.ndim != 3 || lse.shape[0] != p.batch || lse.shape[1] != p.heads_q ||
            lse.shape[2] != p.seqlen_q)
            fail_argument(fmt::format("lse: expected [B, Hq, Sq] = [{}, {}, {}], got {}", p.batch,
                                      p.heads_q, p.seqlen_q, lse.shape_string()));
        p.lse = lse;
        p.has_lse = true;
    } else if (backward) {
        fail_argument("lse: required by the backward (pass the forward's lse output)");
    }

    p.q = q;
    p.k = k;
    p.v = v;
    p.out = out;
    for (const TensorRef* t : {&k, &v, &out, &cos, &sin, &pos_mask, &mask, &lse})
        require_same_device(*t, q);
    // The caller's workspace as bytes on q's device: the kernels write it, so it may share
    // memory with no tensor of the call.
    const TensorRef workspace = workspace_ref(p, q.device);

    if (!backward) {
        // The backward's tensors, when one args struct serves both calls: ignored, but still
        // the caller's memory, which out and lse were written over (overlap audit, session
        // 40). Only their memory matters here: one the backward would refuse is no tensor.
        const TensorRef dout = given_to_forward(args.dout, "dout");
        const TensorRef dq = given_to_forward(args.dq, "dq");
        const TensorRef dk = given_to_forward(args.dk, "dk");
        const TensorRef dv = given_to_forward(args.dv, "dv");
        check_written(out, {&q, &k, &v, &cos, &sin, &pos_mask, &mask, &lse, &dout, &dq, &dk, &dv},
                      kRule);
        if (p.has_lse)
            check_written(lse,
                          {&q, &k, &v, &out, &cos, &sin, &pos_mask, &mask, &dout, &dq, &dk, &dv},
                          kRule);
        if (workspace.present())
            check_written(workspace,
                          {&q, &k, &v, &out, &cos, &sin, &pos_mask, &mask, &lse, &dout, &dq, &dk,
                           &dv},
                          kRule);
        return p;
    }

    TensorRef dout = make_tensor_ref(args.dout, "dout");
    TensorRef dq = make_tensor_ref(args.dq, "dq");
    TensorRef dk = make_tensor_ref(args.dk, "dk");
    TensorRef dv = make_tensor_ref(args.dv, "dv");
    for (const TensorRef* t : {&dout, &dq, &dk, &dv}) {
        if (!t->present())
            fail_argument(fmt::format("{}: required by the backward, got NULL", t->name));
        require_same_dtype(*t, q);
        require_same_device(*t, q);
    }
    require_shape4(dout, p.batch, p.heads_q, p.seqlen_q, p.head_dim, "out");
    require_shape4(dq, p.batch, p.heads_q, p.seqlen_q, p.head_dim, "q");
    require_shape4(dk, p.batch, p.heads_k, p.seqlen_k, p.head_dim, "k");
    require_shape4(dv, p.batch, p.heads_k, p.seqlen_k, p.head_dim, "v");
    const std::initializer_list<const TensorRef*> everything = {
        &q, &k, &v, &out, &cos, &sin, &pos_mask, &mask, &lse, &dout, &dq, &dk, &dv};
    for (const TensorRef* t : {&dq, &dk, &dv}) check_written(*t, everything, kRule);
    if (workspace.present()) check_written(workspace, everything, kRule);
    p.dout = dout;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    return p;
}

}  // namespace rope_jit
