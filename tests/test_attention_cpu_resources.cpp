// The CPU attention's resource edges, through the C API (adversarial test, session 36): a
// problem with nothing to compute returns at once however large its other sizes; one whose
// working memory cannot be had fails OUT_OF_MEMORY with its outputs untouched; a size beyond
// any allocation is OUT_OF_MEMORY too, not an internal error.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "child_process.h"
#include "sanitizer_builds.h"
#include "rope_test_support.h"

namespace {

// A float32 [B, H, S, D] view of `data` (NULL for an empty one) with the given strides.
struct View {
    View(void* data, std::vector<int64_t> shape, std::vector<int64_t> strides)
        : shape_(std::move(shape)), strides_(std::move(strides)) {
        tensor.data = data;
        tensor.device = {kDLCPU, 0};
        tensor.ndim = int32_t(shape_.size());
        tensor.dtype = {kDLFloat, 32, 1};
        tensor.shape = shape_.data();
        tensor.strides = strides_.data();
        tensor.byte_offset = 0;
    }
    View(const View&) = delete;
    View& operator=(const View&) = delete;
    const DLTensor* dl() const { return &tensor; }

    std::vector<int64_t> shape_, strides_;
    DLTensor tensor{};
};

// Keys and values of one element each, seen through zero strides as [1, 1, keys, 1].
struct RepeatedKeys {
    explicit RepeatedKeys(int64_t keys)
        : k(&one, {1, 1, keys, 1}, {0, 0, 0, 0}), v(&one, {1, 1, keys, 1}, {0, 0, 0, 0}) {}
    float one = 1.0f;
    View k, v;
};

}  // namespace

TEST_CASE("an attention backward with no query token returns at once however many query heads") {
    // q, out, dout, dq and lse of 2^60 heads of no token (no memory behind them), k and v of
    // two keys: the backward ran 2^60 empty head loops (years) before its dk and dv.
    const ChildResult child = run_in_child(
        [](std::string* output) {
            const int64_t heads = int64_t(1) << 60;
            const std::vector<int64_t> rows{1, heads, 0, 1}, strides{0, 0, 1, 1};
            View q(nullptr, rows, strides), out(nullptr, rows, strides),
                dout(nullptr, rows, strides), dq(nullptr, rows, strides),
                lse(nullptr, {1, heads, 0}, {0, 0, 1});
            float keys[2] = {1, 2}, values[2] = {3, 4}, dk_data[2] = {7, 7}, dv_data[2] = {7, 7};
            View k(keys, {1, 1, 2, 1}, {2, 2, 1, 1}), v(values, {1, 1, 2, 1}, {2, 2, 1, 1}),
                dk(dk_data, {1, 1, 2, 1}, {2, 2, 1, 1}), dv(dv_data, {1, 1, 2, 1}, {2, 2, 1, 1});
            rope_test::CpuRuntime cpu(2, false);
            rope_jit_runtime* runtime = cpu.handle;
            rope_jit_attention_args a;
            rope_jit_attention_args_init(&a);
            a.q = q.dl(), a.k = k.dl(), a.v = v.dl(), a.out = out.dl(), a.lse = lse.dl();
            a.dout = dout.dl(), a.dq = dq.dl(), a.dk = dk.dl(), a.dv = dv.dl();
            const rope_jit_status forward = rope_jit_attention(runtime, &a);
            const rope_jit_status backward = rope_jit_attention_backward(runtime, &a);
            *output = std::string(rope_jit_status_name(forward)) + " " +
                      rope_jit_status_name(backward) + " " + rope_jit_last_error();
            // No query: no gradient reaches the keys, which are still outputs.
            const bool zeroed =
                dk_data[0] == 0 && dk_data[1] == 0 && dv_data[0] == 0 && dv_data[1] == 0;
            return forward == ROPE_JIT_OK && backward == ROPE_JIT_OK && zeroed ? 0 : 1;
        },
        20);
    CAPTURE(child.output);
    CHECK(child.exited_with(0));  // not killed by the alarm
}

