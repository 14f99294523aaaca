// The rope problems the GPU suites run: a spec of one call (dtype, layout, positions, angles,
// sizes), the host tensors built from it, their device copies, running them on either backend
// and comparing what the GPU left with what the CPU left. Header-only and inline, shared by the
// gpu suites (test_gpu_rope.cpp, test_gpu_multi_device.cpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "gpu_test_support.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_problem.h"
#include "rope_test_support.h"

namespace gpu_rope_test {

using namespace rope_test;
using namespace gpu_test;

// ------------------------------------------------------------------------------------------
// Specs and the problems built from them
// ------------------------------------------------------------------------------------------

enum class Layout { BHSD, BSHD, Padded, Packed, PackedHeadMajor };
enum class Positions { Implicit, PerToken, PerBatchToken, SeqlenOffsets };
enum class Angles { HalfTable, FullTable, InvFreq };

inline const char* layout_name(Layout l) {
    const char* names[] = {"bhsd", "bshd", "padded", "packed+cu_seqlens",
                           "packed_head_major+cu_seqlens"};
    return names[int(l)];
}
inline const char* positions_name(Positions p) {
    const char* names[] = {"implicit", "positions[S]", "positions[B,S]", "seqlen_offsets"};
    return names[int(p)];
}
inline const char* angles_name(Angles a) {
    const char* names[] = {"half table", "full table", "inv_freq"};
    return names[int(a)];
}
inline bool is_packed(Layout l) {
    return l == Layout::Packed || l == Layout::PackedHeadMajor;
}

// One call's parameters. Packed layouts always come with cu_seqlens (positions [S] is then [T]).
struct Spec {
    Dt dt = Dt::F32, table_dt = Dt::F32, index_dt = Dt::I64;
    bool interleaved = false, backward = false, has_k = true, xpos = false;
    bool proportional = false;  // ROPE_JIT_STYLE_PROPORTIONAL (interleaved false, offset 0)
    bool in_place = true;
    bool out_as_same_view = false;  // in place by passing q as q_out (and k as k_out)
    bool rotary_dim_zero = false;   // pass rotary_dim = 0 (R == D, offset 0)
    Layout layout = Layout::BHSD;
    Positions positions = Positions::Implicit;
    Angles angles = Angles::HalfTable;
    int64_t B = 2, S = 5, Hk = 2, group = 2, D = 64, R = 64, offset = 0;
    int64_t position_offset = 0, q_extra = 0;  // q_extra: k has q_extra more (cached) tokens
};

inline std::string describe(const Spec& c) {
    std::ostringstream text;
    text << "dt=" << dt_name(c.dt) << " table_dt=" << dt_name(c.table_dt)
         << " index_dt=" << dt_name(c.index_dt) << " style="
         << (c.proportional  ? "proportional"
             : c.interleaved ? "interleaved"
                             : "half")
         << " backward=" << c.backward << " has_k=" << c.has_k << " xpos=" << c.xpos
         << " in_place=" << c.in_place << " out_as_same_view=" << c.out_as_same_view
         << " rotary_dim_zero=" << c.rotary_dim_zero << " layout=" << layout_name(c.layout)
         << " positions=" << positions_name(c.positions) << " angles=" << angles_name(c.angles)
         << " B=" << c.B << " S=" << c.S << " Hk=" << c.Hk << " group=" << c.group << " D=" << c.D
         << " R=" << c.R << " offset=" << c.offset << " position_offset=" << c.position_offset
         << " q_extra=" << c.q_extra;
    return text.str();
}

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> options) {
    return *(options.begin() + rng() % options.size());
}

