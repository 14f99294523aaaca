#include "cache/compile_lock.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <random>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/log.h"

namespace rope_jit {

namespace {

constexpr std::string_view kLockDir = "locks";
// Hex digits of the key that name its stripe (compile_lock.h says why four).
constexpr size_t kStripeDigits = 4;
// A waiter polls often at first, so it picks up a fast peer's entry at once, then every
// 20 ms: a compile takes far longer, and 20 ms of lag per wait is nothing next to it.
constexpr std::chrono::milliseconds kFirstPoll{5};
constexpr std::chrono::milliseconds kLongestPoll{20};

std::string errno_text(int err) {
    return std::error_code(err, std::generic_category()).message();
}

bool is_lower_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

// One warning per root per process for anything about the lock, like the disk cache's own.
void warn_once(const std::string& root, const std::string& message) {
    log_warning_once("compile_lock:" + root,
                     fmt::format("kernel cache directory '{}': {}", root, message));
}

// The lock files this process has open (CompileLock::fd_ of each live lock), so that a fork()ed
// child closes its copies (compile_lock.h says why). Their mutex is held across fork() (the
// atfork prepare handler) and by each lock while it lists or unlists its file, never across a
// file-system call, so that a fork() in another thread never waits for one (a hung network
// mount would hold it for good). A fork between a file's open and its listing is seen in
// `forks_seen` (the parent's handler counts them), and the lock then closes that file, whose
// open file description the child shares, and opens another before it locks anything.
std::mutex open_locks_mutex;
std::vector<int*> open_locks;
unsigned long forks_seen = 0;  // under open_locks_mutex

void close_lock_files_in_child() {
    for (int* fd : open_locks) {
        close(*fd);
        *fd = -1;
    }
    open_locks.clear();
    open_locks_mutex.unlock();
}

void register_fork_handlers() {
    static std::once_flag once;
    std::call_once(once, [] {
        pthread_atfork([] { open_locks_mutex.lock(); },
                       [] {
                           ++forks_seen;
                           open_locks_mutex.unlock();
                       },
                       close_lock_files_in_child);
    });
}

// Opens (creating it and its directory, mode 0700/0600) the lock file at `path`, a name in
// <root>/locks. Returns the descriptor, or -1 with *problem set.
int open_lock_file(const std::string& root, const std::string& path, std::string* problem) {
    const std::string dir = root + "/" + std::string(kLockDir);
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
        *problem = fmt::format("cannot create '{}': {}", dir, errno_text(errno));
        return -1;
    }
    const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir_fd < 0) {
        *problem = fmt::format("cannot open '{}': {}", dir, errno_text(errno));
        return -1;
    }
    // Judged through the descriptor the file is then opened in, so nothing can be swapped in
    // between. Whoever could write there could hold our locks (slowing us down, no worse).
    struct stat st;
    int fd = -1;
    if (fstat(dir_fd, &st) != 0) {
        *problem = fmt::format("cannot stat '{}': {}", dir, errno_text(errno));
    } else if (st.st_uid != geteuid()) {
        *problem =
            fmt::format("'{}' is owned by uid {}, not by this user", dir, unsigned(st.st_uid));
    } else if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
        *problem = fmt::format("'{}' is world-writable without the sticky bit", dir);
    } else {
        const std::string name = path.substr(path.rfind('/') + 1);
        // O_RDWR: NFS emulates flock with byte-range locks, whose exclusive kind needs a file
        // open for writing. O_NOFOLLOW and O_NONBLOCK: neither a link nor a FIFO in its place
        // can redirect or hang the open.
        fd = openat(dir_fd, name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK,
                    0600);
        if (fd < 0) {
            *problem = fmt::format("cannot open '{}': {}", path, errno_text(errno));
        } else if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            *problem = fmt::format("'{}' is not a regular file", path);
            close(fd);
            fd = -1;
        }
    }
    close(dir_fd);
    return fd;
}

}  // namespace

std::string compile_lock_path(const std::string& root, const std::string& key_hex) {
    if (root.empty() || key_hex.size() < kStripeDigits ||
        !std::all_of(key_hex.begin(), key_hex.begin() + kStripeDigits, is_lower_hex))
        return {};
    return fmt::format("{}/{}/{}.lock", root, kLockDir, key_hex.substr(0, kStripeDigits));
}

