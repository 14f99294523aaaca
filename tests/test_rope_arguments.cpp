// Every bad input to rope_jit_rope returns ERROR_INVALID_ARGUMENT with a message that names
// the argument, and writes nothing.
#include <doctest/doctest.h>

#include <string>

#include "rope_test_support.h"

using namespace rope_test;

namespace {

// A valid call (q and k with GQA, tables) that each test breaks in one way.
struct ValidCall {
    ValidCall() {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        std::mt19937 rng(7);
        q.fill_uniform(rng, -1, 1);
        k.fill_uniform(rng, -1, 1);
        cos_t.fill_uniform(rng, -1, 1);
        sin_t.fill_uniform(rng, -1, 1);
        rope_jit_rope_args_init(&args);
        args.q = q.dl();
        args.k = k.dl();
        args.cos = cos_t.dl();
        args.sin = sin_t.dl();
        REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);
        q_before = q.bytes();
        k_before = k.bytes();
    }
    ~ValidCall() { rope_jit_runtime_free(runtime); }

    // Runs the (broken) call and checks the status, that the message names `needle`, and
    // that neither q nor k changed.
    void expect_invalid(const std::string& needle) {
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(q.bytes() == q_before);
        CHECK(k.bytes() == k_before);
    }

    rope_jit_runtime* runtime = nullptr;
    HostTensor q{Dt::F32, {2, 4, 6, 16}};
    HostTensor k{Dt::F32, {2, 2, 6, 16}};
    HostTensor cos_t{Dt::F32, {8, 8}};
    HostTensor sin_t{Dt::F32, {8, 8}};
    rope_jit_rope_args args{};
    std::vector<uint8_t> q_before, k_before;
};

}  // namespace