TEST_CASE("an attention call whose working memory cannot be had fails with its outputs untouched") {
#ifdef ROPE_JIT_TEST_ASAN
    MESSAGE("skipped: the address-space limit this test sets leaves AddressSanitizer no room");
    return;
#else
    // Two heads (two units on two threads) over 2^23 keys repeated from one element: each
    // thread's float64 working memory takes 4 (forward) or 7 (backward) copies of the keys.
    // Under an address-space limit that holds one thread's and not two, the forward wrote one
    // head's out and lse, and the backward one head's dq and dk rows, before the other thread's
    // allocation failed.
    const ChildResult child = run_in_child(
        [](std::string* output) {
            constexpr int64_t kKeys = int64_t(1) << 23;
            float one = 1.0f;
            View k(&one, {1, 2, kKeys, 1}, {0, 0, 0, 0}), v(&one, {1, 2, kKeys, 1}, {0, 0, 0, 0});
            float q_data[2] = {1, 1}, out_data[2] = {7, 7}, lse_data[2] = {7, 7};
            float dout_data[2] = {1, 1}, dq_data[2] = {7, 7};
            View q(q_data, {1, 2, 1, 1}, {2, 1, 1, 1}), out(out_data, {1, 2, 1, 1}, {2, 1, 1, 1}),
                lse(lse_data, {1, 2, 1}, {2, 1, 1}), dout(dout_data, {1, 2, 1, 1}, {2, 1, 1, 1}),
                dq(dq_data, {1, 2, 1, 1}, {2, 1, 1, 1});
            std::vector<float> dk_data(size_t(2 * kKeys), 7.0f), dv_data(size_t(2 * kKeys), 7.0f);
            View dk(dk_data.data(), {1, 2, kKeys, 1}, {2 * kKeys, kKeys, 1, 1}),
                dv(dv_data.data(), {1, 2, kKeys, 1}, {2 * kKeys, kKeys, 1, 1});
            rope_test::CpuRuntime cpu(2, false);
            rope_jit_runtime* runtime = cpu.handle;
            // Room for one and a half threads' copies of the keys above what is in use now.
            auto limit_to = [&](int copies) {
                long long used_kib = 0;
                std::ifstream status("/proc/self/status");
                for (std::string word; status >> word;)
                    if (word == "VmSize:") status >> used_kib;
                struct rlimit limit;
                if (used_kib <= 0 || getrlimit(RLIMIT_AS, &limit) != 0) return false;
                const rlim_t one_thread = rlim_t(kKeys) * copies * sizeof(double);
                limit.rlim_cur = rlim_t(used_kib) * 1024 + one_thread * 3 / 2;
                return setrlimit(RLIMIT_AS, &limit) == 0;
            };
            rope_jit_attention_args a;
            rope_jit_attention_args_init(&a);
            a.q = q.dl(), a.k = k.dl(), a.v = v.dl(), a.out = out.dl(), a.lse = lse.dl();
            a.dout = dout.dl(), a.dq = dq.dl(), a.dk = dk.dl(), a.dv = dv.dl();
            if (!limit_to(4)) return 4;
            const rope_jit_status forward = rope_jit_attention(runtime, &a);
            const bool forward_untouched =
                out_data[0] == 7 && out_data[1] == 7 && lse_data[0] == 7 && lse_data[1] == 7;
            lse_data[0] = lse_data[1] = 0;  // a valid lse for the backward
            if (!limit_to(7)) return 4;
            const rope_jit_status backward = rope_jit_attention_backward(runtime, &a);
            bool backward_untouched = dq_data[0] == 7 && dq_data[1] == 7;
            for (size_t j = 0; j < dk_data.size(); ++j)
                backward_untouched = backward_untouched && dk_data[j] == 7 && dv_data[j] == 7;
            *output = std::string(rope_jit_status_name(forward)) + " " +
                      rope_jit_status_name(backward) + " " + rope_jit_last_error();
            if (forward != ROPE_JIT_ERROR_OUT_OF_MEMORY || backward != ROPE_JIT_ERROR_OUT_OF_MEMORY)
                return 1;
            return forward_untouched && backward_untouched ? 0 : 2;
        },
        120);
    CAPTURE(child.output);
    CHECK(child.exited_with(0));
#endif
}

TEST_CASE("attention over more keys than any allocation can hold is OUT_OF_MEMORY, not internal") {
    // 2^61 keys repeated from one element: a valid view, whose float64 copy no vector can hold
    // (std::length_error, which was reported as "a bug in rope-jit").
    RepeatedKeys keys(int64_t(1) << 61);
    float q_data[1] = {1}, out_data[1] = {7}, lse_data[1] = {7};
    View q(q_data, {1, 1, 1, 1}, {1, 1, 1, 1}), out(out_data, {1, 1, 1, 1}, {1, 1, 1, 1}),
        lse(lse_data, {1, 1, 1}, {1, 1, 1});
    rope_test::CpuRuntime cpu(1, false);
    rope_jit_runtime* runtime = cpu.handle;
    rope_jit_attention_args a;
    rope_jit_attention_args_init(&a);
    a.q = q.dl(), a.k = keys.k.dl(), a.v = keys.v.dl(), a.out = out.dl(), a.lse = lse.dl();
    CHECK(rope_jit_attention(runtime, &a) == ROPE_JIT_ERROR_OUT_OF_MEMORY);
    CHECK(std::string(rope_jit_last_error()).find("out of host memory") != std::string::npos);
    CHECK(out_data[0] == 7);
    CHECK(lse_data[0] == 7);
}
