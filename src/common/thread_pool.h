// A fixed set of worker threads for the CPU reference. parallel_for splits a range into
// chunks that the workers and the calling thread take in turn. When another call already
// uses the pool, the caller runs its whole range itself instead of waiting, so concurrent
// calls on one runtime never block each other or deadlock.
//
// fork(): a child process inherits the pool but none of its threads, and its mutexes and
// condition variables as the fork caught them (held, or with waiters that do not exist in the
// child). There the pool runs every range on the calling thread and, when destroyed, leaves
// the workers' handles and that state alone: joining or destroying them would crash or hang.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rope_jit {

class ThreadPool {
public:
    // threads <= 0: one per hardware thread. The pool starts threads - 1 workers (fewer when
    // the system grants fewer).
    explicit ThreadPool(int threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return int(state_->workers.size()) + 1; }

    // Calls body(begin, end) over disjoint chunks covering [0, n), each at least `grain`
    // long (except the last), and returns when all are done. An exception thrown by a chunk
    // is rethrown here (the first one) after the others finish. `before` (when given) is
    // called first, on the calling thread, with the number of threads that will run chunks at
    // once (1 where the caller runs the range alone); an exception from it is thrown before
    // any chunk runs.
    void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body,
                      const std::function<void(int)>& before = nullptr);

private:
    struct Job;
    // Everything the workers share, on the heap so that a forked child can abandon it.
    struct State {
        std::vector<std::thread> workers;
        std::mutex busy;  // held by the caller whose job the workers are running
        std::mutex mutex;
        std::condition_variable wake, done;
        Job* job = nullptr;
        uint64_t generation = 0;
        int active = 0;
        bool stop = false;
    };
    static void worker_loop(State& state);
    static void run_chunks(Job& job);
    bool forked() const;

    std::unique_ptr<State> state_;
    // The process's fork count when the workers started (a pthread_atfork child handler counts
    // forks: unlike a pid, which a later process may be given again, it never comes back).
    uint64_t forks_at_start_;
};

}  // namespace rope_jit
