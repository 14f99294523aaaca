// The RoPE launcher: runs a checked RopeProblem whose tensors live on a GPU. Per call it takes
// the launch context from the device layer (cuda/cuda_devices.h), the kernel for the
// problem's spec from the kernel loader (cuda/kernel_loader.h), fills the kernel's parameters,
// sizes the launch (rope_params.h) and launches on the caller's stream. It never
// synchronizes, allocates or creates contexts on that path, so calls can be captured in CUDA
// graphs.
#pragma once

#include <cstdint>

#include "cuda/cuda_devices.h"
#include "cuda/kernel_loader.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_problem.h"
#include "rope_params.h"

namespace rope_jit {

// The recipe of `spec`; a forward's names its backward (the same spec, direction flipped) as
// a follow-up, which the runtime builds in the background once the forward compiled
// (jit/background_builds.h): training calls it right after.
KernelRecipe rope_recipe_with_backward(const KernelSpec& spec);

// The launch geometry of a rope kernel (rope_block_fit in rope_params.h): blocks of
// tokens_per_block tokens, `threads` threads and `shared_bytes` of dynamic shared memory.
// heads_k is 0 without k; units = batch * the longer of q's and k's sequences; sms = the
// device's multiprocessors; token_rows_adjacent: a token's heads lie closer together than its
// tokens (token_rows_adjacent below). Throws Error(UNSUPPORTED) when one token's shared memory
// or the grid exceeds a launch.
struct RopeLaunch {
    int64_t blocks = 0, threads = 0;
    unsigned shared_bytes = 0;
    int tokens_per_block = 0;
    // One token a block, each thread resolving its own rows (RopeKernelParams::direct).
    bool direct = false;
    // The direct path launched as the module's second entry, rope_direct_kernel
    // (RopePlan::direct_entry); else rope_kernel.
    bool direct_entry = false;
    // The staged path's items ordered (head, token, chunk): a [B, H, S, D] buffer's tokens
    // (!token_rows_adjacent) read one head's consecutive rows (RopeKernelParams::items_by_head).
    bool items_by_head = false;
};
RopeLaunch plan_rope_launch(const KernelSpec& spec, int64_t heads_q, int64_t heads_k, int64_t units,
                            int64_t sms, bool token_rows_adjacent);

// Whether q's (and k's, when given) heads of a token lie closer together in memory than its
// tokens: [B, S, H, D] and packed [T, H, D] buffers, not [B, H, S, D] ones (as [B, H, S, D]
// views, head stride below token stride, or a single head).
bool token_rows_adjacent(const TensorRef& q, const TensorRef* k);

// The launch geometry of a QK-norm kernel (rope_norm.cu, rope_norm_params.h): `warps` warps a
// block, each normalizing 32 / lanes of the `rows` (token, head) rows at a time (the forward
// with many rows: runs of `run` rows a group, a block per set of runs; else grid-stride). Throws
// Error(UNSUPPORTED) when the weight gradients do not fit the shared memory of a block.
struct RopeNormLaunch {
    int64_t blocks = 0, threads = 0;
    unsigned shared_bytes = 0;
    int warps = 0;
    int run = 1;  // rows a lane group takes at once (RopeNormParams::run)
};
// What a QK-norm call normalizes: `units` tokens (batch x the longer sequence) of heads_q rows
// of q, heads_k of k and heads_v of v (copied into the KV cache).
struct RopeNormRows {
    int64_t units = 0, heads_q = 0, heads_k = 0, heads_v = 0;
};
RopeNormLaunch plan_rope_norm_launch(const KernelSpec& spec, const RopeNormRows& rows,
                                     int64_t sms);

class RopeCuda {
public:
    // `devices`, `kernels` and `stats` must outlive the launcher. `programmatic_launch`:
    // whether the runtime asks for programmatic launches (programmatic_launch_requested).
    RopeCuda(CudaDevices& devices, KernelLoader& kernels, KernelStats& stats, bool debug_checks,
             bool programmatic_launch);
    RopeCuda(const RopeCuda&) = delete;
    RopeCuda& operator=(const RopeCuda&) = delete;

    // Enqueues the problem on `stream` (a CUstream; NULL = legacy default stream).
    void run(const RopeProblem& problem, void* stream);

private:
    void check_positions_on_device(const RopeProblem& problem, CUstream stream);
    // Whether this call's launch of `kernel` is programmatic (rope_jit_config.
    // programmatic_launch, where the device, the kernel's architecture and the driver take it:
    // launches_programmatically); the kernel's `programmatic` flag and the launch follow the
    // one answer.
    bool launches_programmatically(const RopeProblem& problem, const LoadedKernel& kernel) const;
    // The launch of rope.cu's paths over dense rows, from run(): the bulk path's
    // (rope_bulk_kernel, where bulk_rows_of allows it) or the flat path's (rope_flat_kernel,
    // where flat_rows_of does), the module's second entry; `params` the call's arguments,
    // `rows` its rows, `shape` their grid, `what` the launch as errors name it (a literal: no
    // string is built on the launch path).
    void run_rows(const RopeKernelParams& params, const RopeBulkParams& rows,
                  const RopeBulkLaunch& shape, const LoadedKernel& kernel, bool programmatic,
                  CUstream stream, const char* what);
    // The QK-norm kernel's launch (spec.qk_norm), from run().
    void run_norm(const RopeProblem& problem, const KernelSpec& spec, const LoadedKernel& kernel,
                  CUstream stream);

    CudaDevices& devices_;
    KernelLoader& kernels_;
    KernelStats& stats_;
    bool debug_checks_;
    bool programmatic_launch_;
};

}  // namespace rope_jit
