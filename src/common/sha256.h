// SHA-256 (FIPS 180-4), self-contained so that cache keys and cache entry checksums need no
// crypto library at build or run time. It hashes public data only, so it makes no attempt to
// be constant-time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rope_jit {

class Sha256 {
public:
    Sha256();

    // Feeds bytes; any number of calls, pieces of any size (including 0).
    void update(const void* data, size_t size);
    void update(std::string_view s);

    // The digest of everything fed since construction or the previous finish(). Resets the
    // object, so the same object can then hash a new message.
    std::array<uint8_t, 32> finish();

    // finish() as 64 lowercase hex characters.
    std::string finish_hex();

private:
    // Runs the compression function over `count` consecutive 64-byte blocks.
    using BlockFunction = void (*)(uint32_t* state, const uint8_t* blocks, size_t count);

    friend std::array<uint8_t, 32> sha256_portable(std::string_view data);
    explicit Sha256(BlockFunction compress_blocks);

    void reset();

    BlockFunction compress_blocks_;  // the hardware one where the CPU has it, else portable
    std::array<uint32_t, 8> state_;
    std::array<uint8_t, 64> buffer_;
    size_t buffered_;       // bytes waiting in buffer_, always < 64 between calls
    uint64_t total_bytes_;  // the message length, needed for the final padding
};

// The SHA-256 of `data` as 64 lowercase hex characters.
std::string sha256_hex(std::string_view data);

// Whether Sha256 uses the x86 SHA extensions on this CPU (decided once, from CPUID). Tests
// and benchmarks report it; nothing else needs it, since both paths give the same digest.
bool sha256_hardware_available();

// The digest of `data` computed with the portable C++ compression function even where the
// hardware one exists: the independent reference that tests compare the default path with.
std::array<uint8_t, 32> sha256_portable(std::string_view data);

}  // namespace rope_jit
