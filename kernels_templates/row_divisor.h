// Division of row indices by a divisor fixed for a launch (heads a token, tokens a batch row),
// shared by the host, which prepares the divisor once, and the kernels that divide by it
// (rope_norm.cu's runs, rope.cu's bulk path). Plain C++ only.
#ifndef ROPE_JIT_ROW_DIVISOR_H
#define ROPE_JIT_ROW_DIVISOR_H

#include "host_device.h"

// Division by d (1 <= d < 2^31) of any n < 2^31 as (n * mul) >> shift: shift = 31 + l with
// 2^l >= d, mul = ceil(2^shift / d) < 2^32, whose error mul * d - 2^shift < d <= 2^(shift - 31)
// keeps every quotient of a 31-bit n exact (Granlund and Montgomery). A multiply and a shift
// instead of the ~20 dependent instructions of a division by a run-time value (and the
// reciprocal it computes first), which would sit on every row's path before its first load.
// divisor 0: none (d out of range; a kernel given one divides plainly or not at all).
struct RowDivisor {
    long long divisor;
    unsigned mul;
    int shift;
};
ROPE_JIT_HOST_DEVICE constexpr RowDivisor row_divisor(long long d) {
    if (d <= 0 || d > 0x7fffffffLL) return RowDivisor{0, 0, 0};
    int l = 0;
    while ((1LL << l) < d) ++l;
    const unsigned long long power = 1ULL << (31 + l);
    return RowDivisor{d, static_cast<unsigned>((power + d - 1) / d), 31 + l};
}
ROPE_JIT_HOST_DEVICE constexpr unsigned row_divide(unsigned n, RowDivisor d) {
    return static_cast<unsigned>((static_cast<unsigned long long>(n) * d.mul) >> d.shift);
}

#endif