CompileLock::CompileLock(const DiskCache& disk, const std::string& key_hex,
                         std::chrono::milliseconds max_wait,
                         const std::function<bool()>& published) noexcept {
    try {
        const std::string& root = disk.root();
        const std::string path = compile_lock_path(root, key_hex);
        // An unusable root stores nothing, so there is nothing to wait for; the disk cache
        // itself warns about it.
        if (path.empty() || !disk.writable()) return;
        register_fork_handlers();
        std::string problem;
        // The deadline bounds the whole constructor: the open's retries and the wait.
        const auto deadline = std::chrono::steady_clock::now() + max_wait;
        // A fork that overtook the open (see open_locks) sends us back to open another
        // description, after a random pause of under half a millisecond: a thread that forks
        // in a loop, each fork as slow as our open (a parent of many gigabytes), would
        // otherwise overtake every retry in step.
        std::minstd_rand jitter(static_cast<unsigned>(
            std::chrono::steady_clock::now().time_since_epoch().count() ^ uintptr_t(this)));
        while (fd_ < 0) {
            unsigned long forks_before;
            {
                std::lock_guard<std::mutex> lock(open_locks_mutex);
                forks_before = forks_seen;
            }
            const int fd = open_lock_file(root, path, &problem);
            if (fd < 0) break;
            {
                std::lock_guard<std::mutex> lock(open_locks_mutex);
                if (forks_seen == forks_before) {
                    fd_ = fd;
                    open_locks.push_back(&fd_);
                }
            }
            if (fd_ >= 0) break;
            close(fd);  // a child may share this description: not one to lock
            if (std::chrono::steady_clock::now() >= deadline) {
                problem = fmt::format("forks in other threads overtook every open for {:g} s",
                                      double(max_wait.count()) / 1000.0);
                break;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 500));
        }
        if (fd_ < 0) {
            warn_once(root, "no compile lock (" + problem +
                                "); processes sharing it may compile a kernel twice");
            return;
        }
        // Polled rather than a blocking flock(LOCK_EX), which has no timeout and would wait
        // forever for a peer that is stopped or hung while holding the lock.
        std::chrono::milliseconds pause = kFirstPoll;
        for (;;) {
            if (flock(fd_, LOCK_EX | LOCK_NB) == 0) {
                held_ = true;
                return;
            }
            const int err = errno;
            if (err == EINTR) continue;
            if (err != EWOULDBLOCK) {
                warn_once(
                    root,
                    fmt::format(
                        "cannot lock '{}' ({}); processes sharing it may compile a kernel twice",
                        path, errno_text(err)));
                break;
            }
            if (published && published()) break;  // nothing left to wait for
            const auto now = std::chrono::steady_clock::now();
            if (now >= deadline) {
                warn_once(
                    root,
                    fmt::format("gave up after {:g} s waiting for the compile lock '{}' (a process "
                                "holding it may be stopped or hung); compiling without it",
                                double(max_wait.count()) / 1000.0, path));
                break;
            }
            std::this_thread::sleep_for(
                std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
            pause = std::min(pause * 2, kLongestPoll);
        }
    } catch (...) {
        // Out of memory for a path or a message: go on without the lock.
    }
    close_file();  // a lock not taken
}

CompileLock::~CompileLock() {
    close_file();
}

void CompileLock::close_file() noexcept {
    // Unlocked while still listed, unlisted under the handlers' mutex, closed after it: on a
    // network file system an unlock or a close may block, and no fork() may wait for that. A
    // fork between the unlisting and the close leaves the child a description no one locks.
    held_ = false;
    if (fd_ < 0) return;
    flock(fd_, LOCK_UN);
    int fd;
    {
        std::lock_guard<std::mutex> lock(open_locks_mutex);
        fd = fd_;
        fd_ = -1;
        const auto listed = std::find(open_locks.begin(), open_locks.end(), &fd_);
        if (listed != open_locks.end()) open_locks.erase(listed);
    }
    close(fd);
}

}  // namespace rope_jit
