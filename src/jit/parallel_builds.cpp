#include "jit/parallel_builds.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "common/error.h"

namespace rope_jit {

void build_binaries_parallel(const std::vector<KernelRecipe>& recipes, const std::string& target,
                             const DiskCache* disk, KernelStats& stats, int threads,
                             const std::vector<std::string>& names,
                             const std::vector<size_t>& start_order) {
    if (recipes.empty()) return;
    if (!start_order.empty()) {
        std::vector<bool> seen(recipes.size(), false);
        bool permutation = start_order.size() == recipes.size();
        for (size_t i = 0; permutation && i < start_order.size(); ++i) {
            permutation = start_order[i] < recipes.size() && !seen[start_order[i]];
            if (permutation) seen[start_order[i]] = true;
        }
        if (!permutation)
            throw Error(ROPE_JIT_ERROR_INTERNAL,
                        "build_binaries_parallel: start_order is not a permutation of the recipes");
    }
    if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
    const size_t workers = std::min(size_t(threads), recipes.size());

    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    size_t error_index = recipes.size();
    std::exception_ptr error;
    auto run = [&] {
        for (;;) {
            const size_t n = next.fetch_add(1);
            if (n >= recipes.size() || failed.load()) return;
            const size_t i = start_order.empty() ? n : start_order[n];
            try {
                build_kernel_binary(recipes[i], target, disk, stats);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mutex);
                if (i < error_index) {
                    error_index = i;
                    error = std::current_exception();
                }
                failed.store(true);
            }
        }
    };
    std::vector<std::thread> pool;
    try {
        for (size_t t = 1; t < workers; ++t) pool.emplace_back(run);
    } catch (...) {
        // No more threads to be had: the ones started and this one do the work.
    }
    run();
    for (std::thread& thread : pool) thread.join();
    if (!error) return;
    if (error_index >= names.size()) std::rethrow_exception(error);
    try {
        std::rethrow_exception(error);
    } catch (const Error& e) {
        throw Error(e.status(), names[error_index] + ": " + e.what());
    }
}

}  // namespace rope_jit
