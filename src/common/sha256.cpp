#include "common/sha256.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace rope_jit {

namespace {

// First 32 bits of the fractional parts of the cube roots of the first 64 primes.
constexpr std::array<uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// First 32 bits of the fractional parts of the square roots of the first 8 primes.
constexpr std::array<uint32_t, 8> kInitial = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                              0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) {
    return (x >> n) | (x << (32 - n));
}

// The compression function of FIPS 180-4 section 6.2.2, in plain C++, one block at a time.
void compress_portable(uint32_t* state, const uint8_t* blocks, size_t count) {
    for (; count > 0; --count, blocks += 64) {
        const uint8_t* block = blocks;
        uint32_t w[64];
        for (int i = 0; i < 16; ++i) {
            // Big-endian by definition of the algorithm, whatever the host order.
            w[i] = (uint32_t(block[4 * i]) << 24) | (uint32_t(block[4 * i + 1]) << 16) |
                   (uint32_t(block[4 * i + 2]) << 8) | uint32_t(block[4 * i + 3]);
        }
        for (int i = 16; i < 64; ++i) {
            uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int i = 0; i < 64; ++i) {
            uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
            uint32_t ch = (e & f) ^ (~e & g);
            uint32_t t1 = h + s1 + ch + kRound[i] + w[i];
            uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
            uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
            uint32_t t2 = s0 + maj;
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_JIT_SHA256_X86 1

// The same compression with the x86 SHA extensions, about five times faster (the disk cache
// checksums every cubin it loads). Compiled for SHA and SSE4.1 only here, and called only when
// CPUID reports both, so the rest of the library keeps the baseline x86-64 instruction set.
//
// sha256rnds2 keeps the eight working variables in two registers, named by their dwords from
// high to low: ABEF = {a, b, e, f} and CDGH = {c, d, g, h}. It runs two rounds, taking
// W[t] + K[t] and W[t+1] + K[t+1] from the low two dwords of its third operand, and returns
// the new ABEF; the new CDGH is the old ABEF, because after two rounds c, d, g, h are the
// previous a, b, e, f.
#define ROPE_JIT_SHA_TARGET __attribute__((target("sha,sse4.1")))

// Four rounds starting at round t, whose message words W[t..t+3] are in `w` (W[t] lowest).
ROPE_JIT_SHA_TARGET inline void four_rounds(__m128i& abef, __m128i& cdgh, __m128i w, int t) {
    __m128i wk = _mm_add_epi32(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(&kRound[t])));
    cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);  // cdgh now holds the new ABEF
    wk = _mm_shuffle_epi32(wk, 0x0e);              // the upper two words down for rounds t+2, t+3
    abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);  // roles swap back: abef is ABEF again
}

// The next four message words W[t..t+3] from the previous sixteen, held four to a register,
// oldest first (w0 = W[t-16..t-13] ... w3 = W[t-4..t-1]):
//   W[t] = sigma1(W[t-2]) + W[t-7] + sigma0(W[t-15]) + W[t-16].
// sha256msg1 adds the sigma0 terms, the byte shift of w3:w2 lines up W[t-7..t-4], and
// sha256msg2 adds the sigma1 terms (chaining W[t], W[t+1] into W[t+2], W[t+3]).
ROPE_JIT_SHA_TARGET inline __m128i next_words(__m128i w0, __m128i w1, __m128i w2, __m128i w3) {
    __m128i x = _mm_add_epi32(_mm_sha256msg1_epu32(w0, w1), _mm_alignr_epi8(w3, w2, 4));
    return _mm_sha256msg2_epu32(x, w3);
}

ROPE_JIT_SHA_TARGET void compress_sha_ni(uint32_t* state, const uint8_t* blocks, size_t count) {
    // Swaps the bytes of each 32-bit word: message words are big-endian.
    const __m128i byte_swap = _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3);

    // state[] is {a..h} in memory order; reversing each half gives {d,c,b,a} and {h,g,f,e}
    // from low dword to high, whose upper and lower halves pair into ABEF and CDGH.
    __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<__m128i*>(state)), 0x1b);
    __m128i efgh =
        _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<__m128i*>(state + 4)), 0x1b);
    __m128i abef = _mm_unpackhi_epi64(efgh, abcd);
    __m128i cdgh = _mm_unpacklo_epi64(efgh, abcd);

    for (; count > 0; --count, blocks += 64) {
        const __m128i abef_in = abef, cdgh_in = cdgh;
        const __m128i* in = reinterpret_cast<const __m128i*>(blocks);
        __m128i w0 = _mm_shuffle_epi8(_mm_loadu_si128(in + 0), byte_swap);
        __m128i w1 = _mm_shuffle_epi8(_mm_loadu_si128(in + 1), byte_swap);
        __m128i w2 = _mm_shuffle_epi8(_mm_loadu_si128(in + 2), byte_swap);
        __m128i w3 = _mm_shuffle_epi8(_mm_loadu_si128(in + 3), byte_swap);
        four_rounds(abef, cdgh, w0, 0);
        four_rounds(abef, cdgh, w1, 4);
        four_rounds(abef, cdgh, w2, 8);
        four_rounds(abef, cdgh, w3, 12);
        // Rounds 16..63: each register is replaced by the words four registers later.
        for (int t = 16; t < 64; t += 16) {
            w0 = next_words(w0, w1, w2, w3);
            four_rounds(abef, cdgh, w0, t);
            w1 = next_words(w1, w2, w3, w0);
            four_rounds(abef, cdgh, w1, t + 4);
            w2 = next_words(w2, w3, w0, w1);
            four_rounds(abef, cdgh, w2, t + 8);
            w3 = next_words(w3, w0, w1, w2);
            four_rounds(abef, cdgh, w3, t + 12);
        }
        abef = _mm_add_epi32(abef, abef_in);
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }

    // Back to memory order: the upper halves give {d,c,b,a}, the lower ones {h,g,f,e}.
    abcd = _mm_shuffle_epi32(_mm_unpackhi_epi64(cdgh, abef), 0x1b);
    efgh = _mm_shuffle_epi32(_mm_unpacklo_epi64(cdgh, abef), 0x1b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(state), abcd);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), efgh);
}

