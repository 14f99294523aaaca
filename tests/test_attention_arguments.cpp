// Every bad input to rope_jit_attention and rope_jit_attention_backward returns
// ERROR_INVALID_ARGUMENT with a message that names the argument, and writes nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

#include "api/attention_args.h"
#include "attention_test_support.h"

using namespace attention_test;
using rope_test::Dt;

namespace {

// A valid forward and backward (GQA, tables, pos_mask, bool mask, causal, lse) that each test
// breaks in one way.
struct ValidCall {
    ValidCall() : problem(config(), rng) {
        rope_jit_config runtime_config;
        rope_jit_config_init(&runtime_config);
        runtime_config.backend = ROPE_JIT_BACKEND_CPU;
        REQUIRE(rope_jit_runtime_create(&runtime_config, &runtime) == ROPE_JIT_OK);
        args = problem.args();
        REQUIRE(rope_jit_attention(runtime, &args) == ROPE_JIT_OK);
        REQUIRE(rope_jit_attention_backward(runtime, &args) == ROPE_JIT_OK);
        before_out = problem.out.bytes();
        before_lse = problem.lse.bytes();
        before_dq = problem.dq.bytes();
        before_dk = problem.dk.bytes();
        before_dv = problem.dv.bytes();
    }
    ~ValidCall() { rope_jit_runtime_free(runtime); }

    static Config config() {
        Config c;
        c.B = 2;
        c.Hq = 4;
        c.Hk = 2;
        c.Sq = 6;
        c.Sk = 6;
        c.D = 16;
        c.R = 8;
        c.causal = true;
        c.pos_mask = true;
        c.mask = Mask::BoolKeys;
        return c;
    }

