// float8 e4m3fn (4 exponent bits, bias 7, 3 mantissa bits, no infinities, NaN 0x7f/0xff,
// largest finite 448) from fp32, as the FP8 outputs of rope_jit_rope_args store it: round to
// nearest, ties to even; saturating (|x| beyond 448, infinities included, gives +-448); NaN
// gives 0x7f. The CPU reference's conversion; the kernels' one is in rope_device.h.
#pragma once

#include <cmath>
#include <cstdint>

namespace rope_jit {

inline uint8_t float_to_e4m3(float x) {
    if (std::isnan(x)) return 0x7f;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const float a = std::fmin(std::fabs(x), 448.0f);
    if (a < 0x1p-6f) {
        // Subnormals (and zero): multiples of 2^-9; 8 * 2^-9 rounds up into the smallest
        // normal, whose code is 8 as well.
        return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));
    }
    int exponent = 0;
    const float mantissa = std::frexp(a, &exponent);  // a = mantissa * 2^exponent, [0.5, 1)
    // 16 * mantissa in [8, 16): 8 + the 3 mantissa bits; a carry to 16 moves to the next
    // binade, which the code's arithmetic does by itself. a <= 448 keeps it below 0x7f.
    const int scaled = int(std::nearbyint(std::ldexp(mantissa, 4)));
    return uint8_t(sign | uint8_t(((exponent - 1 + 7) << 3) + (scaled - 8)));
}

// The value of an e4m3fn code.
inline float e4m3_to_float(uint8_t code) {
    const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
    float value;
    if ((code & 0x7f) == 0x7f)
        value = NAN;
    else if (exponent == 0)
        value = std::ldexp(float(mantissa), -9);
    else
        value = std::ldexp(float(8 + mantissa), exponent - 10);
    return (code & 0x80) ? -value : value;
}

}  // namespace rope_jit
