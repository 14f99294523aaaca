// The CPU backend's gradient sums over tokens (the QK-norm weights' and inv_freq's) are the
// same bits however the pool splits the work: at every cpu_threads, and while another call
// keeps the pool busy (then the caller runs the whole range as one chunk). They were summed
// per chunk, and a chunk's sum of cancelling terms depends on where the chunks start
// (adversarial test, session 36: dw[0] 1536 alone, 1747 beside another call).
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "rope_test_support.h"

using rope_test::Dt;
using rope_test::HostTensor;

namespace {

constexpr int64_t kTokens = 2048, kHeadDim = 64;

// A gradient of 1 everywhere but +1e30 at token 0 and -1e30 at token 300 of feature 0: its
// float64 sum over tokens is exact only within a block that holds both (or neither) of them.
HostTensor cancelling_gradient() {
    HostTensor g(Dt::F32, {1, 1, kTokens, kHeadDim});
    for (int64_t s = 0; s < kTokens; ++s)
        for (int64_t d = 0; d < kHeadDim; ++d)
            g.set({0, 0, s, d}, d == 0 && s == 0 ? 1e30 : d == 0 && s == 300 ? -1e30 : 1.0);
    return g;
}

// The QK-norm backward's weight gradients (q's then k's bytes) on `runtime`.
std::vector<uint8_t> norm_weight_gradients(rope_jit_runtime* runtime) {
    HostTensor g = cancelling_gradient(), gk = cancelling_gradient();
    HostTensor dq(Dt::F32, {1, 1, kTokens, kHeadDim}), dk(Dt::F32, {1, 1, kTokens, kHeadDim});
    HostTensor cos(Dt::F32, {kTokens, kHeadDim}), sin(Dt::F32, {kTokens, kHeadDim});
    HostTensor w(Dt::F32, {kHeadDim}), wk(Dt::F32, {kHeadDim});
    HostTensor x(Dt::F32, {1, 1, kTokens, kHeadDim}), xk(Dt::F32, {1, 1, kTokens, kHeadDim});
    HostTensor dw(Dt::F32, {kHeadDim}), dwk(Dt::F32, {kHeadDim});
    for (int64_t i = 0; i < cos.numel(); ++i) cos.set_at(i, 1.0), sin.set_at(i, 0.0);
    for (int64_t i = 0; i < kHeadDim; ++i) w.set_at(i, 1.0), wk.set_at(i, 1.0);
    for (int64_t i = 0; i < x.numel(); ++i) x.set_at(i, 1.0), xk.set_at(i, 1.0);
    rope_jit_rope_args a;
    rope_jit_rope_args_init(&a);
    a.backward = 1;
    a.q = g.dl(), a.k = gk.dl(), a.q_out = dq.dl(), a.k_out = dk.dl();
    a.cos = cos.dl(), a.sin = sin.dl();
    a.q_norm_weight = w.dl(), a.k_norm_weight = wk.dl();
    a.q_norm_input = x.dl(), a.k_norm_input = xk.dl();
    a.q_norm_weight_grad = dw.dl(), a.k_norm_weight_grad = dwk.dl();
    REQUIRE(rope_jit_rope(runtime, &a) == ROPE_JIT_OK);
    std::vector<uint8_t> sums = dw.bytes();
    sums.insert(sums.end(), dwk.bytes().begin(), dwk.bytes().end());
    return sums;
}

// The frequency gradient of a backward with angles from inv_freq, on `runtime`.
std::vector<uint8_t> frequency_gradient(rope_jit_runtime* runtime) {
    HostTensor g = cancelling_gradient(), gk = cancelling_gradient();
    HostTensor saved(Dt::F32, {1, 1, kTokens, kHeadDim});
    HostTensor saved_k(Dt::F32, {1, 1, kTokens, kHeadDim});
    for (int64_t i = 0; i < saved.numel(); ++i) saved.set_at(i, 1.0), saved_k.set_at(i, 1.0);
    HostTensor inv_freq(Dt::F32, {kHeadDim / 2}), grad(Dt::F32, {kHeadDim / 2});
    for (int64_t i = 0; i < kHeadDim / 2; ++i) inv_freq.set_at(i, 1e-9);  // angles near 0
    rope_jit_rope_args a;
    rope_jit_rope_args_init(&a);
    a.backward = 1;
    a.q = g.dl(), a.k = gk.dl();
    a.inv_freq = inv_freq.dl();
    a.inv_freq_grad = grad.dl();
    a.q_saved = saved.dl(), a.k_saved = saved_k.dl();
    REQUIRE(rope_jit_rope(runtime, &a) == ROPE_JIT_OK);
    return grad.bytes();
}

template <typename Sums>
void check_same_bits_however_split(Sums sums) {
    const std::vector<uint8_t> expected = sums(rope_test::CpuRuntime(1, false).handle);
    for (const int threads : {2, 3, 8}) {
        CAPTURE(threads);
        rope_test::CpuRuntime cpu(threads, false);
        rope_jit_runtime* runtime = cpu.handle;
        CHECK(sums(runtime) == expected);
        // Beside a call that holds the pool: the whole range in one chunk on this thread.
        std::atomic<bool> stop{false};
        std::thread other([&] {
            while (!stop) norm_weight_gradients(runtime);
        });
        for (int n = 0; n < 20; ++n) CHECK(sums(runtime) == expected);
        stop = true;
        other.join();
    }
}

}  // namespace

TEST_CASE("the CPU QK-norm weight gradients are the same bits at every cpu_threads and beside "
          "another call") {
    check_same_bits_however_split(norm_weight_gradients);
}

TEST_CASE("the CPU frequency gradient is the same bits at every cpu_threads and beside another "
          "call") {
    check_same_bits_however_split(frequency_gradient);
}
