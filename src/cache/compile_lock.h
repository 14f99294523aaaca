// A cross-process advisory lock around compiling one kernel into a shared disk cache, so that
// processes (and runtimes or threads of one process) that miss the same key at the same moment
// compile it once: the first compiles and stores, the others wait, then load what it stored.
//
// The lock is flock(2) on <root>/locks/<first 4 hex of the key>.lock:
// - flock, not fcntl/POSIX record locks: flock locks belong to the open file description, so
//   two runtimes or threads of one process that each open the file exclude each other too,
//   whereas POSIX locks belong to the process (they would not serialize its threads, and
//   closing any descriptor of the file would drop them).
// - Striped, never deleted: a lock file per key would grow without bound, and deleting one is
//   racy (a waiter that opened the old file and a newcomer that creates a new one would both
//   "hold" the lock). Two keys of one stripe serialize their compiles, which only costs time,
//   and only when both miss at once. 65536 stripes (four hex digits), of which a root holds
//   at most one file per key it ever compiled: with 256, a preset's 34 kernels shared a stripe
//   in most prewarms (the odds are 1 - e^(-34*33/512), 89%), and the llama3-8b preset's
//   wall time grew from 0.73-0.91 to 1.04-1.10 s when its attention forward waited behind
//   another kernel's compile (H200 run EM, session 30); with 65536 the odds are 0.9%.
// - A process that dies, however it dies, releases its flock when the kernel closes its
//   descriptors: a peer killed mid-compile never leaves the lock taken.
// - Waiting is bounded (kCompileLockMaxWait): a peer that is stopped or stuck delays us, then
//   we compile anyway, which at worst compiles a kernel twice (stores are atomic). It also
//   ends as soon as the entry waited for is on disk (the `published` check), whoever holds
//   the lock by then.
// - A fork()ed child shares the open file descriptions of its parent, and with them the
//   flocks: its copy of a lock file's descriptor would keep the lock taken for as long as the
//   child lives, after the parent released it (an idle worker forked mid-compile stalled every
//   waiter of that stripe for 120 s). A pthread_atfork handler closes the child's copies of
//   every lock file this process has open; the parent's locks stay as they were. Files are
//   opened, unlocked and closed outside the handlers' mutex (a fork never waits on a slow
//   file system), so a lock whose open a fork overtook opens a fresh description before it
//   locks, until its bounded wait runs out.
// The lock only saves work; correctness never depends on it. It is taken only in a root that
// DiskCache::writable() accepts, and any problem with it (a root that is unusable, a lock
// file that cannot be made, a file system without flock) means no lock and at most one
// warning per root per process, never a failed call.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "cache/disk_cache.h"

namespace rope_jit {

// How long a compile waits for peers holding its stripe's lock before it goes ahead alone.
// Far above any single compile (seconds), so only a stopped or hung peer reaches it.
constexpr std::chrono::milliseconds kCompileLockMaxWait = std::chrono::seconds(120);

// "<root>/locks/<first 4 hex of key_hex>.lock"; "" when root is "" or key_hex does not start
// with four lowercase hex digits.
std::string compile_lock_path(const std::string& root, const std::string& key_hex);

// Holds the lock of key_hex's stripe under disk.root() from construction to destruction.
// The constructor waits at most max_wait for it (polling, so the wait can be bounded), and
// stops waiting without it once `published` (when given) returns true: what the lock guards
// is there. It never throws; held() says whether it got the lock.
class CompileLock {
public:
    CompileLock(const DiskCache& disk, const std::string& key_hex,
                std::chrono::milliseconds max_wait = kCompileLockMaxWait,
                const std::function<bool()>& published = nullptr) noexcept;
    ~CompileLock();
    CompileLock(const CompileLock&) = delete;
    CompileLock& operator=(const CompileLock&) = delete;

    // Whether the lock is held: false when it was given up on or not taken at all.
    bool held() const { return held_ && fd_ >= 0; }  // (a forked child's copy holds nothing)

private:
    void close_file() noexcept;  // releases the lock (if held) and closes its file

    // The open lock file, while waiting and while held (closing it releases the lock); -1 once
    // closed, in a forked child too (the handler in compile_lock.cpp closes the child's copy).
    int fd_ = -1;
    bool held_ = false;
};

}  // namespace rope_jit
