// A fixed set of worker threads for the CPU reference. parallel_for splits a range into
// chunks that the workers and the calling thread take in turn. When another call already
// uses the pool, the caller runs its whole range itself instead of waiting, so concurrent
// calls on one runtime never block each other or deadlock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rope_jit {

class ThreadPool {
public:
    // threads <= 0: one per hardware thread. The pool starts threads - 1 workers.
    explicit ThreadPool(int threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return int(workers_.size()) + 1; }

    // Calls body(begin, end) over disjoint chunks covering [0, n), each at least `grain`
    // long (except the last), and returns when all are done. An exception thrown by a chunk
    // is rethrown here (the first one) after the others finish.
    void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

private:
    struct Job;
    void worker_loop();
    static void run_chunks(Job& job);

    std::vector<std::thread> workers_;
    std::mutex busy_;  // held by the caller whose job the workers are running
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    Job* job_ = nullptr;
    uint64_t generation_ = 0;
    int active_ = 0;
    bool stop_ = false;
};

}  // namespace rope_jit
