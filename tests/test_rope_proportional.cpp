// Gemma-4 "proportional" partial rotary (ROPE_JIT_STYLE_PROPORTIONAL) on the CPU backend,
// against a float64 reference written from HF's formulation rather than from pairs: over the
// whole head, y = x * cos_full + rotate_half(x) * sin_full, where the D/2 angles are the R/2
// given ones followed by zeros (cos 1, sin 0). It shares no code with the library's CPU
// reference. Also: the spec's JSON and preamble, and its kernels compiled with NVRTC.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "gpu_rope_problem.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_problem.h"
#include "ops/rope/rope_recipe.h"
#include "rope_jit/rope_jit.h"
#include "rope_test_support.h"
#include "sanitizer_builds.h"

using namespace rope_test;
using rope_jit::KernelSpec;

namespace {

// HF's apply_rotary_pos_emb for one head vector x [D], with the R/2 pair angles given as their
// cosines and sines (already signed for backward): the D/2 frequencies of a proportional
// model are the R/2 rotated ones padded with zeros, and cos/sin are cat(freqs, freqs).
std::vector<double> hf_proportional(const std::vector<double>& x, const std::vector<double>& c,
                                    const std::vector<double>& s) {
    const size_t D = x.size(), half = D / 2;
    std::vector<double> cos_full(D), sin_full(D), rotated(D), y(D);
    for (size_t j = 0; j < half; ++j) {
        const bool turns = j < c.size();
        cos_full[j] = cos_full[j + half] = turns ? c[j] : 1.0;
        sin_full[j] = sin_full[j + half] = turns ? s[j] : 0.0;
    }
    for (size_t j = 0; j < D; ++j) rotated[j] = j < half ? -x[j + half] : x[j - half];
    for (size_t j = 0; j < D; ++j) y[j] = x[j] * cos_full[j] + rotated[j] * sin_full[j];
    return y;
}

enum class Source { HalfTable, FullTable, InvFreq };
enum class Rows { Implicit, Indices, SeqlenOffsets };

struct Sweep {
    Dt dt = Dt::F32;
    Source source = Source::HalfTable;
    Rows rows = Rows::Implicit;
    bool packed = false, bshd = false, backward = false, in_place = true, has_k = true;
    int64_t B = 2, S = 3, Hk = 2, group = 2, D = 16, R = 8, position_offset = 0;
};

// Runs one proportional call through the C API and checks every output against
// hf_proportional, and that features outside the pairs pass through bit for bit.
void run_sweep_case(rope_jit_runtime* runtime, const Sweep& c, std::mt19937& rng) {
    const int64_t half = c.R / 2, Hq = c.Hk * c.group;
    // Token layout: [B, H, S, D] (bshd: stored [B, S, H, D]) or packed [T, H, D].
    std::vector<int64_t> cu = {0};
    for (int64_t b = 0; b < c.B; ++b) cu.push_back(cu.back() + (c.packed ? 1 + rng() % 4 : c.S));
    const int64_t T = cu.back();
    auto make = [&](int64_t H) {
        if (c.packed) return HostTensor(c.dt, {T, H, c.D});
        return c.bshd ? HostTensor(c.dt, {c.B, H, c.S, c.D}, {0, 2, 1, 3})
                      : HostTensor(c.dt, {c.B, H, c.S, c.D});
    };
    HostTensor q = make(Hq), k = make(c.has_k ? c.Hk : 1), q_out = make(Hq), k_out = make(c.Hk);
    q.fill_uniform(rng, -2, 2);
    k.fill_uniform(rng, -2, 2);
    const HostTensor q_in = q, k_in = k;

    // Table rows per token (sequence-local index for packed), from the C API's rules.
    const int64_t P = 24;
    HostTensor positions, seqlen_offsets, cu_seqlens(Dt::I32, {c.B + 1});
    for (int64_t b = 0; b <= c.B; ++b) cu_seqlens.set({b}, double(cu[size_t(b)]));
    if (c.rows == Rows::Indices) {
        positions = c.packed ? HostTensor(Dt::I64, {T}) : HostTensor(Dt::I64, {c.B, c.S});
        positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, rng() % P); });
    } else if (c.rows == Rows::SeqlenOffsets) {
        seqlen_offsets = HostTensor(Dt::I32, {c.B});
        for (int64_t b = 0; b < c.B; ++b) seqlen_offsets.set({b}, double(rng() % 8));
    }
    auto row_of = [&](int64_t b, int64_t s) -> int64_t {  // s: token index (packed: t)
        int64_t sequence = b, index = s;
        if (c.packed)
            for (int64_t i = 0; i < c.B; ++i)
                if (s >= cu[size_t(i)] && s < cu[size_t(i) + 1])
                    sequence = i, index = s - cu[size_t(i)];
        if (c.rows == Rows::Indices)
            return int64_t(c.packed ? positions.get({s}) : positions.get({b, s}));
        if (c.rows == Rows::SeqlenOffsets) return index + int64_t(seqlen_offsets.get({sequence}));
        return index + c.position_offset;
    };

    // Angles per row and pair in the tables; columns the rule must not read hold NaN.
    std::vector<double> inv_freq(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i)  // Gemma-4: the head_dim-based frequencies of the pairs
        inv_freq[size_t(i)] = std::pow(10000.0, -2.0 * double(i) / double(c.D));
    std::uniform_real_distribution<double> any_angle(-7, 7);
    const Dt table_dt = c.dt == Dt::F32 ? Dt::F32 : Dt::BF16;
    const int64_t columns = c.source == Source::FullTable ? c.R : half;
    HostTensor cos_t(table_dt, {P, columns}), sin_t(table_dt, {P, columns}), inv(Dt::F32, {half});
    for (int64_t r = 0; r < P; ++r)
        for (int64_t j = 0; j < columns; ++j) {
            const double a = c.source == Source::InvFreq ? double(r) * inv_freq[size_t(j % half)]
                                                         : any_angle(rng);
            if (j < half) {
                cos_t.set({r, j}, std::cos(a));
                sin_t.set({r, j}, std::sin(a));
            } else {
                cos_t.set({r, j}, std::nan(""));
                sin_t.set({r, j}, std::nan(""));
            }
        }
    for (int64_t i = 0; i < half; ++i) inv.set({i}, inv_freq[size_t(i)]);

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = c.has_k ? k.dl() : nullptr;
    args.q_out = c.in_place ? nullptr : q_out.dl();
    args.k_out = c.in_place || !c.has_k ? nullptr : k_out.dl();
    if (c.source == Source::InvFreq) {
        args.inv_freq = inv.dl();
    } else {
        args.cos = cos_t.dl();
        args.sin = sin_t.dl();
    }
    if (c.rows == Rows::Indices) args.positions = positions.dl();
    if (c.rows == Rows::SeqlenOffsets) args.seqlen_offsets = seqlen_offsets.dl();
    if (c.packed) args.cu_seqlens = cu_seqlens.dl();
    args.position_offset = c.position_offset;
    args.rotary_dim = int32_t(c.R);
    args.style = ROPE_JIT_STYLE_PROPORTIONAL;
    args.backward = c.backward;
    const rope_jit_status status = rope_jit_rope(runtime, &args);
    INFO(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);

    // Table values as the library reads them (rounded to the table dtype); inv_freq angles
    // in float64.
    auto angles_at = [&](int64_t row, std::vector<double>* co, std::vector<double>* si) {
        for (int64_t i = 0; i < half; ++i) {
            double cv, sv;
            if (c.source == Source::InvFreq) {
                const double a = double(row) * double(float(inv_freq[size_t(i)]));
                cv = std::cos(a), sv = std::sin(a);
            } else {
                cv = cos_t.get({row, i}), sv = sin_t.get({row, i});
            }
            (*co)[size_t(i)] = cv;
            (*si)[size_t(i)] = c.backward ? -sv : sv;
        }
    };
    const double tol = tolerance_for(c.dt);
    auto check = [&](const HostTensor& in, const HostTensor& out, int64_t H, const char* name) {
        const size_t pairs = static_cast<size_t>(half);
        std::vector<double> x(static_cast<size_t>(c.D)), co(pairs), si(pairs);
        const int64_t tokens = c.packed ? T : c.S, batches = c.packed ? 1 : c.B;
        for (int64_t b = 0; b < batches; ++b)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t s = 0; s < tokens; ++s) {
                    auto at = [&](int64_t d) {
                        return c.packed ? std::vector<int64_t>{s, h, d}
                                        : std::vector<int64_t>{b, h, s, d};
                    };
                    for (int64_t d = 0; d < c.D; ++d) x[size_t(d)] = in.get(at(d));
                    angles_at(row_of(b, s), &co, &si);
                    const std::vector<double> y = hf_proportional(x, co, si);
                    for (int64_t d = 0; d < c.D; ++d) {
                        const double got = out.get(at(d));
                        CAPTURE(name);
                        CAPTURE(b);
                        CAPTURE(h);
                        CAPTURE(s);
                        CAPTURE(d);
                        const bool rotated = d % (c.D / 2) < half;
                        if (rotated)
                            REQUIRE(std::fabs(got - y[size_t(d)]) <=
                                    tol * (1 + std::fabs(y[size_t(d)])));
                        else
                            REQUIRE(got == x[size_t(d)]);  // passed through bit for bit
                    }
                }
    };
    check(q_in, c.in_place ? q : q_out, Hq, "q");
    if (c.has_k) check(k_in, c.in_place ? k : k_out, c.Hk, "k");
}

}  // namespace

