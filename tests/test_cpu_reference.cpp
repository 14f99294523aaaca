// The CPU backend against the independent float64 reference of rope_test_support.h, over a
// randomized sweep of the whole spec space, plus targeted cases that are easy to reason about.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>
#include <atomic>

#include "child_process.h"
#include "common/thread_pool.h"
#include "rope_test_support.h"
#include "sanitizer_builds.h"

using namespace rope_test;

namespace {

enum class Layout { BHSD, BSHD, Padded, Packed, PackedHeadMajor };
enum class Positions { Implicit, PerToken, PerBatchToken, SeqlenOffsets };
enum class Angles { HalfTable, FullTable, InvFreq };

const char* layout_name(Layout l) {
    const char* names[] = {"bhsd", "bshd", "padded", "packed", "packed_head_major"};
    return names[int(l)];
}
const char* positions_name(Positions p) {
    const char* names[] = {"implicit", "positions[S]", "positions[B,S]", "seqlen_offsets"};
    return names[int(p)];
}
const char* angles_name(Angles a) {
    const char* names[] = {"half table", "full table", "inv_freq"};
    return names[int(a)];
}

struct Config {
    Dt dt = Dt::F32;
    Dt table_dt = Dt::F32;
    Dt index_dt = Dt::I64;
    bool interleaved = false, backward = false, in_place = false, has_k = true, xpos = false;
    Layout layout = Layout::BHSD;
    Positions positions = Positions::Implicit;
    Angles angles = Angles::HalfTable;
    int64_t B = 2, S = 5, Hk = 2, group = 2, D = 64, R = 64, offset = 0;
    int64_t position_offset = 0, q_extra = 0;  // q_extra: cached keys (k has q_extra more tokens)
};

HostTensor make_qk(const Config& c, int64_t H, int64_t S, const std::vector<int64_t>& cu) {
    const bool packed = c.layout == Layout::Packed || c.layout == Layout::PackedHeadMajor;
    if (packed) {
        const int64_t T = cu.back();
        return c.layout == Layout::Packed ? HostTensor(c.dt, {T, H, c.D})
                                          : HostTensor(c.dt, {T, H, c.D}, {1, 0, 2});
    }
    switch (c.layout) {
        case Layout::BSHD: return HostTensor(c.dt, {c.B, H, S, c.D}, {0, 2, 1, 3});
        case Layout::Padded: return HostTensor(c.dt, {c.B, H, S, c.D}, {0, 1, 2, 3}, 6);
        default: return HostTensor(c.dt, {c.B, H, S, c.D});
    }
}

// Everything outside a view's elements must be left alone: compares bytes of `after` that
// the view does not cover with `before`.
void check_untouched_padding(const HostTensor& t, const std::vector<uint8_t>& before) {
    std::vector<bool> covered(before.size() / dt_size(t.dtype()), false);
    t.for_each([&](const std::vector<int64_t>& i) { covered[size_t(t.offset(i))] = true; });
    HostTensor& mutable_t = const_cast<HostTensor&>(t);
    const std::vector<uint8_t>& after = mutable_t.bytes();
    size_t changed = 0;
    for (size_t e = 0; e < covered.size(); ++e)
        if (!covered[e])
            for (size_t byte = 0; byte < dt_size(t.dtype()); ++byte)
                changed +=
                    after[e * dt_size(t.dtype()) + byte] != before[e * dt_size(t.dtype()) + byte];
    CHECK(changed == 0);
}

// Runs one configuration through the C API and compares with the reference.
void run_config(rope_jit_runtime* runtime, const Config& c, std::mt19937& rng) {
    const bool packed = c.layout == Layout::Packed || c.layout == Layout::PackedHeadMajor;
    const int64_t Hq = c.Hk * c.group;
    const int64_t Sk = c.S + c.q_extra;

    // Sequence structure: B sequences of S tokens, or packed sequences of random lengths.
    std::vector<int64_t> cu = {0};
    for (int64_t b = 0; b < c.B; ++b)
        cu.push_back(cu.back() + (packed ? int64_t(rng() % uint32_t(c.S + 1)) : c.S));
    const int64_t T = cu.back();

    HostTensor q = make_qk(c, Hq, c.S, cu);
    HostTensor k = c.has_k ? make_qk(c, c.Hk, packed ? c.S : Sk, cu) : HostTensor();
    q.fill_uniform(rng, -2, 2);
    if (c.has_k) k.fill_uniform(rng, -2, 2);

    // Positions, resolved here by the README's rules, independently of the library.
    const int64_t tokens_q = packed ? T : c.B * c.S;
    const int64_t tokens_k = packed ? T : c.B * Sk;
    std::vector<int64_t> row_q(static_cast<size_t>(tokens_q)), row_k(static_cast<size_t>(tokens_k));
    HostTensor positions, offsets, cu_tensor;
    int64_t P = 1;
    auto sequence_of = [&](int64_t t) {
        return int64_t(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1;
    };
    std::uniform_int_distribution<int64_t> any_row(0, 40);
    switch (c.positions) {
        case Positions::Implicit:
            if (packed) {
                for (int64_t t = 0; t < T; ++t) {
                    const int64_t s = t - cu[size_t(sequence_of(t))];
                    row_q[size_t(t)] = s + c.position_offset + c.q_extra;
                    row_k[size_t(t)] = s + c.position_offset;
                }
            } else {
                for (int64_t b = 0; b < c.B; ++b) {
                    for (int64_t s = 0; s < c.S; ++s)
                        row_q[size_t(b * c.S + s)] = s + c.position_offset + c.q_extra;
                    for (int64_t s = 0; s < Sk; ++s)
                        row_k[size_t(b * Sk + s)] = s + c.position_offset;
                }
            }
            break;
        case Positions::PerToken: {
            const int64_t n = packed ? T : c.S;
            positions = HostTensor(c.index_dt, {n});
            for (int64_t s = 0; s < n; ++s) positions.set({s}, double(any_row(rng)));
            for (int64_t t = 0; t < tokens_q; ++t) {
                const int64_t s = packed ? t : t % c.S;
                row_q[size_t(t)] = row_k[size_t(t)] = int64_t(positions.get({s}));
            }
            break;
        }
        case Positions::PerBatchToken:
            positions = HostTensor(c.index_dt, {c.B, c.S});
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t s = 0; s < c.S; ++s) {
                    positions.set({b, s}, double(any_row(rng)));
                    row_q[size_t(b * c.S + s)] = row_k[size_t(b * c.S + s)] =
                        int64_t(positions.get({b, s}));
                }
            break;
        case Positions::SeqlenOffsets:
            offsets = HostTensor(c.index_dt, {c.B});
            for (int64_t b = 0; b < c.B; ++b) offsets.set({b}, double(rng() % 7));
            for (int64_t t = 0; t < tokens_q; ++t) {
                const int64_t b = packed ? sequence_of(t) : t / c.S;
                const int64_t s = packed ? t - cu[size_t(b)] : t % c.S;
                row_q[size_t(t)] = s + int64_t(offsets.get({b}));
            }
            for (int64_t t = 0; t < tokens_k; ++t) {
                const int64_t b = packed ? sequence_of(t) : t / Sk;
                const int64_t s = packed ? t - cu[size_t(b)] : t % Sk;
                row_k[size_t(t)] = s + int64_t(offsets.get({b}));
            }
            break;
    }
    for (int64_t r : row_q) P = std::max(P, r + 1);
    for (int64_t r : row_k) P = std::max(P, r + 1);
    P += int64_t(rng() % 3);  // tables may be longer than needed
    if (packed) {
        cu_tensor = HostTensor(c.index_dt, {c.B + 1});
        for (int64_t b = 0; b <= c.B; ++b) cu_tensor.set({b}, double(cu[size_t(b)]));
    }

    // Angles. Table columns that the pair rule must not read hold NaN, so a wrong column shows.
    Case ref;
    ref.R = c.R;
    ref.offset = c.offset;
    ref.interleaved = c.interleaved;
    ref.backward = c.backward;
    const int64_t half = c.R / 2;
    const bool full = c.angles == Angles::FullTable;
    const int64_t columns = full ? c.R : half;
    auto column = [&](int64_t i) { return !full ? i : c.interleaved ? 2 * i : i; };
    HostTensor cos_t, sin_t, inv_freq, xpos;
    std::uniform_real_distribution<double> angle(-7, 7), scale(0.5, 1.5);
    if (c.angles == Angles::InvFreq) {
        inv_freq = HostTensor(Dt::F32, {half});
        for (int64_t i = 0; i < half; ++i) {
            inv_freq.set({i}, std::pow(10000.0, -2.0 * double(i) / double(c.R)));
            ref.inv_freq.push_back(inv_freq.get({i}));
        }
    } else {
        cos_t = HostTensor(c.table_dt, {P, columns});
        sin_t = HostTensor(c.table_dt, {P, columns});
        for (int64_t p = 0; p < P; ++p)
            for (int64_t j = 0; j < columns; ++j) {
                cos_t.set({p, j}, std::nan(""));
                sin_t.set({p, j}, std::nan(""));
            }
        ref.cos.assign(size_t(P), std::vector<double>(size_t(half)));
        ref.sin = ref.cos;
        for (int64_t p = 0; p < P; ++p)
            for (int64_t i = 0; i < half; ++i) {
                const double a = angle(rng);
                cos_t.set({p, column(i)}, std::cos(a));
                sin_t.set({p, column(i)}, std::sin(a));
                ref.cos[size_t(p)][size_t(i)] = cos_t.get({p, column(i)});
                ref.sin[size_t(p)][size_t(i)] = sin_t.get({p, column(i)});
            }
    }
    if (c.xpos) {
        xpos = HostTensor(c.table_dt, {P, columns});
        for (int64_t p = 0; p < P; ++p)
            for (int64_t j = 0; j < columns; ++j) xpos.set({p, j}, std::nan(""));
        ref.xpos.assign(size_t(P), std::vector<double>(size_t(half)));
        for (int64_t p = 0; p < P; ++p)
            for (int64_t i = 0; i < half; ++i) {
                xpos.set({p, column(i)}, scale(rng));
                ref.xpos[size_t(p)][size_t(i)] = xpos.get({p, column(i)});
            }
    }

    // Expected outputs, from the reference on the (quantized) inputs.
    auto expected_of = [&](const HostTensor& x, const std::vector<int64_t>& rows, bool is_k) {
        HostTensor e(Dt::F32, x.shape());
        std::vector<int64_t> vec_index = x.shape();
        const int64_t heads = packed ? x.shape()[1] : x.shape()[1];
        const int64_t seq = packed ? T : x.shape()[2];
        const int64_t batches = packed ? 1 : c.B;
        for (int64_t b = 0; b < batches; ++b)
            for (int64_t h = 0; h < heads; ++h)
                for (int64_t s = 0; s < seq; ++s) {
                    auto index = [&](int64_t d) {
                        return packed ? std::vector<int64_t>{s, h, d}
                                      : std::vector<int64_t>{b, h, s, d};
                    };
                    std::vector<double> v(size_t(c.D));
                    for (int64_t d = 0; d < c.D; ++d) v[size_t(d)] = x.get(index(d));
                    std::vector<double> y =
                        reference_rotate(ref, v, rows[size_t(b * seq + s)], is_k);
                    for (int64_t d = 0; d < c.D; ++d) e.set(index(d), quantize(y[size_t(d)], c.dt));
                }
        return e.values();
    };
    const std::vector<double> expected_q = expected_of(q, row_q, false);
    const std::vector<double> expected_k =
        c.has_k ? expected_of(k, row_k, true) : std::vector<double>();
    const std::vector<double> q_before = q.values(),
                              k_before = c.has_k ? k.values() : std::vector<double>();

    HostTensor q_out, k_out;
    if (!c.in_place) {
        q_out = make_qk(c, Hq, c.S, cu);
        if (c.has_k) k_out = make_qk(c, c.Hk, packed ? c.S : Sk, cu);
    }
    const std::vector<uint8_t> q_bytes_before = c.in_place ? q.bytes() : q_out.bytes();

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = c.has_k ? k.dl() : nullptr;
    args.q_out = c.in_place ? nullptr : q_out.dl();
    args.k_out = c.in_place || !c.has_k ? nullptr : k_out.dl();
    if (c.angles == Angles::InvFreq) {
        args.inv_freq = inv_freq.dl();
    } else {
        args.cos = cos_t.dl();
        args.sin = sin_t.dl();
    }
    args.xpos_scale = c.xpos ? xpos.dl() : nullptr;
    args.positions = positions.numel() && c.positions != Positions::Implicit &&
                             c.positions != Positions::SeqlenOffsets
                         ? positions.dl()
                         : nullptr;
    args.seqlen_offsets = c.positions == Positions::SeqlenOffsets ? offsets.dl() : nullptr;
    args.cu_seqlens = packed ? cu_tensor.dl() : nullptr;
    args.position_offset = c.position_offset;
    args.q_position_offset = c.q_extra;
    args.rotary_dim =
        int32_t(c.R == c.D && c.offset == 0 && (rng() & 1) ? 0 : c.R);  // 0 means head_dim
    args.rotary_offset = int32_t(c.offset);
    args.style = c.interleaved ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
    args.backward = c.backward;

    const rope_jit_status status = rope_jit_rope(runtime, &args);
    INFO("message: ", rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);

    const double tol = tolerance_for(c.dt);
    const HostTensor& got_q = c.in_place ? q : q_out;
    CHECK(worst_ratio(got_q.values(), expected_q, tol, tol) <= 1.0);
    check_untouched_padding(got_q, q_bytes_before);
    if (c.has_k) {
        const HostTensor& got_k = c.in_place ? k : k_out;
        CHECK(worst_ratio(got_k.values(), expected_k, tol, tol) <= 1.0);
    }
    if (!c.in_place) {
        CHECK(q.values() == q_before);  // inputs of an out-of-place call stay as they were
        if (c.has_k) CHECK(k.values() == k_before);
    }
}

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> options) {
    return *(options.begin() + rng() % options.size());
}

}  // namespace

