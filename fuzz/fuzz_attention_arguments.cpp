// libFuzzer target: rope_jit_attention and rope_jit_attention_backward on the CPU backend.
// The input describes a call that is valid by default (GQA shapes, tables, pos_mask, masks,
// lse, causal, scale, the backward's gradients) and decides what to break: a dimension of
// one tensor, an optional tensor's presence, a table's rows, a dtype, a device, an output
// placed on another tensor's memory. Each tensor owns exactly the bytes of its view, so ASan
// reports any read or write the checks let through past a view; every failure must come with
// a message.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "fuzz_support.h"

using fuzz::Input;
using fuzz::Tensor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Input in(data, size);
    const DLDataType dtypes[] = {fuzz::kF32, fuzz::kF16, fuzz::kBF16};
    const DLDataType dtype = in.pick(dtypes);
    const int64_t B = in.below(3), Hk = 1 + in.below(3), Hq = Hk * (1 + in.below(3));
    const int64_t Sq = in.below(9), Sk = in.below(9);
    const int64_t head_dims[] = {2, 4, 6, 8, 16, 32, 3, 0};
    const int64_t D = in.pick(head_dims);
    const int64_t max_tokens = std::max(Sq, Sk);

    Tensor q(in, dtype, {in.dim(B), in.dim(Hq), in.dim(Sq), in.dim(D)});
    Tensor k(in, in.chance(32) ? fuzz::kF32 : dtype,
             {in.dim(B), in.dim(Hk), in.dim(Sk), in.dim(D)});
    Tensor v(in, dtype, {in.dim(B), in.dim(Hk), in.dim(Sk), in.dim(D)});
    Tensor out(in, dtype, {in.dim(B), in.dim(Hq), in.dim(Sq), in.dim(D)});

    rope_jit_attention_args args;
    rope_jit_attention_args_init(&args);
    Tensor cos, sin, pos_mask, mask, lse;
    if (in.chance(2)) {
        const int64_t rotary_dims[] = {0, D, D / 2 / 2 * 2, 2, 3, D + 2, -2};
        args.rotary_dim = int32_t(in.pick(rotary_dims));
        const int64_t R = args.rotary_dim == 0 ? D : args.rotary_dim;
        const int64_t columns = in.chance(2) ? R : R / 2;
        const int64_t rows = in.chance(8) ? max_tokens - 1 : max_tokens + in.below(3);
        const DLDataType table = in.pick(dtypes);
        cos =
            Tensor(in, table, {std::max<int64_t>(rows, 0), in.dim(std::max<int64_t>(columns, 0))});
        sin = Tensor(in, in.chance(32) ? fuzz::kF32 : table,
                     {std::max<int64_t>(rows, 0), in.dim(std::max<int64_t>(columns, 0))});
        if (in.chance(3)) {
            const int64_t n = max_tokens + in.below(2) - (in.chance(8) ? 1 : 0);
            pos_mask = in.chance(2) ? Tensor(in, fuzz::kU8, {std::max<int64_t>(n, 0)})
                                    : Tensor(in, in.chance(16) ? fuzz::kI32 : fuzz::kU8,
                                             {in.dim(B), std::max<int64_t>(n, 0)});
        }
    }
    if (in.chance(3)) {
        const DLDataType mask_types[] = {fuzz::kU8, fuzz::kF32, fuzz::kF16, fuzz::kBF16,
                                         fuzz::kI64};
        const DLDataType t = in.pick(mask_types);
        const int64_t batch = in.chance(3) ? 1 : B;
        mask = in.chance(2) ? Tensor(in, t, {in.dim(batch), in.dim(Sk)})
                            : Tensor(in, t, {in.dim(batch), in.dim(Sq), in.dim(Sk)});
    }
    const bool backward = in.chance(2);
    if (backward || in.chance(2)) lse = Tensor(in, fuzz::kF32, {in.dim(B), in.dim(Hq), in.dim(Sq)});
    Tensor dout, dq, dk, dv;
    if (backward) {
        dout = Tensor(in, dtype, {in.dim(B), in.dim(Hq), in.dim(Sq), in.dim(D)});
        dq = Tensor(in, dtype, {in.dim(B), in.dim(Hq), in.dim(Sq), in.dim(D)});
        dk = Tensor(in, dtype, {in.dim(B), in.dim(Hk), in.dim(Sk), in.dim(D)});
        dv = Tensor(in, dtype, {in.dim(B), in.dim(Hk), in.dim(Sk), in.dim(D)});
    }

    // One tensor broken in a way that stays inside its memory.
    Tensor* all[] = {&q, &k, &v, &out, &cos, &sin, &pos_mask, &mask, &lse, &dout, &dq, &dk, &dv};
    if (in.chance(6)) all[in.below(13)]->perturb(in);

    args.q = q.dl();
    args.k = k.dl();
    args.v = v.dl();
    args.out = out.dl();
    args.cos = cos.dl();
    args.sin = in.chance(32) ? nullptr : sin.dl();
    args.pos_mask = pos_mask.dl();
    args.attn_mask = mask.dl();
    args.lse = in.chance(16) ? nullptr : lse.dl();
    args.dout = dout.dl();
    args.dq = dq.dl();
    args.dk = dk.dl();
    args.dv = dv.dl();
    args.causal = in.chance(2);
    const double scales[] = {0.0,
                             0.25,
                             -1.0,
                             std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity(),
                             1e300};
    args.scale = in.pick(scales);
    fuzz::set_raw_enum(args.style, in.chance(8) ? int(int8_t(in.byte())) : int(in.below(2)));

    // An output on another tensor's memory: the same view, or a view inside it.
    DLTensor alias{};
    std::vector<int64_t> alias_shape;
    if (in.chance(8)) {
        const rope_jit_attention_args base = args;
        const DLTensor** outputs[] = {&args.out, &args.lse, &args.dq, &args.dk, &args.dv};
        const DLTensor** written = outputs[in.below(5)];
        const DLTensor* inputs[] = {base.q,    base.k,        base.v,         base.out,
                                    base.cos,  base.pos_mask, base.attn_mask, base.lse,
                                    base.dout, base.dq,       base.dk,        base.dv};
        const DLTensor* host = inputs[in.below(12)];
        if (*written != nullptr && host != nullptr) {
            if (in.chance(2)) {
                *written = host;
            } else {
                alias_shape.assign((*written)->shape, (*written)->shape + (*written)->ndim);
                Tensor* owner = nullptr;
                for (Tensor* t : all)
                    if (t->dl() == host) owner = t;
                if (owner != nullptr) {
                    alias = owner->alias(in, alias_shape);
                    alias.dtype = (*written)->dtype;
                    // The alias keeps the host's element size: only a same-size dtype fits.
                    if (fuzz::element_bytes(alias.dtype) <= fuzz::element_bytes(host->dtype))
                        *written = &alias;
                }
            }
        }
    }
    // A caller's workspace: aligned or not, of any size, or a size without memory.
    alignas(256) static unsigned char workspace[1024];
    if (in.chance(4)) {
        args.workspace = in.chance(8) ? nullptr : workspace + (in.chance(2) ? 0 : in.below(255));
        args.workspace_bytes = in.chance(2) ? size_t(in.below(768)) : 0;
    }
    if (in.chance(64)) args.struct_size = size_t(in.byte());

    size_t workspace_bytes = 0;
    fuzz::check_status(rope_jit_attention_workspace_size(fuzz::cpu_runtime(), &args, backward,
                                                         &workspace_bytes));
    fuzz::check_status(rope_jit_attention(fuzz::cpu_runtime(), &args));
    if (backward) fuzz::check_status(rope_jit_attention_backward(fuzz::cpu_runtime(), &args));
    return 0;
}
