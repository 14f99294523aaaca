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
#include <cstdlib>
#include <cstring>
#include <functional>
#include <system_error>
#include <thread>

#include <fmt/format.h>

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

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

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

// Why a directory must not be trusted, or "" when it may be. Anyone who can write into it
// could plant a kernel with a valid checksum, or swap files under us.
std::string unsafe_dir_problem(const std::string& path, const struct stat& st) {
    if (st.st_uid != geteuid()) {
        return fmt::format("'{}' is owned by uid {}, not by this user (uid {})", path,
                           unsigned(st.st_uid), unsigned(geteuid()));
    }
    if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
        return fmt::format("'{}' is world-writable without the sticky bit", path);
    }
    return {};
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
            // moves the thing aside and carries on.
            if (!create && missing) {
                *missing = true;
                return {};
            }
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

enum class ReadResult { ok, missing, bad };

// Reads a whole entry file. `no_follow` for our own root, where we never create symlinks.
// `keep_atime` for inspection (verify): the access time is what tells used entries from
// unused ones when pruning, so looking at an entry must not count as using it.
ReadResult read_entry_file(const std::string& path, bool no_follow, std::string* bytes,
                           std::string* problem, struct stat* st, bool keep_atime = false) {
    // O_NONBLOCK so a FIFO planted in place of an entry cannot hang the caller.
    int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (no_follow ? O_NOFOLLOW : 0);
    int fd = keep_atime ? open(path.c_str(), flags | O_NOATIME) : -1;
    // O_NOATIME is refused (EPERM) on files of other users: read those like load() does.
    if (fd < 0) fd = open(path.c_str(), flags);
    if (fd < 0) {
        int err = errno;
        if (err == ENOENT || err == ENOTDIR) return ReadResult::missing;
        *problem = err == ELOOP && no_follow ? "a symbolic link in place of the entry"
                                             : "cannot open: " + errno_text(err);
        if (lstat(path.c_str(), st) != 0) std::memset(st, 0, sizeof(*st));
        return ReadResult::bad;
    }
    struct Closer {
        int fd;
        ~Closer() { close(fd); }
    } closer{fd};

    if (fstat(fd, st) != 0) {
        *problem = "cannot stat: " + errno_text(errno);
        return ReadResult::bad;
    }
    if (S_ISDIR(st->st_mode)) {
        *problem = "a directory in place of the entry";
        return ReadResult::bad;
    }
    if (!S_ISREG(st->st_mode)) {
        *problem = "not a regular file";
        return ReadResult::bad;
    }
    if (uint64_t(st->st_size) > kMaxFileBytes) {
        *problem =
            fmt::format("file of {} bytes is larger than any valid entry", uint64_t(st->st_size));
        return ReadResult::bad;
    }
    bytes->clear();
    bytes->reserve(size_t(st->st_size));
    char buffer[1 << 16];
    for (;;) {
        ssize_t n = read(fd, buffer, sizeof(buffer));
        if (n < 0) {
            if (errno == EINTR) continue;
            *problem = "cannot read: " + errno_text(errno);
            return ReadResult::bad;
        }
        if (n == 0) break;
        bytes->append(buffer, size_t(n));
        if (bytes->size() > kMaxFileBytes) {
            *problem = "file is larger than any valid entry";
            return ReadResult::bad;
        }
    }
    return ReadResult::ok;
}

// For a read-only root: why it must not be trusted, or "". Unlike our own root it may belong
// to another user and hold symbolic links, but no directory on the way to an entry may be
// world-writable without the sticky bit. Missing directories are no problem (a miss).
std::string shared_tree_problem(const std::string& root, const std::string* subdir_list,
                                size_t count) {
    std::string path = root;
    for (size_t i = 0;; ++i) {
        struct stat st;
        if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return {};
        if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
            return fmt::format("'{}' is world-writable without the sticky bit", path);
        }
        if (i == count) return {};
        path += '/';
        path += subdir_list[i];
    }
}

std::string warning_key(const std::string& root) { return "disk_cache_root:" + root; }

void warn_unusable_root(const std::string& root, const std::string& problem) {
    log_warning_once(warning_key(root),
                     fmt::format("kernel cache directory '{}' is not used for writing: {}; "
                                 "compiled kernels are kept in memory only",
                                 root, problem));
}

}  // namespace

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

DiskCache::DiskCache(std::string root, std::vector<std::string> read_only_roots)
    : root_(std::move(root)), read_only_roots_(std::move(read_only_roots)) {}

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

std::optional<CacheEntry> DiskCache::load(const CacheEntryId& id) const {
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
                if (auto entry = load_from(root_, id, /*owned=*/true)) return entry;
            }
        }
        for (const std::string& root : read_only_roots_) {
            if (root.empty()) continue;
            // Bundles may belong to anyone (root, an admin), but not be open to every writer.
            auto dirs = subdirs(id);
            problem = shared_tree_problem(root, dirs.data(), dirs.size());
            if (!problem.empty()) {
                log_warning_once(warning_key(root),
                                 fmt::format("read-only kernel cache directory '{}' is not used: {}",
                                             root, problem));
                continue;
            }
            if (auto entry = load_from(root, id, /*owned=*/false)) return entry;
        }
    } catch (...) {
        // A cache problem (even running out of memory reading one) must never fail the
        // caller, who can always compile instead.
    }
    return std::nullopt;
}

