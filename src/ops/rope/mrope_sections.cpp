#include "ops/rope/mrope_sections.h"

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

std::vector<int32_t> pair_axes_from_sections(const int32_t* sections, int32_t num_sections,
                                             bool interleaved, int64_t pairs, const char* name) {
    if (sections == nullptr)
        fail_argument(fmt::format("{}: NULL with {} sections", name, num_sections));
    if (num_sections < 1 || num_sections > kMaxMropeSections)
        fail_argument(fmt::format("{}: expected 1 to {} sections, got {}", name, kMaxMropeSections,
                                  num_sections));
    int64_t total = 0;
    for (int32_t a = 0; a < num_sections; ++a) {
        if (sections[a] < 0)
            fail_argument(fmt::format("{}: section {} is negative ({})", name, a, sections[a]));
        total += sections[a];
    }
    if (total != pairs)
        fail_argument(
            fmt::format("{}: sections sum to {}, but there are {} rotary pairs (rotary_dim / 2); "
                        "each section counts pairs, as Qwen2-VL's mrope_section does",
                        name, total, pairs));

    std::vector<int32_t> axes(size_t(pairs), 0);
    if (!interleaved) {
        int64_t first = 0;
        for (int32_t a = 0; a < num_sections; ++a) {
            for (int64_t i = first; i < first + sections[a]; ++i) axes[size_t(i)] = a;
            first += sections[a];
        }
        return axes;
    }
    // Interleaved: axis a >= 1 owns every A-th pair starting at a, n_a of them; since the
    // sections sum to `pairs`, axis 0 is left with exactly n_0.
    for (int32_t a = 1; a < num_sections; ++a) {
        if (sections[a] == 0) continue;
        const int64_t last = a + int64_t(num_sections) * (sections[a] - 1);
        if (last >= pairs)
            fail_argument(fmt::format(
                "{}: interleaved section {} of {} pairs needs pair {}, but there are only {} "
                "pairs",
                name, a, sections[a], last, pairs));
        for (int64_t k = 0; k < sections[a]; ++k) axes[size_t(a + num_sections * k)] = a;
    }
    return axes;
}

}  // namespace rope_jit
