// The CPU reference of attention with rotary fused in, through the public C API: the forward
// against an independent float64 reference written from the golden README's formula, the
// backward against finite differences of that reference, and the edge cases of the contract
// (queries that see no key, layouts, the default scale, determinism).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "attention_test_support.h"
#include "common/half_float.h"

using namespace attention_test;
using rope_test::Dt;

namespace {

class CpuRuntime {
public:
    CpuRuntime() {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        REQUIRE(rope_jit_runtime_create(&config, &runtime_) == ROPE_JIT_OK);
    }
    ~CpuRuntime() { rope_jit_runtime_free(runtime_); }
    CpuRuntime(const CpuRuntime&) = delete;
    CpuRuntime& operator=(const CpuRuntime&) = delete;
    rope_jit_runtime* get() const { return runtime_; }

private:
    rope_jit_runtime* runtime_ = nullptr;
};

void run_forward(rope_jit_runtime* runtime, Problem& p) {
    const rope_jit_attention_args args = p.args();
    const rope_jit_status status = rope_jit_attention(runtime, &args);
    INFO("rope_jit_attention: " << std::string(rope_jit_status_name(status)) << ": "
                                << std::string(rope_jit_last_error()));
    REQUIRE(status == ROPE_JIT_OK);
}

void run_backward(rope_jit_runtime* runtime, Problem& p) {
    const rope_jit_attention_args args = p.args();
    const rope_jit_status status = rope_jit_attention_backward(runtime, &args);
    INFO("rope_jit_attention_backward: " << std::string(rope_jit_status_name(status)) << ": "
                                         << std::string(rope_jit_last_error()));
    REQUIRE(status == ROPE_JIT_OK);
}

// The output tolerance of a dtype when the only error is the final rounding (normalized).
double rounding_tolerance(Dt dt) {
    return dt == Dt::F32 ? 2e-7 : dt == Dt::F16 ? 1e-3 : 8e-3;
}

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> options) {
    return *(options.begin() + rng() % options.size());
}

Config random_config(std::mt19937& rng) {
    Config c;
    c.dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
    c.table_dt = pick(rng, {Dt::F32, Dt::BF16, Dt::F16});
    c.mask_dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
    c.B = 1 + rng() % 2;
    c.Hk = 1 + rng() % 2;
    c.Hq = c.Hk * pick<int64_t>(rng, {1, 2, 4});
    c.Sq = 1 + rng() % 9;
    c.Sk = rng() % 3 == 0 ? 1 + rng() % 9 : c.Sq;
    c.D = pick<int64_t>(rng, {4, 8, 12, 16});
    c.R = pick<int64_t>(rng, {0, c.D, c.D, c.D / 2, 2});
    c.interleaved = rng() & 1;
    c.table_full = rng() & 1;
    c.causal = rng() & 1;
    c.pos_mask = c.R > 0 && rng() % 3 == 0;
    c.pos_mask_batched = rng() & 1;
    c.mask = pick(rng, {Mask::None, Mask::None, Mask::BoolKeys, Mask::BoolFull, Mask::AddKeys,
                        Mask::AddFull});
    c.mask_batch_broadcast = rng() % 3 == 0;
    c.scale = rng() % 3 == 0 ? 0.3 : 0.0;
    c.bshd = rng() & 1;
    c.pad = rng() % 3 == 0 ? 3 : 0;
    c.rotary_dim_zero = c.R == c.D && (rng() & 1);
    return c;
}

}  // namespace

TEST_CASE(
    "the CPU forward matches an independent float64 reference across dtypes, styles, masks, GQA "
    "and pos_mask") {
    CpuRuntime runtime;
    std::mt19937 rng(2024);
    for (int round = 0; round < 150; ++round) {
        const Config c = random_config(rng);
        CAPTURE(round);
        CAPTURE(describe(c));
        Problem p(c, rng);
        run_forward(runtime.get(), p);
        const Result expected = Reference(p).forward(arrays_of(p));
        CHECK(normalized_error(p.out.values(), expected.out) <= rounding_tolerance(c.dt));
        const std::vector<double> lse = p.lse.values();
        for (size_t i = 0; i < lse.size(); ++i) {
            CAPTURE(i);
            if (std::isinf(expected.lse[i]))
                CHECK(lse[i] == expected.lse[i]);
            else
                CHECK(std::fabs(lse[i] - expected.lse[i]) <=
                      1e-6 * std::max(1.0, std::fabs(expected.lse[i])));
        }
    }
}

