#include "jit/background_builds.h"

#include <algorithm>
#include <set>

#include "common/env_switch.h"
#include "common/error.h"

namespace rope_jit {

namespace {

// Every live service, so that a process that exits without freeing its runtime (Python's
// default runtime, a leaked handle) first stops them: a compile still running while the
// statics of this library and of NVRTC are destroyed would crash the exit. Never destroyed.
struct Registry {
    std::mutex mutex;  // live
    std::set<BackgroundBuilds*> live;
    // The hook's flags have their own mutex: a worker registers after its compile while
    // stop_all_at_exit may hold `mutex`, waiting to join that very worker.
    std::mutex hook_mutex;
    bool hooked = false;
    bool hooked_after_compile = false;
};
Registry& registry() {
    static Registry* instance = new Registry;
    return *instance;
}

void stop_all_at_exit() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (BackgroundBuilds* service : r.live) service->stop();
}

// Exit handlers run in the reverse order of registration, and NVRTC registers the destructors
// of its own statics during its first compile. The first submit now comes before the forward's
// compile, so possibly before NVRTC's first: the hook is registered there, and again once a
// compile has finished (after_compile), which puts a registration after NVRTC's, so that one
// runs before those destructors. Stopping twice is harmless (stop() is idempotent).
void hook_exit(bool after_compile) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.hook_mutex);
    bool& hooked = after_compile ? r.hooked_after_compile : r.hooked;
    if (!hooked) hooked = std::atexit(stop_all_at_exit) == 0;
}

std::string job_key(const std::string& spec_json, const std::string& target) {
    return target + '\n' + spec_json;
}

}  // namespace

int background_build_threads(unsigned cores) {
    return std::clamp(int(cores) - 1, 1, kMaxBackgroundBuildThreads);
}

bool background_builds_disabled_by_env() {
    // (Only "0" was read: "off" or "false" meant on, silently: adversarial pass, session 47.)
    return env_switch("ROPE_JIT_BACKGROUND_BUILDS") == std::optional<bool>(false);
}

BackgroundBuilds::BackgroundBuilds(const DiskCache* disk, KernelStats& stats, Limits limits)
    : disk_(disk), stats_(stats), limits_(limits) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.live.insert(this);
}

BackgroundBuilds::~BackgroundBuilds() {
    stop();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.live.erase(this);
}

bool BackgroundBuilds::submit(KernelRecipe recipe, const std::string& target) noexcept {
    try {
        hook_exit(false);
        std::string key = job_key(recipe.spec_json, target);
        std::lock_guard<std::mutex> lock(mutex_);
        const bool known = kept_.count(key) != 0 || caller_built_.count(key) != 0 ||
                           std::find(running_.begin(), running_.end(), key) != running_.end() ||
                           std::any_of(queue_.begin(), queue_.end(),
                                       [&](const Job& job) { return job.key == key; });
        if (known) return false;
        if (stopping_ || queue_.size() >= limits_.max_queued) {
            stats_.background_dropped.fetch_add(1, std::memory_order_relaxed);
            return false;
        }
        // Workers start with the first job: a runtime that never compiles a forward (a warm
        // cache, inference) never starts a thread.
        if (workers_.empty())
            for (int i = 0; i < std::max(1, limits_.threads); ++i)
                workers_.emplace_back([this] { worker_loop(); });
        queue_.push_back(Job{std::move(key), std::move(recipe), target});
    } catch (...) {
        // Out of memory or no thread to be had: the later call builds it itself.
        stats_.background_dropped.fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    wake_.notify_one();
    return true;
}

void BackgroundBuilds::worker_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        Job job = std::move(queue_.front());
        queue_.pop_front();
        running_.push_back(job.key);
        lock.unlock();

        // The job's compile or disk hit is counted in the runtime's stats when a call takes
        // its binary (take), so that those count the kernels its calls loaded.
        std::optional<Kept> kept;
        try {
            KernelStats job_stats;
            kept = Kept{build_kernel_binary(job.recipe, job.target, disk_, job_stats),
                        job_stats.compile_microseconds.load()};
            if (kept->binary.compiled) hook_exit(true);
            stats_.disk_writes.fetch_add(job_stats.disk_writes.load(), std::memory_order_relaxed);
            stats_.background_builds.fetch_add(1, std::memory_order_relaxed);
        } catch (const Error& e) {
            // Swallowed: the call that needs this kernel builds it again and reports why. A
            // failed compile ran NVRTC too (its statics exist now).
            if (e.status() == ROPE_JIT_ERROR_COMPILE) hook_exit(true);
            stats_.background_failures.fetch_add(1, std::memory_order_relaxed);
        } catch (...) {
            stats_.background_failures.fetch_add(1, std::memory_order_relaxed);
        }

        lock.lock();
        running_.erase(std::find(running_.begin(), running_.end(), job.key));
        // Kept in memory even with a disk cache: the call that takes it reads no file.
        if (kept && limits_.max_kept > 0) {
            if (kept_.size() >= limits_.max_kept) {
                kept_.erase(kept_order_.front());
                kept_order_.pop_front();
            }
            kept_order_.push_back(job.key);
            kept_.emplace(job.key, std::move(*kept));
        }
        done_.notify_all();
    }
}