using gpu_rope_test::pick;

TEST_CASE("a proportional quarter turn on a hand-written example gives the hand-computed result") {
    // D = 8, R = 4: pairs (x0, x4) and (x1, x5) turn a quarter at row 0; x2, x3, x6, x7 stay.
    CpuRuntime runtime;
    HostTensor q(Dt::F32, {1, 1, 1, 8});
    for (int64_t d = 0; d < 8; ++d) q.set({0, 0, 0, d}, double(d + 1));  // 1 .. 8
    HostTensor cos_t(Dt::F32, {1, 2}), sin_t(Dt::F32, {1, 2});
    for (int64_t i = 0; i < 2; ++i) cos_t.set({0, i}, 0.0), sin_t.set({0, i}, 1.0);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    args.rotary_dim = 4;
    args.style = ROPE_JIT_STYLE_PROPORTIONAL;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    // y0 = x0*0 - x4*1 = -5, y4 = x4*0 + x0*1 = 1; likewise y1 = -6, y5 = 2.
    CHECK(q.values() == std::vector<double>{-5, -6, 3, 4, 1, 2, 7, 8});
    args.backward = 1;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    CHECK(q.values() == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8});
}

TEST_CASE("proportional rotary matches HF's formulation over a sweep of head dims and features") {
    CpuRuntime runtime;
    std::mt19937 rng(20261201);
    for (int iteration = 0; iteration < 120; ++iteration) {
        Sweep c;
        c.dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
        c.source = pick(rng, {Source::HalfTable, Source::FullTable, Source::InvFreq});
        c.packed = rng() % 4 == 0;
        c.rows = c.packed ? pick(rng, {Rows::Implicit, Rows::Indices, Rows::SeqlenOffsets})
                          : pick(rng, {Rows::Implicit, Rows::Indices, Rows::SeqlenOffsets});
        c.bshd = !c.packed && (rng() & 1);
        c.backward = rng() & 1;
        c.in_place = rng() & 1;
        c.has_k = rng() % 4 != 0;
        c.D = pick<int64_t>(rng, {2, 8, 12, 64, 256, 512, 576});
        // Gemma-4's quarter, half, all, one pair, and any even R.
        const auto even = [](int64_t n) { return std::max<int64_t>(2, n - n % 2); };
        c.R = pick<int64_t>(rng, {even(c.D / 4), even(c.D / 2), c.D, 2,
                                  2 * (1 + int64_t(rng() % uint32_t(c.D / 2)))});
        c.B = 1 + rng() % 2;
        c.S = 1 + rng() % 4;
        c.Hk = 1 + rng() % 2;
        c.group = pick<int64_t>(rng, {1, 2, 4});
        c.position_offset = c.rows == Rows::Implicit ? rng() % 4 : 0;
        const std::string dtype = dt_name(c.dt);
        CAPTURE(iteration);
        CAPTURE(dtype);
        CAPTURE(int(c.source));
        CAPTURE(int(c.rows));
        CAPTURE(c.packed);
        CAPTURE(c.bshd);
        CAPTURE(c.backward);
        CAPTURE(c.in_place);
        CAPTURE(c.has_k);
        CAPTURE(c.D);
        CAPTURE(c.R);
        CAPTURE(c.group);
        run_sweep_case(runtime.handle, c, rng);
    }
}

