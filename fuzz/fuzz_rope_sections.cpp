// libFuzzer target: multi-section positions (M-RoPE, axial RoPE) on the CPU backend, through
// both users of the section split: rope_jit_rope with mrope_sections and [A, ...] positions,
// and rope_jit_rope_tables with sections and float positions. The input describes a call that
// is valid by default (sections that sum to R/2, contiguous or interleaved; positions inside
// the table; q, k, layouts, tables or inv_freq, xpos) and decides what to break: a section, the
// section count, a position, a dimension, the stated length of the table positions. Each
// tensor and list owns exactly its bytes, so ASan reports any read past one.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_support.h"

using fuzz::Input;
using fuzz::Tensor;

namespace {

// A split of `pairs` into `count` sections (count >= 1), one section perhaps broken.
std::vector<int32_t> make_sections(Input& in, int64_t pairs, int count) {
    std::vector<int32_t> sections(size_t(count), 0);
    int64_t left = pairs;
    for (int a = 0; a + 1 < count; ++a) {
        const int32_t n = int32_t(in.below(left + 1));
        sections[size_t(a)] = n;
        left -= n;
    }
    sections[size_t(count - 1)] = int32_t(left);
    if (in.chance(8)) {
        const int32_t odd[] = {-1, 0, 1, 2, 1 << 30, -(1 << 30), 2147483647};
        sections[size_t(in.below(count))] = in.pick(odd);
    }
    return sections;
}

void fuzz_rope(Input& in) {
    const DLDataType dtypes[] = {fuzz::kF32, fuzz::kF16, fuzz::kBF16};
    const DLDataType dtype = in.pick(dtypes);
    const bool packed = in.chance(3);
    const int64_t B = packed ? 1 : in.below(3), S = in.below(9), Hk = 1 + in.below(2);
    const int64_t Hq = Hk * (1 + in.below(2));
    const int64_t D = 2 * (1 + in.below(12));
    const int64_t R = in.chance(3) ? 2 * (1 + in.below(D / 2)) : D;
    const int64_t offset = in.chance(4) ? in.below(D - R + 1) : 0;
    const int64_t pairs = R / 2;
    const int count = in.chance(16) ? int(int8_t(in.byte())) : int(1 + in.below(8));

    Tensor q = packed ? Tensor(in, dtype, {in.dim(S), in.dim(Hq), in.dim(D)})
                      : Tensor(in, dtype, {in.dim(B), in.dim(Hq), in.dim(S), in.dim(D)});
    Tensor k;
    if (in.chance(2))
        k = packed ? Tensor(in, dtype, {in.dim(S), in.dim(Hk), in.dim(D)})
                   : Tensor(in, dtype, {in.dim(B), in.dim(Hk), in.dim(S), in.dim(D)});
    const int64_t P = 1 + in.below(12);
    const bool table = in.chance(2);
    Tensor cos, sin, inv_freq, xpos;
    const DLDataType table_dtype = in.pick(dtypes);
    const int64_t columns = in.chance(2) ? R : pairs;
    if (table) {
        cos = Tensor(in, table_dtype, {in.dim(P), in.dim(columns)});
        sin = Tensor(in, table_dtype, {in.dim(P), in.dim(columns)});
    } else {
        inv_freq = Tensor(in, fuzz::kF32, {in.dim(pairs)});
    }
    if (in.chance(6)) xpos = Tensor(in, table_dtype, {in.dim(P), in.dim(columns)});

    // Positions [A, S], [A, B, S] or [A, T], inside the table most of the time.
    const int64_t axes = count >= 1 && count <= 8 ? count : 3;
    Tensor positions = packed || in.chance(2) ? Tensor(in, in.chance(2) ? fuzz::kI32 : fuzz::kI64,
                                                       {in.dim(axes), in.dim(S)})
                                              : Tensor(in, in.chance(2) ? fuzz::kI32 : fuzz::kI64,
                                                       {in.dim(axes), in.dim(B), in.dim(S)});
    const int64_t bound = table || xpos.present() ? P : 1 << 20;
    for (int64_t i = 0; i < positions.numel(); ++i)
        positions.set(
            i, in.chance(32) ? in.i64() >> in.below(64) : in.below(std::min<int64_t>(bound, 256)));
    Tensor cu_seqlens;
    if (packed && in.chance(2)) {
        cu_seqlens = Tensor(in, fuzz::kI64, {3});
        const int64_t middle = in.below(S + 1);
        cu_seqlens.set(0, 0);
        cu_seqlens.set(1, middle);
        cu_seqlens.set(2, in.chance(16) ? S + 1 : S);
    }

    Tensor* all[] = {&q, &k, &cos, &sin, &inv_freq, &xpos, &positions, &cu_seqlens};
    if (in.chance(8)) all[in.below(8)]->perturb(in);

    const std::vector<int32_t> sections =
        make_sections(in, pairs, count >= 1 && count <= 64 ? count : 1);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = k.dl();
    args.cos = cos.dl();
    args.sin = sin.dl();
    args.inv_freq = inv_freq.dl();
    args.xpos_scale = xpos.dl();
    args.positions = in.chance(32) ? nullptr : positions.dl();
    args.cu_seqlens = cu_seqlens.dl();
    args.rotary_dim = int32_t(R);
    args.rotary_offset = int32_t(offset);
    fuzz::set_raw_enum(args.style, in.chance(16) ? int(int8_t(in.byte())) : int(in.below(3)));
    args.backward = in.chance(2);
    // A count the list does not match is refused (sums, or 1 to 8) before the list is read.
    args.num_mrope_sections = count;
    args.mrope_sections = in.chance(32) ? nullptr : sections.data();
    args.mrope_interleaved = in.chance(2);
    fuzz::check_status(rope_jit_rope(fuzz::cpu_runtime(), &args));
}

void fuzz_tables(Input& in) {
    const int64_t pairs = 1 + in.below(16);
    const int count = in.chance(16) ? int(int8_t(in.byte())) : int(1 + in.below(8));
    const std::vector<int32_t> sections =
        make_sections(in, pairs, count >= 1 && count <= 64 ? count : 1);
    std::vector<float> inv(static_cast<size_t>(pairs));
    for (float& f : inv) f = float(in.byte()) / 64.0f;
    const int64_t P = in.below(10);
    const int64_t axes = count >= 1 && count <= 8 ? count : 1;
    const DLDataType dtypes[] = {fuzz::kF32, fuzz::kF16, fuzz::kBF16};
    const int64_t columns = in.chance(2) ? 2 * pairs : pairs;
    Tensor cos(in, in.pick(dtypes), {in.dim(P), in.dim(columns)});
    Tensor sin, xpos;
    if (in.chance(2)) sin = Tensor(in, in.pick(dtypes), {in.dim(P), in.dim(columns)});
    if (in.chance(4)) xpos = Tensor(in, in.pick(dtypes), {in.dim(P), in.dim(columns)});
    Tensor* all[] = {&cos, &sin, &xpos};
    if (in.chance(8)) all[in.below(3)]->perturb(in);
    // The rows the call will see (tables of different rows are refused, so the most).
    int64_t rows = 0;
    for (const Tensor* t : all)
        if (t->present() && t->dl()->ndim >= 1) rows = std::max(rows, t->dl()->shape[0]);

    // The positions list: A * rows doubles, stated or not; or a stated, shorter list that the
    // call must refuse before reading it.
    const bool stated = in.chance(2);
    const int64_t held = stated && in.chance(3) ? in.below(axes * rows + 1) : axes * rows;
    std::vector<double> positions(static_cast<size_t>(held));
    for (double& p : positions)
        p = in.chance(32) ? double(in.i64()) : double(int8_t(in.byte())) / 4.0;

    rope_jit_table_config config;
    rope_jit_table_config_init(&config);
    config.inv_freq = inv.data();
    config.num_freqs = size_t(in.chance(16) ? in.below(20) : pairs);
    if (config.num_freqs > inv.size())
        config.num_freqs = inv.size();  // inv_freq's length is the caller's word
    config.positions = in.chance(4) ? nullptr : positions.data();
    config.num_positions = stated ? size_t(held) : 0;
    // A count the list does not match is refused (sums, or 1 to 8) before the list is read.
    config.num_mrope_sections = count;
    config.mrope_sections = sections.data();
    config.mrope_interleaved = in.chance(2);
    fuzz::set_raw_enum(config.style, in.chance(16) ? int(int8_t(in.byte())) : int(in.below(3)));
    config.float32_angles = in.chance(2);
    fuzz::check_status(rope_jit_rope_tables(&config, cos.dl(), sin.dl(), xpos.dl()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Input in(data, size);
    if (in.chance(3))
        fuzz_tables(in);
    else
        fuzz_rope(in);
    return 0;
}
