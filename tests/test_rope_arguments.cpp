// Every bad input to rope_jit_rope returns ERROR_INVALID_ARGUMENT with a message that names
// the argument, and writes nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

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

TEST_CASE("a view whose addresses wrap around the address space is rejected, writing nothing") {
    // (Adversarial pass, session 49.) data + byte_offset wrapped: byte_offset 2^64 - 64 read
    // and wrote the 64 bytes before q's data.
    ValidCall call;
    const std::string wraps = "wraps around the address space";
    DLTensor q = *call.q.dl();
    q.byte_offset = std::numeric_limits<uint64_t>::max() - 63;
    call.args.q = &q;
    call.expect_invalid("q: data + byte_offset (");
    call.expect_invalid(wraps);
    call.args.q = call.q.dl();
    DLTensor k = *call.k.dl();
    k.byte_offset = std::numeric_limits<uint64_t>::max() - 3;
    call.args.k = &k;
    call.expect_invalid("k: data + byte_offset (");
    call.args.k = call.k.dl();

    // At the ends of the address space (no memory is read: the checks refuse, or
    // rope_jit_tensors_share_memory answers from the addresses alone). q is 3072 bytes.
    const size_t q_bytes = call.q.bytes().size();
    const uintptr_t top = std::numeric_limits<uintptr_t>::max();
    DLTensor high = *call.q.dl();
    high.data = reinterpret_cast<void*>(top - (q_bytes - 1));  // its last byte is the top one
    int shared = -1;
    CHECK(rope_jit_tensors_share_memory(&high, &high, &shared) == ROPE_JIT_OK);
    CHECK(shared == 1);
    high.byte_offset = 4;  // one element further
    CHECK(rope_jit_tensors_share_memory(&high, &high, &shared) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find(wraps) != std::string::npos);
    call.args.q = &high;
    call.expect_invalid(wraps);

    // Below 0: a negative batch stride from data 64 reaches 1536 bytes below it.
    const int64_t shape[4] = {2, 4, 6, 16}, strides[4] = {-384, 96, 16, 1};
    DLTensor low = *call.q.dl();
    low.shape = const_cast<int64_t*>(shape);
    low.strides = const_cast<int64_t*>(strides);
    low.data = reinterpret_cast<void*>(uintptr_t(64));
    call.args.q = &low;
    call.expect_invalid(wraps);
    low.data = reinterpret_cast<void*>(uintptr_t(1532));  // one element below address 0
    call.expect_invalid(wraps);
    low.data = reinterpret_cast<void*>(uintptr_t(1536));  // its lowest byte is address 0
    CHECK(rope_jit_tensors_share_memory(&low, &low, &shared) == ROPE_JIT_OK);
    CHECK(shared == 1);
    call.args.q = call.q.dl();
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

TEST_CASE("k with no heads is refused as such, also beside a q with no heads") {
    // It was told that q's 0 heads are no multiple of k's 0 heads (adversarial pass).
    ValidCall call;
    HostTensor k(Dt::F32, {2, 0, 6, 16});
    call.args.k = k.dl();
    call.expect_invalid("k: has no heads ([2, 0, 6, 16]); GQA/MQA needs Hq = group * Hk with "
                        "Hk >= 1 (k NULL rotates q alone)");
    HostTensor q(Dt::F32, {2, 0, 6, 16});
    call.args.q = q.dl();
    call.expect_invalid("k: has no heads ([2, 0, 6, 16])");
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
    SUBCASE("int8 positions: refused as int8, not taken for uint8") {
        HostTensor positions(Dt::F8, {6});  // one-byte elements, relabelled
        positions.dl()->dtype = {kDLInt, 8, 1};
        call.args.positions = positions.dl();
        call.expect_invalid("positions: int8 is not supported");
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
    SUBCASE("tables with columns for empty heads (head_dim 0) name head_dim") {
        HostTensor q(Dt::F32, {2, 4, 6, 0}), k(Dt::F32, {2, 2, 6, 0});
        call.args.q = q.dl();
        call.args.k = k.dl();
        call.expect_invalid("cos: expected [P, 0] for q's head_dim 0, got [8, 8]");
    }
    SUBCASE("sin shaped differently from cos") {
        HostTensor sin_t(Dt::F32, {8, 16});
        call.args.sin = sin_t.dl();
        call.expect_invalid("sin: shape [8, 16] differs from cos [8, 8]");
    }
    SUBCASE("sin of another dtype than cos (the kernel reads both tables as one dtype)") {
        HostTensor bf16_sin(Dt::BF16, {8, 8});
        call.args.sin = bf16_sin.dl();
        call.expect_invalid("sin: dtype bfloat16 differs from cos's float32");
        HostTensor f16_cos(Dt::F16, {8, 8});
        call.args.cos = f16_cos.dl();
        call.args.sin = call.sin_t.dl();
        call.expect_invalid("sin: dtype float32 differs from cos's float16");
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
    SUBCASE("angles from inv_freq and an xpos_scale too short: xpos_scale is named") {
        // (The message named cos, which the call did not pass: review, session 39.)
        HostTensor inv_freq(Dt::F32, {8}), xpos(Dt::F32, {5, 8}), positions(Dt::I64, {6});
        for (int64_t i = 0; i < 8; ++i) inv_freq.set({i}, 1.0);
        for (int64_t i = 0; i < 6; ++i) positions.set({i}, double(i));
        call.args.cos = call.args.sin = nullptr;
        call.args.inv_freq = inv_freq.dl();
        call.args.xpos_scale = xpos.dl();
        call.expect_invalid("xpos_scale: q uses table rows 0..5 (position_offset 0), but the "
                            "table has 5 rows");
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [5] gives table row 5, outside xpos_scale's 5 rows");
    }
}

TEST_CASE("positions outside the table are rejected, naming the offending entry") {
    ValidCall call;
    SUBCASE("per-token [S]") {
        HostTensor positions(Dt::I32, {6});
        for (int64_t s = 0; s < 6; ++s) positions.set({s}, double(s));
        positions.set({4}, 8.0);
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [4] gives table row 8, outside cos's 8 rows");
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

TEST_CASE("seqlen_offsets beside positions (no KV cache) is checked as when given alone") {
    ValidCall call;  // B = 2, S = 6, an 8-row table
    HostTensor positions(Dt::I64, {6});
    for (int64_t s = 0; s < 6; ++s) positions.set({s}, double(s));
    call.args.positions = positions.dl();
    SUBCASE("float32") {
        HostTensor offsets(Dt::F32, {2});
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: dtype must be int32 or int64, got float32");
    }
    SUBCASE("float32 of the wrong length") {
        HostTensor offsets(Dt::F32, {7});
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: dtype must be int32 or int64");
    }
    SUBCASE("not one entry per sequence") {
        HostTensor offsets(Dt::I64, {7});
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: expected [2] (one per sequence), got [7]");
    }
    SUBCASE("well formed: accepted, and the positions give the table rows") {
        // Offsets that would run past the table as rows (3 + 5 = 8): not used as rows here.
        HostTensor offsets(Dt::I32, {2});
        offsets.set({0}, 3.0);
        offsets.set({1}, 1.0);
        HostTensor q_expected = call.q, k_expected = call.k;
        call.args.q = q_expected.dl();
        call.args.k = k_expected.dl();
        REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);  // positions alone
        call.args.q = call.q.dl();
        call.args.k = call.k.dl();
        call.args.seqlen_offsets = offsets.dl();
        const rope_jit_status status = rope_jit_rope(call.runtime, &call.args);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        CHECK(call.q.bytes() == q_expected.bytes());
        CHECK(call.k.bytes() == k_expected.bytes());
        CHECK(call.q.bytes() != call.q_before);  // rotated
    }
}

TEST_CASE("a call that rotates nothing still checks its positions, offsets and cu_seqlens") {
    // q without heads (or heads without features) leaves nothing to rotate; whether the call
    // fails still does not depend on which of its dimensions are empty.
    ValidCall call;  // an 8-row table
    HostTensor no_heads(Dt::F32, {2, 0, 6, 16});
    call.args.q = no_heads.dl();
    call.args.k = nullptr;
    const std::vector<uint8_t> no_heads_before = no_heads.bytes();
    SUBCASE("per-token positions past the table") {
        HostTensor positions(Dt::I64, {6});
        for (int64_t s = 0; s < 6; ++s) positions.set({s}, double(s));
        positions.set({2}, 100.0);
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [2] gives table row 100, outside cos's 8 rows");
        positions.set({2}, 2.0);  // in range: accepted
        CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
    }
    SUBCASE("a negative per-batch position, with head_dim 0") {
        HostTensor no_features(Dt::F32, {2, 4, 6, 0}), cos_t(Dt::F32, {8, 0}),
            sin_t(Dt::F32, {8, 0});
        HostTensor positions(Dt::I32, {2, 6});
        positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, 1.0); });
        positions.set({1, 3}, -5.0);
        call.args.q = no_features.dl();
        call.args.cos = cos_t.dl();
        call.args.sin = sin_t.dl();
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [1, 3] gives table row -5");
    }
    SUBCASE("seqlen_offsets past the table") {
        HostTensor offsets(Dt::I64, {2});
        offsets.set({0}, 0.0);
        offsets.set({1}, 5.0);
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: sequence 1 of q uses table rows 5..10");
    }
    SUBCASE("cu_seqlens that do not end at the tokens of packed q") {
        HostTensor packed(Dt::F32, {10, 0, 16});
        HostTensor cu(Dt::I32, {3});
        cu.set({0}, 0), cu.set({1}, 4), cu.set({2}, 9);
        call.args.q = packed.dl();
        call.args.cu_seqlens = cu.dl();
        call.expect_invalid("cu_seqlens: ends at 9 but q has 10 tokens");
    }
    CHECK(no_heads.bytes() == no_heads_before);
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
        call.expect_invalid("q_out: its strides may make several indices address");
    }
    SUBCASE("in place on a broadcast input") {
        call.q.dl()->strides[0] = 0;
        call.expect_invalid("q: its strides may make several indices address");
    }
    SUBCASE("k passed as the same memory as q") {
        HostTensor q(Dt::F32, {2, 2, 6, 16});
        call.args.q = q.dl();
        call.args.k = q.dl();
        call.expect_invalid("k: is the same memory as q");
    }
}