TEST_CASE("proportional rotary with M-RoPE sections turns each pair by its own axis") {
    // D = 16, R = 8: four pairs (i, i + 8), sections [1, 2, 1] over three position axes.
    CpuRuntime runtime;
    const int64_t S = 3, D = 16, P = 10;
    std::mt19937 rng(5);
    HostTensor q(Dt::F32, {1, 2, S, D});
    q.fill_uniform(rng, -1, 1);
    const HostTensor x0 = q;
    HostTensor cos_t(Dt::F32, {P, 4}), sin_t(Dt::F32, {P, 4}), positions(Dt::I64, {3, S});
    std::uniform_real_distribution<double> any_angle(-3, 3);
    for (int64_t r = 0; r < P; ++r)
        for (int64_t i = 0; i < 4; ++i) {
            const double a = any_angle(rng);
            cos_t.set({r, i}, std::cos(a)), sin_t.set({r, i}, std::sin(a));
        }
    for (int64_t a = 0; a < 3; ++a)
        for (int64_t s = 0; s < S; ++s) positions.set({a, s}, double(rng() % P));
    const int32_t sections[3] = {1, 2, 1};
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    args.positions = positions.dl();
    args.rotary_dim = 8;
    args.style = ROPE_JIT_STYLE_PROPORTIONAL;
    args.mrope_sections = sections;
    args.num_mrope_sections = 3;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    const int64_t axis_of_pair[4] = {0, 1, 1, 2};
    for (int64_t h = 0; h < 2; ++h)
        for (int64_t s = 0; s < S; ++s) {
            std::vector<double> x(D), co(4), si(4);
            for (int64_t d = 0; d < D; ++d) x[size_t(d)] = x0.get({0, h, s, d});
            for (int64_t i = 0; i < 4; ++i) {
                const int64_t row = int64_t(positions.get({axis_of_pair[i], s}));
                co[size_t(i)] = cos_t.get({row, i}), si[size_t(i)] = sin_t.get({row, i});
            }
            const std::vector<double> y = hf_proportional(x, co, si);
            for (int64_t d = 0; d < D; ++d)
                CHECK(q.get({0, h, s, d}) == doctest::Approx(y[size_t(d)]).epsilon(1e-6));
        }
}