TEST_CASE("a NULL runtime, NULL args or uninitialized args are rejected") {
    ValidCall call;
    CHECK(rope_jit_rope(nullptr, &call.args) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("runtime") != std::string::npos);
    CHECK(rope_jit_rope(call.runtime, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("args") != std::string::npos);
    call.args.struct_size = 0;
    call.expect_invalid("struct_size");
}

TEST_CASE("a missing q is rejected") {
    ValidCall call;
    call.args.q = nullptr;
    call.expect_invalid("q: required");
}

TEST_CASE("a tensor with NULL data or NULL shape is rejected") {
    ValidCall call;
    SUBCASE("data") {
        call.k.dl()->data = nullptr;
        call.expect_invalid("k: data is NULL");
    }
    SUBCASE("shape") {
        call.cos_t.dl()->shape = nullptr;
        call.expect_invalid("cos: shape is NULL");
    }
}

TEST_CASE("q with the wrong number of dimensions is rejected") {
    ValidCall call;
    HostTensor q2(Dt::F32, {4, 16});
    call.args.q = q2.dl();
    call.expect_invalid("q: expected 4 dimensions");
}

TEST_CASE("an odd head_dim is rejected") {
    ValidCall call;
    HostTensor q(Dt::F32, {2, 4, 6, 15});
    call.args.q = q.dl();
    call.args.k = nullptr;
    call.expect_invalid("head_dim (last dimension) must be even");
}

TEST_CASE("an odd or too large rotary_dim and a bad rotary_offset are rejected") {
    ValidCall call;
    SUBCASE("odd") {
        call.args.rotary_dim = 7;
        call.expect_invalid("rotary_dim: must be even");
    }
    SUBCASE("negative") {
        call.args.rotary_dim = -4;
        call.expect_invalid("rotary_dim: must be even and positive");
    }
    SUBCASE("offset + dim beyond head_dim") {
        HostTensor cos_t(Dt::F32, {8, 6}), sin_t(Dt::F32, {8, 6});
        call.args.cos = cos_t.dl();
        call.args.sin = sin_t.dl();
        call.args.rotary_dim = 12;
        call.args.rotary_offset = 6;
        call.expect_invalid("rotary_offset 6 + rotary_dim 12 exceeds head_dim 16");
    }
    SUBCASE("negative offset") {
        call.args.rotary_offset = -2;
        call.expect_invalid("rotary_offset: must be >= 0");
    }
}

TEST_CASE("Hq not a multiple of Hk is rejected") {
    ValidCall call;
    HostTensor k(Dt::F32, {2, 3, 6, 16});
    call.args.k = k.dl();
    call.expect_invalid("not a multiple of k's 3 heads");
}

TEST_CASE("k that disagrees with q in batch, head_dim, dtype or rank is rejected") {
    ValidCall call;
    SUBCASE("batch") {
        HostTensor k(Dt::F32, {3, 2, 6, 16});
        call.args.k = k.dl();
        call.expect_invalid("k: batch 3 differs");
    }
    SUBCASE("head_dim") {
        HostTensor k(Dt::F32, {2, 2, 6, 8});
        call.args.k = k.dl();
        call.expect_invalid("k: head_dim 8 differs");
    }
    SUBCASE("dtype") {
        HostTensor k(Dt::F16, {2, 2, 6, 16});
        call.args.k = k.dl();
        call.expect_invalid("k: dtype float16 differs");
    }
    SUBCASE("rank") {
        HostTensor k(Dt::F32, {12, 2, 16});
        call.args.k = k.dl();
        call.expect_invalid("k: has 3 dimensions");
    }
}

TEST_CASE("outputs whose shape or dtype differ from their inputs are rejected") {
    ValidCall call;
    SUBCASE("q_out shape") {
        HostTensor out(Dt::F32, {2, 4, 5, 16});
        call.args.q_out = out.dl();
        call.expect_invalid("q_out: shape [2, 4, 5, 16] does not match q [2, 4, 6, 16]");
    }
    SUBCASE("k_out shape") {
        HostTensor out(Dt::F32, {2, 4, 6, 16});
        call.args.k_out = out.dl();
        call.expect_invalid("k_out: shape [2, 4, 6, 16] does not match k [2, 2, 6, 16]");
    }
    SUBCASE("q_out dtype") {
        HostTensor out(Dt::BF16, {2, 4, 6, 16});
        call.args.q_out = out.dl();
        call.expect_invalid("q_out: dtype bfloat16 does not match q float32");
    }
    SUBCASE("k_out without k") {
        HostTensor out(Dt::F32, {2, 2, 6, 16});
        call.args.k = nullptr;
        call.args.k_out = out.dl();
        call.expect_invalid("k_out: given without k");
    }
}

TEST_CASE("unsupported dtypes are rejected") {
    ValidCall call;
    SUBCASE("integer q") {
        HostTensor q(Dt::I32, {2, 4, 6, 16});
        call.args.q = q.dl();
        call.args.k = nullptr;
        call.expect_invalid("q: dtype must be float32, float16 or bfloat16, got int32");
    }
    SUBCASE("float64 q") {
        call.q.dl()->dtype = {kDLFloat, 64, 1};
        call.expect_invalid("q: unsupported dtype (code 2, 64 bits)");
    }
    SUBCASE("vector lanes") {
        call.q.dl()->dtype = {kDLFloat, 32, 4};
        call.expect_invalid("q: vector dtypes");
    }
    SUBCASE("float positions") {
        HostTensor positions(Dt::F32, {6});
        call.args.positions = positions.dl();
        call.expect_invalid("positions: dtype must be int32 or int64");
    }
    SUBCASE("integer table") {
        HostTensor cos_t(Dt::I64, {8, 8});
        call.args.cos = cos_t.dl();
        call.expect_invalid("cos: dtype must be float32");
    }
}

TEST_CASE("missing or malformed angle sources are rejected") {
    ValidCall call;
    SUBCASE("no angles at all") {
        call.args.cos = call.args.sin = nullptr;
        call.expect_invalid("no angles given");
    }
    SUBCASE("cos without sin") {
        call.args.sin = nullptr;
        call.expect_invalid("sin: NULL while cos is given");
    }
    SUBCASE("table width that is neither R/2 nor R") {
        HostTensor cos_t(Dt::F32, {8, 5}), sin_t(Dt::F32, {8, 5});
        call.args.cos = cos_t.dl();
        call.args.sin = sin_t.dl();
        call.expect_invalid("cos: expected [P, 8] (half table) or [P, 16] (full table)");
    }
    SUBCASE("sin shaped differently from cos") {
        HostTensor sin_t(Dt::F32, {8, 16});
        call.args.sin = sin_t.dl();
        call.expect_invalid("sin: shape [8, 16] differs from cos [8, 8]");
    }
    SUBCASE("inv_freq of the wrong length") {
        HostTensor inv(Dt::F32, {7});
        call.args.cos = call.args.sin = nullptr;
        call.args.inv_freq = inv.dl();
        call.expect_invalid("inv_freq: expected [8]");
    }
    SUBCASE("xpos_scale shaped unlike the tables") {
        HostTensor xpos(Dt::F32, {8, 16});
        call.args.xpos_scale = xpos.dl();
        call.expect_invalid("xpos_scale: shape [8, 16] differs from cos [8, 8]");
    }
}

TEST_CASE("tables too short for the positions are rejected") {
    ValidCall call;
    SUBCASE("implicit positions with an offset") {
        call.args.position_offset = 3;  // rows 3..8 of an 8-row table
        call.expect_invalid("the table has 8 rows");
    }
    SUBCASE("negative position_offset") {
        call.args.position_offset = -1;
        call.expect_invalid("uses table rows -1..4");
    }
    SUBCASE("q_position_offset past the end") {
        call.args.q_position_offset = 5;
        call.expect_invalid("q_position_offset 5");
    }
    SUBCASE("k longer than the table") {
        HostTensor k(Dt::F32, {2, 2, 9, 16});
        call.args.k = k.dl();
        call.expect_invalid("k uses table rows 0..8");
    }
}

TEST_CASE("positions outside the table are rejected, naming the offending entry") {
    ValidCall call;
    SUBCASE("per-token [S]") {
        HostTensor positions(Dt::I32, {6});
        for (int64_t s = 0; s < 6; ++s) positions.set({s}, double(s));
        positions.set({4}, 8.0);
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [4] gives table row 8, outside the table's 8 rows");
    }
    SUBCASE("per-batch [B, S], negative") {
        HostTensor positions(Dt::I64, {2, 6});
        positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, 1.0); });
        positions.set({1, 2}, -1.0);
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [1, 2] gives table row -1");
    }
    SUBCASE("seqlen_offsets") {
        HostTensor offsets(Dt::I64, {2});
        offsets.set({0}, 0.0);
        offsets.set({1}, 3.0);
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: sequence 1 of q uses table rows 3..8");
    }
    SUBCASE("positions of the wrong shape") {
        HostTensor positions(Dt::I64, {5});
        call.args.positions = positions.dl();
        call.expect_invalid("positions: expected");
    }
    SUBCASE("seqlen_offsets of the wrong shape") {
        HostTensor offsets(Dt::I64, {3});
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: expected [2]");
    }
    SUBCASE("per-token positions with a k of another length") {
        HostTensor positions(Dt::I64, {6});
        HostTensor k(Dt::F32, {2, 2, 4, 16});
        call.args.positions = positions.dl();
        call.args.k = k.dl();
        call.expect_invalid("per-token positions need the same number");
    }
}