TEST_CASE("empty q and k with NULL data (torch's empty tensors) make a call that writes nothing") {
    // torch gives every empty tensor data NULL: q and k then look like one view, which must not
    // read as one memory (an empty tensor has no element to share).
    ValidCall call;
    HostTensor q(Dt::F32, {0, 2, 6, 16}), k(Dt::F32, {0, 2, 6, 16});
    HostTensor q_out(Dt::F32, {0, 2, 6, 16}), k_out(Dt::F32, {0, 2, 6, 16});
    const std::vector<uint8_t> cos_before = call.cos_t.bytes(), sin_before = call.sin_t.bytes();
    call.args.q = q.dl();
    call.args.k = k.dl();
    // The same call on empty tensors with data of their own, then on NULL data: both succeed.
    auto run_both = [&](std::initializer_list<HostTensor*> tensors) {
        CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        for (HostTensor* t : tensors) t->dl()->data = nullptr;
        const rope_jit_status status = rope_jit_rope(call.runtime, &call.args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_OK);
    };
    SUBCASE("q and k of one shape, in place") { run_both({&q, &k}); }
    SUBCASE("q and k of one shape, into q_out and k_out of that shape") {
        call.args.q_out = q_out.dl();
        call.args.k_out = k_out.dl();
        run_both({&q, &k, &q_out, &k_out});
    }
    SUBCASE("a backward with inv_freq_grad: the empty call's gradient is zero") {
        HostTensor q_saved(Dt::F32, {0, 2, 6, 16}), k_saved(Dt::F32, {0, 2, 6, 16});
        HostTensor inv_freq(Dt::F32, {8}), grad(Dt::F32, {8});
        std::mt19937 rng(3);
        inv_freq.fill_uniform(rng, 0.1, 1);
        call.args.cos = call.args.sin = nullptr;
        call.args.inv_freq = inv_freq.dl();
        call.args.backward = 1;
        call.args.q_saved = q_saved.dl();
        call.args.k_saved = k_saved.dl();
        call.args.inv_freq_grad = grad.dl();
        for (HostTensor* t : {&q, &k, &q_saved, &k_saved}) t->dl()->data = nullptr;
        for (int64_t i = 0; i < 8; ++i) grad.set({i}, 5.0);
        const rope_jit_status status = rope_jit_rope(call.runtime, &call.args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_OK);
        CHECK(grad.values() == std::vector<double>(8, 0.0));
    }
    // Nothing else was touched.
    CHECK(call.cos_t.bytes() == cos_before);
    CHECK(call.sin_t.bytes() == sin_before);
    CHECK(call.q.bytes() == call.q_before);
    CHECK(call.k.bytes() == call.k_before);
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
    call.expect_invalid(
        "style: must be ROPE_JIT_STYLE_HALF, ROPE_JIT_STYLE_INTERLEAVED or "
        "ROPE_JIT_STYLE_PROPORTIONAL, got 7");
}