TEST_CASE("the proportional frequency gradient matches finite differences of HF's formulation") {
    // loss = sum(g * rope(x; inv_freq)); d loss / d inv_freq[i] by central differences of the
    // float64 reference, against what the backward call gives from g and the forward output.
    CpuRuntime runtime;
    const int64_t S = 5, H = 3, D = 12, R = 4, half = R / 2;
    std::mt19937 rng(11);
    HostTensor x(Dt::F32, {1, H, S, D}), g(Dt::F32, {1, H, S, D}), y(Dt::F32, {1, H, S, D});
    HostTensor g_out(Dt::F32, {1, H, S, D}), inv(Dt::F32, {half}), grad(Dt::F32, {half});
    x.fill_uniform(rng, -1, 1);
    g.fill_uniform(rng, -1, 1);
    const double inv_freq[2] = {0.7, 0.3};
    for (int64_t i = 0; i < half; ++i) inv.set({i}, inv_freq[i]);

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = x.dl();
    args.q_out = y.dl();
    args.inv_freq = inv.dl();
    args.rotary_dim = int32_t(R);
    args.style = ROPE_JIT_STYLE_PROPORTIONAL;
    args.position_offset = 2;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    args.q = g.dl();
    args.q_out = g_out.dl();
    args.backward = 1;
    args.inv_freq_grad = grad.dl();
    args.q_saved = y.dl();
    const rope_jit_status status = rope_jit_rope(runtime.handle, &args);
    INFO(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);

    auto loss = [&](const double* freqs) {
        double total = 0;
        std::vector<double> v(D), co(half), si(half);
        for (int64_t h = 0; h < H; ++h)
            for (int64_t s = 0; s < S; ++s) {
                for (int64_t d = 0; d < D; ++d) v[size_t(d)] = x.get({0, h, s, d});
                for (int64_t i = 0; i < half; ++i) {
                    const double a = double(s + 2) * freqs[i];
                    co[size_t(i)] = std::cos(a), si[size_t(i)] = std::sin(a);
                }
                const std::vector<double> out = hf_proportional(v, co, si);
                for (int64_t d = 0; d < D; ++d) total += g.get({0, h, s, d}) * out[size_t(d)];
            }
        return total;
    };
    for (int64_t i = 0; i < half; ++i) {
        const double step = 1e-5;
        double plus[2] = {double(float(inv_freq[0])), double(float(inv_freq[1]))};
        double minus[2] = {plus[0], plus[1]};
        plus[i] += step, minus[i] -= step;
        const double expected = (loss(plus) - loss(minus)) / (2 * step);
        CAPTURE(i);
        CHECK(grad.get({i}) == doctest::Approx(expected).epsilon(1e-4));
    }
}

