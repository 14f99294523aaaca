// libFuzzer target: parse_cache_entry over arbitrary bytes, as a hostile or damaged cache file
// would present them. It must never read outside the bytes, never crash, and accept only what
// serialize_cache_entry would write back byte for byte.
//
// The first input byte picks a mode, the rest is the file:
//   bit 0: patch the checksum field before parsing (when the lengths allow), so inputs get
//          past the SHA-256 check that random bytes never pass, and the accepting path runs;
//   bit 1: expect a key other than the one echoed in the file (the key echo check);
//   bit 2: instead, serialize an entry made of the rest (spec JSON, then payload, split at
//          the second byte) and check it parses back equal, and that flipping any one bit
//          of the file (bit 3 set; which bit from the third byte) makes it rejected.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "cache/disk_cache.h"
#include "common/sha256.h"

namespace {

constexpr size_t kHeadBytes = 8 + 4 + 64 + 4;  // magic, format, key echo, spec length
constexpr size_t kChecksumBytes = 32;

uint32_t read_u32(const std::string& bytes, size_t at) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | uint8_t(bytes[at + size_t(i)]);
    return v;
}

// Writes the checksum the format asks for into `file`, when its lengths leave room for it.
void patch_checksum(std::string& file) {
    if (file.size() < kHeadBytes) return;
    const uint64_t spec_size = read_u32(file, kHeadBytes - 4);
    const uint64_t checksum_at = kHeadBytes + spec_size + 8;
    if (checksum_at + kChecksumBytes > file.size()) return;
    rope_jit::Sha256 hasher;
    hasher.update(std::string_view(file).substr(0, size_t(checksum_at)));
    hasher.update(std::string_view(file).substr(size_t(checksum_at + kChecksumBytes)));
    const auto digest = hasher.finish();
    std::memcpy(&file[size_t(checksum_at)], digest.data(), kChecksumBytes);
}

bool is_key_hex(std::string_view text) {
    if (text.size() != 64) return false;
    for (char c : text)
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    return true;
}

}  // namespace

// Round trip of a well-formed entry, and rejection of every single-bit corruption of it.
void check_round_trip(const uint8_t* data, size_t size) {
    if (size < 3) return;
    const uint8_t mode = data[0];
    const size_t split = std::min<size_t>(data[1], size - 3);
    const size_t flip = data[2];
    const rope_jit::CacheEntryId id{std::string(64, 'c'), "13.0", "sm_90", "cubin"};
    rope_jit::CacheEntry entry;
    entry.spec_json.assign(reinterpret_cast<const char*>(data + 3), split);
    entry.payload.assign(reinterpret_cast<const char*>(data + 3 + split),
                         reinterpret_cast<const char*>(data + size));
    std::string file = rope_jit::serialize_cache_entry(id, entry);
    std::string problem;
    const auto parsed = rope_jit::parse_cache_entry(id, file, &problem);
    if (!parsed || parsed->spec_json != entry.spec_json || parsed->payload != entry.payload)
        __builtin_trap();
    if (mode & 8) {
        const size_t bit = (flip * 7919u + size) % (file.size() * 8);
        file[bit / 8] = char(file[bit / 8] ^ (1 << (bit % 8)));
        if (rope_jit::parse_cache_entry(id, file, &problem)) __builtin_trap();
    }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    const uint8_t mode = data[0];
    if (mode & 4) {
        check_round_trip(data, size);
        return 0;
    }
    std::string file(reinterpret_cast<const char*>(data + 1), size - 1);
    if (mode & 1) patch_checksum(file);

    rope_jit::CacheEntryId id{std::string(64, 'a'), "13.0", "sm_90", "cubin"};
    if (file.size() >= 76 && is_key_hex(std::string_view(file).substr(12, 64))) {
        id.key_hex = file.substr(12, 64);
        if (mode & 2) id.key_hex[0] = id.key_hex[0] == '0' ? '1' : '0';
    }

    // The parser sees exactly the file's bytes in a buffer of their size, so ASan catches
    // any read past the end.
    std::string problem;
    const auto entry = rope_jit::parse_cache_entry(id, file, &problem);
    if (!entry) {
        if (problem.empty()) __builtin_trap();  // a rejection must say why
        return 0;
    }
    // Accepted: it must be exactly what the writer produces for this entry.
    if (rope_jit::serialize_cache_entry(id, *entry) != file) __builtin_trap();
    return 0;
}