TEST_CASE(
    "the CPU backend matches the float64 reference over a randomized sweep of the spec space") {
    CpuRuntime runtime;
    std::mt19937 rng(20261129);
    for (int iteration = 0; iteration < 400; ++iteration) {
        Config c;
        c.dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
        c.table_dt = pick(rng, {Dt::F32, Dt::F16, Dt::BF16});
        c.index_dt = pick(rng, {Dt::I32, Dt::I64});
        c.interleaved = rng() & 1;
        c.backward = rng() & 1;
        c.in_place = rng() & 1;
        c.has_k = rng() % 4 != 0;
        c.xpos = rng() % 5 == 0;
        c.layout = pick(rng, {Layout::BHSD, Layout::BSHD, Layout::Padded, Layout::Packed,
                              Layout::PackedHeadMajor});
        const bool packed = c.layout == Layout::Packed || c.layout == Layout::PackedHeadMajor;
        c.positions =
            packed ? pick(rng, {Positions::Implicit, Positions::PerToken, Positions::SeqlenOffsets})
                   : pick(rng, {Positions::Implicit, Positions::PerToken, Positions::PerBatchToken,
                                Positions::SeqlenOffsets});
        c.angles = pick(rng, {Angles::HalfTable, Angles::FullTable, Angles::InvFreq});
        c.D = pick<int64_t>(rng, {2, 8, 34, 64, 80, 96, 128, 256});
        c.R = rng() % 3 == 0 ? 2 * (1 + int64_t(rng() % uint32_t(c.D / 2))) : c.D;
        c.offset = c.R < c.D ? int64_t(rng() % uint32_t(c.D - c.R + 1)) : 0;
        c.B = 1 + rng() % 3;
        c.S = 1 + rng() % 9;
        c.Hk = 1 + rng() % 3;
        c.group = pick<int64_t>(rng, {1, 2, 4, 8});
        c.position_offset = c.positions == Positions::Implicit ? rng() % 4 : 0;
        c.q_extra = c.positions == Positions::Implicit && !packed && c.has_k && rng() % 3 == 0
                        ? 1 + rng() % 4
                        : 0;

        CAPTURE(iteration);
        const std::string dtype = dt_name(c.dt), table_dtype = dt_name(c.table_dt),
                          index_dtype = dt_name(c.index_dt);
        const std::string layout = layout_name(c.layout), positions = positions_name(c.positions),
                          angles = angles_name(c.angles);
        CAPTURE(dtype);
        CAPTURE(table_dtype);
        CAPTURE(index_dtype);
        CAPTURE(c.interleaved);
        CAPTURE(c.backward);
        CAPTURE(c.in_place);
        CAPTURE(c.has_k);
        CAPTURE(c.xpos);
        CAPTURE(layout);
        CAPTURE(positions);
        CAPTURE(angles);
        CAPTURE(c.B);
        CAPTURE(c.S);
        CAPTURE(c.Hk);
        CAPTURE(c.group);
        CAPTURE(c.D);
        CAPTURE(c.R);
        CAPTURE(c.offset);
        CAPTURE(c.position_offset);
        CAPTURE(c.q_extra);
        run_config(runtime.handle, c, rng);
    }
}

