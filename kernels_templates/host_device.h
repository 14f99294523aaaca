// ROPE_JIT_HOST_DEVICE marks the functions that the parameter headers (rope_params.h,
// attention_params.h) share between the host launchers and the kernels NVRTC compiles.
#ifndef ROPE_JIT_HOST_DEVICE_H
#define ROPE_JIT_HOST_DEVICE_H

#if defined(__CUDACC__)
#define ROPE_JIT_HOST_DEVICE __host__ __device__
#else
#define ROPE_JIT_HOST_DEVICE
#endif

// The cos/sin table column of rotation pair `pair`: a full table ([P, R]) of interleaved pairs
// holds pair i at column 2i (its cos repeated at 2i + 1); every other table at column i. The one
// statement of this rule for host code and kernels.
ROPE_JIT_HOST_DEVICE constexpr int table_column(bool table_full, bool interleaved, int pair) {
    return table_full && interleaved ? 2 * pair : pair;
}
// Columns a table row spans for `pairs` rotation pairs (the same rule).
ROPE_JIT_HOST_DEVICE constexpr int table_columns(bool table_full, bool interleaved, int pairs) {
    return table_full && interleaved ? 2 * pairs : pairs;
}

#endif
