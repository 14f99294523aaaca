// parse_byte_size (common/byte_size.h), the one reader of sizes for ROPE_JIT_CACHE_MAX_BYTES and
// rope-jit-cache --max-bytes: every unit spelling, the 64-bit edges, and what it refuses. The
// expected values are written out as powers of two, not computed by the parser's own table.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "common/byte_size.h"

using rope_jit::ByteSize;
using rope_jit::parse_byte_size;

TEST_CASE("parse_byte_size reads bytes and K/M/G/T in powers of 1024, with B or iB after") {
    const std::pair<const char*, uint64_t> good[] = {
        {"0", 0},
        {"4096", 4096},
        {"007", 7},
        {"00000000000000000000001", 1},  // leading zeros count for nothing
        {"512B", 512},
        {"3k", 3u << 10},
        {"3K", 3u << 10},
        {"3KB", 3u << 10},
        {"3kiB", 3u << 10},
        {"20M", 20u << 20},
        {"20MiB", 20u << 20},
        {"2G", uint64_t(2) << 30},
        {"2GB", uint64_t(2) << 30},
        {"2GiB", uint64_t(2) << 30},
        {"1T", uint64_t(1) << 40},
        {"16777215T", 0xFFFFFF0000000000ull},  // (2^24 - 1) * 2^40, the largest in T
        {"18446744073709551615", UINT64_MAX},
    };
    for (const auto& [text, bytes] : good) {
        CAPTURE(text);
        const ByteSize size = parse_byte_size(text);
        CHECK(size.status == ByteSize::Status::ok);
        CHECK(size.bytes == bytes);
    }
}

TEST_CASE("parse_byte_size refuses what is no size, naming why") {
    const std::pair<const char*, ByteSize::Status> bad[] = {
        {"", ByteSize::Status::not_a_number},
        {"B", ByteSize::Status::not_a_number},
        {"G", ByteSize::Status::not_a_number},
        {"+1", ByteSize::Status::not_a_number},
        {"-1", ByteSize::Status::not_a_number},
        {" 1", ByteSize::Status::not_a_number},
        {"lots", ByteSize::Status::not_a_number},
        {"1 ", ByteSize::Status::unknown_unit},
        {"12 M", ByteSize::Status::unknown_unit},
        {"1.5G", ByteSize::Status::unknown_unit},
        {"1e9", ByteSize::Status::unknown_unit},
        {"2g", ByteSize::Status::unknown_unit},
        {"2m", ByteSize::Status::unknown_unit},
        {"5iB", ByteSize::Status::unknown_unit},
        {"2GBB", ByteSize::Status::unknown_unit},
        {"2Gib", ByteSize::Status::unknown_unit},
        {"2P", ByteSize::Status::unknown_unit},
        {"18446744073709551616", ByteSize::Status::too_large},
        {"99999999999999999999", ByteSize::Status::too_large},
        {"16777216T", ByteSize::Status::too_large},
        {"17179869184G", ByteSize::Status::too_large},
    };
    for (const auto& [text, status] : bad) {
        CAPTURE(text);
        const ByteSize size = parse_byte_size(text);
        CHECK(size.status == status);
        CHECK(size.bytes == 0);
    }
}
