// A wall-clock stopwatch for the runtime's timing counters (rope_jit_stats) and compile times.
#pragma once

#include <chrono>
#include <cstdint>

namespace rope_jit {

class Stopwatch {
public:
    double milliseconds() const {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count();
    }
    uint64_t microseconds() const {
        return uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::steady_clock::now() - start_)
                            .count());
    }

private:
    std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace rope_jit
