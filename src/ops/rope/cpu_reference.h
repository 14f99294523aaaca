// The CPU reference: executes a checked RopeProblem on host memory. It is the fallback when
// no GPU is present and the oracle every GPU test compares against, so it favours exactness
// (fp32 arithmetic, fp64 angles from inv_freq) and clarity; rows are processed with
// unit-stride inner loops the compiler vectorizes, tokens split across the pool's threads.
#pragma once

#include "ops/rope/rope_problem.h"
#include "common/thread_pool.h"

namespace rope_jit {

// Requires every tensor of `problem` to be host-accessible and its positions checked
// (check_positions_on_host). Writes q_out (and k_out).
void rope_cpu(const RopeProblem& problem, ThreadPool& pool);

}  // namespace rope_jit
