// Test support: which sanitizer this build runs under, for tests that set limits a sanitizer's
// runtime cannot live with (an address-space limit leaves AddressSanitizer's shadow memory no
// room).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define ROPE_JIT_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ROPE_JIT_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define ROPE_JIT_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ROPE_JIT_TEST_TSAN 1
#endif
#endif

// Whether a sweep that shows each kernel of a list compiles goes on to compile its next one:
// always in an optimized build; under AddressSanitizer, the first two of each sweep, which
// still put the host side of a compile (spec, source, NVRTC's calls, the binary) under the
// sanitizer. NVRTC itself is not instrumented, so compiling the rest there finds nothing that
// the optimized build's run of the same sweep does not, while ASan's allocator makes each
// compile 2-3x slower: such sweeps took half of the sanitized suite's time on CI's 2 cores.
class SweepCompiles {
  public:
    bool next() {
#if defined(ROPE_JIT_TEST_ASAN)
        if (taken_ == kUnderAsan) return false;
#endif
        ++taken_;
        return true;
    }
    // How many kernels the sweep compiled.
    int taken() const { return taken_; }

  private:
    static constexpr int kUnderAsan = 2;
    int taken_ = 0;
};
