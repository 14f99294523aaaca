// A size in bytes as people type it: "1073741824", "500K", "20M", "2G", "1T", with an optional
// "B" or "iB" after the letter ("2GB", "2GiB"); every letter a power of 1024. One parser for
// $ROPE_JIT_CACHE_MAX_BYTES and rope-jit-cache's --max-bytes, so a value one takes the other
// takes too.
#pragma once

#include <cstdint>
#include <string_view>

namespace rope_jit {

struct ByteSize {
    enum class Status { ok, not_a_number, unknown_unit, too_large };
    Status status = Status::not_a_number;
    uint64_t bytes = 0;
};

// The unit letters and their powers of 1024 (k is K's lower-case spelling).
struct ByteSizeUnit {
    char letter;
    int shift;
};
inline constexpr ByteSizeUnit kByteSizeUnits[] = {
    {'K', 10}, {'k', 10}, {'M', 20}, {'G', 30}, {'T', 40}};

inline ByteSize parse_byte_size(std::string_view text) {
    size_t digits = 0;
    while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
    if (digits == 0) return {ByteSize::Status::not_a_number, 0};
    std::string_view unit = text.substr(digits);
    int shift = -1;
    if (unit.empty() || unit == "B") {
        shift = 0;
    } else {
        for (const ByteSizeUnit& known : kByteSizeUnits) {
            const std::string_view rest = unit.substr(1);
            if (unit[0] == known.letter && (rest.empty() || rest == "B" || rest == "iB")) {
                shift = known.shift;
            }
        }
    }
    if (shift < 0) return {ByteSize::Status::unknown_unit, 0};
    // Digit by digit, so that leading zeros cost nothing and 2^64 - 1 itself is taken; a
    // number or a shift past 64 bits would wrap to a tiny size.
    uint64_t number = 0;
    for (char digit : text.substr(0, digits)) {
        const uint64_t value = uint64_t(digit - '0');
        if (number > (UINT64_MAX - value) / 10) return {ByteSize::Status::too_large, 0};
        number = number * 10 + value;
    }
    if (number > (UINT64_MAX >> shift)) return {ByteSize::Status::too_large, 0};
    return {ByteSize::Status::ok, number << shift};
}

}  // namespace rope_jit