TEST_CASE("a quarter turn on a hand-written example gives the hand-computed result") {
    // D = 4, half style, one token at position 1 whose angle is pi/2 for pair 0 and 0 for
    // pair 1: pair (x0, x2) turns a quarter, (x1, x3) stays.
    CpuRuntime runtime;
    HostTensor q(Dt::F32, {1, 1, 1, 4});
    for (int64_t d = 0; d < 4; ++d) q.set({0, 0, 0, d}, double(d + 1));  // 1 2 3 4
    HostTensor cos_t(Dt::F32, {2, 2}), sin_t(Dt::F32, {2, 2});
    cos_t.set({1, 0}, 0.0), sin_t.set({1, 0}, 1.0);
    cos_t.set({1, 1}, 1.0), sin_t.set({1, 1}, 0.0);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    args.position_offset = 1;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    // y0 = x0*c - x2*s = -3, y2 = x2*c + x0*s = 1; pair 1 unchanged.
    CHECK(q.values() == std::vector<double>{-3, 2, 1, 4});

    SUBCASE("and backward turns it back") {
        args.backward = 1;
        REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
        CHECK(q.values() == std::vector<double>{1, 2, 3, 4});
    }
}

TEST_CASE("empty inputs are a successful no-op") {
    CpuRuntime runtime;
    HostTensor q(Dt::F32, {2, 4, 0, 8});
    HostTensor cos_t(Dt::F32, {4, 4}), sin_t(Dt::F32, {4, 4});
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    CHECK(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
}

TEST_CASE("many threads calling one runtime at once all get correct results") {
    CpuRuntime runtime;
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < 6; ++t)
        threads.emplace_back([&, t] {
            HostTensor q(Dt::F32, {2, 8, 64, 64});
            std::mt19937 rng{static_cast<uint32_t>(t)};
            q.fill_uniform(rng, -1, 1);
            HostTensor inv(Dt::F32, {32});
            for (int64_t i = 0; i < 32; ++i) inv.set({i}, std::pow(10000.0, -double(i) / 32));
            const std::vector<double> original = q.values();
            rope_jit_rope_args args;
            rope_jit_rope_args_init(&args);
            args.q = q.dl();
            args.inv_freq = inv.dl();
            for (int round = 0; round < 20; ++round) {
                args.backward = round % 2;
                if (rope_jit_rope(runtime.handle, &args) != ROPE_JIT_OK) ++failures;
            }
            // An even number of forward/backward pairs returns the input (up to rounding).
            if (worst_ratio(q.values(), original, 1e-5, 1e-5) > 1.0) ++failures;
        });
    for (std::thread& t : threads) t.join();
    CHECK(failures.load() == 0);
}