// Redraws what stays a run-time argument of a compiled kernel: batch, tokens, heads (the GQA
// group stays), position offsets.
inline void redraw_sizes(Spec& c, std::mt19937& rng) {
    c.B = 1 + rng() % 3;
    c.S = 1 + rng() % 40;
    c.Hk = 1 + rng() % 2;
    c.position_offset = c.positions == Positions::Implicit ? rng() % 4 : 0;
    c.q_extra =
        c.positions == Positions::Implicit && !is_packed(c.layout) && c.has_k && rng() % 3 == 0
            ? 1 + rng() % 4
            : 0;
}

// A random point of the spec space, with small shapes (B <= 3, S <= 40, heads <= 16).
inline Spec random_spec(std::mt19937& rng) {
    Spec c;
    c.dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
    c.table_dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
    c.index_dt = pick(rng, {Dt::I32, Dt::I64});
    c.interleaved = rng() & 1;
    c.backward = rng() & 1;
    c.in_place = rng() & 1;
    c.out_as_same_view = c.in_place && (rng() & 1);
    c.has_k = rng() % 4 != 0;
    c.xpos = rng() % 6 == 0;
    c.layout = pick(
        rng, {Layout::BHSD, Layout::BSHD, Layout::Padded, Layout::Packed, Layout::PackedHeadMajor});
    const bool packed = is_packed(c.layout);
    c.positions =
        packed ? pick(rng, {Positions::Implicit, Positions::PerToken, Positions::SeqlenOffsets})
               : pick(rng, {Positions::Implicit, Positions::PerToken, Positions::PerBatchToken,
                            Positions::SeqlenOffsets});
    c.angles = pick(rng, {Angles::HalfTable, Angles::FullTable, Angles::InvFreq});
    c.D = pick<int64_t>(rng, {64, 80, 96, 128, 256});
    c.R = c.D;
    c.offset = 0;
    if (rng() % 3 == 0) {  // partial rotary: common fractions and odd pair counts, at any offset
        c.R = pick<int64_t>(rng,
                            {c.D / 2, c.D / 4, 2 * (1 + int64_t(rng() % uint32_t(c.D / 2 - 1)))});
        c.offset = pick<int64_t>(rng, {0, c.D - c.R, int64_t(rng() % uint32_t(c.D - c.R + 1))});
    }
    c.rotary_dim_zero = c.R == c.D && (rng() & 1);
    c.group = pick<int64_t>(rng, {1, 4, 8});
    redraw_sizes(c, rng);
    return c;
}

// The seed of the proportional sweep (test_gpu_rope_proportional.cpp), whose specs a CPU test
// also compiles (test_rope_proportional.cpp).
constexpr uint32_t kProportionalSeed = 20261201;
constexpr uint32_t kProportionalFamilies = 40;

// A random spec made proportional (ROPE_JIT_STYLE_PROPORTIONAL): no offset, head dims up to
// Gemma-4's 512 and 576, and R a quarter, a half, all of D, one pair or any even count.
inline Spec random_proportional_spec(std::mt19937& rng) {
    Spec c = random_spec(rng);
    c.proportional = true;
    c.interleaved = false;
    c.offset = 0;
    c.D = pick<int64_t>(rng, {12, 64, 80, 128, 256, 512, 576});
    const auto even = [](int64_t n) { return std::max<int64_t>(2, n - n % 2); };
    c.R = pick<int64_t>(
        rng, {even(c.D / 4), even(c.D / 2), c.D, 2, 2 * (1 + int64_t(rng() % uint32_t(c.D / 2)))});
    c.rotary_dim_zero = c.R == c.D && (rng() & 1);
    return c;
}

// Where each tensor of a call sits in a Problem; an absent tensor has an empty shape.
enum Slot : size_t {
    kQ,
    kK,
    kQOut,
    kKOut,
    kCos,
    kSin,
    kInvFreq,
    kXpos,
    kPositions,
    kSeqlenOffsets,
    kCuSeqlens,
    kSlots
};

inline const char* slot_name(size_t slot) {
    const char* names[] = {"q",         "k",        "q_out",      "k_out",     "cos",
                           "sin",       "inv_freq", "xpos_scale", "positions", "seqlen_offsets",
                           "cu_seqlens"};
    return names[slot];
}

