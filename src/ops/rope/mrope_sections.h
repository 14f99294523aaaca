// Multi-section positions (M-RoPE, axial RoPE): which position axis each rotary pair reads.
// Qwen2-VL splits the R/2 pairs into contiguous sections (mrope_section), Qwen3-VL interleaves
// them, rotary-embedding-torch's get_axial_freqs concatenates one block per axis (contiguous
// sections of equal size). The rope op and the table builder share this one definition.
#pragma once

#include <cstdint>
#include <vector>

namespace rope_jit {

// The most sections (position axes) a call may have. Small and fixed so that a GPU kernel can
// take the split as a fixed-size parameter.
constexpr int32_t kMaxMropeSections = 8;

// Checks a split of `pairs` rotary pairs into num_sections sections and returns the axis of
// every pair ([pairs] values in [0, num_sections)):
//   contiguous:  pairs [0, n0) -> axis 0, [n0, n0 + n1) -> axis 1, ...
//   interleaved: axis a >= 1 takes pairs a, a + A, ..., a + A * (n_a - 1); axis 0 the rest.
// Sections are >= 0 and sum to `pairs`. Throws Error(INVALID_ARGUMENT) naming `name` (the
// argument holding the sections) otherwise.
std::vector<int32_t> pair_axes_from_sections(const int32_t* sections, int32_t num_sections,
                                             bool interleaved, int64_t pairs, const char* name);

}  // namespace rope_jit
