// Frequency builders and angle tables: the inverse frequencies of HF transformers' rope types
// and of rotary-embedding-torch's RotaryEmbedding, and cos/sin/xPos tables built from them.
// The public header (section "Frequency builders and angle tables") states every formula;
// this file implements them in float64. Host-only: no runtime, no device.
#pragma once

#include <cstddef>
#include <vector>

#include "rope_jit/rope_jit.h"

namespace rope_jit {

struct Frequencies {
    std::vector<double> inv_freq;
    double attention_factor = 1.0;
};

// The n inverse frequencies and the attention factor of `config`. Throws
// Error(INVALID_ARGUMENT) naming the field when the config does not define them.
Frequencies compute_frequencies(const rope_jit_freq_config& config, size_t n);

// Refuses outputs of rope_jit_inv_freq (inv_freq[0..n), *attention_factor) that overlap each
// other or config's factor lists. n is the checked count (compute_frequencies first).
void check_inv_freq_outputs(const rope_jit_freq_config& config, const float* inv_freq, size_t n,
                            const float* attention_factor);

// Fills the given tables (any may be NULL, not all). Checks everything before writing, so a
// failure writes nothing. Throws Error(INVALID_ARGUMENT) naming the argument.
void fill_rope_tables(const rope_jit_table_config& config, const DLTensor* cos, const DLTensor* sin,
                      const DLTensor* xpos_scale);

}  // namespace rope_jit