TEST_CASE("a proportional style with a rotary offset is rejected, naming rotary_offset") {
    ValidCall call;
    call.args.style = ROPE_JIT_STYLE_PROPORTIONAL;
    call.args.rotary_dim = 4;
    call.args.rotary_offset = 2;
    call.expect_invalid("rotary_offset: must be 0 with ROPE_JIT_STYLE_PROPORTIONAL");
}

namespace {

// A q-only call with angles from inv_freq (no table bounds the positions): q [1, 2, 4, 8]
// float32, inv_freq [4].
struct InvFreqCall {
    InvFreqCall() {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.disk_cache = 0;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        std::mt19937 rng(5);
        q.fill_uniform(rng, -1, 1);
        inv_freq.fill_uniform(rng, 0.1, 1);
        rope_jit_rope_args_init(&args);
        args.q = q.dl();
        args.inv_freq = inv_freq.dl();
        q_before = q.bytes();
    }
    ~InvFreqCall() { rope_jit_runtime_free(runtime); }

    void expect_invalid(const std::string& needle) {
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(q.bytes() == q_before);
    }

    rope_jit_runtime* runtime = nullptr;
    HostTensor q{Dt::F32, {1, 2, 4, 8}};
    HostTensor inv_freq{Dt::F32, {4}};
    rope_jit_rope_args args{};
    std::vector<uint8_t> q_before;
};

}  // namespace

