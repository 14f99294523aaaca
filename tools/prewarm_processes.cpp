#include "prewarm_processes.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

extern char** environ;

namespace rope_jit_cache {

using json = nlohmann::json;

std::string worker_kernel_line(const WorkerKernel& kernel) {
    return json{{"index", kernel.index}, {"spec", kernel.spec_json}, {"target", kernel.target}}
               .dump() +
           "\n";
}

WorkerKernel parse_worker_kernel_line(const std::string& line) {
    const json value = json::parse(line);
    WorkerKernel kernel;
    kernel.index = value.at("index").get<size_t>();
    kernel.spec_json = value.at("spec").get<std::string>();
    kernel.target = value.at("target").get<std::string>();
    return kernel;
}

std::string worker_result_line(const WorkerResult& result) {
    // Errors may hold bytes that are not UTF-8 (paths): replaced, not thrown on.
    return json{{"index", result.index},     {"result", result.result},
                {"ms", result.ms},           {"compile_ms", result.compile_ms},
                {"written", result.written}, {"evicted", result.evicted},
                {"error", result.error}}
               .dump(-1, ' ', false, json::error_handler_t::replace) +
           "\n";
}

WorkerResult parse_worker_result_line(const std::string& line) {
    const json value = json::parse(line);
    WorkerResult result;
    result.index = value.at("index").get<size_t>();
    result.result = value.at("result").get<std::string>();
    result.ms = value.at("ms").get<double>();
    result.compile_ms = value.at("compile_ms").get<double>();
    result.written = value.at("written").get<bool>();
    result.evicted = value.at("evicted").get<uint64_t>();
    result.error = value.at("error").get<std::string>();
    return result;
}

int split_processes(size_t jobs, size_t kernels, int requested) {
    jobs = std::max<size_t>(jobs, 1);
    const size_t wanted = requested > 0 ? size_t(requested) : jobs >= 8 ? jobs / 4 : 1;
    return int(std::max<size_t>(std::min({wanted, jobs, std::max<size_t>(kernels, 1)}), 1));
}

size_t jobs_of_worker(size_t jobs, int processes, int worker) {
    const size_t p = size_t(std::max(processes, 1));
    return std::max<size_t>(jobs / p + (size_t(worker) < jobs % p ? 1 : 0), 1);
}

void exit_with_parent(long parent) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (long(getppid()) != parent) _exit(1);  // it ended before the request took effect
}

