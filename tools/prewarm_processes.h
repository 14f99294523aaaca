// Worker processes of `rope-jit-cache prewarm`. NVRTC compiles in one process scale badly: on
// the H200 machine's 16 cores, 16 threads finish the llama3-8b preset's 34 kernels only 4.5x
// faster than one (each compile 3x slower beside the others, with little more CPU time: they
// wait inside NVRTC), while four processes of four threads take 1.28-1.49 s against 2.08-2.25 s
// for one process of 16 (runs EF-EG, session 29, a fresh driver compute cache each time).
// The parent plans the kernels and hands each worker its share on stdin; each worker, this
// same executable run as `rope-jit-cache [--cache-dir D] prewarm-worker --parent PID --jobs J`,
// compiles its share with J threads and reports each kernel on stdout as it finishes, one JSON
// line each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace rope_jit_cache {

// One kernel of a worker's share: its index in the parent's plan, its canonical spec JSON and
// its target.
struct WorkerKernel {
    size_t index = 0;
    std::string spec_json, target;
};

// What a worker reports of one kernel: "compiled", "cached" or "failed", the prewarm call's
// wall time and NVRTC's share of it, whether an entry was written, how many entries the size
// limit removed after it, the error if it failed.
struct WorkerResult {
    size_t index = 0;
    std::string result;
    double ms = 0.0, compile_ms = 0.0;
    bool written = false;
    uint64_t evicted = 0;  // entries the cache's size limit removed after this kernel's write
    std::string error;
};

// The line protocol: a share is WorkerKernel lines; a report, WorkerResult lines.
std::string worker_kernel_line(const WorkerKernel& kernel);
WorkerKernel parse_worker_kernel_line(const std::string& line);  // throws std::exception
std::string worker_result_line(const WorkerResult& result);
WorkerResult parse_worker_result_line(const std::string& line);  // throws std::exception

// The worker processes a prewarm of `kernels` kernels with `jobs` threads in all runs in:
// `requested` when given (at most one a job), else one below 8 jobs (a process of that many
// threads scales there) and one per 4 jobs from 8 up (the H200 machine's best: 4 x 4 and
// 8 x 2 alike, run EG); at most one a kernel. Worker w of them takes jobs_of_worker threads.
int split_processes(size_t jobs, size_t kernels, int requested);
size_t jobs_of_worker(size_t jobs, int processes, int worker);

// Runs `shares` (one per worker) in worker processes of this executable, worker w started
// with the arguments worker_args(w) (after argv[0]), calling `on_result` on the calling thread
// for each kernel as its worker reports it. A kernel whose worker exits without reporting it
// is reported failed, with the worker's exit status. Returns false, having reported nothing,
// when the workers could not be started (the caller then compiles in this process). Workers
// start with SIGPIPE at its default (a worker whose parent is gone dies at its next report).
bool run_prewarm_workers(const std::function<std::vector<std::string>(int)>& worker_args,
                         const std::vector<std::vector<WorkerKernel>>& shares,
                         const std::function<void(const WorkerResult&)>& on_result);

// In a worker: ends this process when `parent` (the pid that started it) ends, or has ended.
void exit_with_parent(long parent);

}  // namespace rope_jit_cache