// A call's tensors in host memory, built from a spec.
struct Problem {
    Spec spec;
    std::array<HostTensor, kSlots> t;

    bool has(size_t slot) const { return !t[slot].shape().empty(); }
    // The slots the call writes: the outputs, or the inputs when in place.
    bool written(size_t slot) const {
        if (spec.in_place) return slot == kQ || (slot == kK && has(kK));
        return slot == kQOut || (slot == kKOut && has(kKOut));
    }
    int64_t table_rows() const {
        return has(kCos) ? t[kCos].shape()[0] : has(kXpos) ? t[kXpos].shape()[0] : 0;
    }
};

inline HostTensor make_qk(const Spec& c, int64_t H, int64_t S, int64_t T) {
    switch (c.layout) {
        case Layout::Packed: return HostTensor(c.dt, {T, H, c.D});
        case Layout::PackedHeadMajor: return HostTensor(c.dt, {T, H, c.D}, {1, 0, 2});
        case Layout::BSHD: return HostTensor(c.dt, {c.B, H, S, c.D}, {0, 2, 1, 3});
        case Layout::Padded: return HostTensor(c.dt, {c.B, H, S, c.D}, {0, 1, 2, 3}, 6);
        case Layout::BHSD: break;
    }
    return HostTensor(c.dt, {c.B, H, S, c.D});
}

// Fills the angle tables (or inv_freq) and xPos scales for P rows. Table columns that the pair
// rule must not read hold NaN, so that reading a wrong column shows in the result.
inline void fill_angles(Problem& p, int64_t P, std::mt19937& rng) {
    const Spec& c = p.spec;
    const int64_t half = c.R / 2;
    const bool full = c.angles == Angles::FullTable;
    const int64_t columns = full ? c.R : half;
    auto column = [&](int64_t i) { return !full ? i : c.interleaved ? 2 * i : i; };
    std::uniform_real_distribution<double> angle(-7, 7), scale(0.5, 1.5);
    if (c.angles == Angles::InvFreq) {
        p.t[kInvFreq] = HostTensor(Dt::F32, {half});
        for (int64_t i = 0; i < half; ++i)
            p.t[kInvFreq].set({i}, std::pow(10000.0, -2.0 * double(i) / double(c.R)));
    } else {
        p.t[kCos] = HostTensor(c.table_dt, {P, columns});
        p.t[kSin] = HostTensor(c.table_dt, {P, columns});
        for (int64_t r = 0; r < P; ++r)
            for (int64_t j = 0; j < columns; ++j) {
                p.t[kCos].set({r, j}, std::nan(""));
                p.t[kSin].set({r, j}, std::nan(""));
            }
        for (int64_t r = 0; r < P; ++r)
            for (int64_t i = 0; i < half; ++i) {
                const double a = angle(rng);
                p.t[kCos].set({r, column(i)}, std::cos(a));
                p.t[kSin].set({r, column(i)}, std::sin(a));
            }
    }
    if (c.xpos) {
        p.t[kXpos] = HostTensor(c.table_dt, {P, columns});
        for (int64_t r = 0; r < P; ++r)
            for (int64_t j = 0; j < columns; ++j) p.t[kXpos].set({r, j}, std::nan(""));
        for (int64_t r = 0; r < P; ++r)
            for (int64_t i = 0; i < half; ++i) p.t[kXpos].set({r, column(i)}, scale(rng));
    }
}

