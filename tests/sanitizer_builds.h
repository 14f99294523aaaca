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
