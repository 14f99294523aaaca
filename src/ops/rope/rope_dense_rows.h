// The launcher's choice of rope.cu's paths over dense rows: the bulk path (RopePlan::bulk_rows,
// rope_bulk_kernel), where a call's rows allow tiles of whole rows to move between global and
// shared memory by the bulk copy engine, and the flat path (RopePlan::flat_rows,
// rope_flat_kernel), where [B, H, S, D] rows are walked as one array; the kernels' arguments
// for them, and their launches.
#pragma once

#include <cstdint>
#include <optional>

#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_problem.h"
#include "rope_params.h"

namespace rope_jit {

// The bulk path's arguments for `problem` (a call of `spec`) on a device of compute capability
// `compute_capability` (90 for 9.0), or nothing where it cannot take that path: a plan without
// bulk_rows; a device before sm_90 (no bulk copy engine); rows of q or k that are not one dense
// run in memory, in the same order ([B, S, H, D] or packed: a token's heads next to each other;
// [B, H, S, D]: a head's tokens), with an output laid out exactly like its input; an address
// not 16-byte aligned or a row not a multiple of 16 bytes (the engine's unit); a row over a
// tile; 2^31 rows or more (the kernel splits a row index in 32 bits).
std::optional<RopeBulkParams> bulk_rows_of(const KernelSpec& spec, const RopeProblem& problem,
                                           int compute_capability);

// The bulk path's grid: kRopeBulkBlocksPerSm blocks a multiprocessor (fewer where there are
// fewer tiles) of kRopeBulkThreads threads, each with its barriers and kRopeBulkStages tiles
// of shared memory.
struct RopeBulkLaunch {
    int64_t blocks = 0, threads = 0;
    unsigned shared_bytes = 0;
};
RopeBulkLaunch plan_rope_bulk_launch(const RopeBulkParams& bulk, int64_t sms);

// Whether `problem`'s q and k, and their outputs, lie in [B, H, S, D] memory the flat path
// can walk: each one dense run of rows with a head's tokens next to each other, and not also
// with a token's heads together (one head, or one token: the direct path reads those rows in
// one run already); no positions tensor (each item would look its position up) and no packed
// batch. make_kernel_spec derives KernelSpec::head_major from it.
bool head_major_rows(const RopeProblem& problem);

// The flat path's arguments for `problem` (a call of `spec`; RopeBulkParams' rows and divisors,
// its tile fields unused), or nothing where it cannot take that path: a plan without
// flat_rows (its spec's head_major among its conditions), rows that are not head_major_rows,
// 2^31 rows or 2^32 items of q or k or more (the kernel counts them in 32 bits).
std::optional<RopeBulkParams> flat_rows_of(const KernelSpec& spec, const RopeProblem& problem);

// The flat path's grid: an item a thread, blocks of kRopeFlatThreads.
RopeBulkLaunch plan_rope_flat_launch(const KernelSpec& spec, const RopeBulkParams& rows);

}  // namespace rope_jit
