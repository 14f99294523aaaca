// The launcher's choice of rope.cu's paths over dense rows: the bulk path (RopePlan::bulk_rows,
// rope_bulk_kernel), where a call's rows allow tiles of whole rows to move between global and
// shared memory by the bulk copy engine, and the flat path (RopePlan::flat_rows,
// rope_flat_kernel), where dense rows are walked as one array; the kernels' arguments
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

// Whether `problem` is a call of the kind the flat path takes: q and k, and their outputs, each
// one dense run of rows, not packed, and either
//   - with a head's tokens next to each other ([B, H, S, D] memory) and not also with a token's
//     heads together: any dtype (the direct path reads such buffers in runs of a row, a head
//     plane apart; H200 run DU, session 27: Llama-3-8B 0.905 -> 0.934 of copy, D64
//     interleaved 0.825 -> 0.895), or
//   - with a token's heads together ([B, S, H, D], or one head), 16-bit elements, the whole
//     head rotated and more than one token a sequence. H200 runs DW-DX (session 28), the
//     direct or staged path -> flat: Llama-3-8B 0.932-0.941 -> 0.952-0.953 (fp16 0.944 ->
//     0.954, out of place 0.915 -> 0.932), 1x32768 0.951 -> 0.958, D64 0.889 -> 0.903, D256
//     0.929 -> 0.940, interleaved 0.936 -> 0.959, D96 0.915-0.918 -> 0.919-0.924, D80
//     0.907-0.914 -> 0.903-0.911 (no better). Where it loses: float32 (Llama 0.965 -> 0.94),
//     in-place partial rotary (GPT-NeoX 24/96 0.55 -> 0.54, Phi-2 -0.005; GPT-J and Gemma-4
//     gained 0.01). Decode (one token a sequence) keeps the direct path's launch (B=64: equal).
//     Out-of-place partial rotary goes flat where its plan has flat_copies (16-byte vectors:
//     interleaved pairs, or half style in rows of 4 or 8 vectors, rope_params.h); the
//     other plans drop dense_rows and keep the bulk or staged path.
// Rows times head_dim / 2 under 2^32 (the items a row are at most head_dim / 2).
// A positions tensor is allowed: each item looks its position up while its data loads
// (Llama-3-8B with positions 0.928 -> 0.941, [B, H, S, D] backward 0.890 -> 0.930, run DW).
// make_kernel_spec derives KernelSpec::dense_rows from it.
bool flat_rows_call(const RopeProblem& problem);

// The flat path's arguments for `problem` (a call of `spec`; RopeBulkParams' rows and divisors,
// its tile fields unused), or nothing where it cannot take that path: a plan without
// flat_rows (its spec's dense_rows among its conditions), a call that is not flat_rows_call,
// 2^31 rows or 2^32 items of q or k or more (the kernel counts them in 32 bits).
std::optional<RopeBulkParams> flat_rows_of(const KernelSpec& spec, const RopeProblem& problem);

// The flat path's grid: an item a thread, blocks of kRopeFlatThreads.
RopeBulkLaunch plan_rope_flat_launch(const KernelSpec& spec, const RopeBulkParams& rows);

}  // namespace rope_jit