std::optional<CacheEntry> DiskCache::load_from(const std::string& root, const CacheEntryId& id,
                                               bool owned) const {
    const std::string path = entry_path(root, id);
    std::string bytes, problem;
    // A second look only when a concurrent store replaced the bad file while we judged it.
    for (int attempt = 0; attempt < 2; ++attempt) {
        struct stat st;
        std::memset(&st, 0, sizeof(st));
        ReadResult result = read_entry_file(path, owned, &bytes, &problem, &st);
        if (result == ReadResult::missing) return std::nullopt;
        if (result == ReadResult::ok) {
            if (auto entry = parse_cache_entry(id, bytes, &problem)) return entry;
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
        return true;
    } catch (...) {
        return false;
    }
}

bool DiskCache::writable(std::string* why) const {
    try {
        auto say = [&](std::string problem) {
            if (why) *why = std::move(problem);
            return false;
        };
        if (root_.empty()) return say("no cache directory configured");
        const std::string version_dir(kVersionDir);
        std::string problem = check_tree(root_, &version_dir, 1, /*create=*/true, nullptr);
        if (!problem.empty()) return say(problem);
        const std::string top = root_ + "/" + version_dir;
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

std::vector<DiskCache::EntryReport> DiskCache::verify(const std::string& root) const {
    std::vector<EntryReport> reports;
    // levels: [0] nvrtc<ver>, [1] target, [2] key prefix; entries live one level below.
    std::function<void(const std::string&, std::vector<std::string>&)> walk =
        [&](const std::string& dir, std::vector<std::string>& levels) {
            int error = 0;
            const std::vector<std::string> names = sorted_names(dir, &error);
            // A directory this user cannot list hides whatever it holds: say so, rather than
            // report a cache that looks clean (missing is fine: removed meanwhile, or no cache).
            if (error != 0 && error != ENOENT) {
                EntryReport report;
                report.path = dir;
                report.is_directory = true;
                report.problem = fmt::format("cannot list this directory: {}",
                                             std::error_code(error, std::generic_category()).message());
                reports.push_back(std::move(report));
                return;
            }
            for (const std::string& name : names) {
                EntryReport report;
                report.path = dir + "/" + name;
                struct stat st;
                if (lstat(report.path.c_str(), &st) != 0) continue;  // removed meanwhile
                const bool is_dir = S_ISDIR(st.st_mode);
                report.is_directory = is_dir;
                report.file_bytes = uint64_t(st.st_size);
                report.modified = int64_t(st.st_mtime);
                report.accessed = int64_t(st.st_atime);
                if (name.compare(0, kTempPrefix.size(), kTempPrefix) == 0) {
                    report.found = Found::temp_file;
                    report.problem = "leftover temp file of an interrupted or ongoing write";
                } else if (name.find(kBadMarker) != std::string::npos) {
                    report.found = Found::set_aside;
                    report.problem = "entry set aside earlier as damaged";
                } else if (levels.size() < 3) {
                    if (is_dir) {
                        levels.push_back(name);
                        walk(report.path, levels);
                        levels.pop_back();
                        continue;
                    }
                    report.problem = "unexpected file outside the entry layout";
                } else {
                    size_t dot = name.find('.');
                    CacheEntryId id;
                    if (dot == kKeyChars) {
                        id.key_hex = name.substr(0, dot);
                        id.kind = name.substr(dot + 1);
                    }
                    if (levels[0].compare(0, 5, "nvrtc") == 0) {
                        id.nvrtc_version = levels[0].substr(5);
                    }
                    id.target = levels[1];
                    report.key_hex = id.key_hex;
                    report.nvrtc_version = id.nvrtc_version;
                    report.target = id.target;
                    report.kind = id.kind;
                    std::string problem = id_problem(id);
                    if (!problem.empty()) {
                        report.problem = is_dir ? "unexpected directory in the entry layout"
                                                : "not an entry of the cache layout: " + problem;
                    } else if (levels[2] != id.key_hex.substr(0, 2)) {
                        report.problem = "entry is in the wrong key prefix directory";
                    } else {
                        report.found = Found::entry;
                        std::string bytes;
                        // In our own root a symbolic link is damage, exactly as load() sees it.
                        ReadResult result = read_entry_file(report.path, /*no_follow=*/root == root_,
                                                            &bytes, &report.problem, &st,
                                                            /*keep_atime=*/true);
                        if (result == ReadResult::missing) continue;  // removed meanwhile
                        if (result == ReadResult::ok) {
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
    walk(root + "/" + std::string(kVersionDir), levels);
    return reports;
}

}  // namespace rope_jit