#undef ROPE_JIT_SHA_TARGET

// SHA: CPUID leaf 7 subleaf 0, EBX bit 29. SSE4.1: leaf 1, ECX bit 19 (it includes SSSE3's
// byte shuffle and alignr).
bool cpu_has_sha_ni() {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 19))) return false;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;  // leaf 7 absent
    return (ebx & (1u << 29)) != 0;
}
#endif

bool hardware_available() {
#if defined(ROPE_JIT_SHA256_X86)
    static const bool available = cpu_has_sha_ni();
    return available;
#else
    return false;
#endif
}

using BlockFunction = void (*)(uint32_t* state, const uint8_t* blocks, size_t count);

// Chosen once per process: the CPU does not change under us.
BlockFunction default_block_function() {
#if defined(ROPE_JIT_SHA256_X86)
    if (hardware_available()) return compress_sha_ni;
#endif
    return compress_portable;
}

std::string hex(const std::array<uint8_t, 32>& digest) {
    static const char kDigits[] = "0123456789abcdef";
    std::string out(64, '0');
    for (size_t i = 0; i < digest.size(); ++i) {
        out[2 * i] = kDigits[digest[i] >> 4];
        out[2 * i + 1] = kDigits[digest[i] & 0xf];
    }
    return out;
}

}  // namespace

Sha256::Sha256() : Sha256(default_block_function()) {}

Sha256::Sha256(BlockFunction compress_blocks) : compress_blocks_(compress_blocks) {
    reset();
}

void Sha256::reset() {
    state_ = kInitial;
    buffer_.fill(0);
    buffered_ = 0;
    total_bytes_ = 0;
}

void Sha256::update(const void* data, size_t size) {
    if (size == 0) return;  // data may be null for an empty piece
    const uint8_t* bytes = static_cast<const uint8_t*>(data);
    total_bytes_ += size;
    if (buffered_ > 0) {
        size_t take = std::min(size, buffer_.size() - buffered_);
        std::memcpy(buffer_.data() + buffered_, bytes, take);
        buffered_ += take;
        bytes += take;
        size -= take;
        if (buffered_ < buffer_.size()) return;
        compress_blocks_(state_.data(), buffer_.data(), 1);
        buffered_ = 0;
    }
    // Whole blocks straight from the caller's memory, all in one call: no copy for large
    // inputs, and the hardware path keeps its state in registers across the whole run.
    const size_t whole = size / 64;
    if (whole > 0) {
        compress_blocks_(state_.data(), bytes, whole);
        bytes += whole * 64;
        size -= whole * 64;
    }
    if (size > 0) {
        std::memcpy(buffer_.data(), bytes, size);
        buffered_ = size;
    }
}

void Sha256::update(std::string_view s) {
    update(s.data(), s.size());
}

std::array<uint8_t, 32> Sha256::finish() {
    const uint64_t bit_length = total_bytes_ * 8;
    // Padding: 0x80, zeros up to 56 mod 64, then the bit length big-endian.
    uint8_t pad[72] = {0x80};
    size_t pad_size = (buffered_ < 56 ? 56 : 120) - buffered_;
    for (int i = 0; i < 8; ++i) pad[pad_size + i] = uint8_t(bit_length >> (56 - 8 * i));
    update(pad, pad_size + 8);

    std::array<uint8_t, 32> digest;
    for (int i = 0; i < 8; ++i) {
        digest[4 * i] = uint8_t(state_[i] >> 24);
        digest[4 * i + 1] = uint8_t(state_[i] >> 16);
        digest[4 * i + 2] = uint8_t(state_[i] >> 8);
        digest[4 * i + 3] = uint8_t(state_[i]);
    }
    reset();
    return digest;
}

std::string Sha256::finish_hex() {
    return hex(finish());
}

std::string sha256_hex(std::string_view data) {
    Sha256 hasher;
    hasher.update(data);
    return hasher.finish_hex();
}

bool sha256_hardware_available() {
    return hardware_available();
}

std::array<uint8_t, 32> sha256_portable(std::string_view data) {
    Sha256 hasher(compress_portable);
    hasher.update(data);
    return hasher.finish();
}

}  // namespace rope_jit