TEST_CASE("the CPU backward matches finite differences of the independent reference") {
    CpuRuntime runtime;
    std::mt19937 rng(77);
    std::vector<Config> configs;
    auto add = [&](std::function<void(Config&)> change) {
        Config c;
        c.B = 1;
        c.Hq = 2;
        c.Hk = 1;
        c.Sq = 4;
        c.Sk = 4;
        c.D = 8;
        c.R = 8;
        change(c);
        configs.push_back(c);
    };
    add([](Config&) {});
    add([](Config& c) { c.R = 0; });
    add([](Config& c) {
        c.causal = true;
        c.Hq = 4;
        c.Hk = 2;
    });
    add([](Config& c) {
        c.interleaved = true;
        c.table_full = true;
        c.R = 4;
    });
    add([](Config& c) { c.pos_mask = true; });
    add([](Config& c) {
        c.pos_mask = true;
        c.interleaved = true;
        c.causal = true;
        c.Sq = 5;
        c.Sk = 5;
    });
    add([](Config& c) {
        c.mask = Mask::BoolFull;
        c.Sk = 6;
    });
    add([](Config& c) {
        c.mask = Mask::AddKeys;
        c.pos_mask = true;
        c.pos_mask_batched = true;
        c.B = 2;
    });
    add([](Config& c) {
        c.mask = Mask::AddFull;
        c.causal = true;
        c.Sq = 6;
        c.Sk = 3;
        c.scale = 0.7;
    });
    for (const Config& c : configs) {
        CAPTURE(describe(c));
        Problem p(c, rng);
        run_forward(runtime.get(), p);
        run_backward(runtime.get(), p);
        const Reference reference(p);
        const std::vector<double> weights = p.dout.values();
        auto loss = [&](const Arrays& a) {
            const Result r = reference.forward(a);
            double sum = 0;
            for (size_t i = 0; i < r.out.size(); ++i) sum += r.out[i] * weights[i];
            return sum;
        };
        const Arrays base = arrays_of(p);
        const double h = 1e-5;
        auto gradient = [&](std::vector<double> Arrays::*member) {
            std::vector<double> g((base.*member).size());
            for (size_t i = 0; i < g.size(); ++i) {
                Arrays plus = base, minus = base;
                (plus.*member)[i] += h;
                (minus.*member)[i] -= h;
                g[i] = (loss(plus) - loss(minus)) / (2 * h);
            }
            return g;
        };
        CHECK(normalized_error(p.dq.values(), gradient(&Arrays::q)) <= 1e-5);
        CHECK(normalized_error(p.dk.values(), gradient(&Arrays::k)) <= 1e-5);
        CHECK(normalized_error(p.dv.values(), gradient(&Arrays::v)) <= 1e-5);
    }
}

TEST_CASE("a query that sees no key gets out 0, lse -inf and no gradient") {
    CpuRuntime runtime;
    std::mt19937 rng(5);
    SUBCASE("a boolean mask hides every key of one batch") {
        Config c;
        c.B = 2;
        c.mask = Mask::BoolKeys;
        Problem p(c, rng);
        std::fill(p.mask_bool.bytes().begin(), p.mask_bool.bytes().begin() + c.Sk, uint8_t(0));
        run_forward(runtime.get(), p);
        run_backward(runtime.get(), p);
        for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t i = 0; i < c.Sq; ++i) {
                CHECK(p.lse.get({0, h, i}) == -std::numeric_limits<double>::infinity());
                CHECK(std::isfinite(p.lse.get({1, h, i})));
                for (int64_t d = 0; d < c.D; ++d) {
                    CHECK(p.out.get({0, h, i, d}) == 0.0);
                    CHECK(p.dq.get({0, h, i, d}) == 0.0);
                }
            }
        for (int64_t j = 0; j < c.Sk; ++j)
            for (int64_t d = 0; d < c.D; ++d) {
                CHECK(p.dk.get({0, 0, j, d}) == 0.0);
                CHECK(p.dv.get({0, 0, j, d}) == 0.0);
            }
    }
    SUBCASE("there are no keys at all") {
        Config c;
        c.Sk = 0;
        Problem p(c, rng);
        run_forward(runtime.get(), p);
        run_backward(runtime.get(), p);
        for (double x : p.out.values()) CHECK(x == 0.0);
        for (double x : p.dq.values()) CHECK(x == 0.0);
        for (double x : p.lse.values()) CHECK(x == -std::numeric_limits<double>::infinity());
    }
}