TEST_CASE("a proportional spec round-trips through JSON and specializes with an enumerator") {
    std::string error;
    const auto spec = KernelSpec::from_json(
        R"({"head_dim": 512, "rotary_dim": 128, "style": "proportional", "dtype": "bfloat16"})",
        &error);
    INFO(error);
    REQUIRE(spec.has_value());
    CHECK(spec->proportional == 1);
    CHECK(spec->interleaved == 0);
    CHECK(spec->vec == 8);  // 64 pairs and 256 features a half: 16-byte vectors
    CHECK(spec->to_json().find(R"("style":"proportional")") != std::string::npos);
    CHECK(KernelSpec::from_json(spec->to_json(), nullptr) == spec);
    CHECK(spec->describe().find("proportional") != std::string::npos);
    CHECK(spec->preamble().find("enum : bool { PROPORTIONAL = true };") != std::string::npos);
    // Other specs carry the field as an enumerator too, never as a module global.
    KernelSpec half = *spec;
    half.proportional = 0;
    CHECK(half.preamble().find("enum : bool { PROPORTIONAL = false };") != std::string::npos);
    CHECK(half.preamble().find("constexpr bool PROPORTIONAL") == std::string::npos);
    CHECK(half.to_json().find(R"("style":"half")") != std::string::npos);

    // A proportional spec with an offset, or vectors that do not tile head_dim/2, is refused.
    CHECK(!KernelSpec::from_json(
               R"({"head_dim": 64, "rotary_dim": 16, "rotary_offset": 8, "style": "proportional"})",
               &error)
               .has_value());
    CHECK(error.find("rotary_offset") != std::string::npos);
    CHECK(!KernelSpec::from_json(R"({"head_dim": 12, "rotary_dim": 8, "style": "proportional",
                                     "vec": 4, "vec_loads": true})",
                                 &error)
               .has_value());
    CHECK(error.find("head_dim/2") != std::string::npos);
    CHECK(!KernelSpec::from_json(R"({"head_dim": 12, "style": "diagonal"})", &error).has_value());
    CHECK(error.find("proportional") != std::string::npos);  // the vocabulary is listed

    rope_jit_kernel_spec in;
    rope_jit_kernel_spec_init(&in);
    in.head_dim = 576;
    in.rotary_dim = 144;
    in.style = ROPE_JIT_STYLE_PROPORTIONAL;
    const KernelSpec from_public = rope_jit::kernel_spec_from_public(in);
    CHECK(from_public.proportional == 1);
    CHECK(from_public.vec == 4);  // float32: 72 pairs and 288 features a half
    in.rotary_offset = 2;
    CHECK_THROWS_WITH_AS(rope_jit::kernel_spec_from_public(in), doctest::Contains("rotary_offset"),
                         rope_jit::Error);
}