TEST_CASE(
    "negative positions are rejected with inv_freq too, naming the source, and nothing is "
    "written") {
    InvFreqCall call;
    SUBCASE("position_offset") {
        call.args.position_offset = -5;
        call.expect_invalid("position_offset");
    }
    SUBCASE("q_position_offset taking q below 0") {
        call.args.position_offset = 2;
        call.args.q_position_offset = -3;
        call.expect_invalid("q_position_offset -3");
    }
    SUBCASE("an int64 positions entry") {
        HostTensor positions(Dt::I64, {4});
        const int64_t values[4] = {0, -7, 2, 3};
        for (int64_t s = 0; s < 4; ++s) positions.set({s}, double(values[s]));
        call.args.positions = positions.dl();
        call.expect_invalid("positions: [1] gives position -7");
    }
    SUBCASE("an M-RoPE axis") {
        HostTensor positions(Dt::I32, {2, 4});
        for (int64_t s = 0; s < 4; ++s)
            positions.set({0, s}, double(s)), positions.set({1, s}, s == 3 ? -1.0 : 1.0);
        const int32_t sections[2] = {2, 2};
        call.args.positions = positions.dl();
        call.args.mrope_sections = sections;
        call.args.num_mrope_sections = 2;
        call.expect_invalid("positions: [1, 3] gives position -1");
    }
    SUBCASE("seqlen_offsets") {
        HostTensor offsets(Dt::I64, {1});
        offsets.set({0}, -2);
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: sequence 0 of q");
    }
    SUBCASE("seqlen_offsets whose last position overflows int64") {
        HostTensor offsets(Dt::I64, {1});
        const int64_t top = std::numeric_limits<int64_t>::max() - 1;
        std::memcpy(offsets.bytes().data(), &top, sizeof top);
        call.args.seqlen_offsets = offsets.dl();
        call.expect_invalid("seqlen_offsets: sequence 0 of q");
    }
    SUBCASE("position_offset with packed sequences") {
        HostTensor packed(Dt::F32, {4, 2, 8});
        HostTensor cu(Dt::I32, {3});
        cu.set({0}, 0), cu.set({1}, 1), cu.set({2}, 4);
        const std::vector<uint8_t> packed_before = packed.bytes();
        call.args.q = packed.dl();
        call.args.cu_seqlens = cu.dl();
        call.args.position_offset = -1;
        call.expect_invalid("position_offset");
        CHECK(packed.bytes() == packed_before);
    }
    SUBCASE("positions >= 0 and large still work") {
        HostTensor positions(Dt::I64, {4});
        for (int64_t s = 0; s < 4; ++s) positions.set({s}, double(s * 1000));
        call.args.positions = positions.dl();
        CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        call.args.positions = nullptr;
        call.args.position_offset = 3;
        call.args.q_position_offset = -3;
        CHECK(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
    }
}

namespace {

// The start of the message for a tensor whose device type has no DLPack enumerator.
std::string device_type_message(const char* name, int type) {
    return std::string(name) + ": device type " + std::to_string(type) + " is not";
}

// A view of another tensor's memory: shape and strides (elements) from `offset` elements in.
struct View {
    View(HostTensor& base, std::vector<int64_t> shape_, std::vector<int64_t> strides_,
         int64_t offset, Dt dt = Dt::F32)
        : shape(std::move(shape_)), strides(std::move(strides_)) {
        tensor = *base.dl();
        tensor.dtype = dl_type(dt);
        tensor.ndim = int(shape.size());
        tensor.shape = shape.data();
        tensor.strides = strides.data();
        tensor.byte_offset = uint64_t(offset) * dt_size(dt);
    }
    std::vector<int64_t> shape, strides;
    DLTensor tensor{};
};

// `tensor` as a compact view of the nine dims shape9 (one dim more than the memory queries take):
// shape9 is 1s and the tensor's own shape.
DLTensor with_nine_dims(const DLTensor& tensor, int64_t* shape9) {
    DLTensor nine_dims = tensor;
    const int ones = 9 - tensor.ndim;
    for (int i = 0; i < 9; ++i) shape9[i] = i < ones ? 1 : tensor.shape[i - ones];
    nine_dims.ndim = 9;
    nine_dims.shape = shape9;
    nine_dims.strides = nullptr;
    return nine_dims;
}

}  // namespace

TEST_CASE("tensors written by the call that share memory with another tensor of it are rejected") {
    ValidCall call;  // q [2, 4, 6, 16], k [2, 2, 6, 16], tables [8, 8]
    SUBCASE("q_out placed on k's memory") {
        HostTensor k_big(Dt::F32, {2, 4, 7, 16});
        call.args.k = k_big.dl();
        // One token into k, with k's strides: overlaps it without being the same view.
        View q_out(k_big, {2, 4, 6, 16}, {448, 112, 16, 1}, 16);
        call.args.q_out = &q_out.tensor;
        call.expect_invalid("q_out: shares memory with k");
    }
    SUBCASE("q_out exactly on k") {
        HostTensor k_same(Dt::F32, {2, 4, 6, 16});
        call.args.k = k_same.dl();
        call.args.q_out = k_same.dl();
        call.expect_invalid("is the same memory as");
        const std::string message = rope_jit_last_error();
        CHECK(message.find("q_out") != std::string::npos);
    }
    SUBCASE("k in place starting 2 tokens into q") {
        View k(call.q, {2, 2, 4, 16}, {384, 96, 16, 1}, 2 * 16);
        call.args.k = &k.tensor;
        call.expect_invalid("q: shares memory with k");
    }
    SUBCASE("q_out and k_out one buffer") {
        HostTensor out(Dt::F32, {2, 4, 6, 16});
        View k_out(out, {2, 2, 6, 16}, {384, 96, 16, 1}, 0);
        call.args.q_out = out.dl();
        call.args.k_out = &k_out.tensor;
        call.expect_invalid("shares memory with");
        const std::string message = rope_jit_last_error();
        CHECK(message.find("q_out") != std::string::npos);
        CHECK(message.find("k_out") != std::string::npos);
    }
    SUBCASE("q_out and k_out the very same view") {
        HostTensor q(Dt::F32, {2, 2, 6, 16});
        HostTensor out(Dt::F32, {2, 2, 6, 16});
        call.args.q = q.dl();
        call.args.q_out = out.dl();
        call.args.k_out = out.dl();
        call.expect_invalid("q_out: is the same memory as k_out");
    }
    SUBCASE("q in place over positions") {
        HostTensor positions(Dt::I64, {6});
        for (int64_t s = 0; s < 6; ++s) positions.set({s}, double(s));
        View aliased(call.q, {6}, {1}, 0, Dt::I64);  // q's first 12 floats read as 6 positions
        std::memcpy(call.q.bytes().data(), positions.bytes().data(), 48);
        call.q_before = call.q.bytes();
        call.args.positions = &aliased.tensor;
        call.expect_invalid("q: shares memory with positions");
    }
    SUBCASE("k_out over the cos table") {
        View k_out(call.cos_t, {2, 2, 2, 8}, {32, 16, 8, 1}, 0);
        HostTensor k(Dt::F32, {2, 2, 2, 8});
        HostTensor q(Dt::F32, {2, 4, 2, 8});
        call.args.q = q.dl();
        call.args.k = k.dl();
        call.args.k_out = &k_out.tensor;
        call.expect_invalid("k_out: shares memory with cos");
    }
}

TEST_CASE(
    "views of one buffer that never touch the same elements stay accepted and are rotated once") {
    ValidCall call;
    const int64_t B = 2, S = 6, H = 2, D = 16;
    std::mt19937 rng(9);
    HostTensor cos_t(Dt::F32, {8, 8}), sin_t(Dt::F32, {8, 8});
    cos_t.fill_uniform(rng, -1, 1);
    sin_t.fill_uniform(rng, -1, 1);
    rope_test::Case c;
    c.D = D;
    c.R = D;
    c.cos.assign(8, std::vector<double>(8));
    c.sin = c.cos;
    for (int64_t p = 0; p < 8; ++p)
        for (int64_t i = 0; i < 8; ++i) {
            c.cos[size_t(p)][size_t(i)] = cos_t.get({p, i});
            c.sin[size_t(p)][size_t(i)] = sin_t.get({p, i});
        }
    // Expected: every head vector at (b, s) of the rotated slots turned by row s, the rest as is.
    auto check_rotated = [&](const HostTensor& before, const HostTensor& after,
                             const std::vector<int64_t>& slot_of, int64_t rotated_slots) {
        const int64_t slots = int64_t(slot_of.size());
        double worst = 0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s)
                for (int64_t h = 0; h < slots; ++h) {
                    std::vector<double> x(static_cast<size_t>(D)), y(static_cast<size_t>(D));
                    for (int64_t d = 0; d < D; ++d) {
                        x[size_t(d)] = before.get({b, s, h, d});
                        y[size_t(d)] = after.get({b, s, h, d});
                    }
                    const std::vector<double> expected =
                        slot_of[size_t(h)] < rotated_slots
                            ? rope_test::reference_rotate(c, x, s, false)
                            : x;
                    worst = std::max(worst, rope_test::worst_ratio(y, expected, 1e-5, 1e-5));
                }
        CHECK(worst <= 1);
    };
    call.args.cos = cos_t.dl();
    call.args.sin = sin_t.dl();
    SUBCASE("q and k as [:, :, 0] and [:, :, 1] of a [B, S, 3, H, D] qkv, in place") {
        HostTensor qkv(Dt::F32, {B, S, 3 * H, D});  // [B, S, 3, H, D] with (3, H) merged
        qkv.fill_uniform(rng, -2, 2);
        const HostTensor before = qkv;
        // [B, H, S, D] views: batch S*3H*D, head D, token 3H*D, feature 1.
        View q(qkv, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, 0);
        View k(qkv, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, H * D);
        call.args.q = &q.tensor;
        call.args.k = &k.tensor;
        REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        check_rotated(before, qkv, {0, 0, 1, 1, 2, 2}, 2);
    }
    SUBCASE(
        "q and k as head slices of a [B, S, Hq + 2 Hk, D] qkv, out of place into one fused "
        "output") {
        HostTensor qkv(Dt::F32, {B, S, 3 * H, D});
        qkv.fill_uniform(rng, -2, 2);
        HostTensor out(Dt::F32, {B, S, 3 * H, D});
        out.fill_uniform(rng, -2, 2);
        HostTensor qkv_before = qkv, out_before = out;
        View q(qkv, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, 0);
        View k(qkv, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, H * D);
        View q_out(out, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, 0);
        View k_out(out, {B, H, S, D}, {S * 3 * H * D, D, 3 * H * D, 1}, H * D);
        call.args.q = &q.tensor;
        call.args.k = &k.tensor;
        call.args.q_out = &q_out.tensor;
        call.args.k_out = &k_out.tensor;
        REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        CHECK(qkv.bytes() == qkv_before.bytes());
        // out's q and k slots hold the rotated inputs, its v slot is untouched.
        HostTensor expected_src = qkv_before;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s)
                for (int64_t d = 0; d < D; ++d)
                    for (int64_t h = 2 * H; h < 3 * H; ++h)
                        expected_src.set({b, s, h, d}, out_before.get({b, s, h, d}));
        check_rotated(expected_src, out, {0, 0, 1, 1, 2, 2}, 2);
    }
    SUBCASE("q_out interleaved with q (every other head), never touching q's elements") {
        HostTensor buffer(Dt::F32, {B, S, 2 * H, D});
        buffer.fill_uniform(rng, -2, 2);
        const HostTensor before = buffer;
        View q(buffer, {B, H, S, D}, {S * 2 * H * D, 2 * D, 2 * H * D, 1}, 0);
        View q_out(buffer, {B, H, S, D}, {S * 2 * H * D, 2 * D, 2 * H * D, 1}, D);
        call.args.q = &q.tensor;
        call.args.k = nullptr;
        call.args.q_out = &q_out.tensor;
        REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        // Even heads (q) unchanged; odd heads hold q's rotation.
        HostTensor expected_src = before;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s)
                for (int64_t h = 0; h < H; ++h)
                    for (int64_t d = 0; d < D; ++d)
                        expected_src.set({b, s, 2 * h + 1, d}, before.get({b, s, 2 * h, d}));
        check_rotated(expected_src, buffer, {2, 0, 2, 0}, 1);
    }
    SUBCASE("cos and sin halves of one buffer (both only read)") {
        HostTensor both(Dt::F32, {8, 16});
        for (int64_t p = 0; p < 8; ++p)
            for (int64_t i = 0; i < 8; ++i)
                both.set({p, i}, cos_t.get({p, i})), both.set({p, 8 + i}, sin_t.get({p, i}));
        View cos(both, {8, 8}, {16, 1}, 0), sin(both, {8, 8}, {16, 1}, 8);
        HostTensor q(Dt::F32, {B, S, H, D});
        q.fill_uniform(rng, -2, 2);
        const HostTensor before = q;
        View q4(q, {B, H, S, D}, {S * H * D, D, H * D, 1}, 0);
        call.args.q = &q4.tensor;
        call.args.k = nullptr;
        call.args.cos = &cos.tensor;
        call.args.sin = &sin.tensor;
        REQUIRE(rope_jit_rope(call.runtime, &call.args) == ROPE_JIT_OK);
        check_rotated(before, q, {0, 0}, 1);
    }
}