TEST_CASE(
    "a NaN in the v of a key a row sees counts even where its probability underflows to 0") {
    // The CPU reference skipped keys of probability 0 (masked or underflowed), so a NaN in
    // such a key's v vanished, where the GPU's P.V gives NaN (adversarial pass, session 35).
    // A masked key's NaN v still counts for nothing.
    CpuRuntime runtime;
    std::mt19937 rng(12);
    Config c;
    c.B = 1;
    c.Hq = c.Hk = 1;
    c.Sq = 1;
    c.Sk = 3;
    c.D = 8;
    c.R = 0;  // no rotation: the scores are q . k / sqrt(8)
    c.mask = Mask::BoolKeys;
    Problem p(c, rng);
    // Scores: key 0 sees q . k0 = 1600, key 1 sees -1600 (exp underflows to 0), key 2 masked.
    for (int64_t d = 0; d < c.D; ++d) {
        p.q.set({0, 0, 0, d}, d == 0 ? 40.0 : 0.0);
        p.k.set({0, 0, 0, d}, d == 0 ? 40.0 * std::sqrt(8.0) : 0.0);
        p.k.set({0, 0, 1, d}, d == 0 ? -40.0 * std::sqrt(8.0) : 0.0);
    }
    p.mask_bool.bytes()[2] = 0;
    SUBCASE("a seen key of probability 0") {
        p.v.set({0, 0, 1, 0}, std::numeric_limits<double>::quiet_NaN());
        run_forward(runtime.get(), p);
        CHECK(std::isnan(p.out.get({0, 0, 0, 0})));
    }
    SUBCASE("a masked key") {
        p.v.set({0, 0, 2, 0}, std::numeric_limits<double>::quiet_NaN());
        run_forward(runtime.get(), p);
        for (int64_t d = 0; d < c.D; ++d) CHECK(std::isfinite(p.out.get({0, 0, 0, d})));
        CHECK(p.out.get({0, 0, 0, 1}) == doctest::Approx(p.v.get({0, 0, 0, 1})));
    }
}

TEST_CASE(
    "a NaN in a query row makes that row's out, lse and dq NaN, and the keys it sees get NaN "
    "gradients") {
    CpuRuntime runtime;
    for (const bool causal : {false, true}) {
        CAPTURE(causal);
        std::mt19937 rng(11);
        Config c;
        c.B = 1;
        c.Hq = c.Hk = 1;
        c.Sq = c.Sk = 5;
        c.D = c.R = 8;
        c.causal = causal;
        c.mask = Mask::BoolKeys;
        Problem p(c, rng);
        p.mask_bool.bytes()[4] = 0;  // key 4 hidden: it must keep finite gradients
        // Row 2 has NaN in every score (one NaN feature): a NaN must not read as "no key".
        p.q.set({0, 0, 2, 3}, std::numeric_limits<double>::quiet_NaN());
        run_forward(runtime.get(), p);
        run_backward(runtime.get(), p);
        const int64_t seen = causal ? 3 : 4;  // keys row 2 sees
        for (int64_t i = 0; i < c.Sq; ++i) {
            CAPTURE(i);
            CHECK(std::isnan(p.lse.get({0, 0, i})) == (i == 2));
            for (int64_t d = 0; d < c.D; ++d) {
                CHECK(std::isnan(p.out.get({0, 0, i, d})) == (i == 2));
                CHECK(std::isnan(p.dq.get({0, 0, i, d})) == (i == 2));
            }
        }
        for (int64_t j = 0; j < c.Sk; ++j) {
            CAPTURE(j);
            CHECK(std::isnan(p.dk.get({0, 0, j, 0})) == (j < seen));
            CHECK(std::isnan(p.dv.get({0, 0, j, 0})) == (j < seen));
        }
    }
}