// Builds every tensor of a spec: random q and k in [-2, 2], poisoned outputs, positions, and
// tables just long enough for the rows used (plus 0..2 spare rows).
inline Problem make_problem(const Spec& c, std::mt19937& rng) {
    Problem p;
    p.spec = c;
    const bool packed = is_packed(c.layout);
    const int64_t Hq = c.Hk * c.group, Sk = c.S + c.q_extra;

    std::vector<int64_t> cu = {0};  // packed: sequences of random lengths 0..S
    for (int64_t b = 0; b < c.B; ++b)
        cu.push_back(cu.back() + (packed ? int64_t(rng() % uint32_t(c.S + 1)) : c.S));
    const int64_t T = cu.back();
    int64_t longest = 0;  // longest sequence of q or k
    for (int64_t b = 0; b < c.B; ++b)
        longest = std::max(longest, cu[size_t(b) + 1] - cu[size_t(b)]);
    if (!packed && c.has_k) longest = std::max(longest, Sk);

    p.t[kQ] = make_qk(c, Hq, c.S, T);
    p.t[kQ].fill_uniform(rng, -2, 2);
    if (c.has_k) {
        p.t[kK] = make_qk(c, c.Hk, packed ? c.S : Sk, T);
        p.t[kK].fill_uniform(rng, -2, 2);
    }
    if (!c.in_place) {
        p.t[kQOut] = make_qk(c, Hq, c.S, T);
        if (c.has_k) p.t[kKOut] = make_qk(c, c.Hk, packed ? c.S : Sk, T);
    }

    int64_t max_row = 0;
    std::uniform_int_distribution<int64_t> any_row(0, 40);
    switch (c.positions) {
        case Positions::Implicit: max_row = longest - 1 + c.position_offset + c.q_extra; break;
        case Positions::PerToken: {
            const int64_t n = packed ? T : c.S;
            p.t[kPositions] = HostTensor(c.index_dt, {n});
            for (int64_t s = 0; s < n; ++s) {
                const int64_t row = any_row(rng);
                p.t[kPositions].set({s}, double(row));
                max_row = std::max(max_row, row);
            }
            break;
        }
        case Positions::PerBatchToken:
            p.t[kPositions] = HostTensor(c.index_dt, {c.B, c.S});
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t s = 0; s < c.S; ++s) {
                    const int64_t row = any_row(rng);
                    p.t[kPositions].set({b, s}, double(row));
                    max_row = std::max(max_row, row);
                }
            break;
        case Positions::SeqlenOffsets:
            p.t[kSeqlenOffsets] = HostTensor(c.index_dt, {c.B});
            for (int64_t b = 0; b < c.B; ++b) {
                const int64_t offset = int64_t(rng() % 7);
                p.t[kSeqlenOffsets].set({b}, double(offset));
                max_row = std::max(max_row, offset + longest - 1);
            }
            break;
    }
    if (packed) {
        p.t[kCuSeqlens] = HostTensor(c.index_dt, {c.B + 1});
        for (int64_t b = 0; b <= c.B; ++b) p.t[kCuSeqlens].set({b}, double(cu[size_t(b)]));
    }
    fill_angles(p, std::max<int64_t>(max_row + 1, 1) + int64_t(rng() % 3), rng);
    return p;
}

using Views = std::array<const DLTensor*, kSlots>;

inline Views host_views(Problem& p) {
    Views views{};
    for (size_t s = 0; s < kSlots; ++s) views[s] = p.has(s) ? p.t[s].dl() : nullptr;
    return views;
}

inline rope_jit_rope_args make_args(const Spec& c, const Views& v, rope_jit::CUstream stream) {
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = v[kQ];
    args.k = v[kK];
    args.q_out = c.out_as_same_view ? v[kQ] : v[kQOut];
    args.k_out = c.out_as_same_view ? v[kK] : v[kKOut];
    args.cos = v[kCos];
    args.sin = v[kSin];
    args.inv_freq = v[kInvFreq];
    args.xpos_scale = v[kXpos];
    args.positions = v[kPositions];
    args.seqlen_offsets = v[kSeqlenOffsets];
    args.cu_seqlens = v[kCuSeqlens];
    args.position_offset = c.position_offset;
    args.q_position_offset = c.q_extra;
    args.rotary_dim = int32_t(c.rotary_dim_zero ? 0 : c.R);
    args.rotary_offset = int32_t(c.offset);
    args.style = c.proportional  ? ROPE_JIT_STYLE_PROPORTIONAL
                 : c.interleaved ? ROPE_JIT_STYLE_INTERLEAVED
                                 : ROPE_JIT_STYLE_HALF;
    args.backward = c.backward;
    args.stream = stream;
    return args;
}