namespace {

struct Worker {
    pid_t pid = -1;
    int to_child = -1, from_child = -1;
    std::string pending;                 // bytes read after the last complete line
    std::vector<bool> reported;          // by position in its share
    std::vector<size_t> indices;         // its share's plan indices
};

void close_fd(int& fd) {
    if (fd >= 0) close(fd);
    fd = -1;
}

// Writes all of `text`, or fails (a worker that died: EPIPE, with SIGPIPE ignored).
bool write_all(int fd, const std::string& text) {
    size_t done = 0;
    while (done < text.size()) {
        const ssize_t n = write(fd, text.data() + done, text.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        done += size_t(n);
    }
    return true;
}

// Starts one worker with its stdin and stdout on pipes; false if it could not start.
bool start_worker(const std::vector<std::string>& args, Worker& worker) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0) return false;
    if (pipe2(out, O_CLOEXEC) != 0) {
        close(in[0]);
        close(in[1]);
        return false;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    // SIGPIPE at its default and no signal blocked in the worker (this process ignores
    // SIGPIPE while it runs workers; an orphaned worker must die at its next report).
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    sigset_t none, pipe_signal;
    sigemptyset(&none);
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    posix_spawnattr_setsigdefault(&attributes, &pipe_signal);
    posix_spawnattr_setsigmask(&attributes, &none);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
    std::vector<char*> argv;
    std::string name = "rope-jit-cache";
    argv.push_back(name.data());
    std::vector<std::string> copies = args;
    for (std::string& arg : copies) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    const int status =
        posix_spawn(&pid, "/proc/self/exe", &actions, &attributes, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
    close(in[0]);
    close(out[1]);
    if (status != 0) {
        close(in[1]);
        close(out[0]);
        return false;
    }
    worker.pid = pid;
    worker.to_child = in[1];
    worker.from_child = out[0];
    return true;
}

std::string exit_text(int status) {
    if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return fmt::format("signal {}", WTERMSIG(status));
    return "unknown status";
}

}  // namespace

bool run_prewarm_workers(const std::function<std::vector<std::string>(int)>& worker_args,
                         const std::vector<std::vector<WorkerKernel>>& shares,
                         const std::function<void(const WorkerResult&)>& on_result) {
    // A worker that dies while its share is written must not kill this process with SIGPIPE.
    struct sigaction ignore {}, previous {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, &previous);

    std::vector<Worker> workers(shares.size());
    bool started = true;
    for (size_t w = 0; w < shares.size() && started; ++w)
        started = start_worker(worker_args(int(w)), workers[w]);
    if (!started) {
        for (Worker& worker : workers) {
            close_fd(worker.to_child);
            close_fd(worker.from_child);
            if (worker.pid > 0)  // EOF on stdin: it exits
                while (waitpid(worker.pid, nullptr, 0) < 0 && errno == EINTR) {
                }
        }
        sigaction(SIGPIPE, &previous, nullptr);
        return false;
    }
    for (size_t w = 0; w < shares.size(); ++w) {
        std::string input;
        for (const WorkerKernel& kernel : shares[w]) {
            input += worker_kernel_line(kernel);
            workers[w].indices.push_back(kernel.index);
        }
        workers[w].reported.assign(shares[w].size(), false);
        write_all(workers[w].to_child, input);  // a failed write shows as unreported kernels
        close_fd(workers[w].to_child);
    }

    // Each worker's reports, as they come; a line that does not parse, or names a kernel not
    // in its share, is ignored (the kernel is then reported failed below).
    auto take_line = [&](Worker& worker, const std::string& line) {
        WorkerResult result;
        try {
            result = parse_worker_result_line(line);
        } catch (const std::exception&) {
            return;
        }
        const auto at = std::find(worker.indices.begin(), worker.indices.end(), result.index);
        if (at == worker.indices.end() || worker.reported[size_t(at - worker.indices.begin())])
            return;
        worker.reported[size_t(at - worker.indices.begin())] = true;
        on_result(result);
    };
    size_t open = workers.size();
    while (open > 0) {
        std::vector<pollfd> fds;
        std::vector<size_t> owners;
        for (size_t w = 0; w < workers.size(); ++w)
            if (workers[w].from_child >= 0) {
                fds.push_back(pollfd{workers[w].from_child, POLLIN, 0});
                owners.push_back(w);
            }
        if (poll(fds.data(), fds.size(), -1) < 0) {
            if (errno == EINTR) continue;
            // Cannot wait for reports any more: end the workers; what they did not report is
            // reported failed below.
            for (Worker& worker : workers) kill(worker.pid, SIGTERM);
            break;
        }
        for (size_t f = 0; f < fds.size(); ++f) {
            if (fds[f].revents == 0) continue;
            Worker& worker = workers[owners[f]];
            char buffer[65536];
            const ssize_t n = read(worker.from_child, buffer, sizeof buffer);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                close_fd(worker.from_child);
                --open;
                continue;
            }
            worker.pending.append(buffer, size_t(n));
            for (size_t end; (end = worker.pending.find('\n')) != std::string::npos;) {
                take_line(worker, worker.pending.substr(0, end));
                worker.pending.erase(0, end + 1);
            }
        }
    }
    for (Worker& worker : workers) {
        close_fd(worker.from_child);
        int status = 0;
        while (waitpid(worker.pid, &status, 0) < 0 && errno == EINTR) {
        }
        for (size_t k = 0; k < worker.indices.size(); ++k) {
            if (worker.reported[k]) continue;
            WorkerResult lost;
            lost.index = worker.indices[k];
            lost.result = "failed";
            lost.error = fmt::format("the prewarm worker process ended ({}) before reporting it",
                                     exit_text(status));
            on_result(lost);
        }
    }
    sigaction(SIGPIPE, &previous, nullptr);
    return true;
}

}  // namespace rope_jit_cache