TEST_CASE("16-bit outputs are the float64 result rounded once, also just above a halfway point") {
    // out = sigmoid(scale) for q = [1], keys [1] and [0], values [1] and [0]. Each scale puts
    // the output about 1e-9 above the midpoint between two representable values: rounding to a
    // float first would land on the midpoint and then go to the even (lower) neighbour.
    CpuRuntime runtime;
    struct Case {
        Dt dt;
        double scale;
        uint16_t below, above;  // the two neighbours of the result
    };
    for (const Case& k : {Case{Dt::F16, 0.00097656630290141218, 0x3800, 0x3801},
                          Case{Dt::BF16, 0.0078125434621407943, 0x3f00, 0x3f01}}) {
        CAPTURE(rope_test::dt_name(k.dt));
        Config c;
        c.dt = k.dt;
        c.Hq = c.Hk = 1;
        c.Sq = 1;
        c.Sk = 2;
        c.D = 2;
        c.R = 0;
        c.scale = k.scale;
        std::mt19937 rng(1);
        Problem p(c, rng);
        for (int64_t d = 0; d < c.D; ++d) {
            p.q.set({0, 0, 0, d}, d == 0 ? 1.0 : 0.0);
            p.k.set({0, 0, 0, d}, d == 0 ? 1.0 : 0.0);
            p.k.set({0, 0, 1, d}, 0.0);
            p.v.set({0, 0, 0, d}, d == 0 ? 1.0 : 0.0);
            p.v.set({0, 0, 1, d}, 0.0);
        }
        run_forward(runtime.get(), p);
        const long double exact = 1.0L / (1.0L + std::exp(-static_cast<long double>(k.scale)));
        auto value_of = [&](uint16_t bits) {
            return k.dt == Dt::F16 ? double(rope_jit::fp16_to_float(bits))
                                   : double(rope_jit::bf16_to_float(bits));
        };
        const long double to_below = exact - value_of(k.below),
                          to_above = value_of(k.above) - exact;
        REQUIRE((to_below > 0 && to_above > 0));
        const uint16_t nearest = to_below < to_above ? k.below : k.above;
        CHECK(nearest == k.above);  // the case is what it says: just above the midpoint
        uint16_t got = 0;
        std::memcpy(&got, p.out.bytes().data(), 2);
        CHECK(got == nearest);
    }
}

TEST_CASE(
    "strided views give the same results as contiguous tensors and leave their padding alone") {
    CpuRuntime runtime;
    Config c;
    c.dt = Dt::BF16;
    c.Hq = 4;
    c.Hk = 2;
    c.Sq = 7;
    c.Sk = 9;
    c.D = 16;
    c.R = 8;
    c.causal = true;
    c.pos_mask = true;
    std::mt19937 rng_a(9), rng_b(9);
    Problem contiguous(c, rng_a);
    c.bshd = true;
    c.pad = 5;
    Problem strided(c, rng_b);
    REQUIRE(contiguous.q.values() == strided.q.values());
    run_forward(runtime.get(), contiguous);
    run_forward(runtime.get(), strided);
    run_backward(runtime.get(), contiguous);
    run_backward(runtime.get(), strided);
    CHECK(contiguous.out.values() == strided.out.values());
    CHECK(contiguous.lse.values() == strided.lse.values());
    CHECK(contiguous.dq.values() == strided.dq.values());
    CHECK(contiguous.dk.values() == strided.dk.values());
    CHECK(contiguous.dv.values() == strided.dv.values());
    // The pad elements after each stored row keep HostTensor's 0xA5 poison.
    for (HostTensor* t : {&strided.out, &strided.dq, &strided.dk, &strided.dv}) {
        const std::vector<uint8_t>& bytes = t->bytes();
        const int64_t row = c.D + c.pad;
        for (size_t e = 0; e < bytes.size() / 2; ++e)
            if (int64_t(e) % row >= c.D) {
                CAPTURE(e);
                CHECK(bytes[2 * e] == 0xA5);
                CHECK(bytes[2 * e + 1] == 0xA5);
            }
    }
}