// Whether the launcher takes the flat path (rope_flat_kernel) for the call `args` describes.
inline bool takes_flat_path(const rope_jit_rope_args& args) {
    const rope_jit::RopeProblem problem = rope_jit::make_rope_problem(args);
    return rope_jit::flat_rows_of(rope_jit::make_kernel_spec(problem), problem).has_value();
}

// Device copies of every tensor of a problem on device `ordinal`, allocated in the context
// current on the calling thread (which must belong to that device).
class DeviceProblem {
public:
    explicit DeviceProblem(const Problem& p, int ordinal = 0) {
        for (size_t s = 0; s < kSlots; ++s)
            if (p.has(s)) tensors_[s] = std::make_unique<DeviceTensor>(p.t[s], ordinal);
    }
    Views views() const {
        Views views{};
        for (size_t s = 0; s < kSlots; ++s) views[s] = tensors_[s] ? tensors_[s]->dl() : nullptr;
        return views;
    }
    DeviceTensor& operator[](size_t slot) { return *tensors_[slot]; }
    // Every tensor as it is now on the device, in a copy of `like` (the problem mirrored).
    Problem download(const Problem& like) const {
        Problem out = like;
        for (size_t s = 0; s < kSlots; ++s)
            if (tensors_[s]) tensors_[s]->download(out.t[s]);
        return out;
    }

private:
    std::array<std::unique_ptr<DeviceTensor>, kSlots> tensors_;
};

// ------------------------------------------------------------------------------------------
// Running a problem on either backend
// ------------------------------------------------------------------------------------------

struct CallResult {
    rope_jit_status status;
    std::string message;
};

inline CallResult call_rope(rope_jit_runtime* runtime, const rope_jit_rope_args& args) {
    const rope_jit_status status = rope_jit_rope(runtime, &args);
    return {status, rope_jit_last_error()};
}

// doctest prints a const char* as a pointer: messages go through std::string.
inline void require_ok(const CallResult& result, const std::string& where) {
    const std::string status = rope_jit_status_name(result.status);
    INFO(where, ": rope_jit_rope -> ", status, ": ", result.message);
    REQUIRE(result.status == ROPE_JIT_OK);
}

// Runs the problem `calls` times with host tensors, alternating direction from spec.backward
// (forward, backward, forward...), on a copy of it; returns the copy.
inline Problem run_with_host_tensors(rope_jit_runtime* runtime, const Problem& p, int calls = 1) {
    Problem out = p;
    rope_jit_rope_args args = make_args(out.spec, host_views(out), nullptr);
    for (int call = 0; call < calls; ++call) {
        args.backward = p.spec.backward != (call % 2 == 1);
        require_ok(call_rope(runtime, args), "host tensors");
    }
    return out;
}

// Runs the problem once with device copies of every tensor on `stream`, synchronizes that
// stream and returns every tensor as the device holds it afterwards.
inline Problem run_with_device_tensors(rope_jit_runtime* runtime, const Problem& p,
                                       rope_jit::CUstream stream = nullptr) {
    DeviceProblem device(p);
    require_ok(call_rope(runtime, make_args(p.spec, device.views(), stream)), "device tensors");
    synchronize(stream);
    return device.download(p);
}

// ------------------------------------------------------------------------------------------
// Comparing
// ------------------------------------------------------------------------------------------

