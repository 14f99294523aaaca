// What the fuzzers in fuzz/ found in rope_jit_rope's argument checks, kept as regression
// tests: each input is rejected with a message naming the argument (or, for empty tensors,
// accepted as a quick no-op), and nothing is written.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "rope_test_support.h"

using namespace rope_test;

namespace {

struct CpuCall {
    CpuCall() {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.disk_cache = 0;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        std::mt19937 rng(11);
        q.fill_uniform(rng, -1, 1);
        inv_freq.fill_uniform(rng, 0, 1);
        rope_jit_rope_args_init(&args);
        args.q = q.dl();
        args.inv_freq = inv_freq.dl();
        REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);
        q_before = q.bytes();
    }
    ~CpuCall() { rope_jit_runtime_free(runtime); }

    void expect_invalid(const std::string& needle) {
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(q.bytes() == q_before);
    }

    // Runs the call, checking it succeeds; returns how long it took (calls over tensors that
    // hold nothing must not loop over their extents).
    double seconds_of_call() {
        const auto start = std::chrono::steady_clock::now();
        CHECK(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }

    rope_jit_runtime* runtime = nullptr;
    HostTensor q{Dt::F32, {1, 2, 3, 8}};
    HostTensor inv_freq{Dt::F32, {4}};
    rope_jit_rope_args args{};
    std::vector<uint8_t> q_before;
};

}  // namespace

TEST_CASE("a tensor whose element count or byte extent overflows int64 is rejected, naming it") {
    CpuCall call;
    int64_t shape[4] = {int64_t(1) << 62, 4, 2, 8};  // 2^62 * 64 elements: past int64
    DLTensor huge = *call.q.dl();
    huge.shape = shape;
    huge.strides = nullptr;
    call.args.q = &huge;
    call.expect_invalid("q: shape");

    int64_t small_shape[4] = {2, 2, 3, 8};  // one step of a stride of 2^63 - 1 elements
    int64_t strides[4] = {std::numeric_limits<int64_t>::max(), 24, 8, 1};
    DLTensor far = *call.q.dl();
    far.shape = small_shape;
    far.strides = strides;
    call.args.q = &far;
    call.expect_invalid("more bytes than memory can hold");
}

TEST_CASE("a data pointer not aligned to the element size is rejected, naming the tensor") {
    CpuCall call;
    for (uint64_t offset : {1u, 2u, 3u}) {
        CAPTURE(offset);
        DLTensor shifted = *call.q.dl();
        shifted.byte_offset = offset;
        call.args.q = &shifted;
        call.expect_invalid("q: data + byte_offset is not aligned to its 4-byte float32 elements");
    }
    HostTensor positions{Dt::I64, {3}};
    DLTensor odd_positions = *positions.dl();
    odd_positions.byte_offset = 4;
    call.args.q = call.q.dl();
    call.args.positions = &odd_positions;
    call.expect_invalid(
        "positions: data + byte_offset is not aligned to its 8-byte int64 elements");
}

TEST_CASE("an empty tensor with NULL data and a byte_offset is a successful no-op") {
    CpuCall call;
    int64_t shape[4] = {2, 0, 3, 8};
    DLTensor empty = *call.q.dl();
    empty.data = nullptr;
    empty.byte_offset = 3;
    empty.shape = shape;
    call.args.q = &empty;
    CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
}

TEST_CASE("a q with no heads returns at once however large its batch") {
    CpuCall call;
    int64_t shape[4] = {int64_t(1) << 31, 0, 2, 8};
    DLTensor headless = *call.q.dl();
    headless.shape = shape;
    call.args.q = &headless;
    const double seconds = call.seconds_of_call();
    CAPTURE(seconds);
    CHECK(seconds < 0.5);
    CHECK(call.q.bytes() == call.q_before);
}

TEST_CASE("a q with no heads beside a k with few tokens rotates k alone, at once") {
    // q [1, 0, 2^40, 8] holds nothing, yet the CPU loop walked its 2^40 tokens (about 2.7
    // days; adversarial pass, session 38): the tokens covered are those of tensors with heads.
    CpuCall call;
    std::mt19937 rng(12);
    HostTensor k(Dt::F32, {1, 1, 4, 8}), alone(Dt::F32, {1, 1, 4, 8});
    k.fill_uniform(rng, -1, 1);
    alone.bytes() = k.bytes();
    int64_t shape[4] = {1, 0, int64_t(1) << 40, 8};
    DLTensor headless = *call.q.dl();
    headless.shape = shape;
    headless.data = nullptr;
    call.args.q = &headless;
    call.args.k = k.dl();
    const double seconds = call.seconds_of_call();
    CAPTURE(seconds);
    CHECK(seconds < 0.5);
    // k rotated as the same tensor given as q alone (no xPos: q and k rotate alike).
    call.args.q = alone.dl();
    call.args.k = nullptr;
    REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
    CHECK(k.bytes() == alone.bytes());
}

