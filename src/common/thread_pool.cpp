#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>

namespace rope_jit {

struct ThreadPool::Job {
    const std::function<void(int64_t, int64_t)>* body;
    int64_t n, chunk;
    std::atomic<int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
};

ThreadPool::ThreadPool(int threads) {
    if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
    try {
        workers_.reserve(size_t(threads - 1));
        for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
    } catch (...) {
        // No more threads (or memory) to be had: the workers started and each caller, which
        // always takes chunks itself, do the work.
    }
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
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

void ThreadPool::worker_loop() {
    uint64_t seen = 0;
    for (;;) {
        Job* job;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            job = job_;
            if (job == nullptr) continue;  // woke after that job had already finished
            ++active_;
        }
        run_chunks(*job);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            --active_;
        }
        done_.notify_all();
    }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (workers_.empty() || n <= grain || !busy.owns_lock()) {
        body(0, n);
        return;
    }
    Job job;
    job.body = &body;
    job.n = n;
    // About four chunks per thread balances load without making chunks tiny.
    job.chunk = std::max(grain, (n + 4 * size() - 1) / (4 * size()));
    {
        std::lock_guard<std::mutex> lock(mutex_);
        job_ = &job;
        ++generation_;
    }
    wake_.notify_all();
    run_chunks(job);
    {
        // Workers that woke for this job hold a pointer to it until they decrement active_;
        // clearing job_ first stops late wakers from seeing it.
        std::unique_lock<std::mutex> lock(mutex_);
        job_ = nullptr;
        done_.wait(lock, [&] { return active_ == 0; });
    }
    if (job.error) std::rethrow_exception(job.error);
}

}  // namespace rope_jit
