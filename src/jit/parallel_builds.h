// Builds many kernels at once, as prewarming a model's set does: every recipe through the
// shared builder (jit/kernel_builder.h: disk cache, compile lock, NVRTC) on up to `threads`
// threads, the caller's among them. NVRTC compiles independent programs in parallel, and a
// compile is single-threaded, so a model's set takes about its slowest kernels' time on enough
// cores instead of the sum.
#pragma once

#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_recipe.h"

namespace rope_jit {

// Builds recipes[i] for a device of `target` ("sm_90") into `disk` (may be NULL: the binaries
// are then built and dropped, which still checks that they compile) for every i, on
// min(threads, recipes.size()) threads; threads <= 0: one per hardware thread. The recipes'
// source() and target() are called on those threads. After a failure no new build starts;
// the ones running finish, then the error of the lowest-indexed failed recipe is rethrown,
// prefixed by `names[i]` when names has an entry for it ("specs[3]: ..."). Same entries, and
// the same stats, as building them one after the other.
// `start_order`, when not empty, is a permutation of the indices giving the order in which
// builds start (the slowest first, so that the wall time approaches the slowest kernel's
// rather than ending on one started last); errors are still reported by lowest index.
void build_binaries_parallel(const std::vector<KernelRecipe>& recipes, const std::string& target,
                             const DiskCache* disk, KernelStats& stats, int threads,
                             const std::vector<std::string>& names = {},
                             const std::vector<size_t>& start_order = {});

}  // namespace rope_jit