TEST_CASE("position offsets of magnitude 2^53 or more are rejected, naming the offset") {
    CpuCall call;
    const int64_t limit = int64_t(1) << 53;
    for (int64_t offset : {limit, -limit, std::numeric_limits<int64_t>::max(),
                           std::numeric_limits<int64_t>::min()}) {
        CAPTURE(offset);
        call.args.position_offset = offset;
        call.args.q_position_offset = 0;
        call.expect_invalid("position_offset:");
        call.args.position_offset = 0;
        call.args.q_position_offset = offset;
        call.expect_invalid("q_position_offset:");
    }
    // Large but representable offsets still work with angles computed from inv_freq.
    call.args.position_offset = limit - 16;
    call.args.q_position_offset = 0;
    CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
}

TEST_CASE("a struct_size that would cut a field in two is rejected") {
    CpuCall call;
    for (size_t size : {size_t(12), size_t(60), sizeof(rope_jit_rope_args) - 4}) {
        CAPTURE(size);
        call.args.struct_size = size;
        call.expect_invalid("struct_size");
    }
    // An older caller's smaller struct, ending at a field boundary, is still read.
    call.args.struct_size = offsetof(rope_jit_rope_args, k);
    CHECK(rope_jit_rope(call.runtime, &call.args) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);  // no angle source then
    CHECK(std::string(rope_jit_last_error()).find("struct_size") == std::string::npos);
}

TEST_CASE(
    "table rows past int64 (a headless q of 2^63 - 1 tokens, an offset near the top) are rejected, "
    "not overflowed") {
    CpuCall call;
    HostTensor cos_t(Dt::F32, {8, 4}), sin_t(Dt::F32, {8, 4});
    call.args.inv_freq = nullptr;
    call.args.cos = cos_t.dl();
    call.args.sin = sin_t.dl();
    SUBCASE("implicit positions: the last row of 2^63 - 1 tokens from row 2") {
        // The fuzzer's q: no batch and no features, so no elements and no bytes, but 2^63 - 1
        // tokens whose table rows the implicit positions still check.
        int64_t shape[4] = {0, 1, std::numeric_limits<int64_t>::max(), 0};
        DLTensor empty = *call.q.dl();
        empty.shape = shape;
        empty.strides = nullptr;
        call.args.q = &empty;
        HostTensor no_columns(Dt::F32, {8, 0});
        call.args.cos = call.args.sin = no_columns.dl();
        call.args.position_offset = 2;
        call.expect_invalid("q uses table rows 2..9223372036854775807");
    }
    SUBCASE("seqlen_offsets: a sequence starting at row 2^63 - 1") {
        HostTensor offsets(Dt::I64, {1});
        const int64_t top = std::numeric_limits<int64_t>::max();
        std::memcpy(offsets.bytes().data(), &top, sizeof top);
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: sequence 0 of q uses table rows");
    }
}

TEST_CASE("empty M-RoPE positions with NULL data give a zero gradient without offsetting NULL") {
    // fuzz_freq_grad: an empty backward still owes its frequency gradient, so its positions
    // are checked; a [2, 0] positions tensor may have NULL data, and splitting it into its
    // axes offset that NULL (undefined behaviour, reported by UBSan) before the fix.
    CpuCall call;
    HostTensor q(Dt::F32, {1, 2, 0, 8}), q_saved(Dt::F32, {1, 2, 0, 8});
    q.dl()->data = nullptr;
    q_saved.dl()->data = nullptr;
    HostTensor grad(Dt::F32, {4});
    grad.set({0}, 5);
    int64_t shape[2] = {2, 0};
    DLTensor positions{};
    positions.device = {kDLCPU, 0};
    positions.ndim = 2;
    positions.dtype = {kDLInt, 64, 1};
    positions.shape = shape;
    const int32_t sections[2] = {2, 2};
    call.args.q = q.dl();
    call.args.backward = 1;
    call.args.inv_freq_grad = grad.dl();
    call.args.q_saved = q_saved.dl();
    call.args.positions = &positions;
    call.args.mrope_sections = sections;
    call.args.num_mrope_sections = 2;
    CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
    CHECK(grad.values() == std::vector<double>(4, 0.0));
}