TEST_CASE("malformed cu_seqlens are rejected") {
    ValidCall call;
    HostTensor q(Dt::F32, {10, 4, 16});
    HostTensor cu(Dt::I32, {3});
    call.args.q = q.dl();
    call.args.k = nullptr;
    call.args.cu_seqlens = cu.dl();
    const std::vector<uint8_t> packed_before = q.bytes();
    SUBCASE("not starting at 0") {
        cu.set({0}, 1), cu.set({1}, 4), cu.set({2}, 10);
        call.expect_invalid("cu_seqlens: must start at 0");
    }
    SUBCASE("decreasing") {
        cu.set({0}, 0), cu.set({1}, 6), cu.set({2}, 5);
        call.expect_invalid("cu_seqlens: decreases at index 2");
    }
    SUBCASE("not ending at T") {
        cu.set({0}, 0), cu.set({1}, 4), cu.set({2}, 9);
        call.expect_invalid("cu_seqlens: ends at 9 but q has 10 tokens");
    }
    SUBCASE("with 4-D q") {
        call.args.q = call.q.dl();
        call.expect_invalid("cu_seqlens: only valid with packed q");
    }
    SUBCASE("a sequence longer than the table") {
        HostTensor long_q(Dt::F32, {12, 4, 16});
        call.args.q = long_q.dl();
        cu.set({0}, 0), cu.set({1}, 3), cu.set({2}, 12);
        call.expect_invalid("sequence 1 of q uses table rows 0..8");
    }
    CHECK(q.bytes() == packed_before);
}