TEST_CASE("a thread pool says how many threads will run a range before any chunk runs") {
    rope_jit::ThreadPool pool(4);
    REQUIRE(pool.size() == 4);
    std::atomic<int> chunks{0};
    auto count_chunks = [&](int64_t, int64_t) { ++chunks; };
    int threads = 0;
    auto record = [&](int n) {
        threads = n;
        CHECK(chunks.load() == 0);  // before any chunk
    };
    pool.parallel_for(1000, 1, count_chunks, record);
    CHECK(threads == 4);
    threads = 0, chunks = 0;
    pool.parallel_for(2, 1, count_chunks, record);  // two chunks: two threads at most
    CHECK(threads == 2);
    threads = 0, chunks = 0;
    pool.parallel_for(10, 10, count_chunks, record);  // one grain: the caller alone
    CHECK(threads == 1);
    CHECK(chunks == 1);
    // While another range holds the pool, the caller runs its range alone.
    std::atomic<bool> inside{false}, release{false};
    std::thread holder([&] {
        pool.parallel_for(1000, 1, [&](int64_t, int64_t) {
            inside = true;
            while (!release) std::this_thread::yield();
        });
    });
    while (!inside) std::this_thread::yield();
    threads = 0, chunks = 0;
    pool.parallel_for(1000, 1, count_chunks, record);
    CHECK(threads == 1);
    CHECK(chunks == 1);
    release = true;
    holder.join();
    // An exception from `before` leaves before any chunk runs.
    chunks = 0;
    CHECK_THROWS_AS(pool.parallel_for(1000, 1, count_chunks,
                                      [](int) { throw std::runtime_error("no memory"); }),
                    std::runtime_error);
    CHECK(chunks == 0);
}