KernelBinary BackgroundBuilds::build_now(const KernelRecipe& recipe, const std::string& target) {
    if (std::optional<KernelBinary> ready = take(recipe.spec_json, target))
        return std::move(*ready);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        caller_built_.insert(job_key(recipe.spec_json, target));
    }
    // The follow-ups are queued on the disk miss, before this compile starts: they compile on
    // the background threads while this one compiles here.
    try {
        KernelBinary binary = build_kernel_binary(recipe, target, disk_, stats_, [&] {
            if (recipe.follow_ups) submit_follow_ups(recipe, target);
        });
        if (binary.compiled) hook_exit(true);
        return binary;
    } catch (const Error& e) {
        // A failed compile ran NVRTC too: the follow-ups it queued may still be compiling
        // when the process exits.
        if (e.status() == ROPE_JIT_ERROR_COMPILE) hook_exit(true);
        throw;
    }
}

void BackgroundBuilds::submit_follow_ups(const KernelRecipe& recipe,
                                         const std::string& target) noexcept {
    // Best effort: a recipe that cannot be made now is built (or reported) by the call that
    // needs it.
    try {
        for (KernelRecipe& next : recipe.follow_ups()) submit(std::move(next), target);
    } catch (...) {
        stats_.background_failures.fetch_add(1, std::memory_order_relaxed);
    }
}

std::optional<KernelBinary> BackgroundBuilds::take(const std::string& spec_json,
                                                   const std::string& target) {
    const std::string key = job_key(spec_json, target);
    std::unique_lock<std::mutex> lock(mutex_);
    auto queued =
        std::find_if(queue_.begin(), queue_.end(), [&](const Job& job) { return job.key == key; });
    if (queued != queue_.end()) {
        queue_.erase(queued);
        // Under the same lock: no other thread's miss may queue it again before the caller
        // builds it.
        caller_built_.insert(key);
        return std::nullopt;
    }
    done_.wait(lock,
               [&] { return std::find(running_.begin(), running_.end(), key) == running_.end(); });
    auto kept = kept_.find(key);
    if (kept == kept_.end()) return std::nullopt;
    KernelBinary binary = std::move(kept->second.binary);
    if (binary.compiled) {
        stats_.compiles.fetch_add(1, std::memory_order_relaxed);
        stats_.compile_microseconds.fetch_add(kept->second.compile_microseconds,
                                              std::memory_order_relaxed);
    } else {
        stats_.disk_hits.fetch_add(1, std::memory_order_relaxed);
    }
    kept_.erase(kept);
    kept_order_.erase(std::find(kept_order_.begin(), kept_order_.end(), key));
    return binary;
}

void BackgroundBuilds::wait_idle() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return running_.empty() && (queue_.empty() || stopping_); });
}

size_t BackgroundBuilds::pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.size() + running_.size();
}

void BackgroundBuilds::stop() noexcept {
    std::vector<std::thread> workers;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        stats_.background_dropped.fetch_add(queue_.size(), std::memory_order_relaxed);
        queue_.clear();
        workers.swap(workers_);
    }
    wake_.notify_all();
    done_.notify_all();
    // A running compile finishes (NVRTC has no way to interrupt it); its worker then sees
    // stopping_ and returns.
    for (std::thread& worker : workers) worker.join();
}

}  // namespace rope_jit
