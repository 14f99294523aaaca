// The CPU reference of attention with rotary embeddings fused in: the fallback without a GPU
// and the oracle of every GPU test. It favours exactness and clarity: every product and sum
// in float64, each result rounded once to its dtype; the backward's probabilities from the
// caller's lse and its delta from the caller's out, as the GPU kernels take them. All working
// memory is had before any output is written: a call that runs out of host memory throws
// std::bad_alloc with its outputs untouched.
#pragma once

#include "ops/attention/attention_problem.h"
#include "common/thread_pool.h"

namespace rope_jit {

// Writes out (and lse). Every tensor of `problem` must be host-accessible.
void attention_forward_cpu(const AttentionProblem& problem, ThreadPool& pool);

// Writes dq, dk and dv. Every tensor of `problem` must be host-accessible.
void attention_backward_cpu(const AttentionProblem& problem, ThreadPool& pool);

}  // namespace rope_jit
