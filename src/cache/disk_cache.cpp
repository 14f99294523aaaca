#include "cache/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "common/byte_size.h"
#include "common/error.h"
#include "common/log.h"
#include "common/sha256.h"

namespace rope_jit {

namespace {

constexpr char kMagic[8] = {'R', 'J', 'I', 'T', 'C', 'A', 'C', 'H'};
constexpr size_t kKeyChars = 64;
constexpr size_t kChecksumBytes = 32;
// magic, format, key echo, spec length: everything before the spec JSON.
constexpr size_t kHeadBytes = sizeof(kMagic) + 4 + kKeyChars + 4;
// payload length and checksum: everything between the spec JSON and the payload.
constexpr size_t kMidBytes = 8 + kChecksumBytes;
constexpr uint64_t kMaxFileBytes =
    kHeadBytes + kCacheMaxSpecBytes + kMidBytes + kCacheMaxPayloadBytes;

constexpr std::string_view kTempPrefix = ".tmp-";
constexpr std::string_view kBadMarker = ".bad-";
constexpr std::string_view kVersionDir = "v1";

std::string errno_text(int err) {
    return std::error_code(err, std::generic_category()).message();
}

// ---- id validation ----------------------------------------------------------------------

bool is_key_hex(std::string_view s) {
    return s.size() == kKeyChars && std::all_of(s.begin(), s.end(), [](char c) {
               return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
           });
}

bool is_word_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// A leading '.' is refused so no component can be "." or ".." or collide with ".tmp-" files.
bool is_path_word(std::string_view s) {
    return !s.empty() && s.size() <= 64 && s[0] != '.' &&
           std::all_of(s.begin(), s.end(),
                       [](char c) { return is_word_char(c) || c == '.' || c == '-'; });
}

// Without '.' and '-' in the extension, "<key>.<kind>" splits unambiguously and can never
// look like a set-aside "<...>.bad-<pid>-<n>" name.
bool is_kind(std::string_view s) {
    return !s.empty() && s.size() <= 16 && std::all_of(s.begin(), s.end(), is_word_char);
}

std::string id_problem(const CacheEntryId& id) {
    if (!is_key_hex(id.key_hex)) return "the key is not 64 lowercase hex characters";
    if (!is_path_word(id.nvrtc_version)) {
        return fmt::format("bad NVRTC version '{}'", id.nvrtc_version);
    }
    if (!is_path_word(id.target)) return fmt::format("bad target '{}'", id.target);
    if (!is_kind(id.kind)) return fmt::format("bad entry kind '{}'", id.kind);
    return {};
}

// The directories between a root and an entry, in order.
std::array<std::string, 4> subdirs(const CacheEntryId& id) {
    return {std::string(kVersionDir), "nvrtc" + id.nvrtc_version, id.target,
            id.key_hex.substr(0, 2)};
}

// ---- entry format -----------------------------------------------------------------------

void put_u32(std::string& out, uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(char(uint8_t(v >> (8 * i))));
}

void put_u64(std::string& out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(char(uint8_t(v >> (8 * i))));
}

uint32_t get_u32(const char* p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | uint8_t(p[i]);
    return v;
}

uint64_t get_u64(const char* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | uint8_t(p[i]);
    return v;
}

std::array<uint8_t, 32> entry_checksum(std::string_view before_checksum, std::string_view payload) {
    Sha256 hasher;
    hasher.update(before_checksum);
    hasher.update(payload);
    return hasher.finish();
}

// ---- file system helpers ----------------------------------------------------------------

// Group or world write permission: someone else may create, rename or replace files there.
bool others_can_write(const struct stat& st) {
    return (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
}

std::string others_can_write_problem(const std::string& path) {
    return fmt::format(
        "'{}' can be written by other users (group- or world-writable; a sticky "
        "bit does not stop them creating files): `chmod go-w` it to use it",
        path);
}

// Why a directory of our own root must not be trusted, or "" when it may be. Anyone who can
// write into it could plant a kernel with a valid checksum, or swap files under us.
std::string unsafe_dir_problem(const std::string& path, const struct stat& st) {
    if (st.st_uid != geteuid()) {
        return fmt::format("'{}' is owned by uid {}, not by this user (uid {})", path,
                           unsigned(st.st_uid), unsigned(geteuid()));
    }
    if (others_can_write(st)) return others_can_write_problem(path);
    return {};
}

bool trusted_owner(const struct stat& st) {
    return st.st_uid == geteuid() || st.st_uid == 0;
}

// The directories above a cache root: owned by this user or root, and writable by others only
// with the sticky bit (as /tmp), so that nobody else can rename or replace the way down.
// `resolved` is an absolute path without symbolic links; its last component is not checked.
std::string ancestors_problem(const std::string& resolved) {
    if (resolved.empty() || resolved[0] != '/') return {};
    std::string dir = "/";
    for (size_t next = 1;;) {
        struct stat st;
        if (stat(dir.c_str(), &st) != 0) return {};
        if (!trusted_owner(st)) {
            return fmt::format("'{}' is owned by uid {}, neither this user (uid {}) nor root", dir,
                               unsigned(st.st_uid), unsigned(geteuid()));
        }
        if (others_can_write(st) && !(st.st_mode & S_ISVTX)) {
            return fmt::format("'{}' can be written by other users without the sticky bit", dir);
        }
        const size_t slash = resolved.find('/', next);
        if (slash == std::string::npos) return {};  // what follows is the last component
        dir = resolved.substr(0, slash);
        next = slash + 1;
    }
}

// realpath as a string, or "" (missing, or unresolvable).
std::string resolved_path(const std::string& path) {
    char* resolved = realpath(path.c_str(), nullptr);
    if (resolved == nullptr) return {};
    std::string out = resolved;
    std::free(resolved);
    return out;
}

// Creates `path` and its missing parents with mode 0700. Returns "" or the problem.
std::string make_dirs(const std::string& path) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0) {
        return S_ISDIR(st.st_mode) ? std::string() : fmt::format("'{}' is not a directory", path);
    }
    for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
        std::string prefix = path.substr(0, slash);
        if (!prefix.empty() && prefix.back() != '/' && mkdir(prefix.c_str(), 0700) != 0 &&
            errno != EEXIST) {
            // Some file systems report EROFS or EACCES for a directory that already exists.
            int err = errno;
            if (stat(prefix.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
                return fmt::format("cannot create '{}': {}", prefix, errno_text(err));
            }
        }
        if (slash == std::string::npos) break;
    }
    if (stat(path.c_str(), &st) != 0) {
        return fmt::format("cannot create '{}': {}", path, errno_text(errno));
    }
    if (!S_ISDIR(st.st_mode)) return fmt::format("'{}' is not a directory", path);
    return {};
}

// Renames a bad entry out of the way so the next store can replace it, but only when the
// path still holds the very file we judged (judged.st_ino == 0: whatever is there): a
// concurrent store may have put a good one there, and then *replaced is set. Returns the new
// name, or "" when nothing was moved.
std::string set_aside(const std::string& path, const struct stat& judged,
                      bool* replaced = nullptr) {
    static std::atomic<uint64_t> counter{0};
    if (replaced) *replaced = false;
    struct stat now;
    if (lstat(path.c_str(), &now) != 0) {
        if (replaced) *replaced = errno == ENOENT;
        return {};
    }
    if (judged.st_ino != 0 && (now.st_ino != judged.st_ino || now.st_dev != judged.st_dev)) {
        if (replaced) *replaced = true;
        return {};
    }
    std::string moved = fmt::format("{}{}{}-{}", path, kBadMarker, long(getpid()),
                                    counter.fetch_add(1, std::memory_order_relaxed));
    if (rename(path.c_str(), moved.c_str()) != 0) return {};
    return moved;
}

// The root must be a safe directory; below it every directory must be a real directory (not
// a symlink, which we never create) that is safe too. With `create`, missing ones are made
// (mode 0700); without, a missing one sets *missing and stops. Returns "" or the problem.
std::string check_tree(const std::string& root, const std::string* subdir_list, size_t count,
                       bool create, bool* missing) {
    if (missing) *missing = false;
    struct stat st;
    if (create) {
        std::string problem = make_dirs(root);
        if (!problem.empty()) return problem;
    }
    if (stat(root.c_str(), &st) != 0) {
        if (errno == ENOENT && !create && missing) {
            *missing = true;
            return {};
        }
        return fmt::format("cannot use '{}': {}", root, errno_text(errno));
    }
    if (!S_ISDIR(st.st_mode)) return fmt::format("'{}' is not a directory", root);
    std::string problem = unsafe_dir_problem(root, st);
    if (!problem.empty()) return problem;
    problem = ancestors_problem(resolved_path(root));
    if (!problem.empty()) return problem;

    std::string path = root;
    for (size_t i = 0; i < count; ++i) {
        path += '/';
        path += subdir_list[i];
        if (create && mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
            return fmt::format("cannot create '{}': {}", path, errno_text(errno));
        }
        if (lstat(path.c_str(), &st) != 0) {
            if (errno == ENOENT && !create && missing) {
                *missing = true;
                return {};
            }
            return fmt::format("cannot use '{}': {}", path, errno_text(errno));
        }
        if (!S_ISDIR(st.st_mode)) {
            // Damage, not a threat (the parent was checked): a reader just misses, a writer
            // moves the thing aside and carries on. Not in the root itself: a file named like
            // the format directory there was put by someone (the cache never writes one), so
            // it stays, and the cache cannot be written (its writes keep kernels in memory).
            if (!create && missing) {
                *missing = true;
                return {};
            }
            if (i == 0)
                return fmt::format("'{}' is not a directory: a file of the cache's own name in "
                                   "its root, left alone; move it to use this cache directory",
                                   path);
            std::string moved = create ? set_aside(path, st) : std::string();
            if (moved.empty() || mkdir(path.c_str(), 0700) != 0 || lstat(path.c_str(), &st) != 0 ||
                !S_ISDIR(st.st_mode)) {
                return fmt::format("'{}' is not a directory", path);
            }
            log_warning(fmt::format("kernel cache: '{}' was not a directory; set aside as '{}'",
                                    path, moved));
        }
        problem = unsafe_dir_problem(path, st);
        if (!problem.empty()) return problem;
    }
    return {};
}

bool write_all(int fd, const char* data, size_t size) {
    while (size > 0) {
        ssize_t n = write(fd, data, size);
        if (n < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        if (n == 0) {  // no progress and no errno: treat as a full disk rather than spin
            errno = ENOSPC;
            return false;
        }
        data += n;
        size -= size_t(n);
    }
    return true;
}

// Unique among threads and processes sharing the directory, so writers never collide.
std::string temp_name() {
    static std::atomic<uint64_t> counter{0};
    return fmt::format("{}{}-{:x}-{}", kTempPrefix, long(getpid()),
                       std::hash<std::thread::id>{}(std::this_thread::get_id()),
                       counter.fetch_add(1, std::memory_order_relaxed));
}

// Deletes the temp file unless it was published, whatever way store() leaves.
class TempFileGuard {
public:
    explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
    ~TempFileGuard() {
        if (fd_ >= 0) close(fd_);
        if (!path_.empty()) unlink(path_.c_str());
    }
    TempFileGuard(const TempFileGuard&) = delete;
    TempFileGuard& operator=(const TempFileGuard&) = delete;

    int& fd() { return fd_; }
    void published() { path_.clear(); }

private:
    std::string path_;
    int fd_ = -1;
};

// Unavailable: the file could not be opened for a reason of the moment (no descriptor or
// memory to spare), which says nothing about the entry: never damage, never set aside.
enum class ReadResult { Ok, Missing, Bad, Untrusted, Unavailable };

bool transient_open_error(int err) {
    return err == EMFILE || err == ENFILE || err == ENOMEM || err == ENOBUFS || err == EAGAIN ||
           err == EINTR;
}

// Appends bytes of fd to *bytes until it holds `want` bytes or the file ends. False, with
// *problem, on a read error.
bool read_up_to(int fd, size_t want, std::string* bytes, std::string* problem) {
    char buffer[1 << 16];
    while (bytes->size() < want) {
        const size_t chunk = std::min(sizeof(buffer), want - bytes->size());
        ssize_t n = read(fd, buffer, chunk);
        if (n < 0) {
            if (errno == EINTR) continue;
            *problem = "cannot read: " + errno_text(errno);
            return false;
        }
        if (n == 0) break;
        bytes->append(buffer, size_t(n));
    }
    return true;
}

// Reads an entry file, judging its header before reading further: a file that does not
// start like an entry, or whose lengths exceed the limits, is read no further than that
// (parse_cache_entry then says what is wrong with what was read), so a huge file in place of
// an entry costs a few bytes, not its size. `no_follow` for our own root, where we never
// create symlinks. `keep_atime` for inspection (verify): the access time is what tells used
// entries from unused ones when pruning, so looking at an entry must not count as using it.
ReadResult read_entry_file(const std::string& path, bool no_follow, std::string* bytes,
                           std::string* problem, struct stat* st, bool keep_atime = false) {
    // O_NONBLOCK so a FIFO planted in place of an entry cannot hang the caller.
    int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (no_follow ? O_NOFOLLOW : 0);
    int fd = keep_atime ? open(path.c_str(), flags | O_NOATIME) : -1;
    // O_NOATIME is refused (EPERM) on files of other users: read those like load() does.
    if (fd < 0) fd = open(path.c_str(), flags);
    if (fd < 0) {
        int err = errno;
        if (err == ENOENT || err == ENOTDIR) return ReadResult::Missing;
        if (transient_open_error(err)) {
            *problem = "cannot open it now: " + errno_text(err);
            return ReadResult::Unavailable;
        }
        *problem = err == ELOOP && no_follow ? "a symbolic link in place of the entry"
                                             : "cannot open: " + errno_text(err);
        if (lstat(path.c_str(), st) != 0) std::memset(st, 0, sizeof(*st));
        return ReadResult::Bad;
    }
    struct Closer {
        int fd;
        ~Closer() { close(fd); }
    } closer{fd};

    if (fstat(fd, st) != 0) {
        *problem = "cannot stat: " + errno_text(errno);
        return ReadResult::Bad;
    }
    if (S_ISDIR(st->st_mode)) {
        *problem = "a directory in place of the entry";
        return ReadResult::Bad;
    }
    if (!S_ISREG(st->st_mode)) {
        *problem = "not a regular file";
        return ReadResult::Bad;
    }
    *problem = untrusted_file_problem(*st);
    if (!problem->empty()) return ReadResult::Untrusted;
    if (uint64_t(st->st_size) > kMaxFileBytes) {
        *problem =
            fmt::format("file of {} bytes is larger than any valid entry", uint64_t(st->st_size));
        return ReadResult::Bad;
    }
    bytes->clear();
    if (!read_up_to(fd, kHeadBytes, bytes, problem)) return ReadResult::Bad;
    if (bytes->size() < kHeadBytes || std::memcmp(bytes->data(), kMagic, sizeof(kMagic)) != 0 ||
        get_u32(bytes->data() + 8) != kCacheFormatVersion) {
        return ReadResult::Ok;
    }
    const uint32_t spec_size = get_u32(bytes->data() + kHeadBytes - 4);
    if (spec_size > kCacheMaxSpecBytes) return ReadResult::Ok;
    const size_t payload_at = kHeadBytes + spec_size + kMidBytes;
    if (!read_up_to(fd, payload_at, bytes, problem)) return ReadResult::Bad;
    if (bytes->size() < payload_at) return ReadResult::Ok;
    const uint64_t payload_size = get_u64(bytes->data() + payload_at - kMidBytes);
    if (payload_size > kCacheMaxPayloadBytes) return ReadResult::Ok;
    // One byte past the end shows trailing garbage without reading all of it.
    const size_t whole = payload_at + size_t(payload_size);
    bytes->reserve(whole + 1);
    if (!read_up_to(fd, whole + 1, bytes, problem)) return ReadResult::Bad;
    return ReadResult::Ok;
}

std::string warning_key(const std::string& root) {
    return "disk_cache_root:" + root;
}

void warn_unusable_root(const std::string& root, const std::string& problem) {
    log_warning_once(warning_key(root),
                     fmt::format("kernel cache directory '{}' is not used for writing: {}; "
                                 "compiled kernels are kept in memory only",
                                 root, problem));
}

}  // namespace

std::string untrusted_file_problem(const struct stat& st) {
    if (!trusted_owner(st)) {
        return fmt::format("owned by uid {}, neither this user (uid {}) nor root",
                           unsigned(st.st_uid), unsigned(geteuid()));
    }
    if (others_can_write(st)) return "writable by other users (group- or world-writable)";
    return {};
}

std::string trust_problem(const std::string& root, const std::string& dir) {
    const std::string resolved_root = resolved_path(root);
    if (resolved_root.empty()) return {};  // missing: nothing to trust, a miss
    // Resolved, the way to dir may leave the root (a bundle may hold links): each directory
    // on it is judged by the ancestor rule when it lies above the root, else strictly.
    std::string resolved = resolved_path(dir);
    if (resolved.empty()) resolved = resolved_root;  // dir missing: a miss; judge the root
    auto above_root = [&](const std::string& path) {
        return path.size() < resolved_root.size() &&
               resolved_root.compare(0, path.size(), path) == 0 &&
               (path == "/" || resolved_root[path.size()] == '/');
    };
    for (size_t slash = 0;; slash = resolved.find('/', slash + 1)) {
        const std::string path = slash == std::string::npos ? resolved
                                 : slash == 0               ? std::string("/")
                                                            : resolved.substr(0, slash);
        struct stat st;
        if (stat(path.c_str(), &st) != 0) return {};
        if (!trusted_owner(st)) {
            return fmt::format("'{}' is owned by uid {}, neither this user (uid {}) nor root", path,
                               unsigned(st.st_uid), unsigned(geteuid()));
        }
        if (others_can_write(st)) {
            if (!above_root(path)) return others_can_write_problem(path);
            if (!(st.st_mode & S_ISVTX)) {
                return fmt::format("'{}' can be written by other users without the sticky bit",
                                   path);
            }
        }
        if (slash == std::string::npos) return {};
    }
}

LayoutName classify_layout_name(size_t depth, std::string_view name) {
    auto digits = [](std::string_view text) {
        return !text.empty() && text.size() <= 20 &&
               std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    auto lower_hex = [](std::string_view text) {
        return std::all_of(text.begin(), text.end(),
                           [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
    };
    // "sm_90", "sm_90a", "compute_90": what choose_target and the device layer name.
    auto is_target = [&](std::string_view text) {
        for (std::string_view prefix : {std::string_view("sm_"), std::string_view("compute_")}) {
            if (text.substr(0, prefix.size()) != prefix) continue;
            std::string_view rest = text.substr(prefix.size());
            size_t n = 0;
            while (n < rest.size() && rest[n] >= '0' && rest[n] <= '9') ++n;
            return n > 0 && n <= 4 && rest.size() - n <= 2 &&
                   std::all_of(rest.begin() + long(n), rest.end(),
                               [](char c) { return c >= 'a' && c <= 'z'; });
        }
        return false;
    };
    auto is_directory_name = [&](std::string_view text) {
        switch (depth) {
            case 0: return text.substr(0, 5) == "nvrtc" && is_path_word(text.substr(5));
            case 1: return is_target(text);
            case 2: return text.size() == 2 && lower_hex(text);
            default: return false;
        }
    };
    auto is_entry_name = [&](std::string_view text) {
        return depth == 3 && text.size() > kKeyChars + 1 && text[kKeyChars] == '.' &&
               is_key_hex(text.substr(0, kKeyChars)) && is_kind(text.substr(kKeyChars + 1));
    };
    // "<layout name>.bad-<pid>-<n>" (set_aside).
    const size_t bad = name.rfind(kBadMarker);
    if (bad != std::string_view::npos) {
        std::string_view base = name.substr(0, bad), tail = name.substr(bad + kBadMarker.size());
        const size_t dash = tail.find('-');
        if (dash != std::string_view::npos && digits(tail.substr(0, dash)) &&
            digits(tail.substr(dash + 1)) && (is_directory_name(base) || is_entry_name(base))) {
            return LayoutName::SetAside;
        }
        return LayoutName::Foreign;
    }
    // ".tmp-<pid>-<thread hash hex>-<n>" (temp_name).
    if (depth == 3 && name.substr(0, kTempPrefix.size()) == kTempPrefix) {
        std::string_view rest = name.substr(kTempPrefix.size());
        const size_t first = rest.find('-'), last = rest.rfind('-');
        if (first != std::string_view::npos && last != first && digits(rest.substr(0, first)) &&
            digits(rest.substr(last + 1))) {
            std::string_view thread = rest.substr(first + 1, last - first - 1);
            if (!thread.empty() && thread.size() <= 16 && lower_hex(thread)) {
                return LayoutName::Temp;
            }
        }
        return LayoutName::Foreign;
    }
    if (is_directory_name(name)) return LayoutName::Directory;
    if (is_entry_name(name)) return LayoutName::Entry;
    return LayoutName::Foreign;
}

std::vector<std::string> sorted_names(const std::string& dir, int* error) {
    std::vector<std::string> names;
    DIR* handle = opendir(dir.c_str());
    if (error != nullptr) *error = handle == nullptr ? errno : 0;
    if (handle == nullptr) return names;
    while (const dirent* entry = readdir(handle)) {
        std::string_view name = entry->d_name;
        if (name != "." && name != "..") names.emplace_back(name);
    }
    closedir(handle);
    std::sort(names.begin(), names.end());
    return names;
}

bool cache_file_directory_is_empty(const std::string& path) {
    int error = 0;
    return sorted_names(path, &error).empty() && error == 0;
}

// ---- entry format -----------------------------------------------------------------------

std::string serialize_cache_entry(const CacheEntryId& id, const CacheEntry& entry) {
    if (!is_key_hex(id.key_hex)) {
        fail_argument("cache entry key is not 64 lowercase hex characters");
    }
    if (entry.spec_json.size() > kCacheMaxSpecBytes) {
        fail_argument(fmt::format("cache entry spec JSON of {} bytes exceeds the limit of {}",
                                  entry.spec_json.size(), kCacheMaxSpecBytes));
    }
    if (uint64_t(entry.payload.size()) > kCacheMaxPayloadBytes) {
        fail_argument(fmt::format("cache entry payload of {} bytes exceeds the limit of {}",
                                  entry.payload.size(), kCacheMaxPayloadBytes));
    }
    std::string_view payload(entry.payload.data(), entry.payload.size());
    std::string out;
    out.reserve(kHeadBytes + entry.spec_json.size() + kMidBytes + payload.size());
    out.append(kMagic, sizeof(kMagic));
    put_u32(out, kCacheFormatVersion);
    out += id.key_hex;
    put_u32(out, uint32_t(entry.spec_json.size()));
    out += entry.spec_json;
    put_u64(out, uint64_t(payload.size()));
    std::array<uint8_t, 32> checksum = entry_checksum(out, payload);
    out.append(reinterpret_cast<const char*>(checksum.data()), checksum.size());
    out += payload;
    return out;
}

std::optional<CacheEntry> parse_cache_entry(const CacheEntryId& id, std::string_view bytes,
                                            std::string* problem) {
    auto reject = [&](std::string why) -> std::optional<CacheEntry> {
        if (problem) *problem = std::move(why);
        return std::nullopt;
    };
    // Every length is checked against what remains before it is used, by subtraction, so
    // no sum can overflow and no read can pass the end.
    if (bytes.empty()) return reject("empty file");
    if (bytes.size() < kHeadBytes) {
        return reject(fmt::format("truncated header ({} bytes)", bytes.size()));
    }
    const char* p = bytes.data();
    if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
        return reject("bad magic: not a rope-jit cache entry");
    }
    uint32_t format = get_u32(p + 8);
    if (format != kCacheFormatVersion) {
        return reject(
            fmt::format("format version {}, this build reads {}", format, kCacheFormatVersion));
    }
    if (bytes.substr(12, kKeyChars) != id.key_hex) {
        return reject("key echo does not match the key the entry is stored under");
    }
    uint32_t spec_size = get_u32(p + 12 + kKeyChars);
    if (spec_size > kCacheMaxSpecBytes) {
        return reject(fmt::format("spec JSON length {} exceeds the limit", spec_size));
    }
    size_t rest = bytes.size() - kHeadBytes;
    if (rest < spec_size) return reject("truncated spec JSON");
    rest -= spec_size;
    if (rest < kMidBytes) return reject("truncated header after the spec JSON");
    rest -= kMidBytes;
    const size_t payload_length_at = kHeadBytes + spec_size;
    uint64_t payload_size = get_u64(p + payload_length_at);
    if (payload_size > kCacheMaxPayloadBytes) {
        return reject(fmt::format("payload length {} exceeds the limit", payload_size));
    }
    if (rest < payload_size) {
        return reject(fmt::format("truncated payload ({} of {} bytes)", rest, payload_size));
    }
    if (rest > payload_size) {
        return reject(fmt::format("{} bytes of trailing garbage", rest - payload_size));
    }

    const size_t checksum_at = payload_length_at + 8;
    std::string_view payload = bytes.substr(checksum_at + kChecksumBytes);
    std::array<uint8_t, 32> expected = entry_checksum(bytes.substr(0, checksum_at), payload);
    if (std::memcmp(expected.data(), p + checksum_at, kChecksumBytes) != 0) {
        return reject("checksum mismatch");
    }

    CacheEntry entry;
    entry.spec_json.assign(p + kHeadBytes, spec_size);
    entry.payload.assign(payload.begin(), payload.end());
    return entry;
}

// ---- DiskCache --------------------------------------------------------------------------

DiskCache::DiskCache(std::string root, std::vector<std::string> read_only_roots, uint64_t max_bytes,
                     std::chrono::milliseconds rescan_interval)
    : root_(std::move(root)),
      read_only_roots_(std::move(read_only_roots)),
      max_bytes_(max_bytes),
      rescan_interval_(rescan_interval) {}

uint64_t DiskCache::default_max_bytes() {
    const char* value = std::getenv("ROPE_JIT_CACHE_MAX_BYTES");
    if (value == nullptr || *value == '\0') return kCacheDefaultMaxBytes;
    const ByteSize size = parse_byte_size(value);
    if (size.status == ByteSize::Status::too_large) {
        fail_argument(fmt::format(
            "ROPE_JIT_CACHE_MAX_BYTES: '{}' is too large (over 2^64 - 1 bytes)", value));
    }
    if (size.status != ByteSize::Status::ok) {
        fail_argument(
            fmt::format("ROPE_JIT_CACHE_MAX_BYTES: '{}' is not a size in bytes (like "
                        "1073741824, 500M or 2GiB; 0 = unbounded)",
                        value));
    }
    return size.bytes;
}

std::string DiskCache::default_root() {
    auto env = [](const char* name) -> std::string {
        const char* value = std::getenv(name);
        return value != nullptr ? value : "";
    };
    std::string dir = env("ROPE_JIT_CACHE_DIR");
    if (!dir.empty()) return dir;
    dir = env("XDG_CACHE_HOME");
    if (!dir.empty() && dir[0] == '/') return dir + "/rope_jit";
    dir = env("HOME");
    if (!dir.empty()) return dir + "/.cache/rope_jit";
    return {};
}

std::vector<std::string> DiskCache::default_read_only_roots() {
    std::vector<std::string> roots;
    const char* value = std::getenv("ROPE_JIT_CACHE_RO_DIRS");
    if (value == nullptr) return roots;
    std::string_view rest = value;
    while (!rest.empty()) {
        size_t colon = rest.find(':');
        std::string_view part = rest.substr(0, colon);
        if (!part.empty()) roots.emplace_back(part);
        if (colon == std::string_view::npos) break;
        rest.remove_prefix(colon + 1);
    }
    return roots;
}

std::string DiskCache::entry_path(const std::string& root, const CacheEntryId& id) const {
    std::string problem = id_problem(id);
    if (!problem.empty()) fail_argument("invalid cache entry id: " + problem);
    std::string path = root;
    for (const std::string& dir : subdirs(id)) {
        path += '/';
        path += dir;
    }
    return fmt::format("{}/{}.{}", path, id.key_hex, id.kind);
}

std::optional<CacheEntry> DiskCache::load(const CacheEntryId& id,
                                          const std::string* expected_spec_json) const {
    try {
        std::string problem = id_problem(id);
        if (!problem.empty()) {
            log_warning_once("disk_cache_bad_id:" + problem,
                             "kernel cache lookup skipped: invalid entry id: " + problem);
            return std::nullopt;
        }
        if (!root_.empty()) {
            // Never read our own root when others can write into it: a planted entry would
            // pass every check.
            auto dirs = subdirs(id);
            bool missing = false;
            problem = check_tree(root_, dirs.data(), dirs.size(), /*create=*/false, &missing);
            if (!problem.empty()) {
                log_warning_once(
                    warning_key(root_),
                    fmt::format("kernel cache directory '{}' is not used: {}", root_, problem));
            } else if (!missing) {
                if (auto entry = load_from(root_, id, /*owned=*/true, expected_spec_json)) {
                    return entry;
                }
            }
        }
        for (const std::string& root : read_only_roots_) {
            if (root.empty()) continue;
            // Bundles may belong to root (shared by every user) or to this user, and no one
            // else may be able to write on the way to the entry.
            const std::string path = entry_path(root, id);
            problem = trust_problem(root, path.substr(0, path.rfind('/')));
            if (!problem.empty()) {
                log_warning_once(
                    warning_key(root),
                    fmt::format("read-only kernel cache directory '{}' is not used: {}", root,
                                problem));
                continue;
            }
            if (auto entry = load_from(root, id, /*owned=*/false, expected_spec_json)) {
                return entry;
            }
        }
    } catch (...) {
        // A cache problem (even running out of memory reading one) must never fail the
        // caller, who can always compile instead.
    }
    return std::nullopt;
}

std::optional<CacheEntry> DiskCache::load_from(const std::string& root, const CacheEntryId& id,
                                               bool owned,
                                               const std::string* expected_spec_json) const {
    const std::string path = entry_path(root, id);
    std::string bytes, problem;
    // A second look only when a concurrent store replaced the bad file while we judged it.
    for (int attempt = 0; attempt < 2; ++attempt) {
        struct stat st;
        std::memset(&st, 0, sizeof(st));
        ReadResult result = read_entry_file(path, owned, &bytes, &problem, &st);
        if (result == ReadResult::Missing) return std::nullopt;
        if (result == ReadResult::Unavailable) {
            log_warning_once("disk_cache_unavailable:" + path,
                             fmt::format("kernel cache entry '{}' was not read ({}); compiled "
                                         "instead, the entry left as it is",
                                         path, problem));
            return std::nullopt;
        }
        if (result == ReadResult::Untrusted) {
            // Not ours to move: it stays, and a store replaces it by rename.
            log_warning_once(
                "disk_cache_untrusted:" + path,
                fmt::format("kernel cache entry '{}' is not trusted ({}); ignored", path, problem));
            return std::nullopt;
        }
        if (result == ReadResult::Ok) {
            if (auto entry = parse_cache_entry(id, bytes, &problem)) {
                // The key is a hash: a file under it holding another spec is a planted or
                // mixed-up kernel, never to be launched in place of the one asked for.
                if (expected_spec_json == nullptr || entry->spec_json == *expected_spec_json) {
                    // The size limit evicts by last use; relatime would rarely record it.
                    if (owned) {
                        const struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
                        utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW);
                    }
                    return entry;
                }
                problem = fmt::format("its stored spec {} is not the requested {}",
                                      entry->spec_json.substr(0, 200),
                                      expected_spec_json->substr(0, 200));
            }
        }
        if (!owned) break;
        bool replaced = false;
        std::string moved = set_aside(path, st, &replaced);
        if (!moved.empty()) {
            log_warning(
                fmt::format("kernel cache entry '{}' is damaged ({}); set aside as '{}' "
                            "and recompiled",
                            path, problem, moved));
            return std::nullopt;
        }
        if (!replaced) break;
    }
    // Left in place, it would be met again on every load of this id: say it once.
    log_warning_once(
        "disk_cache_bad_entry:" + path,
        fmt::format("kernel cache entry '{}' is damaged ({}); ignored", path, problem));
    return std::nullopt;
}

bool DiskCache::store(const CacheEntryId& id, const CacheEntry& entry) const {
    try {
        std::string problem = id_problem(id);
        if (!problem.empty()) {
            log_warning_once("disk_cache_bad_id:" + problem,
                             "kernel cache store skipped: invalid entry id: " + problem);
            return false;
        }
        if (root_.empty()) {
            log_warning_once(warning_key(root_),
                             "no kernel cache directory (set ROPE_JIT_CACHE_DIR, XDG_CACHE_HOME or "
                             "HOME); compiled kernels are kept in memory only");
            return false;
        }
        auto dirs = subdirs(id);
        problem = check_tree(root_, dirs.data(), dirs.size(), /*create=*/true, nullptr);
        if (!problem.empty()) {
            warn_unusable_root(root_, problem);
            return false;
        }
        const std::string final_path = entry_path(root_, id);
        const std::string bytes = serialize_cache_entry(id, entry);
        const std::string temp_path = final_path.substr(0, final_path.rfind('/') + 1) + temp_name();
        TempFileGuard temp(temp_path);

        // Readers only ever open the final name, which rename switches from one complete
        // file to another; the fsync first makes sure a crash cannot leave it pointing at
        // a file whose data never reached the disk.
        auto fail = [&](const char* what) {
            const int err = errno;
            warn_unusable_root(root_,
                               fmt::format("cannot {} '{}': {}", what, temp_path, errno_text(err)));
            return false;
        };
        temp.fd() =
            open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (temp.fd() < 0) {
            int err = errno;
            temp.published();  // not ours to delete: O_EXCL failed or nothing was created
            errno = err;
            return fail("create");
        }
        if (!write_all(temp.fd(), bytes.data(), bytes.size())) return fail("write");
        if (fsync(temp.fd()) != 0) return fail("sync");
        int fd = temp.fd();
        temp.fd() = -1;
        if (close(fd) != 0) return fail("close");
        if (rename(temp_path.c_str(), final_path.c_str()) != 0) {
            // A directory in place of the entry: move it aside like load() would, once.
            if (errno != EISDIR && errno != ENOTEMPTY && errno != EEXIST) return fail("rename");
            struct stat unknown;
            std::memset(&unknown, 0, sizeof(unknown));
            std::string moved = set_aside(final_path, unknown);
            if (moved.empty() || rename(temp_path.c_str(), final_path.c_str()) != 0) {
                return fail("rename");
            }
            log_warning(fmt::format("kernel cache entry '{}' was not a file; set aside as '{}'",
                                    final_path, moved));
        }
        temp.published();
        // No fsync of the directory: losing the rename in a crash only costs a recompile.
        try {
            evict(id, bytes.size());
        } catch (...) {
            // The entry is in place: a walk that failed (out of memory) leaves the limit to
            // the next store.
        }
        return true;
    } catch (...) {
        return false;
    }
}

std::optional<DiskCache::FileStamp> DiskCache::entry_file_stamp(const CacheEntryId& id) const {
    if (root_.empty()) return std::nullopt;
    try {
        struct stat st;
        if (lstat(entry_path(root_, id).c_str(), &st) != 0 || !S_ISREG(st.st_mode))
            return std::nullopt;
        return FileStamp{uint64_t(st.st_dev), uint64_t(st.st_ino), uint64_t(st.st_size),
                         int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
    } catch (...) {
        return std::nullopt;  // an invalid id, or no memory for its path: nothing to find
    }
}

bool DiskCache::writable(std::string* why, bool create) const {
    try {
        auto say = [&](std::string problem) {
            if (why) *why = std::move(problem);
            return false;
        };
        if (root_.empty()) return say("no cache directory configured");
        const std::string version_dir(kVersionDir);
        bool missing = false;
        std::string problem =
            check_tree(root_, &version_dir, 1, create, create ? nullptr : &missing);
        if (!problem.empty()) return say(problem);
        // Without `create`, a missing <root>/v1 is judged by the root that would hold it.
        const std::string top = missing ? root_ : root_ + "/" + version_dir;
        if (faccessat(AT_FDCWD, top.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
            return say(fmt::format("cannot write into '{}': {}", top, errno_text(errno)));
        }
        if (why) why->clear();
        return true;
    } catch (...) {
        if (why) *why = "out of memory";
        return false;
    }
}

void DiskCache::evict(const CacheEntryId& stored, uint64_t stored_bytes) const {
    if (max_bytes_ == 0) return;
    // Only this build's tree (format and NVRTC version): entries of other versions are not
    // ours to judge, and the lock files and temp files are never counted or removed.
    const std::string top = fmt::format("{}/{}/nvrtc{}", root_, kVersionDir, stored.nvrtc_version);
    // A walk at every store made n stores into one tree cost n^2/2 entry visits (16000 stores
    // into an empty root: 312 s, the last ones 38 ms each): walk only when this cache's own
    // writes since its last walk could pass the limit, or that walk is old (the constructor).
    LastWalk& last = *last_walk_;
    const uint64_t tree = std::hash<std::string>{}(top) | 1;  // never 0
    using Clock = std::chrono::steady_clock;
    const Clock::duration now = Clock::now().time_since_epoch();
    if (last.tree.load() == tree && now - Clock::duration(last.when.load()) < rescan_interval_) {
        // An entry stored over another counts twice: that only brings the next walk sooner.
        if (last.bytes.fetch_add(stored_bytes) + stored_bytes <= max_bytes_) return;
    }
    const std::string keep = entry_path(root_, stored);
    struct Candidate {
        std::string path;
        uint64_t bytes;
        int64_t used_ns;
    };
    std::vector<Candidate> entries;
    uint64_t total = 0;
    // A directory to walk: a real directory (never a link out of the cache) that is safe.
    auto safe_dir = [](const std::string& path) {
        struct stat st;
        return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
               unsafe_dir_problem(path, st).empty();
    };
    auto ns = [](const struct timespec& t) { return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec; };
    for (const std::string& target : sorted_names(top)) {
        const std::string target_dir = top + "/" + target;
        if (classify_layout_name(1, target) != LayoutName::Directory || !safe_dir(target_dir)) {
            continue;
        }
        for (const std::string& prefix : sorted_names(target_dir)) {
            const std::string prefix_dir = target_dir + "/" + prefix;
            if (classify_layout_name(2, prefix) != LayoutName::Directory || !safe_dir(prefix_dir)) {
                continue;
            }
            for (const std::string& name : sorted_names(prefix_dir)) {
                if (classify_layout_name(3, name) != LayoutName::Entry) continue;
                const std::string path = prefix_dir + "/" + name;
                struct stat st;
                if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
                    st.st_uid != geteuid()) {
                    continue;
                }
                entries.push_back(
                    {path, uint64_t(st.st_size), std::max(ns(st.st_atim), ns(st.st_mtim))});
                total += uint64_t(st.st_size);
            }
        }
    }
    if (total > max_bytes_) {
        std::sort(entries.begin(), entries.end(), [](const Candidate& a, const Candidate& b) {
            return a.used_ns != b.used_ns ? a.used_ns < b.used_ns : a.path < b.path;
        });
    }
    // unlink is atomic: a loader that opened the file reads it whole, one that comes later
    // misses and recompiles. Another process evicting at once only makes some unlinks ENOENT.
    for (const Candidate& entry : entries) {
        if (total <= max_bytes_) break;
        if (entry.path == keep) continue;
        if (unlink(entry.path.c_str()) == 0) {
            total -= entry.bytes;
            evictions_->fetch_add(1, std::memory_order_relaxed);
        } else if (errno == ENOENT) {
            total -= entry.bytes;  // another process evicted it first
        }
    }
    last.bytes.store(total);
    last.when.store(now.count());
    last.tree.store(tree);
}

std::vector<DiskCache::EntryReport> DiskCache::verify(const std::string& root) const {
    std::vector<EntryReport> reports;
    const bool own_root = root == root_;
    // Why directories above the root are not to be trusted ("" when they are): inherited by
    // every entry found.
    const std::string root_problem = trust_problem(root, root);
    // levels: [0] nvrtc<ver>, [1] target, [2] key prefix; entries live one level below.
    std::function<void(const std::string&, std::vector<std::string>&, const std::string&)> walk =
        [&](const std::string& dir, std::vector<std::string>& levels,
            const std::string& inherited_problem) {
            std::string dir_problem = inherited_problem;
            struct stat dir_st;
            if (dir_problem.empty() && lstat(dir.c_str(), &dir_st) == 0) {
                if (!trusted_owner(dir_st)) {
                    dir_problem = fmt::format(
                        "'{}' is owned by uid {}, neither this user (uid {}) "
                        "nor root",
                        dir, unsigned(dir_st.st_uid), unsigned(geteuid()));
                } else if (others_can_write(dir_st)) {
                    dir_problem = others_can_write_problem(dir);
                }
            }
            int error = 0;
            const std::vector<std::string> names = sorted_names(dir, &error);
            // No descriptor or memory to list it with now: reported, prune would remove a
            // whole directory of good entries for it. Stop the walk instead.
            if (transient_open_error(error))
                throw Error(ROPE_JIT_ERROR_CACHE,
                            fmt::format("cannot list '{}' now: {}; the walk of the cache stopped "
                                        "there, nothing was changed",
                                        dir, errno_text(error)));
            // A directory this user cannot list hides whatever it holds: say so, rather than
            // report a cache that looks clean (missing is fine: removed meanwhile, or no cache).
            if (error != 0 && error != ENOENT) {
                EntryReport report;
                report.path = dir;
                report.is_directory = true;
                report.problem =
                    fmt::format("cannot list this directory: {}",
                                std::error_code(error, std::generic_category()).message());
                struct stat unlisted;
                if (lstat(dir.c_str(), &unlisted) == 0) {  // (its times need no listing)
                    report.modified = int64_t(unlisted.st_mtime);
                    report.accessed = int64_t(unlisted.st_atime);
                }
                reports.push_back(std::move(report));
                return;
            }
            const size_t depth = levels.size();
            for (const std::string& name : names) {
                const LayoutName kind = classify_layout_name(depth, name);
                if (kind == LayoutName::Foreign) continue;  // not the cache's: never reported
                EntryReport report;
                report.path = dir + "/" + name;
                struct stat st;
                if (lstat(report.path.c_str(), &st) != 0) continue;  // removed meanwhile
                const bool is_dir = S_ISDIR(st.st_mode);
                if (is_dir && kind != LayoutName::Directory &&
                    !cache_file_directory_is_empty(report.path))
                    continue;  // not the cache's: never reported
                report.is_directory = is_dir;
                report.file_bytes = uint64_t(st.st_size);
                report.modified = int64_t(st.st_mtime);
                report.accessed = int64_t(st.st_atime);
                if (kind == LayoutName::Temp) {
                    report.found = Found::TempFile;
                    report.problem = "leftover temp file of an interrupted or ongoing write";
                } else if (kind == LayoutName::SetAside) {
                    report.found = Found::SetAside;
                    report.problem = "entry set aside earlier as damaged";
                } else if (kind == LayoutName::Directory) {
                    if (is_dir) {
                        levels.push_back(name);
                        walk(report.path, levels, dir_problem);
                        levels.pop_back();
                        continue;
                    }
                    report.problem = "not a directory in place of a directory of the layout";
                } else {
                    CacheEntryId id;
                    id.key_hex = name.substr(0, kKeyChars);
                    id.kind = name.substr(kKeyChars + 1);
                    id.nvrtc_version = levels[0].substr(5);
                    id.target = levels[1];
                    report.key_hex = id.key_hex;
                    report.nvrtc_version = id.nvrtc_version;
                    report.target = id.target;
                    report.kind = id.kind;
                    if (levels[2] != id.key_hex.substr(0, 2)) {
                        report.problem = "entry is in the wrong key prefix directory";
                    } else {
                        report.found = Found::Entry;
                        std::string bytes;
                        // In our own root a symbolic link is damage, exactly as load() sees it.
                        ReadResult result = read_entry_file(report.path, /*no_follow=*/own_root,
                                                            &bytes, &report.problem, &st,
                                                            /*keep_atime=*/true);
                        if (result == ReadResult::Missing) continue;  // removed meanwhile
                        // Reported as damage, prune would delete a good entry: stop instead.
                        if (result == ReadResult::Unavailable)
                            throw Error(ROPE_JIT_ERROR_CACHE,
                                        fmt::format("'{}': {}; the walk of the cache stopped "
                                                    "there, nothing was changed",
                                                    report.path, report.problem));
                        if (result == ReadResult::Untrusted || !dir_problem.empty()) {
                            report.untrusted = true;
                            report.problem = "not trusted: " +
                                             (dir_problem.empty() ? report.problem : dir_problem);
                        } else if (result == ReadResult::Ok) {
                            if (auto entry = parse_cache_entry(id, bytes, &report.problem)) {
                                report.ok = true;
                                report.spec_json = std::move(entry->spec_json);
                                report.payload_bytes = entry->payload.size();
                            }
                        }
                    }
                }
                reports.push_back(std::move(report));
            }
        };
    std::vector<std::string> levels;
    walk(root + "/" + std::string(kVersionDir), levels, root_problem);
    return reports;
}

}  // namespace rope_jit