TEST_CASE("proportional kernels compile with NVRTC for sm_90 in every variant") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    struct Variant {
        const char* json;
    };
    // In place and out of place (chunk items and the copy of each half's tail), vector and
    // scalar widths, tables of both formats, inv_freq with the frequency gradient, M-RoPE,
    // packed varlen, GQA, head dims 512 and 576 and odd halves.
    const char* const variants[] = {
        R"({"head_dim": 512, "rotary_dim": 128, "style": "proportional", "dtype": "bfloat16",
            "table_dtype": "bfloat16", "gqa_group": 8})",
        R"({"head_dim": 512, "rotary_dim": 128, "style": "proportional", "dtype": "bfloat16",
            "table_dtype": "bfloat16", "in_place_q": false, "direction": "backward"})",
        R"({"head_dim": 576, "rotary_dim": 144, "style": "proportional", "dtype": "float16",
            "angles": "table-half", "in_place_q": false, "positions": "indices"})",
        R"({"head_dim": 12, "rotary_dim": 4, "style": "proportional", "in_place_q": false,
            "packed": true, "positions": "seqlen-offsets"})",
        R"({"head_dim": 256, "rotary_dim": 64, "style": "proportional", "angles": "inv-freq",
            "direction": "backward", "freq_grad": true, "in_place_q": false})",
        R"({"head_dim": 128, "rotary_dim": 32, "style": "proportional", "positions": "indices",
            "mrope_axes": 3, "dtype": "bfloat16", "has_k": false})",
        R"({"head_dim": 64, "rotary_dim": 64, "style": "proportional", "xpos": true})",
        R"({"head_dim": 64, "rotary_dim": 16, "style": "proportional", "dtype": "bfloat16",
            "vec": 1, "vec_loads": false, "copy_vec": 1, "in_place_q": false,
            "table_vec_loads": false})",
    };
    rope_jit::KernelStats stats;
    for (const char* json : variants) {
        std::string error;
        const auto spec = KernelSpec::from_json(json, &error);
        INFO(json, error);
        REQUIRE(spec.has_value());
        CHECK(spec->proportional == 1);
        const std::string name = spec->describe();
        CAPTURE(name);
        const rope_jit::KernelBinary binary =
            rope_jit::build_kernel_binary(*spec, "sm_90", nullptr, stats);
        REQUIRE(binary.image.size() > 4);
        CHECK(std::string(binary.image.data(), 4) ==
              "\x7f"
              "ELF");
    }
}

TEST_CASE("the proportional GPU sweep's calls run on the CPU backend and their kernels compile") {
    // The specs of test_gpu_rope_proportional.cpp's sweep (which needs a GPU), checked here
    // without one: each call is valid, and the kernel it selects compiles for sm_90.
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    CpuRuntime runtime;
    rope_jit::KernelStats stats;
    SweepCompiles compiles;
    std::vector<KernelSpec> compiled;
    for (uint32_t family = 0; family < gpu_rope_test::kProportionalFamilies; ++family) {
        std::mt19937 family_rng(gpu_rope_test::kProportionalSeed + family);
        const gpu_rope_test::Spec c = gpu_rope_test::random_proportional_spec(family_rng);
        std::mt19937 rng(gpu_rope_test::kProportionalSeed + 7919 + family);
        gpu_rope_test::Problem p = gpu_rope_test::make_problem(c, rng);
        const std::string spec_text = gpu_rope_test::describe(c);
        CAPTURE(family);
        CAPTURE(spec_text);
        gpu_rope_test::run_with_host_tensors(runtime.handle, p);
        const rope_jit_rope_args args =
            gpu_rope_test::make_args(c, gpu_rope_test::host_views(p), nullptr);
        const KernelSpec spec = rope_jit::make_kernel_spec(rope_jit::make_rope_problem(args));
        CHECK(spec.proportional == 1);
        if (std::find(compiled.begin(), compiled.end(), spec) != compiled.end()) continue;
        compiled.push_back(spec);
        if (!compiles.next()) continue;
        const std::string name = spec.describe();
        CAPTURE(name);
        const rope_jit::KernelBinary binary =
            rope_jit::build_kernel_binary(spec, "sm_90", nullptr, stats);
        CHECK(std::string(binary.image.data(), 4) ==
              "\x7f"
              "ELF");
    }
    MESSAGE(compiled.size() << " proportional kernels, " << compiles.taken() << " compiled");
}