TEST_CASE("a thread pool that cannot start all its threads works with the ones it has") {
    // Creating the workers threw (no more threads to be had: RLIMIT_NPROC, cgroup pids.max);
    // the workers already started were destroyed running, and the process aborted
    // (adversarial test, session 35).
#ifdef ROPE_JIT_TEST_ASAN
    MESSAGE("skipped: the address-space limit this test sets leaves AddressSanitizer no room");
    return;
#else
    constexpr int kThreads = 1000;
    constexpr int64_t kItems = 100000;
    // In a child, with an address space limit a little above what it uses now: thread stacks
    // (8 MiB by default) cannot be mapped after the first few. Its exit status: 0 when every
    // item was done exactly once, twice; its output: the pool's size.
    const ChildResult child = run_in_child(
        [&](std::string* output) {
            std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[kItems]());
            long long used_kib = 0;
            {
                std::ifstream status("/proc/self/status");
                for (std::string word; status >> word;)
                    if (word == "VmSize:") status >> used_kib;
            }
            struct rlimit limit;
            if (used_kib <= 0 || getrlimit(RLIMIT_AS, &limit) != 0) return 3;
            limit.rlim_cur = rlim_t(used_kib) * 1024 + (16u << 20);
            if (setrlimit(RLIMIT_AS, &limit) != 0) return 4;
            rope_jit::ThreadPool pool(kThreads);
            bool all_once = true;
            for (int round = 1; round <= 2; ++round) {
                pool.parallel_for(kItems, 1, [&](int64_t begin, int64_t end) {
                    for (int64_t i = begin; i < end; ++i) hits[size_t(i)]++;
                });
                for (int64_t i = 0; i < kItems; ++i)
                    all_once = all_once && hits[size_t(i)] == round;
            }
            *output = std::to_string(pool.size());
            return all_once ? 0 : 1;
        },
        120);
    const std::string& size = child.output;
    CAPTURE(size);
    CAPTURE(child.wait_status);
    REQUIRE(child.exited_with(0));  // not aborted (nor killed by the alarm), every item once
    REQUIRE_FALSE(size.empty());
    CHECK(std::stoi(size) >= 1);
    CHECK(std::stoi(size) < kThreads);  // the limit did stop thread creation