// Both backends rotate in fp32, so fp16/bf16 outputs may differ by one rounding step. fp32
// results with tables differ only by a few fp32 roundings (FMA contraction on the GPU); xPos
// scales and inv_freq angles (sincos of two libraries) leave more room.
inline double gpu_tolerance(const Spec& c) {
    switch (c.dt) {
        case Dt::F32: return c.angles == Angles::InvFreq ? 2e-5 : c.xpos ? 1e-5 : 1e-6;
        case Dt::F16: return 2e-3;
        default: return 1.6e-2;
    }
}

inline std::string format_number(double v) {
    std::ostringstream text;
    text << std::setprecision(9) << v;
    return text.str();
}

// Element-wise |got - expected| <= tol * (1 + |expected|), reporting the worst element.
inline void check_close(const HostTensor& got, const HostTensor& expected, double tol,
                        const std::string& what) {
    const std::vector<double> g = got.values(), e = expected.values();
    REQUIRE(g.size() == e.size());
    size_t worst = 0;
    double worst_ratio = 0;
    for (size_t i = 0; i < g.size(); ++i) {
        const double allowed = tol * (1 + std::fabs(e[i]));
        const double error = std::fabs(g[i] - e[i]);
        const double ratio = error <= allowed       ? error / std::max(allowed, 1e-300)
                             : std::isfinite(error) ? error / allowed
                                                    : 1e30;
        if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
    const std::string detail =
        g.empty() ? std::string("empty")
                  : "worst element " + std::to_string(worst) + " (row-major): got " +
                        format_number(g[worst]) + ", expected " + format_number(e[worst]) +
                        ", tolerance " + format_number(tol) + " * (1 + |expected|)";
    INFO(what, ": ", detail);
    CHECK(worst_ratio <= 1.0);
}

// Bytes of `got` outside its view must equal those of `before` (same buffer shape).
inline void check_outside_view_untouched(const HostTensor& got, const HostTensor& before,
                                         const std::string& what) {
    const size_t element = dt_size(got.dtype());
    const std::vector<uint8_t>& after_bytes = bytes_of(got);
    const std::vector<uint8_t>& before_bytes = bytes_of(before);
    REQUIRE(after_bytes.size() == before_bytes.size());
    std::vector<bool> covered(after_bytes.size() / element, false);
    got.for_each([&](const std::vector<int64_t>& i) { covered[size_t(got.offset(i))] = true; });
    size_t changed = 0;
    for (size_t e = 0; e < covered.size(); ++e)
        if (!covered[e])
            changed +=
                std::memcmp(&after_bytes[e * element], &before_bytes[e * element], element) != 0;
    INFO(what, ": elements outside the view that changed: ", changed);
    CHECK(changed == 0);
}

inline void check_bytes_unchanged(const HostTensor& got, const HostTensor& before,
                                  const std::string& what) {
    const bool unchanged = bytes_of(got) == bytes_of(before);
    INFO(what, ": must be left exactly as it was");
    CHECK(unchanged);
}

// What the GPU left against what the CPU left: written tensors within tol, the bytes around
// their views untouched, and every tensor the call only reads exactly as it was.
inline void check_gpu_matches_cpu(const Problem& original, const Problem& gpu, const Problem& cpu,
                                  double tol) {
    for (size_t s = 0; s < kSlots; ++s) {
        if (!original.has(s)) continue;
        if (original.written(s)) {
            check_close(gpu.t[s], cpu.t[s], tol, std::string(slot_name(s)) + " (GPU vs CPU)");
            check_outside_view_untouched(gpu.t[s], original.t[s],
                                         std::string(slot_name(s)) + " on the device");
        } else {
            check_bytes_unchanged(gpu.t[s], original.t[s],
                                  std::string(slot_name(s)) + " on the device");
        }
    }
}

inline void check_nothing_written(const Problem& before, const Problem& after) {
    for (size_t s = 0; s < kSlots; ++s)
        if (before.has(s)) check_bytes_unchanged(after.t[s], before.t[s], slot_name(s));
}

}  // namespace gpu_rope_test
