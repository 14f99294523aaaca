// fp16 and bf16 <-> fp32 conversions, header-only so that the CPU reference, the tools and
// the tests all convert exactly the same way (round to nearest even, NaN stays NaN).
#pragma once

#include <cstdint>
#include <cstring>

namespace rope_jit {

inline uint32_t float_bits(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}

inline float bits_float(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// bfloat16 is the upper half of a float32.
inline float bf16_to_float(uint16_t value) {
    return bits_float(uint32_t(value) << 16);
}

inline uint16_t float_to_bf16(float value) {
    uint32_t bits = float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);  // quiet NaN
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t((bits + rounding) >> 16);
}

inline float fp16_to_float(uint16_t value) {
    uint32_t sign = uint32_t(value & 0x8000u) << 16;
    uint32_t exponent = (value >> 10) & 0x1fu;
    uint32_t mantissa = value & 0x3ffu;
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
    if (exponent == 0) {
        // Subnormal (or zero): value = mantissa * 2^-24, exact in fp32.
        float magnitude = float(mantissa) * (1.0f / 16777216.0f);
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float value) {
    uint32_t bits = float_bits(value);
    uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
    if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (magnitude < 0x38800000u) {
        // Result is subnormal in fp16: round magnitude / 2^-24 to an integer, ties to even.
        // Adding 0.5f (= 2^-1) aligns the fp16 subnormal grid with fp32's last mantissa bits.
        float scaled = bits_float(magnitude) + 0.5f;
        return uint16_t(sign | uint16_t(float_bits(scaled) - float_bits(0.5f)));
    }
    // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
    uint32_t rebased = magnitude - (112u << 23);
    uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
    return uint16_t(sign | uint16_t((rebased + rounding) >> 13));
}

// `value` rounded to a float toward zero, with the last mantissa bit set when that was
// inexact ("round to odd"). Rounding the result to fp16 or bf16 (nearest even, 13 or 16 bits
// fewer) then rounds `value` once: through the nearest float instead, a double just above a
// halfway point could land on it and go to even (off by one unit in the last place).
inline float float_round_to_odd(double value) {
    float nearest = float(value);
    if (double(nearest) == value || value != value || nearest - nearest != 0.0f)
        return nearest;  // exact, NaN, inf
    if ((nearest < 0.0f ? -double(nearest) : double(nearest)) > (value < 0.0 ? -value : value))
        nearest = bits_float(float_bits(nearest) - 1u);  // one step toward zero (same sign)
    return bits_float(float_bits(nearest) | 1u);
}

inline uint16_t double_to_fp16(double value) {
    return float_to_fp16(float_round_to_odd(value));
}
inline uint16_t double_to_bf16(double value) {
    return float_to_bf16(float_round_to_odd(value));
}

}  // namespace rope_jit