    // Runs the broken call (forward, or backward) and checks the status, that the message
    // names `needle`, and that no output changed.
    void expect_invalid(const std::string& needle, bool backward = false) {
        const rope_jit_status status = backward ? rope_jit_attention_backward(runtime, &args)
                                                : rope_jit_attention(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(problem.out.bytes() == before_out);
        CHECK(problem.lse.bytes() == before_lse);
        CHECK(problem.dq.bytes() == before_dq);
        CHECK(problem.dk.bytes() == before_dk);
        CHECK(problem.dv.bytes() == before_dv);
    }

    std::mt19937 rng{3};
    Problem problem;
    rope_jit_runtime* runtime = nullptr;
    rope_jit_attention_args args{};
    std::vector<uint8_t> before_out, before_lse, before_dq, before_dk, before_dv;
};

}  // namespace

TEST_CASE("attention: a NULL runtime, NULL args or uninitialized args are rejected") {
    ValidCall call;
    CHECK(rope_jit_attention(nullptr, &call.args) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("runtime") != std::string::npos);
    CHECK(rope_jit_attention_backward(call.runtime, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("args") != std::string::npos);
    call.args.struct_size = 0;
    call.expect_invalid("struct_size");
    call.expect_invalid("struct_size", true);
}

TEST_CASE(
    "attention: `deterministic` defaults to 0, and to 1 for a caller built before the field") {
    rope_jit_attention_args args;
    rope_jit_attention_args_init(&args);
    CHECK(args.deterministic == 0);
    CHECK(rope_jit::read_attention_args(&args).deterministic == 0);
    args.deterministic = 1;
    CHECK(rope_jit::read_attention_args(&args).deterministic == 1);
    // The struct as the previous header laid it out: it ended with dv.
    rope_jit_attention_args old;
    rope_jit_attention_args_init(&old);
    old.struct_size = offsetof(rope_jit_attention_args, dv) + sizeof old.dv;
    old.deterministic = 0;  // beyond the old struct: never read
    const rope_jit_attention_args read = rope_jit::read_attention_args(&old);
    CHECK(read.deterministic == 1);
    CHECK(read.struct_size == sizeof(rope_jit_attention_args));
    CHECK_THROWS(rope_jit::read_attention_args(nullptr));
}

TEST_CASE("attention: a missing q, k, v or out is rejected") {
    for (const std::string n : {"q", "k", "v", "out"}) {
        CAPTURE(n);
        ValidCall call;
        if (n == "q") call.args.q = nullptr;
        if (n == "k") call.args.k = nullptr;
        if (n == "v") call.args.v = nullptr;
        if (n == "out") call.args.out = nullptr;
        call.expect_invalid(n + ": required");
    }
}

TEST_CASE("attention: shapes that do not fit together are rejected") {
    ValidCall call;
    SUBCASE("q is not 4-D") {
        call.problem.q.dl()->ndim = 3;
        call.expect_invalid("q: expected 4 dimensions");
    }
    SUBCASE("k has another batch") {
        call.problem.k.dl()->shape[0] = 1;
        call.expect_invalid("k: shape");
    }
    SUBCASE("k has another head_dim") {
        call.problem.k.dl()->shape[3] = 8;
        call.expect_invalid("k: shape");
    }
    SUBCASE("Hq is not a multiple of Hk") {
        call.problem.k.dl()->shape[1] = 3;
        call.expect_invalid("not a multiple of k's 3 heads");
    }
    SUBCASE("v has another length than k") {
        call.problem.v.dl()->shape[2] = 5;
        call.expect_invalid("v: shape");
    }
    SUBCASE("out has another shape than q") {
        call.problem.out.dl()->shape[2] = 5;
        call.expect_invalid("out: shape");
    }
}

TEST_CASE("attention: dtypes that do not fit are rejected") {
    ValidCall call;
    SUBCASE("q of integers") {
        call.problem.q.dl()->dtype = {kDLInt, 32, 1};
        call.expect_invalid("q: dtype must be float32, float16 or bfloat16");
    }
    SUBCASE("k of another float dtype") {
        call.problem.k.dl()->dtype = {kDLFloat, 16, 1};
        call.expect_invalid("k: dtype float16 differs from q's float32");
    }
    SUBCASE("out of another float dtype") {
        call.problem.out.dl()->dtype = {kDLBfloat, 16, 1};
        call.expect_invalid("out: dtype");
    }
    SUBCASE("lse not float32") {
        call.problem.lse.dl()->dtype = {kDLFloat, 16, 1};
        call.expect_invalid("lse: dtype must be float32");
    }
}

TEST_CASE("attention: bad rotation arguments are rejected") {
    ValidCall call;
    SUBCASE("cos without sin") {
        call.args.sin = nullptr;
        call.expect_invalid("sin: NULL while cos is given");
    }
    SUBCASE("sin without cos") {
        call.args.cos = nullptr;
        call.expect_invalid("cos: NULL while sin is given");
    }
    SUBCASE("an odd rotary_dim") {
        call.args.rotary_dim = 7;
        call.expect_invalid("rotary_dim: must be even");
    }
    SUBCASE(
        "rotary_dim 0 (head_dim) with an odd head_dim: the message names the head_dim it stands "
        "for") {
        for (auto* t : {&call.problem.q, &call.problem.k, &call.problem.v, &call.problem.out})
            t->dl()->shape[3] = 15;
        call.args.rotary_dim = 0;
        call.expect_invalid("rotary_dim: 0 means head_dim, 15, which is odd");
    }
    SUBCASE("rotary_dim above head_dim") {
        call.args.rotary_dim = 18;
        call.expect_invalid("rotary_dim: 18 exceeds head_dim 16");
    }
    SUBCASE("a table of the wrong width") {
        call.args.rotary_dim = 16;
        call.expect_invalid("cos: expected [P, 8] (half table) or [P, 16] (full table)");
    }
    SUBCASE("a table with too few rows") {
        call.problem.cos.dl()->shape[0] = 5;
        call.problem.sin.dl()->shape[0] = 5;
        call.expect_invalid("cos: has 5 rows");
    }
    SUBCASE("sin of another shape") {
        call.problem.sin.dl()->shape[0] = 6;
        call.expect_invalid("sin: shape");
    }
    SUBCASE("an unknown style") {
        call.args.style = static_cast<rope_jit_style>(5);
        call.expect_invalid("style: must be");
    }
    SUBCASE("pos_mask without tables") {
        call.args.cos = nullptr;
        call.args.sin = nullptr;
        call.expect_invalid("pos_mask: given without cos/sin");
    }
    SUBCASE("pos_mask of floats") {
        call.args.pos_mask = call.problem.v.dl();
        call.expect_invalid("pos_mask: ");
    }
    SUBCASE("pos_mask shorter than the sequence") {
        call.problem.pos_mask.dl()->shape[0] = 3;
        call.expect_invalid("pos_mask: has 3 entries");
    }
}

TEST_CASE("attention: bad masks, scales and lse are rejected") {
    ValidCall call;
    SUBCASE("attn_mask of int32") {
        HostTensor ints(Dt::I32, {2, 6});
        call.args.attn_mask = ints.dl();
        call.expect_invalid("attn_mask: dtype must be bool/uint8");
    }
    SUBCASE("attn_mask of the wrong length") {
        call.problem.mask_bool.dl()->shape[1] = 5;
        call.expect_invalid("attn_mask: expected [B, Sk]");
    }
    SUBCASE("a NaN scale") {
        call.args.scale = std::numeric_limits<double>::quiet_NaN();
        call.expect_invalid("scale: must be finite");
    }
    SUBCASE("an infinite scale") {
        call.args.scale = std::numeric_limits<double>::infinity();
        call.expect_invalid("scale: must be finite");
    }
    SUBCASE("lse of the wrong shape") {
        call.problem.lse.dl()->shape[2] = 5;
        call.expect_invalid("lse: expected [B, Hq, Sq]");
    }
}

TEST_CASE("attention: int8 tensors are refused, not read as bool masks") {
    // An int8 mask was read as a bool mask (-1 "add -1" taken as "keep"), an int8 pos_mask
    // as flags (adversarial test, session 35).
    ValidCall call;
    SUBCASE("an int8 attn_mask") {
        ByteTensor int8_mask({2, 6}, kDLInt);
        for (size_t i = 0; i < int8_mask.bytes().size(); ++i)
            int8_mask.bytes()[i] = i % 3 == 0 ? uint8_t(0xff) : 0;  // -1 and 0
        call.args.attn_mask = int8_mask.dl();
        call.expect_invalid("attn_mask: int8 is not supported");
        call.expect_invalid("attn_mask: int8 is not supported", true);
    }
    SUBCASE("an int8 pos_mask") {
        call.problem.pos_mask.dl()->dtype = {kDLInt, 8, 1};
        call.expect_invalid("pos_mask: int8 is not supported");
    }
    SUBCASE("int8 q") {
        call.problem.q.dl()->dtype = {kDLInt, 8, 1};
        call.expect_invalid("q: int8 is not supported");
    }
}

TEST_CASE("attention: a tensor of too many or no dimensions is refused with the bound it broke") {
    ValidCall call;
    SUBCASE("a 5-D q") {
        HostTensor q5(Dt::F32, {1, 2, 4, 6, 16});
        call.args.q = q5.dl();
        call.expect_invalid("q: expected at most 4 dimensions, got 5");
    }
    SUBCASE("a 4-D lse") {
        HostTensor lse4(Dt::F32, {2, 4, 6, 1});
        call.args.lse = lse4.dl();
        call.expect_invalid("lse: expected at most 3 dimensions, got 4");
    }
    SUBCASE("a 0-D pos_mask") {
        call.problem.pos_mask.dl()->ndim = 0;
        call.expect_invalid("pos_mask: expected at least 1 dimensions, got 0");
    }
}

TEST_CASE("attention: HF's 4-D [B, 1, Sq, Sk] mask is refused with the shapes taken and a hint") {
    ValidCall call;
    HostTensor mask4(Dt::F32, {2, 1, 6, 6});
    mask4.fill_uniform(call.rng, -1, 0);
    call.args.attn_mask = mask4.dl();
    call.expect_invalid(
        "attn_mask: expected [B, Sk] = [2, 6] or [B, Sq, Sk] = [2, 6, 6] (B may be 1), got "
        "[2, 1, 6, 6] (a [B, 1, Sq, Sk] mask as HF builds it passes as mask[:, 0])");
    call.expect_invalid("passes as mask[:, 0]", true);
    SUBCASE("a 1-D mask gets the shapes, without the hint") {
        HostTensor mask1(Dt::F32, {6});
        call.args.attn_mask = mask1.dl();
        call.expect_invalid(
            "attn_mask: expected [B, Sk] = [2, 6] or [B, Sq, Sk] = [2, 6, 6] (B "
            "may be 1), got [6]");
        CHECK(std::string(rope_jit_last_error()).find("HF") == std::string::npos);
    }
    SUBCASE("the hint holds: mask[:, 0] passes and masks as the same mask stored [B, Sq, Sk]") {
        // mask[:, 0] of the 4-D mask: a [B, Sq, Sk] view of its memory.
        DLTensor view = *mask4.dl();
        int64_t shape[3] = {2, 6, 6}, strides[3] = {36, 6, 1};
        view.ndim = 3;
        view.shape = shape;
        view.strides = strides;
        call.args.attn_mask = &view;
        REQUIRE(rope_jit_attention(call.runtime, &call.args) == ROPE_JIT_OK);
        const std::vector<uint8_t> out_view = call.problem.out.bytes();
        HostTensor mask3(Dt::F32, {2, 6, 6});
        for (int64_t b = 0; b < 2; ++b)
            for (int64_t i = 0; i < 6; ++i)
                for (int64_t j = 0; j < 6; ++j) mask3.set({b, i, j}, mask4.get({b, 0, i, j}));
        call.args.attn_mask = mask3.dl();
        REQUIRE(rope_jit_attention(call.runtime, &call.args) == ROPE_JIT_OK);
        CHECK(call.problem.out.bytes() == out_view);
        CHECK(out_view != call.before_out);  // the mask did change the result
    }
}

TEST_CASE("attention: k with no heads is refused as such") {
    // It was told that q's heads are no multiple of k's 0 heads (adversarial test, session 35).
    ValidCall call;
    SUBCASE("k and v with no heads") {
        call.problem.k.dl()->shape[1] = 0;
        call.problem.v.dl()->shape[1] = 0;
        call.expect_invalid("k: has no heads ([2, 0, 6, 16])");
        call.expect_invalid("k: has no heads", true);
    }
    SUBCASE("q, k, v and out with no heads") {
        for (HostTensor* t : {&call.problem.q, &call.problem.k, &call.problem.v, &call.problem.out})
            t->dl()->shape[1] = 0;
        call.problem.lse.dl()->shape[1] = 0;
        call.expect_invalid("k: has no heads");
    }
}

TEST_CASE("attention: outputs that overlap inputs or repeat elements are rejected") {
    ValidCall call;
    SUBCASE("out is q") {
        call.args.out = call.problem.q.dl();
        call.expect_invalid("out: overlaps q");
    }
    SUBCASE("out has a zero stride") {
        call.problem.out.dl()->strides[2] = 0;
        call.expect_invalid("out: its strides may make several indices address");
    }
    SUBCASE("dk is dv") {
        call.args.dk = call.problem.dv.dl();
        call.expect_invalid("dk: overlaps dv", true);
    }
    SUBCASE("dq is dout") {
        call.args.dq = call.problem.dout.dl();
        call.expect_invalid("dq: overlaps dout", true);
    }
    // The forward ignores the backward's tensors, but they are the caller's memory when one
    // args struct serves both calls: out and lse were written over them (overlap audit,
    // session 40).
    SUBCASE("the forward's out on dq or dout, given beside it") {
        call.args.out = call.problem.dq.dl();
        call.expect_invalid("out: overlaps dq");
        call.args.out = call.problem.dout.dl();
        call.expect_invalid("out: overlaps dout");
    }
    SUBCASE("the forward's lse on dk, given beside it") {
        DLTensor lse_on_dk = *call.problem.lse.dl();
        lse_on_dk.data = call.problem.dk.dl()->data;
        call.args.lse = &lse_on_dk;
        call.expect_invalid("lse: overlaps dk");
    }
    SUBCASE("the forward ignores backward tensors it would refuse, but for their memory") {
        // They were validated as the backward does: a float64 dq or a 5-D dout failed the
        // forward (review, session 40).
        DLTensor wide_dq = *call.problem.dq.dl();
        wide_dq.dtype = DLDataType{kDLFloat, 64, 1};
        DLTensor deep_dout = *call.problem.dout.dl();
        int64_t shape[5] = {1, 2, 4, 6, 16};
        deep_dout.ndim = 5;
        deep_dout.shape = shape;
        deep_dout.strides = nullptr;
        call.args.dq = &wide_dq;
        call.args.dout = &deep_dout;
        REQUIRE(rope_jit_attention(call.runtime, &call.args) == ROPE_JIT_OK);
        CHECK(call.problem.out.bytes() == call.before_out);  // the same inputs, the same out
    }
}

TEST_CASE("attention backward: a missing dout, dq, dk or dv is rejected") {
    for (const std::string name : {"dout", "dq", "dk", "dv"}) {
        CAPTURE(name);
        ValidCall call;
        if (name == "dout") call.args.dout = nullptr;
        if (name == "dq") call.args.dq = nullptr;
        if (name == "dk") call.args.dk = nullptr;
        if (name == "dv") call.args.dv = nullptr;
        call.expect_invalid(name + ": required by the backward", true);
    }
}

TEST_CASE("attention backward: a missing lse or mismatched gradients are rejected") {
    ValidCall call;
    SUBCASE("no lse") {
        call.args.lse = nullptr;
        call.expect_invalid("lse: required by the backward", true);
    }
    SUBCASE("dq of another shape") {
        call.problem.dq.dl()->shape[1] = 2;
        call.expect_invalid("dq: shape", true);
    }
    SUBCASE("dk of another dtype") {
        call.problem.dk.dl()->dtype = {kDLFloat, 64, 1};
        call.expect_invalid("dk: unsupported dtype", true);
    }
}

TEST_CASE("attention: tensors on different devices are rejected") {
    ValidCall call;
    SUBCASE("k on a GPU while q is on the CPU") {
        call.problem.k.dl()->device = {kDLCUDA, 0};
        call.expect_invalid("k: lives on CUDA device 0, but q lives on CPU device 0");
    }
    SUBCASE("everything on a GPU, on a CPU-only runtime") {
        for (HostTensor* t : {&call.problem.q, &call.problem.k, &call.problem.v, &call.problem.out,
                              &call.problem.lse, &call.problem.cos, &call.problem.sin})
            t->dl()->device = {kDLCUDA, 0};
        call.problem.pos_mask.dl()->device = {kDLCUDA, 0};
        call.problem.mask_bool.dl()->device = {kDLCUDA, 0};
        call.expect_invalid("CPU backend");
    }
}

TEST_CASE(
    "attention: a device type outside DLPack's enum is rejected as a raw integer, naming the "
    "tensor") {
    ValidCall call;
    for (int type : {16, -1}) {
        CAPTURE(type);
        DLTensor v = *call.args.v;
        std::memcpy(&v.device.device_type, &type, sizeof type);
        call.args.v = &v;
        call.expect_invalid("v: device type " + std::to_string(type) + " is not");
        call.expect_invalid("v: device type " + std::to_string(type) + " is not", true);
        call.args.v = call.problem.v.dl();
    }
}

namespace {

// Host memory at a 256-byte boundary, for the workspace fields.
struct AlignedBytes {
    alignas(256) unsigned char bytes[1024];
};

}  // namespace

TEST_CASE(
    "attention: a misaligned workspace, or workspace_bytes without a workspace, is rejected on "
    "every backend") {
    ValidCall call;
    AlignedBytes memory;
    SUBCASE("not 256-byte aligned") {
        for (const size_t offset : {size_t(1), size_t(16), size_t(128)}) {
            CAPTURE(offset);
            call.args.workspace = memory.bytes + offset;
            call.args.workspace_bytes = 512;
            call.expect_invalid("workspace: address 0x");
            call.expect_invalid("is not 256-byte aligned", true);
        }
    }
    SUBCASE("a size without memory") {
        call.args.workspace_bytes = 4096;
        call.expect_invalid("workspace_bytes: 4096 with a NULL workspace");
        call.expect_invalid("workspace_bytes: 4096 with a NULL workspace", true);
    }
    SUBCASE("sharing bytes with a tensor of the call") {
        // From the 256-byte boundary at or below a tensor's first byte up to that byte: the
        // range meets the tensor (the check reads no memory: nothing there is touched).
        for (const DLTensor* t : {call.args.q, call.args.v, call.args.lse, call.args.dk}) {
            const uintptr_t first = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
            const uintptr_t base = first / 256 * 256;
            call.args.workspace = reinterpret_cast<void*>(base);
            call.args.workspace_bytes = size_t(first - base) + 1;
            CAPTURE(first);
            call.expect_invalid("workspace: overlaps ");
            call.expect_invalid("workspace: overlaps ", true);
        }
    }
}

TEST_CASE(
    "attention: a workspace given to a call that needs none (the CPU backend) is left untouched "
    "and changes no result") {
    ValidCall call;
    AlignedBytes memory;
    std::fill(std::begin(memory.bytes), std::end(memory.bytes), 0xab);
    // Even one too small for any GPU kernel: this call needs none.
    call.args.workspace = memory.bytes;
    call.args.workspace_bytes = 1;
    REQUIRE(rope_jit_attention(call.runtime, &call.args) == ROPE_JIT_OK);
    REQUIRE(rope_jit_attention_backward(call.runtime, &call.args) == ROPE_JIT_OK);
    CHECK(call.problem.out.bytes() == call.before_out);
    CHECK(call.problem.lse.bytes() == call.before_lse);
    CHECK(call.problem.dq.bytes() == call.before_dq);
    CHECK(call.problem.dk.bytes() == call.before_dk);
    CHECK(call.problem.dv.bytes() == call.before_dv);
    for (const unsigned char b : memory.bytes) REQUIRE(b == 0xab);
}

TEST_CASE(
    "attention_workspace_size: 0 on the CPU backend, the call's own argument checks, and the "
    "workspace fields ignored") {
    ValidCall call;
    size_t bytes = 12345;
    REQUIRE(rope_jit_attention_workspace_size(call.runtime, &call.args, 0, &bytes) == ROPE_JIT_OK);
    CHECK(bytes == 0);
    bytes = 12345;
    REQUIRE(rope_jit_attention_workspace_size(call.runtime, &call.args, 1, &bytes) == ROPE_JIT_OK);
    CHECK(bytes == 0);
    // The query is what a caller runs before it has a workspace: the fields are not checked.
    AlignedBytes memory;
    call.args.workspace = memory.bytes + 8;
    call.args.workspace_bytes = 3;
    CHECK(rope_jit_attention_workspace_size(call.runtime, &call.args, 1, &bytes) == ROPE_JIT_OK);
    call.args.workspace = nullptr;
    call.args.workspace_bytes = 0;

    auto expect_invalid = [&](rope_jit_runtime* runtime, const rope_jit_attention_args* args,
                              int backward, size_t* out, const std::string& needle) {
        const rope_jit_status status =
            rope_jit_attention_workspace_size(runtime, args, backward, out);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
    };
    expect_invalid(call.runtime, &call.args, 0, nullptr, "bytes: NULL");
    expect_invalid(nullptr, &call.args, 0, &bytes, "runtime: NULL");
    expect_invalid(call.runtime, nullptr, 0, &bytes, "args: NULL");
    // What the call refuses, the query refuses with the same message, and *bytes is 0.
    call.args.dq = nullptr;
    bytes = 12345;
    expect_invalid(call.runtime, &call.args, 1, &bytes, "dq: required by the backward");
    CHECK(bytes == 0);
    // ... but only the direction asked about: the forward takes no dq.
    CHECK(rope_jit_attention_workspace_size(call.runtime, &call.args, 0, &bytes) == ROPE_JIT_OK);
    call.args.dq = call.problem.dq.dl();
    DLTensor k = *call.args.k;
    int64_t k_shape[4];
    std::copy(k.shape, k.shape + 4, k_shape);
    k_shape[3] = 32;
    k.shape = k_shape;
    call.args.k = &k;
    expect_invalid(call.runtime, &call.args, 0, &bytes, "k: shape");
    call.args.k = call.problem.k.dl();
    for (HostTensor* t : {&call.problem.q, &call.problem.k, &call.problem.v, &call.problem.out,
                          &call.problem.lse, &call.problem.cos, &call.problem.sin})
        t->dl()->device = {kDLCUDA, 0};
    call.problem.pos_mask.dl()->device = {kDLCUDA, 0};
    call.problem.mask_bool.dl()->device = {kDLCUDA, 0};
    expect_invalid(call.runtime, &call.args, 0, &bytes, "CPU backend");
}

TEST_CASE(
    "attention: a caller built before the workspace fields gets none, whatever lies past its "
    "struct") {
    ValidCall call;
    const size_t old_size = offsetof(rope_jit_attention_args, deterministic) + sizeof(int);
    // The previous header's struct ended with `deterministic` (plus padding to a multiple of
    // its alignment, which a compiler adds to sizeof).
    const size_t old_struct_size =
        (old_size + alignof(rope_jit_attention_args) - 1) / alignof(rope_jit_attention_args) *
        alignof(rope_jit_attention_args);
    REQUIRE(old_struct_size == offsetof(rope_jit_attention_args, workspace));
    call.args.struct_size = old_struct_size;
    call.args.deterministic = 1;
    // Garbage where the old caller's struct ends: never read.
    call.args.workspace = reinterpret_cast<void*>(uintptr_t(3));
    call.args.workspace_bytes = 7;
    const rope_jit_attention_args read = rope_jit::read_attention_args(&call.args);
    CHECK(read.workspace == nullptr);
    CHECK(read.workspace_bytes == 0);
    CHECK(read.deterministic == 1);
    CHECK(rope_jit_attention(call.runtime, &call.args) == ROPE_JIT_OK);
    CHECK(rope_jit_attention_backward(call.runtime, &call.args) == ROPE_JIT_OK);
    size_t bytes = 1;
    CHECK(rope_jit_attention_workspace_size(call.runtime, &call.args, 1, &bytes) == ROPE_JIT_OK);
    CHECK(bytes == 0);
    CHECK(call.problem.out.bytes() == call.before_out);
    CHECK(call.problem.dq.bytes() == call.before_dq);
}
