#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <random>
#include <string>
#include <vector>

#include "common/sha256.h"

using rope_jit::Sha256;
using rope_jit::sha256_hex;
using rope_jit::sha256_portable;

TEST_CASE("SHA-256 of the FIPS 180-4 example messages matches the published digests") {
    CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    CHECK(sha256_hex(
              "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopq"
              "klmnopqrlmnopqrsmnopqrstnopqrstu") ==
          "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST_CASE("SHA-256 pads correctly at every block boundary") {
    // Lengths around 55/56 (where the length no longer fits the last block) and 64.
    struct Case {
        size_t length;
        const char* digest;
    };
    const Case cases[] = {
        {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
        {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
        {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
        {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
        {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
        {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
        {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
    };
    for (const Case& c : cases) {
        CAPTURE(c.length);
        CHECK(sha256_hex(std::string(c.length, 'a')) == c.digest);
    }
}

TEST_CASE("SHA-256 of one million 'a' fed in uneven pieces matches the published digest") {
    const std::string chunk(1000, 'a');
    Sha256 hasher;
    size_t fed = 0;
    size_t piece = 1;
    while (fed < 1000000) {
        size_t n = std::min({piece, chunk.size(), size_t(1000000) - fed});
        hasher.update(chunk.data(), n);
        fed += n;
        piece = piece * 7 % 997 + 1;  // sizes that straddle block boundaries in every way
    }
    CHECK(hasher.finish_hex() ==
          "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("SHA-256 fed incrementally at random split points equals the one-shot digest") {
    std::mt19937 rng(20240607);
    for (int round = 0; round < 300; ++round) {
        std::string data(rng() % 400, '\0');
        for (char& c : data) c = char(rng());
        CAPTURE(data.size());

        Sha256 hasher;
        size_t at = 0;
        while (at < data.size()) {
            size_t n = rng() % (data.size() - at + 1);
            hasher.update(std::string_view(data).substr(at, n));
            at += n;
        }
        hasher.update(nullptr, 0);
        CHECK(hasher.finish_hex() == sha256_hex(data));
    }
}

TEST_CASE("A Sha256 object hashes a new message after finish") {
    Sha256 hasher;
    hasher.update("something else");
    (void)hasher.finish();
    hasher.update("abc");
    std::array<uint8_t, 32> digest = hasher.finish();
    CHECK(digest[0] == 0xba);
    CHECK(digest[31] == 0xad);
}

TEST_CASE("SHA-256's default path (hardware where the CPU has it) equals the portable path") {
    // Where the CPU has the x86 SHA extensions, the tests above already check the hardware
    // path against published digests; this one compares it with the portable code over many
    // lengths and split points. Without them both sides are the portable code.
    if (!rope_jit::sha256_hardware_available()) {
        MESSAGE("no x86 SHA extensions on this CPU: both sides of this test are portable");
    }
    std::mt19937 rng(20261202);
    auto random_bytes = [&rng](size_t n) {
        std::string data(n, '\0');
        for (char& c : data) c = char(rng());
        return data;
    };
    // Every length through 2000 (all block offsets, short and multi-block runs), then sizes of
    // real cubins in the disk cache, which the fast path exists for.
    std::vector<size_t> lengths;
    for (size_t n = 0; n <= 2000; ++n) lengths.push_back(n);
    for (size_t n : {4096, 65536 + 7, 70001, 263406}) lengths.push_back(n);

    for (size_t length : lengths) {
        CAPTURE(length);
        const std::string data = random_bytes(length);
        const std::array<uint8_t, 32> expected = sha256_portable(data);

        Sha256 whole;
        whole.update(data);
        CHECK(whole.finish() == expected);

        // Uneven pieces: single bytes, odd sizes, and long runs of whole blocks.
        Sha256 pieces;
        size_t at = 0;
        while (at < data.size()) {
            size_t cap = rng() % 4 == 0 ? 1 : rng() % 3 == 0 ? 200 : 5000;
            size_t n = std::min(data.size() - at, size_t(rng() % cap + 1));
            pieces.update(data.data() + at, n);
            at += n;
        }
        CHECK(pieces.finish() == expected);
    }
}

TEST_CASE("SHA-256's portable path matches the published digests") {
    // sha256_portable is the reference of the test above, so it is checked on its own too.
    auto hex = [](const std::array<uint8_t, 32>& digest) {
        static const char kDigits[] = "0123456789abcdef";
        std::string out;
        for (uint8_t byte : digest) {
            out += kDigits[byte >> 4];
            out += kDigits[byte & 15];
        }
        return out;
    };
    CHECK(hex(sha256_portable("")) ==
          "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(hex(sha256_portable("abc")) ==
          "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(hex(sha256_portable(std::string(56, 'a'))) ==
          "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
    CHECK(hex(sha256_portable(std::string(1000000, 'a'))) ==
          "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}