TEST_CASE("outputs that overlap their input only partly, or alias themselves, are rejected") {
    ValidCall call;
    SUBCASE("q_out shifted by one element inside q's buffer") {
        HostTensor out = call.q;  // same shape; point it one element into q's memory
        out.dl()->data = call.q.bytes().data();
        out.dl()->byte_offset = 4;
        call.args.q_out = out.dl();
        call.expect_invalid("q_out: overlaps q without being the same view");
    }
    SUBCASE("the very same view is in place, and allowed") {
        call.args.q_out = call.q.dl();
        CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
    }
    SUBCASE("an output with a zero stride") {
        HostTensor out(Dt::F32, {2, 4, 6, 16});
        out.dl()->strides[1] = 0;
        call.args.q_out = out.dl();
        call.expect_invalid("q_out: strides make several indices address the same element");
    }
    SUBCASE("in place on a broadcast input") {
        call.q.dl()->strides[0] = 0;
        call.expect_invalid("q: strides make several indices address the same element");
    }
    SUBCASE("k passed as the same memory as q") {
        HostTensor q(Dt::F32, {2, 2, 6, 16});
        call.args.q = q.dl();
        call.args.k = q.dl();
        call.expect_invalid("k: is the same memory as q");
    }
}

TEST_CASE("tensors on a device the backend cannot reach are rejected") {
    ValidCall call;
    SUBCASE("CUDA tensors on the CPU backend") {
        call.q.dl()->device = {kDLCUDA, 0};
        call.k.dl()->device = {kDLCUDA, 0};
        call.cos_t.dl()->device = {kDLCUDA, 0};
        call.sin_t.dl()->device = {kDLCUDA, 0};
        call.expect_invalid("q: lives on CUDA device 0, but this runtime runs on the CPU backend");
    }
    SUBCASE("mixed devices") {
        call.k.dl()->device = {kDLCUDA, 1};
        call.expect_invalid("k: lives on CUDA device 1, but q lives on CPU device 0");
    }
    SUBCASE("an unsupported device type") {
        call.q.dl()->device = {kDLROCM, 0};
        call.k.dl()->device = {kDLROCM, 0};
        call.cos_t.dl()->device = {kDLROCM, 0};
        call.sin_t.dl()->device = {kDLROCM, 0};
        call.expect_invalid("q: lives on ROCm, which rope-jit cannot reach");
    }
}

TEST_CASE("an unknown style is rejected") {
    ValidCall call;
    call.args.style = static_cast<rope_jit_style>(7);
    call.expect_invalid("style: must be ROPE_JIT_STYLE_HALF or ROPE_JIT_STYLE_INTERLEAVED, got 7");
}