TEST_CASE("scale 0 means 1/sqrt(head_dim)") {
    CpuRuntime runtime;
    Config c;
    c.D = 16;
    c.R = 16;
    std::mt19937 rng_a(3), rng_b(3);
    Problem by_default(c, rng_a);
    c.scale = 0.25;
    Problem explicit_scale(c, rng_b);
    run_forward(runtime.get(), by_default);
    run_forward(runtime.get(), explicit_scale);
    CHECK(by_default.out.values() == explicit_scale.out.values());
}

TEST_CASE("the CPU backward is deterministic") {
    CpuRuntime runtime;
    Config c;
    c.B = 2;
    c.Hq = 8;
    c.Hk = 2;
    c.Sq = 33;
    c.Sk = 33;
    c.D = 16;
    c.R = 16;
    c.causal = true;
    std::mt19937 rng(11);
    Problem p(c, rng);
    run_forward(runtime.get(), p);
    run_backward(runtime.get(), p);
    const std::vector<uint8_t> dq = p.dq.bytes(), dk = p.dk.bytes(), dv = p.dv.bytes();
    run_backward(runtime.get(), p);
    CHECK(dq == p.dq.bytes());
    CHECK(dk == p.dk.bytes());
    CHECK(dv == p.dv.bytes());
}

TEST_CASE("the CPU backward works from the caller's out and lse, as the GPU kernels do") {
    // It recomputed both, so a stale or wrong lse or out gave a correct gradient on the CPU
    // and another one on the GPU (adversarial test, session 32).
    CpuRuntime runtime;
    Config c;
    c.Hq = 2, c.Hk = 1, c.Sq = 9, c.Sk = 9, c.D = 16, c.R = 16;
    c.causal = true;
    std::mt19937 rng(17);
    Problem p(c, rng);
    run_forward(runtime.get(), p);
    run_backward(runtime.get(), p);
    const std::vector<double> dq = p.dq.values(), dv = p.dv.values();
    SUBCASE("lse + log 2 halves every probability, and so dv, a sum of them times dout") {
        for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t i = 0; i < c.Sq; ++i)
                p.lse.set({0, h, i}, p.lse.get({0, h, i}) + std::log(2.0));
        run_backward(runtime.get(), p);
        const std::vector<double> halved = p.dv.values();
        for (size_t k = 0; k < dv.size(); ++k)
            CHECK(halved[k] == doctest::Approx(dv[k] / 2).epsilon(1e-5).scale(1e-6));
    }
    SUBCASE("out 0 makes delta 0: dv keeps its value, dq does not") {
        for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t i = 0; i < c.Sq; ++i)
                for (int64_t d = 0; d < c.D; ++d) p.out.set({0, h, i, d}, 0.0);
        run_backward(runtime.get(), p);
        const std::vector<double> dv_now = p.dv.values(), dq_now = p.dq.values();
        for (size_t k = 0; k < dv.size(); ++k) CHECK(dv_now[k] == doctest::Approx(dv[k]));
        double moved = 0;
        for (size_t k = 0; k < dq.size(); ++k)
            moved = std::max(moved, std::abs(dq_now[k] - dq[k]));
        CHECK(moved > 1e-3);
    }
    SUBCASE("a NaN lse makes that row's dq NaN and leaves the other rows' as they were") {
        p.lse.set({0, 1, 4}, std::numeric_limits<double>::quiet_NaN());
        run_backward(runtime.get(), p);
        for (int64_t d = 0; d < c.D; ++d) {
            CHECK(std::isnan(p.dq.get({0, 1, 4, d})));
            CHECK(p.dq.get({0, 1, 3, d}) == doctest::Approx(dq[size_t((c.Sq + 3) * c.D + d)]));
        }
    }
}
