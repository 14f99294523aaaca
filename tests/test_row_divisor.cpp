// RowDivisor (kernels_templates/row_divisor.h): the multiply-shift division by heads a token or
// tokens a batch row that rope_norm.cu and rope.cu's bulk path use, against integer division.
#include <doctest/doctest.h>

#include <vector>

#include "row_divisor.h"

TEST_CASE("the kernels' multiply-shift row division matches integer division") {
    // Every divisor a kernel may meet (heads a token, tokens a batch row) up to 2^31 - 1,
    // against the dividends where rounding fails first: multiples of d and their neighbours,
    // and the largest 31-bit ones.
    std::vector<long long> divisors;
    for (long long d = 1; d <= 4096; ++d) divisors.push_back(d);
    for (int bit = 12; bit < 31; ++bit)
        for (long long d : {(1LL << bit) - 1, 1LL << bit, (1LL << bit) + 1, 3LL << (bit - 1)})
            divisors.push_back(d);
    divisors.push_back(0x7fffffffLL);
    long long checked = 0;
    for (const long long d : divisors) {
        const RowDivisor div = row_divisor(d);
        REQUIRE(div.divisor == d);
        std::vector<long long> dividends = {0, 1, d - 1, d, d + 1, 0x7fffffffLL, 0x7ffffffeLL};
        for (long long q : {1LL, 2LL, 3LL, 40LL, 48LL, 4095LL, 65535LL, 1LL << 20}) {
            for (long long delta = -1; delta <= 1; ++delta) {
                const long long n = q * d + delta;
                if (n >= 0 && n <= 0x7fffffffLL) dividends.push_back(n);
            }
        }
        const long long top = 0x7fffffffLL / d * d;  // the last multiple below 2^31
        dividends.insert(dividends.end(), {top - 1, top});
        for (const long long n : dividends) {
            if (n < 0) continue;
            const unsigned got = row_divide(static_cast<unsigned>(n), div);
            if (got != static_cast<unsigned>(n / d)) {
                FAIL_CHECK(n << " / " << d << ": got " << got << ", expected " << n / d);
                break;
            }
            ++checked;
        }
    }
    MESSAGE(checked << " quotients checked");
    // Divisors outside 1 .. 2^31 - 1 are refused (divisor 0: the kernel divides plainly).
    CHECK(row_divisor(0).divisor == 0);
    CHECK(row_divisor(-3).divisor == 0);
    CHECK(row_divisor(1LL << 31).divisor == 0);
}
