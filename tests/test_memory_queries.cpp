// rope_jit_tensors_share_memory against enumeration, for views whose strides give the search's
// steps no common divisor to lean on: 1-byte (float8) and 2-byte elements with odd, negative
// and zero strides. And the views that made it scan billions of candidates (adversarial pass,
// session 48): 1-byte views with strides 2^31 + 1 against 2^31 and 2^32 + 1 against 2^32.
// The queries touch no memory, so the views point into a buffer that is never read.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <random>
#include <vector>

#include "rope_jit/rope_jit.h"
#include "rope_test_support.h"

namespace {

using rope_test::Dt;

struct ByteView {
    Dt dt;
    std::vector<int64_t> shape, strides;  // strides in elements
    int64_t start;                        // the first element's byte offset in the buffer
};

DLTensor dl_view(const ByteView& v, uint8_t* base) {
    DLTensor t{};
    // An address, not a pointer into the buffer: the queries read no memory, and the views of
    // the last test start gigabytes past it.
    t.data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(v.start));
    t.device = {kDLCPU, 0};
    t.ndim = int32_t(v.shape.size());
    t.dtype = rope_test::dl_type(v.dt);
    t.shape = const_cast<int64_t*>(v.shape.data());
    t.strides = const_cast<int64_t*>(v.strides.data());
    return t;
}

// Every byte of every element, sorted.
std::vector<int64_t> bytes_of(const ByteView& v) {
    const int64_t size = int64_t(rope_test::dt_size(v.dt));
    std::vector<int64_t> out;
    std::vector<int64_t> index(v.shape.size(), 0);
    const int64_t count = [&] {
        int64_t n = 1;
        for (int64_t s : v.shape) n *= s;
        return n;
    }();
    for (int64_t e = 0; e < count; ++e) {
        int64_t offset = v.start, rest = e;
        for (size_t d = v.shape.size(); d-- > 0;) {
            offset += (rest % v.shape[d]) * v.strides[d] * size;
            rest /= v.shape[d];
        }
        for (int64_t b = 0; b < size; ++b) out.push_back(offset + b);
    }
    std::sort(out.begin(), out.end());
    return out;
}

int share(const ByteView& a, const ByteView& b, uint8_t* base) {
    DLTensor ta = dl_view(a, base), tb = dl_view(b, base);
    int shared = -1;
    const rope_jit_status status = rope_jit_tensors_share_memory(&ta, &tb, &shared);
    INFO(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);
    return shared;
}

}  // namespace

TEST_CASE("rope_jit_tensors_share_memory matches enumeration for 1- and 2-byte views") {
    static uint8_t buffer[1 << 16];
    std::mt19937 rng(48);
    const int64_t choices[] = {1, 2, 3, 5, 7, 11, 13, 17, 31, 64, 65, 127, 255, -1, -3, -7, -33, 0};
    auto random_view = [&](Dt dt) {
        ByteView v{dt, {}, {}, 0};
        const size_t dims = 1 + rng() % 3;
        int64_t low = 0, high = 0;
        for (size_t d = 0; d < dims; ++d) {
            v.shape.push_back(1 + int64_t(rng() % 6));
            v.strides.push_back(choices[rng() % std::size(choices)]);
            const int64_t reach =
                v.strides.back() * (v.shape.back() - 1) * int64_t(rope_test::dt_size(dt));
            (reach < 0 ? low : high) += reach;
        }
        // Inside the buffer, near the other view, aligned to the element (as tensors are).
        v.start = -low + int64_t(rng() % 256) * int64_t(rope_test::dt_size(dt));
        return v;
    };
    int shared_count = 0, apart = 0;
    for (int trial = 0; trial < 20000; ++trial) {
        const ByteView a = random_view(rng() % 2 ? Dt::F8 : Dt::F16);
        const ByteView b = random_view(rng() % 2 ? Dt::F8 : Dt::BF16);
        const std::vector<int64_t> bytes_a = bytes_of(a), bytes_b = bytes_of(b);
        std::vector<int64_t> common;
        std::set_intersection(bytes_a.begin(), bytes_a.end(), bytes_b.begin(), bytes_b.end(),
                              std::back_inserter(common));
        const int expected = common.empty() ? 0 : 1;
        CAPTURE(trial);
        REQUIRE(share(a, b, buffer) == expected);
        REQUIRE(share(b, a, buffer) == expected);
        (expected ? shared_count : apart) += 1;
    }
    // Both answers were asked for many times.
    CHECK(shared_count > 2000);
    CHECK(apart > 2000);
}

TEST_CASE("1-byte views with large odd strides are settled at once" * doctest::timeout(10)) {
    // Before, the search scanned every candidate of its largest step that the smaller steps'
    // divisor then rejected, uncounted by its budget: the first pairs took seconds (a
    // rope_jit_rope with such float8 KV caches 8 s), the last hours. The timeout reports a
    // slow answer; the answers are the point.
    static uint8_t buffer[16];
    const int64_t two28 = int64_t(1) << 28, two31 = int64_t(1) << 31, two32 = int64_t(1) << 32;
    // a's bytes x (2^31 + 1), b's s + 2^31 y, x and y below 2^28: equal where
    // x + 2^31 (x - y) = s, so x = s (mod 2^31) and then y = x.
    ByteView a{Dt::F8, {two28}, {two31 + 1}, 0};
    ByteView b{Dt::F8, {two28}, {two31}, 3};
    CHECK(share(a, b, buffer) == 1);  // x = y = 3
    b.start = 5;
    b.shape = {2};  // y below 2: x = y = 5 is out of its reach
    CHECK(share(a, b, buffer) == 0);
    b.start = two28 + 7;
    b.shape = {two28};  // x = 2^28 + 7 is out of a's reach
    CHECK(share(a, b, buffer) == 0);
    // Two steps of a against one of b, with no divisor in common at the top: from the largest
    // step down every multiple of 2^33 is a candidate (past the search's bound, this answered
    // "may share"); taken first, a's second index has one candidate modulo 2^32, 2^31 + 5,
    // past its 2^28: they share nothing. Moved to start at a's byte 2^32 + 1 + 2^33, they do.
    ByteView c{Dt::F8, {int64_t(1) << 20, two28}, {int64_t(1) << 33, two32 + 1}, 0};
    ByteView d{Dt::F8, {int64_t(1) << 30}, {two32}, two31 + 5};
    CHECK(share(c, d, buffer) == 0);
    d.start = (two32 + 1) + (int64_t(1) << 33);  // x0 = 1, x1 = 1, y = 0
    CHECK(share(c, d, buffer) == 1);
    d.start = (two32 + 1) * 7 + (int64_t(1) << 33) * 5 - two32 * 9;  // x1 = 7, x0 = 5, y = 9
    CHECK(share(c, d, buffer) == 1);
}