TEST_CASE("q and k of a model-sized fused qkv are told apart quickly, without a false overlap") {
    // Shapes of Llama-3-8B training (B 4, S 4096, Hq 32, Hk 8, D 128) over a buffer that is
    // never read: the table is too short, so the call fails after the memory checks, and the
    // message shows which check refused it.
    ValidCall call;
    HostTensor cos_t(Dt::F32, {8, 64}), sin_t(Dt::F32, {8, 64});
    call.args.cos = cos_t.dl();
    call.args.sin = sin_t.dl();
    const int64_t B = 4, S = 4096, D = 128;
    struct Layout {
        int64_t hq, hk, token_heads, k_head;  // heads per token in the buffer, k's first head
    };
    for (const Layout& l : {Layout{32, 32, 96, 32}, Layout{32, 8, 48, 32}}) {
        CAPTURE(l.hk);
        View q(call.q, {B, l.hq, S, D}, {S * l.token_heads * D, D, l.token_heads * D, 1}, 0);
        View k(call.q, {B, l.hk, S, D}, {S * l.token_heads * D, D, l.token_heads * D, 1},
               l.k_head * D);
        // An address far from the heap, so the views meet only each other.
        void* const far_away = reinterpret_cast<void*>(uintptr_t(1) << 46);
        q.tensor.data = k.tensor.data = far_away;
        call.args.q = &q.tensor;
        call.args.k = &k.tensor;
        const auto start = std::chrono::steady_clock::now();
        call.expect_invalid("cos: q uses table rows 0..4095");
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        CAPTURE(seconds);
        CHECK(seconds < 0.05);
        // k one head back: its first head is q's last, so the two overlap.
        View k_back(call.q, {B, l.hk, S, D}, {S * l.token_heads * D, D, l.token_heads * D, 1},
                    (l.k_head - 1) * D);
        k_back.tensor.data = far_away;
        call.args.k = &k_back.tensor;
        call.expect_invalid("q: shares memory with k");
    }
}

