#include "common/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>

namespace rope_jit {

namespace {

// How many fork()s this process descends through; a child's handler adds one.
std::atomic<uint64_t> fork_count{0};

uint64_t forks_so_far() {
    static std::once_flag registered;
    std::call_once(registered, [] {
        pthread_atfork(nullptr, nullptr, [] { fork_count.fetch_add(1); });
    });
    return fork_count.load();
}

}  // namespace

struct ThreadPool::Job {
    const std::function<void(int64_t, int64_t)>* body;
    int64_t n, chunk;
    std::atomic<int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
};

ThreadPool::ThreadPool(int threads)
    : state_(std::make_unique<State>()), forks_at_start_(forks_so_far()) {
    if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
    State& state = *state_;
    try {
        state.workers.reserve(size_t(threads - 1));
        for (int i = 1; i < threads; ++i)
            state.workers.emplace_back([&state] { worker_loop(state); });
    } catch (...) {
        // No more threads (or memory) to be had: the workers started and each caller, which
        // always takes chunks itself, do the work.
    }
}

ThreadPool::~ThreadPool() {
    if (forked()) {
        state_.release();  // see the header: nothing of it can be joined or destroyed here
        return;
    }
    {
        std::lock_guard<std::mutex> lock(state_->mutex);
        state_->stop = true;
    }
    state_->wake.notify_all();
    for (std::thread& worker : state_->workers) worker.join();
}

bool ThreadPool::forked() const {
    return fork_count.load(std::memory_order_relaxed) != forks_at_start_;
}

void ThreadPool::run_chunks(Job& job) {
    for (;;) {
        int64_t begin = job.next.fetch_add(job.chunk);
        if (begin >= job.n) return;
        try {
            (*job.body)(begin, std::min(job.n, begin + job.chunk));
        } catch (...) {
            std::lock_guard<std::mutex> lock(job.error_mutex);
            if (!job.error) job.error = std::current_exception();
        }
    }
}

void ThreadPool::worker_loop(State& state) {
    uint64_t seen = 0;
    for (;;) {
        Job* job;
        {
            std::unique_lock<std::mutex> lock(state.mutex);
            state.wake.wait(lock, [&] { return state.stop || state.generation != seen; });
            if (state.stop) return;
            seen = state.generation;
            job = state.job;
            if (job == nullptr) continue;  // woke after that job had already finished
            ++state.active;
        }
        run_chunks(*job);
        {
            std::lock_guard<std::mutex> lock(state.mutex);
            --state.active;
        }
        state.done.notify_all();
    }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body,
                              const std::function<void(int)>& before) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    State& state = *state_;
    auto alone = [&] {
        if (before) before(1);
        body(0, n);
    };
    if (state.workers.empty() || n <= grain || forked()) return alone();
    std::unique_lock<std::mutex> busy(state.busy, std::try_to_lock);
    if (!busy.owns_lock()) return alone();
    Job job;
    job.body = &body;
    job.n = n;
    // About four chunks per thread balances load without making chunks tiny.
    job.chunk = std::max(grain, (n + 4 * size() - 1) / (4 * size()));
    if (before) before(int(std::min<int64_t>(size(), (n + job.chunk - 1) / job.chunk)));
    {
        std::lock_guard<std::mutex> lock(state.mutex);
        state.job = &job;
        ++state.generation;
    }
    state.wake.notify_all();
    run_chunks(job);
    {
        // Workers that woke for this job hold a pointer to it until they decrement active;
        // clearing job first stops late wakers from seeing it.
        std::unique_lock<std::mutex> lock(state.mutex);
        state.job = nullptr;
        state.done.wait(lock, [&] { return state.active == 0; });
    }
    if (job.error) std::rethrow_exception(job.error);
}

}  // namespace rope_jit