#endif
}

TEST_CASE(
    "a child forked after the CPU pool started runs calls on its own thread and frees the "
    "runtime") {
    // The child inherited the workers as handles to threads it does not have: freeing the
    // runtime joined them and hung, or crashed (adversarial test, session 35).
#ifdef ROPE_JIT_TEST_TSAN
    MESSAGE("skipped: ThreadSanitizer does not follow a multi-threaded process into fork()");
    return;
#else
    CpuRuntime cpu(4, false);
    rope_jit_runtime* runtime = cpu.handle;
    HostTensor q(Dt::F32, {2, 4, 256, 64});
    std::mt19937 rng(35);
    q.fill_uniform(rng, -1, 1);
    HostTensor inv(Dt::F32, {32});
    for (int64_t i = 0; i < 32; ++i) inv.set({i}, std::pow(10000.0, -double(i) / 32));
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.inv_freq = inv.dl();
    const std::vector<uint8_t> input = q.bytes();
    REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);  // starts the pool's workers
    const std::vector<uint8_t> expected = q.bytes();
    REQUIRE(expected != input);
    std::memcpy(q.bytes().data(), input.data(), input.size());

    SUBCASE("a call, then free") {
        const ChildResult child = run_in_child(
            [&](std::string*) {
                if (rope_jit_rope(runtime, &args) != ROPE_JIT_OK) return 1;
                if (q.bytes() != expected) return 2;
                rope_jit_runtime_free(runtime);
                return 0;
            },
            30);
        CAPTURE(child.wait_status);
        CHECK(child.exited_with(0));  // neither crashed nor stopped by the alarm
    }
    SUBCASE("free at once") {
        const ChildResult child = run_in_child(
            [&](std::string*) {
                rope_jit_runtime_free(runtime);
                return 0;
            },
            30);
        CAPTURE(child.wait_status);
        CHECK(child.exited_with(0));
    }
    // The parent's runtime and pool are as they were.
    CHECK(q.bytes() == input);
    REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);
    CHECK(q.bytes() == expected);