TEST_CASE("rope_jit_tensors_share_memory gives the answer rope_jit_rope's memory checks act on") {
    // [1, 8, H, 4] views of one buffer of 8 tokens x 6 heads x 4 features: q heads 0-3, k heads
    // 4-5 (a fused layout), k moved one head back onto q's last head, k on q's later tokens.
    HostTensor buffer(Dt::F32, {8, 6, 4});
    const std::vector<int64_t> strides = {192, 24, 4, 1};
    View q(buffer, {1, 8, 4, 4}, strides, 0);
    View k(buffer, {1, 8, 2, 4}, strides, 16);
    View k_on_q(buffer, {1, 8, 2, 4}, strides, 12);
    View k_tokens_later(buffer, {1, 4, 4, 4}, strides, 4 * 24);
    View empty(buffer, {0, 8, 4, 4}, strides, 0);
    HostTensor elsewhere(Dt::F32, {1, 8, 4, 4});
    HostTensor cos(Dt::F32, {8, 2}), sin(Dt::F32, {8, 2});
    struct Case {
        const char* what;
        const DLTensor* k;
        int shared;
        const char* refusal;  // rope_jit_rope's in place, or "" where it rotates both
    };
    for (const Case& c :
         {Case{"fused q and k interleave", &k.tensor, 0, ""},
          Case{"k one head back", &k_on_q.tensor, 1, "q: shares memory with k"},
          Case{"k on q's later tokens", &k_tokens_later.tensor, 1, "q: shares memory with k"},
          Case{"the same view", &q.tensor, 1, "k: is the same memory as q"},
          Case{"another buffer", elsewhere.dl(), 0, ""}}) {
        const std::string what = c.what;
        CAPTURE(what);
        int shared = -1;
        REQUIRE(rope_jit_tensors_share_memory(&q.tensor, c.k, &shared) == ROPE_JIT_OK);
        CHECK(shared == c.shared);
        shared = -1;
        REQUIRE(rope_jit_tensors_share_memory(c.k, &q.tensor, &shared) == ROPE_JIT_OK);
        CHECK(shared == c.shared);
        ValidCall call;
        call.args.q = &q.tensor;
        call.args.k = c.k;
        call.args.cos = cos.dl();
        call.args.sin = sin.dl();
        const rope_jit_status status = rope_jit_rope(call.runtime, &call.args);
        const std::string message = status == ROPE_JIT_OK ? "" : rope_jit_last_error();
        CAPTURE(message);
        CHECK(message.rfind(c.refusal, 0) == 0);
        CHECK((status == ROPE_JIT_OK) == (c.shared == 0));
    }
    int shared = -1;
    REQUIRE(rope_jit_tensors_share_memory(&q.tensor, &empty.tensor, &shared) == ROPE_JIT_OK);
    CHECK(shared == 0);
    shared = -1;
    CHECK(rope_jit_tensors_share_memory(nullptr, &q.tensor, &shared) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(shared == 0);
    CHECK(std::string(rope_jit_last_error()) == "a: NULL");
    CHECK(rope_jit_tensors_share_memory(&q.tensor, &k.tensor, nullptr) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()) == "shared: NULL");

    // A batching transform's memory has a dim more (torch.func.vmap's of a 4-dim q has 5): a
    // batch of two q of 2 heads (heads 0-1 and 2-3) beside a batch of k of one head each,
    // heads 4 and 5 (apart) or 3 and 4 (head 3 is the second q's).
    View q_batch(buffer, {2, 1, 8, 2, 4}, {8, 192, 24, 4, 1}, 0);
    View k_batch(buffer, {2, 1, 8, 1, 4}, {4, 192, 24, 4, 1}, 16);
    View k_batch_on_q(buffer, {2, 1, 8, 1, 4}, {4, 192, 24, 4, 1}, 12);
    for (const auto& [batch, expected] : {std::pair{&k_batch, 0}, std::pair{&k_batch_on_q, 1}}) {
        CAPTURE(expected);
        shared = -1;
        REQUIRE(rope_jit_tensors_share_memory(&q_batch.tensor, &batch->tensor, &shared) ==
                ROPE_JIT_OK);
        CHECK(shared == expected);
    }
    int64_t shape9[9];
    const DLTensor nine_dims = with_nine_dims(q.tensor, shape9);
    shared = -1;
    CHECK(rope_jit_tensors_share_memory(&q.tensor, &nine_dims, &shared) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(shared == 0);
    CHECK(std::string(rope_jit_last_error()).rfind("b: expected at most 8 dimensions", 0) == 0);
}

TEST_CASE("rope_jit_tensor_has_distinct_elements gives the answer rope_jit_rope's write check acts "
          "on") {
    // [1, 8, 4, 4] views of one buffer of 8 tokens x 6 heads x 4 features: q's heads of a fused
    // layout (strided, distinct), the heads broadcast (stride 0), tokens two heads apart so
    // that token t + 1's first heads are token t's last (as_strided), and all of it empty.
    HostTensor buffer(Dt::F32, {8, 6, 4});
    View fused(buffer, {1, 8, 4, 4}, {192, 24, 4, 1}, 0);
    View broadcast(buffer, {1, 8, 4, 4}, {192, 24, 0, 1}, 0);
    View tokens_overlap(buffer, {1, 8, 4, 4}, {192, 8, 4, 1}, 0);
    View empty(buffer, {1, 0, 4, 4}, {192, 8, 4, 1}, 0);
    HostTensor cos(Dt::F32, {8, 2}), sin(Dt::F32, {8, 2});
    struct Case {
        const char* what;
        const DLTensor* q;
        int distinct;
    };
    for (const Case& c : {Case{"a fused layout's q", &fused.tensor, 1},
                          Case{"heads broadcast", &broadcast.tensor, 0},
                          Case{"tokens overlapping", &tokens_overlap.tensor, 0},
                          Case{"empty", &empty.tensor, 1}}) {
        const std::string what = c.what;
        CAPTURE(what);
        int distinct = -1;
        REQUIRE(rope_jit_tensor_has_distinct_elements(c.q, &distinct) == ROPE_JIT_OK);
        CHECK(distinct == c.distinct);
        ValidCall call;
        call.args.q = c.q;
        call.args.k = nullptr;
        call.args.cos = cos.dl();
        call.args.sin = sin.dl();
        const rope_jit_status status = rope_jit_rope(call.runtime, &call.args);
        const std::string message = status == ROPE_JIT_OK ? "" : rope_jit_last_error();
        CAPTURE(message);
        CHECK((status == ROPE_JIT_OK) == (c.distinct == 1));
        if (c.distinct == 0)
            CHECK(message.rfind("q: its strides may make several indices address the same "
                                "element", 0) == 0);
    }
    int distinct = -1;
    CHECK(rope_jit_tensor_has_distinct_elements(nullptr, &distinct) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(distinct == 0);
    CHECK(std::string(rope_jit_last_error()) == "t: NULL");
    CHECK(rope_jit_tensor_has_distinct_elements(&fused.tensor, nullptr) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()) == "distinct: NULL");

    // A batching transform's memory has a dim more: two [1, 8, 2, 4] q, heads 0-1 and 2-3 of
    // the buffer (distinct), or heads 0-1 and 1-2 (the batch overlaps), or two batch levels.
    View batch(buffer, {2, 1, 8, 2, 4}, {8, 192, 24, 4, 1}, 0);
    View batch_overlapping(buffer, {2, 1, 8, 2, 4}, {4, 192, 24, 4, 1}, 0);
    View two_levels(buffer, {3, 2, 1, 2, 1, 4}, {8, 4, 192, 24, 4, 1}, 0);
    View two_levels_overlapping(buffer, {3, 2, 1, 2, 2, 4}, {8, 4, 192, 24, 4, 1}, 0);
    struct Batched {
        const char* what;
        const View* view;
        int distinct;
    };
    for (const Batched& c : {Batched{"a batch of two", &batch, 1},
                             Batched{"a batch overlapping by a head", &batch_overlapping, 0},
                             Batched{"two batch levels", &two_levels, 1},
                             Batched{"two levels overlapping", &two_levels_overlapping, 0}}) {
        const std::string what = c.what;
        CAPTURE(what);
        distinct = -1;
        REQUIRE(rope_jit_tensor_has_distinct_elements(&c.view->tensor, &distinct) == ROPE_JIT_OK);
        CHECK(distinct == c.distinct);
    }
    int64_t shape9[9];
    const DLTensor nine_dims = with_nine_dims(fused.tensor, shape9);
    distinct = -1;
    CHECK(rope_jit_tensor_has_distinct_elements(&nine_dims, &distinct) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(distinct == 0);
    CHECK(std::string(rope_jit_last_error()).rfind("t: expected at most 8 dimensions", 0) == 0);

    // rope_jit_rope itself still takes 4 dims.
    View q5(buffer, {1, 1, 8, 4, 4}, {192, 192, 24, 4, 1}, 0);
    ValidCall call;
    call.args.q = &q5.tensor;
    call.args.k = nullptr;
    call.args.cos = cos.dl();
    call.args.sin = sin.dl();
    call.expect_invalid("q: expected at most 4 dimensions");
}

TEST_CASE("a device type outside DLPack's enum is rejected as a raw integer, naming the tensor") {
    ValidCall call;
    for (int type : {16, -1, 0, 1000}) {
        CAPTURE(type);
        DLTensor k = *call.k.dl();
        std::memcpy(&k.device.device_type, &type, sizeof type);
        call.args.k = &k;
        call.expect_invalid(device_type_message("k", type));
        DLTensor q = *call.q.dl();
        std::memcpy(&q.device.device_type, &type, sizeof type);
        call.args.k = call.k.dl();
        call.args.q = &q;
        call.expect_invalid(device_type_message("q", type));
        call.args.q = call.q.dl();
    }
}

TEST_CASE("an output is refused exactly when it shares an element with its input (brute force)") {
    // Random strided views of one 512-float buffer as q and q_out; the expected verdict comes
    // from listing both views' element offsets.
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    HostTensor buffer(Dt::F32, {512});
    HostTensor inv_freq(Dt::F32, {1});
    inv_freq.set({0}, 0.5);
    std::mt19937 rng(23);
    auto random_view = [&](std::vector<int64_t>& shape, std::vector<int64_t>& strides) -> int64_t {
        shape = {1 + int64_t(rng() % 2), 1 + int64_t(rng() % 3), 1 + int64_t(rng() % 3), 2};
        strides.assign(4, 0);
        int64_t low = 0, high = 0;
        for (int d = 0; d < 4; ++d) {
            const int64_t choices[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, -1, -8, 0};
            strides[size_t(d)] = choices[rng() % 13];
            const int64_t reach = strides[size_t(d)] * (shape[size_t(d)] - 1);
            (reach < 0 ? low : high) += reach;
        }
        const int64_t span = high - low + 1;
        return -low + int64_t(rng() % uint32_t(512 - span + 1));  // the first element's offset
    };
    auto offsets = [](const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                      int64_t start) {
        std::vector<int64_t> out;
        for (int64_t a = 0; a < shape[0]; ++a)
            for (int64_t b = 0; b < shape[1]; ++b)
                for (int64_t c = 0; c < shape[2]; ++c)
                    for (int64_t d = 0; d < shape[3]; ++d)
                        out.push_back(start + a * strides[0] + b * strides[1] + c * strides[2] +
                                      d * strides[3]);
        std::sort(out.begin(), out.end());
        return out;
    };
    int refused = 0, accepted = 0, interleaved = 0;
    for (int trial = 0; trial < 3000; ++trial) {
        std::vector<int64_t> q_shape, q_strides, out_strides, unused;
        const int64_t q_start = random_view(q_shape, q_strides);
        std::vector<int64_t> out_shape = q_shape;
        int64_t out_start = random_view(unused, out_strides);
        // Keep q_out inside the buffer with q's shape.
        int64_t low = 0, high = 0;
        for (int d = 0; d < 4; ++d) {
            const int64_t reach = out_strides[size_t(d)] * (out_shape[size_t(d)] - 1);
            (reach < 0 ? low : high) += reach;
        }
        out_start = -low + int64_t(rng() % uint32_t(512 - (high - low + 1) + 1));
        // Half the time near q, where the two may meet.
        const int64_t near = q_start - 4 + int64_t(rng() % 8);
        if (rng() % 2 && near + low >= 0 && near + high < 512) out_start = near;
        const std::vector<int64_t> q_offsets = offsets(q_shape, q_strides, q_start);
        const std::vector<int64_t> out_offsets = offsets(out_shape, out_strides, out_start);
        const bool q_repeats =
            std::adjacent_find(q_offsets.begin(), q_offsets.end()) != q_offsets.end();
        const bool out_repeats =
            std::adjacent_find(out_offsets.begin(), out_offsets.end()) != out_offsets.end();
        if (q_repeats) continue;  // refused for that reason, with its own message
        std::vector<int64_t> common;
        std::set_intersection(q_offsets.begin(), q_offsets.end(), out_offsets.begin(),
                              out_offsets.end(), std::back_inserter(common));
        bool same = q_start == out_start;
        for (size_t d = 0; d < 4; ++d)
            same = same && (q_shape[d] == 1 || q_strides[d] == out_strides[d]);

        DLTensor q = *buffer.dl(), out = *buffer.dl();
        q.ndim = out.ndim = 4;
        q.shape = q_shape.data();
        out.shape = out_shape.data();
        q.strides = q_strides.data();
        out.strides = out_strides.data();
        q.byte_offset = uint64_t(q_start) * 4;
        out.byte_offset = uint64_t(out_start) * 4;
        rope_jit_rope_args args;
        rope_jit_rope_args_init(&args);
        args.q = &q;
        args.q_out = &out;
        args.inv_freq = inv_freq.dl();
        args.rotary_dim = 2;
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(trial);
        CAPTURE(message);
        if (out_repeats && !same) {
            CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(message.find("same element") != std::string::npos);
        } else if (message.find("same element") != std::string::npos) {
            // The distinct-elements test is a sufficient one (has_distinct_elements): some
            // interleaving strides are refused though no element repeats.
            CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        } else if (!same && !common.empty()) {
            CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(message.find("q_out: overlaps q") != std::string::npos);
            ++refused;
        } else {
            CHECK(status == ROPE_JIT_OK);
            ++accepted;
            // Accepted although their ranges meet: views that interleave.
            if (!same && out_offsets.front() <= q_offsets.back() &&
                q_offsets.front() <= out_offsets.back())
                ++interleaved;
        }
    }
    CAPTURE(refused);
    CAPTURE(accepted);
    CAPTURE(interleaved);
    CHECK(refused > 20);
    CHECK(accepted > 100);
    CHECK(interleaved > 20);
    rope_jit_runtime_free(runtime);
}
