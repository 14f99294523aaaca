// Builds kernels that a caller will almost surely ask for soon (training calls a forward's
// backward kernels right after it) on a small pool of background threads, so that the later
// call finds them ready. Each job runs the shared builder (jit/kernel_builder.h), so it takes
// the same compile lock and leaves a disk-cache entry (other processes then get a disk hit).
//
// The binaries also stay in memory (a few, until a call takes them), so that the call reads
// no file; the job's compile (or disk hit) counts in the runtime's compiles (or disk_hits)
// only then: those keep counting the kernels the runtime's calls loaded, once each.
//
// When: build_now queues a recipe's follow-ups as soon as its own build misses the disk cache,
// before its compile starts on the caller's thread, so the backward kernels compile side by
// side with the forward on the other cores rather than after it.
//
// Bounded (background_build_threads: at most one thread per core but the caller's, a fixed
// queue; a full queue refuses), never blocking the caller that submits, cancellable: stop()
// (and the destructor) drops queued jobs and waits for the ones running, since an NVRTC
// compile cannot be interrupted. A failed job is counted and
// forgotten: the real call builds again and reports the error to its caller.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_recipe.h"

namespace rope_jit {

class BackgroundBuilds {
public:
    struct Limits {
        int threads = 1;         // workers, started on the first submit (at least 1)
        size_t max_queued = 16;  // jobs waiting; submit refuses beyond
        size_t max_kept = 16;    // binaries held until a call takes them; the oldest go
    };

    // `disk` (NULL: memory-only) and `stats` must outlive the service.
    BackgroundBuilds(const DiskCache* disk, KernelStats& stats, Limits limits);
    BackgroundBuilds(const DiskCache* disk, KernelStats& stats)
        : BackgroundBuilds(disk, stats, Limits{}) {}
    ~BackgroundBuilds();
    BackgroundBuilds(const BackgroundBuilds&) = delete;
    BackgroundBuilds& operator=(const BackgroundBuilds&) = delete;

    // Queues the build of `recipe` for a device of `target` ("sm_90") and returns at once.
    // false (nothing queued; counted in stats.background_dropped unless it is a duplicate)
    // when the queue is full or the service stopped; also false, uncounted, when the same
    // (spec, target) is already queued, running or kept, or a caller builds or built it
    // through build_now. Never throws.
    bool submit(KernelRecipe recipe, const std::string& target) noexcept;

    // The binary of `recipe` for a device of `target`, as the loader gets it on a memory
    // miss: take()'s, else the builder's (throwing its errors). On a disk-cache miss (a real
    // compile ahead, not a disk hit) the recipe's follow-ups are submitted before that compile
    // starts, so they build in parallel with it; on a hit nothing is submitted.
    KernelBinary build_now(const KernelRecipe& recipe, const std::string& target);

    // Just before a caller builds (spec_json, target) itself. A queued job for it is dropped
    // (the caller builds it now); a running one is waited for (it holds the compile lock
    // anyway). Returns the binary a job built for it (counting the job's compile or disk hit
    // in the stats), once; else nullopt.
    std::optional<KernelBinary> take(const std::string& spec_json, const std::string& target);

    // Blocks until no job is queued or running (tests and benchmarks).
    void wait_idle();

    // Drops the queued jobs, waits for the running ones and joins the workers. Later submits
    // are refused. Idempotent; the destructor calls it.
    void stop() noexcept;

    // Jobs queued or running now.
    size_t pending() const;

private:
    struct Job {
        std::string key;
        KernelRecipe recipe;
        std::string target;
    };
    void worker_loop();
    void submit_follow_ups(const KernelRecipe& recipe, const std::string& target) noexcept;

    const DiskCache* disk_;
    KernelStats& stats_;
    const Limits limits_;

    mutable std::mutex mutex_;
    std::condition_variable wake_;  // workers: a job or stop
    std::condition_variable done_;  // take and wait_idle: a job finished
    std::deque<Job> queue_;
    std::vector<std::string> running_;  // keys being built now
    // Keys build_now built or builds on a caller's thread: a follow-up naming one (the
    // attention backward's prepare kernel, which the forward runs first) is not queued.
    std::set<std::string> caller_built_;
    struct Kept {
        KernelBinary binary;
        uint64_t compile_microseconds = 0;
    };
    std::map<std::string, Kept> kept_;    // results no call took yet, by key
    std::deque<std::string> kept_order_;  // oldest first
    std::vector<std::thread> workers_;
    bool stopping_ = false;
};

// The background threads for a machine of `cores` hardware threads: one per core but the one
// the caller compiles on, at least 1 and at most kMaxBackgroundBuildThreads (a forward's
// backward is at most three kernels; more threads would only compete with the caller's other
// work). 2 cores: 1; 4: 3; 16: 4.
constexpr int kMaxBackgroundBuildThreads = 4;
int background_build_threads(unsigned cores);

// ROPE_JIT_BACKGROUND_BUILDS=0 in the environment: background builds are off whatever the
// config says (unset, empty or 1: as the config says). Read when a runtime is created; any
// other value throws INVALID_ARGUMENT naming the variable.
bool background_builds_disabled_by_env();

}  // namespace rope_jit
