// libFuzzer target: learned frequencies on the CPU backend. Mostly rope_jit_rope's backward
// with inv_freq_grad, q_saved and k_saved, over every position source (implicit offsets,
// per-token indices, per-sequence offsets, packed cu_seqlens, M-RoPE axes) and xpos; also
// rope_jit_inv_freq, whose gradient's inv_freq comes from it, with stated and unstated
// longrope list lengths. The input describes a valid call and decides what to break (a
// shape, a dtype, the gradient's memory placed on another tensor, a position). Each tensor
// and list owns exactly its bytes, so ASan reports any read past one.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "fuzz_support.h"

using fuzz::Input;
using fuzz::Tensor;

namespace {

void fuzz_gradient(Input& in) {
    const DLDataType dtypes[] = {fuzz::kF32, fuzz::kF16, fuzz::kBF16};
    const DLDataType dtype = in.pick(dtypes);
    const bool packed = in.chance(4);
    const int64_t B = packed ? 1 : in.below(3), S = in.below(8), Hk = 1 + in.below(2);
    const int64_t Hq = Hk * (1 + in.below(2));
    const int64_t D = 2 * (1 + in.below(10));
    const int64_t R = in.chance(3) ? 2 * (1 + in.below(D / 2)) : D;
    const int64_t pairs = R / 2;
    const bool has_k = in.chance(3) != 0;
    auto qk_shape = [&](int64_t heads) {
        return packed ? std::vector<int64_t>{in.dim(S), in.dim(heads), in.dim(D)}
                      : std::vector<int64_t>{in.dim(B), in.dim(heads), in.dim(S), in.dim(D)};
    };
    Tensor q(in, dtype, qk_shape(Hq)),
        q_saved(in, in.chance(32) ? fuzz::kF32 : dtype, qk_shape(Hq));
    Tensor k, k_saved;
    if (has_k) {
        k = Tensor(in, dtype, qk_shape(Hk));
        if (!in.chance(32)) k_saved = Tensor(in, dtype, qk_shape(Hk));
    }
    Tensor inv_freq(in, in.chance(32) ? fuzz::kF16 : fuzz::kF32, {in.dim(pairs)});
    Tensor grad(in, in.chance(32) ? fuzz::kF16 : fuzz::kF32, {in.dim(pairs)});
    const int64_t P = 1 + in.below(10);
    Tensor xpos;
    if (in.chance(5))
        xpos = Tensor(in, in.pick(dtypes), {in.dim(P), in.dim(in.chance(2) ? R : pairs)});
    const int64_t bound = xpos.present() ? P : 1 << 20;

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    Tensor positions, offsets, cu_seqlens;
    std::vector<int32_t> sections;
    switch (in.below(4)) {
        case 0:  // implicit: offsets, sometimes negative or past the xpos table
            args.position_offset = in.chance(16) ? in.i64() >> in.below(64) : in.below(4);
            args.q_position_offset = in.chance(16) ? -in.below(4) : in.below(3);
            break;
        case 1: {  // per-token indices, perhaps with M-RoPE axes
            const int axes = in.chance(3) ? int(1 + in.below(3)) : 0;
            std::vector<int64_t> shape;
            if (axes > 0) shape.push_back(in.dim(axes));
            if (!packed && in.chance(2)) shape.push_back(in.dim(B));
            shape.push_back(in.dim(S));
            positions = Tensor(in, in.chance(2) ? fuzz::kI32 : fuzz::kI64, shape);
            for (int64_t i = 0; i < positions.numel(); ++i)
                positions.set(i, in.chance(32) ? in.i64() >> in.below(64)
                                               : in.below(std::min<int64_t>(bound, 64)));
            if (axes > 0) {
                int64_t left = pairs;
                for (int a = 0; a + 1 < axes; ++a) {
                    sections.push_back(int32_t(in.below(left + 1)));
                    left -= sections.back();
                }
                sections.push_back(int32_t(left));
                args.mrope_sections = sections.data();
                args.num_mrope_sections = axes;
                args.mrope_interleaved = in.chance(2);
            }
            break;
        }
        case 2:  // per-sequence offsets
            offsets = Tensor(in, in.chance(2) ? fuzz::kI32 : fuzz::kI64, {in.dim(B)});
            for (int64_t i = 0; i < offsets.numel(); ++i)
                offsets.set(i, in.chance(16) ? in.i64() >> in.below(64)
                                             : in.below(std::min<int64_t>(bound, 8)));
            break;
        default:  // packed sequences
            if (packed) {
                cu_seqlens = Tensor(in, fuzz::kI32, {3});
                cu_seqlens.set(0, 0);
                cu_seqlens.set(1, in.below(S + 1));
                cu_seqlens.set(2, in.chance(16) ? S + 2 : S);
            }
            break;
    }

    Tensor* all[] = {&q,    &q_saved, &k,         &k_saved, &inv_freq,
                     &grad, &xpos,    &positions, &offsets, &cu_seqlens};
    if (in.chance(8)) all[in.below(10)]->perturb(in);

    args.q = q.dl();
    args.k = k.dl();
    args.inv_freq = inv_freq.dl();
    args.inv_freq_grad = grad.dl();
    args.q_saved = q_saved.dl();
    args.k_saved = k_saved.dl();
    args.xpos_scale = xpos.dl();
    args.positions = positions.dl();
    args.seqlen_offsets = offsets.dl();
    args.cu_seqlens = cu_seqlens.dl();
    args.rotary_dim = int32_t(R);
    args.rotary_offset = int32_t(in.chance(4) ? in.below(D - R + 1) : 0);
    fuzz::set_raw_enum(args.style, in.chance(16) ? int(int8_t(in.byte())) : int(in.below(3)));
    args.backward = !in.chance(16);

    // The gradient, a saved output or an output on another tensor's memory.
    DLTensor alias{};
    std::vector<int64_t> alias_shape;
    if (in.chance(8)) {
        Tensor* hosts[] = {&q, &k, &q_saved, &k_saved, &inv_freq, &xpos};
        Tensor* host = hosts[in.below(6)];
        const DLTensor** targets[] = {&args.inv_freq_grad, &args.q_saved, &args.k_saved,
                                      &args.q_out};
        const DLTensor** target = targets[in.below(4)];
        const DLTensor* like = *target != nullptr ? *target : args.q;
        if (host->present() && like != nullptr) {
            alias_shape.assign(like->shape, like->shape + like->ndim);
            alias = host->alias(in, alias_shape);
            alias.dtype = like->dtype;
            if (fuzz::element_bytes(alias.dtype) <= fuzz::element_bytes(host->dl()->dtype))
                *target = &alias;
        }
    }
    fuzz::check_status(rope_jit_rope(fuzz::cpu_runtime(), &args));
}

void fuzz_frequencies(Input& in) {
    rope_jit_freq_config config;
    rope_jit_freq_config_init(&config);
    fuzz::set_raw_enum(config.rope_type, in.chance(16) ? int(int8_t(in.byte())) : int(in.below(9)));
    config.rotary_dim = int32_t(in.chance(16) ? int32_t(in.i64()) : 2 * in.below(40));
    const double values[] = {0.0,
                             1.0,
                             2.0,
                             0.5,
                             -1.0,
                             10000.0,
                             1e-300,
                             1e300,
                             std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN()};
    config.theta = in.chance(2) ? 10000.0 : in.pick(values);
    config.factor = in.pick(values);
    config.attention_factor = in.chance(2) ? 0.0 : in.pick(values);
    config.beta_fast = in.chance(2) ? 0.0 : in.pick(values);
    config.beta_slow = in.chance(2) ? 0.0 : in.pick(values);
    config.mscale = in.chance(2) ? 0.0 : in.pick(values);
    config.mscale_all_dim = in.chance(2) ? 0.0 : in.pick(values);
    config.low_freq_factor = in.chance(2) ? 1.0 : in.pick(values);
    config.high_freq_factor = in.chance(2) ? 4.0 : in.pick(values);
    config.theta_rescale_factor = in.chance(2) ? 1.0 : in.pick(values);
    config.max_freq = in.pick(values);
    const int64_t counts[] = {0, 1, 2048, 4096, 131072, -1, std::numeric_limits<int64_t>::max()};
    config.max_position_embeddings = in.pick(counts);
    config.original_max_position_embeddings = in.pick(counts);
    config.seq_len = in.pick(counts);
    config.truncate = in.chance(2);
    config.num_freqs = int32_t(in.chance(8) ? int32_t(in.i64()) : in.below(40));

    // n as the recipe needs it, or not; longrope lists of the stated length (or of the length
    // the recipe reads, when unstated: that is the caller's word).
    const size_t needed = config.rotary_dim > 0 ? size_t(config.rotary_dim / 2) : 0;
    const size_t n = in.chance(8) ? size_t(in.below(64)) : needed;
    const bool stated = in.chance(2);
    const size_t held_short =
        stated ? size_t(in.chance(2) ? 1 + in.below(64) : int64_t(needed)) : n;
    const size_t held_long = stated ? size_t(in.chance(2) ? 1 + in.below(64) : int64_t(needed)) : n;
    if (n > 4096 || needed > 4096) return;
    std::vector<float> short_factor(held_short), long_factor(held_long);
    for (float& f : short_factor) f = float(in.byte()) / 32.0f;
    for (float& f : long_factor) f = float(in.byte()) / 32.0f;
    config.short_factor = in.chance(16) ? nullptr : short_factor.data();
    config.long_factor = in.chance(16) ? nullptr : long_factor.data();
    if (stated) {
        config.num_short_factor = held_short;
        config.num_long_factor = held_long;
    }
    // Unstated lists are read for n elements: hold that many (n is checked against R / 2 first).
    if (!stated && (short_factor.size() < n || long_factor.size() < n)) return;

    std::vector<float> inv(n);
    float attention = 0;
    fuzz::check_status(
        rope_jit_inv_freq(&config, inv.data(), n, in.chance(2) ? &attention : nullptr));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Input in(data, size);
    if (in.chance(4))
        fuzz_frequencies(in);
    else
        fuzz_gradient(in);
    return 0;
}
