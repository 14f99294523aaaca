// Test support: work run in a forked child, for what a test cannot undo in its own process (a
// resource limit, a seccomp filter) or what happens only after fork(). The child's crash,
// hang or exception is the parent's to see, never the child going on with the test run.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include <doctest/doctest.h>

struct ChildResult {
    int wait_status = 0;  // as waitpid gives it: WIFEXITED, WEXITSTATUS...
    std::string output;   // what the work wrote to *output

    bool exited_with(int code) const {
        return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == code;
    }
};

// Runs work(&output) in a forked child and returns its wait status and output. work returns
// the child's exit code; it must not use doctest's assertions (they would count in the child
// alone); an exception it lets out is exit code 99. Crashes kill the child (doctest's handlers
// are reset there), and an alarm of `seconds` stops a hang.
template <typename Work>
ChildResult run_in_child(Work&& work, unsigned seconds = 60) {
    int pipe_ends[2];
    REQUIRE(pipe(pipe_ends) == 0);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        close(pipe_ends[0]);
        for (const int signal_number : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT})
            std::signal(signal_number, SIG_DFL);
        alarm(seconds);
        std::string output;
        int code = 99;
        try {
            code = work(&output);
        } catch (...) {
        }
        const bool sent =
            write(pipe_ends[1], output.data(), output.size()) == ssize_t(output.size());
        _exit(sent ? code : 98);
    }
    close(pipe_ends[1]);
    ChildResult result;
    char buffer[4096];
    for (ssize_t n; (n = read(pipe_ends[0], buffer, sizeof buffer)) > 0;)
        result.output.append(buffer, size_t(n));
    close(pipe_ends[0]);
    REQUIRE(waitpid(child, &result.wait_status, 0) == child);
    return result;
}