#endif
}

TEST_CASE("a thread pool inherited by a forked child runs every range on the calling thread") {
#ifdef ROPE_JIT_TEST_TSAN
    MESSAGE("skipped: ThreadSanitizer does not follow a multi-threaded process into fork()");
    return;
#else
    constexpr int64_t kItems = 100000;
    auto pool = std::make_unique<rope_jit::ThreadPool>(4);
    REQUIRE(pool->size() > 1);
    // The workers wait for jobs, as they would after any call.
    std::atomic<int64_t> parent_items{0};
    pool->parallel_for(kItems, 1, [&](int64_t begin, int64_t end) { parent_items += end - begin; });
    REQUIRE(parent_items.load() == kItems);
    const ChildResult child = run_in_child([&](std::string*) {
        std::vector<int> hits(size_t(kItems), 0);
        bool caller_only = true;
        const std::thread::id caller = std::this_thread::get_id();
        for (int round = 1; round <= 2; ++round)
            pool->parallel_for(kItems, 1, [&](int64_t begin, int64_t end) {
                caller_only = caller_only && std::this_thread::get_id() == caller;
                for (int64_t i = begin; i < end; ++i) hits[size_t(i)]++;
            });
        for (const int h : hits)
            if (h != 2) return 1;
        if (!caller_only) return 2;
        pool.reset();  // must neither hang nor crash
        return 0;
    }, 30);
    CAPTURE(child.wait_status);
    CHECK(child.exited_with(0));
#endif
}
