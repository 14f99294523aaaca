// The on-disk kernel cache (DESIGN.md, "The disk cache"): one file per compiled kernel under a
// root directory. Files are published by rename, so readers never lock and never see a
// partial file; every read is checked, so a damaged file is a miss that the caller recompiles,
// never a crash. Nothing here throws out of load() or store(): a cache problem degrades to a
// warning and an in-memory run.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rope_jit {

// Identifies one entry. Every field is part of the entry's path, so each is validated
// (load/store refuse an invalid id; entry_path throws).
struct CacheEntryId {
    // 64 lowercase hex chars: the SHA-256 the caller computes over the template digest, the
    // spec, the NVRTC options, the NVRTC version, the target and kCacheFormatVersion.
    std::string key_hex;
    // "MAJOR.MINOR" of NVRTC, e.g. "13.0". Characters [A-Za-z0-9._-], not starting with '.'.
    std::string nvrtc_version;
    // The compile target, e.g. "sm_90". Same character rule as nvrtc_version.
    std::string target;
    // The file extension: "cubin" or "ptx" ([A-Za-z0-9_]+).
    std::string kind;
};

struct CacheEntry {
    // The spec the kernel was built for, as JSON; stored for listing, not interpreted here.
    std::string spec_json;
    // The cubin or PTX bytes.
    std::vector<char> payload;
};

// Bumped whenever the entry file layout changes; the path's "v1" follows it.
constexpr uint32_t kCacheFormatVersion = 1;
// Lengths above these are taken as corruption rather than trusted for an allocation: a spec
// is a few hundred bytes and a cubin a few MiB. A file is judged by its header before more
// of it is read, so a huge file in place of an entry costs a few bytes of reading, not its
// size (rope_jit.h and the README state the payload limit).
constexpr uint32_t kCacheMaxSpecBytes = 1u << 20;
constexpr uint64_t kCacheMaxPayloadBytes = uint64_t(64) << 20;
// The size limit of a writable root when neither the config nor $ROPE_JIT_CACHE_MAX_BYTES
// sets one.
constexpr uint64_t kCacheDefaultMaxBytes = uint64_t(1) << 30;
// How old a cache's last walk of its tree for the size limit may be before a store walks it
// again although the cache's own writes since then fit (DiskCache's constructor).
constexpr std::chrono::milliseconds kCacheRescanInterval{1000};

// What a name found at `depth` below <root>/v<N> is in the cache layout, by the name alone:
// depth 0 holds nvrtc<version> directories, 1 target directories (sm_90, sm_90a,
// compute_90), 2 key-prefix directories (2 lowercase hex), 3 entries ("<64 hex>.<kind>"),
// temp files (".tmp-<pid>-<hex>-<n>") and set-aside entries; a layout name followed by
// ".bad-<pid>-<n>" is set aside at any depth. Everything else is foreign: not the cache's,
// so never reported by verify and never removed (a mistaken root must lose nothing).
enum class LayoutName { Foreign, Directory, Entry, Temp, SetAside };
LayoutName classify_layout_name(size_t depth, std::string_view name);

// The names in `dir` but "." and "..", sorted; `*error` (when given) is errno when it cannot
// be listed, else 0. Shared by the cache's walks (verify here, scan and removal in
// cache_maintenance).
std::vector<std::string> sorted_names(const std::string& dir, int* error = nullptr);

// Whether `path` is a directory the cache may hold under a name it gives files (an entry, a
// temp file, a set-aside entry): only an empty one. The cache never writes such directories,
// so one holding anything (or that cannot be listed) is someone else's, never reported or
// removed; an empty one is damage in the entry's place.
bool cache_file_directory_is_empty(const std::string& path);

class DiskCache {
public:
    // root: the writable root, "" for none (then only read_only_roots are read).
    // read_only_roots: searched after root, in order; never written, never modified.
    // max_bytes: after a store, the least recently used entries of the stored entry's
    // nvrtc<version> directory in root are removed until those entries fit (0 = unbounded).
    // Finding them means walking that tree (about 2.5 us an entry), so a store walks it only
    // when this cache's own writes since its last walk could pass the limit, or that walk is
    // older than rescan_interval (others write too): the tree may exceed the limit by what
    // other processes and caches stored since this cache's last walk, never by its own writes.
    // Touches nothing on disk: directories are created by the first store() or writable().
    DiskCache(std::string root, std::vector<std::string> read_only_roots, uint64_t max_bytes = 0,
              std::chrono::milliseconds rescan_interval = kCacheRescanInterval);

    // $ROPE_JIT_CACHE_DIR, else $XDG_CACHE_HOME/rope_jit (when absolute, as the XDG spec
    // requires), else $HOME/.cache/rope_jit; "" when none is set (empty counts as unset).
    static std::string default_root();
    // $ROPE_JIT_CACHE_RO_DIRS split at ':', empty parts dropped.
    static std::vector<std::string> default_read_only_roots();
    // $ROPE_JIT_CACHE_MAX_BYTES (a size as common/byte_size.h reads it: 1073741824, 500M,
    // 2G, 2GiB; 0 = unbounded), else kCacheDefaultMaxBytes. Throws Error(INVALID_ARGUMENT)
    // naming the variable for any other value.
    static uint64_t default_max_bytes();

    // <root>/v1/nvrtc<ver>/<target>/<first 2 hex of key>/<key>.<kind>. Throws rope_jit::Error
    // (ERROR_INVALID_ARGUMENT) for an invalid id.
    std::string entry_path(const std::string& root, const CacheEntryId& id) const;

    // The first valid entry for id in root, then in each read-only root; nullopt for a miss.
    // A file there that fails any check (unreadable, truncated, wrong magic, format, key echo
    // or checksum, a stored spec other than *expected_spec_json when that is given, a
    // directory or other non-file in its place) counts as a miss and gets a warning; in root
    // it is also renamed to <path>.bad-<pid>-<n> so the next store replaces it. Only trusted
    // files are read (see trust_problem below): an untrusted one is a miss with one warning,
    // left in place; root is not read at all when it is unsafe (see writable()), nor a
    // read-only root whose directories fail the trust rule. A hit in root refreshes the
    // entry's access time, which the size limit evicts by. Never throws.
    std::optional<CacheEntry> load(const CacheEntryId& id,
                                   const std::string* expected_spec_json = nullptr) const;

    // Writes the entry under root atomically (temp file ".tmp-..." in the entry's directory,
    // fsync, rename over the final path; directories created with mode 0700). Concurrent
    // stores of one id from any threads or processes are safe: the last rename wins and
    // every reader sees one complete entry. Then, with a size limit, evicts (see the
    // constructor): only entry-named files of this layout are counted and removed, never
    // temp files, lock files, other NVRTC versions or formats, and never the entry just
    // stored; a process loading an evicted entry at that moment either reads it whole (it
    // holds it open) or misses and recompiles. Returns false, with one warning per root per
    // process, when root is "" or unusable (see writable()) or a write fails (disk full...);
    // no temp file is left behind. Never throws.
    bool store(const CacheEntryId& id, const CacheEntry& entry) const;

    // Whether store() can write under root: it exists or can be created (with `create`, this
    // creates <root>/v1; without, a missing <root>/v1 is judged by the root, which must
    // exist), it and <root>/v1 are directories owned by this user that no other user can
    // write (no group or world write bit, sticky or not: others could plant entries), every
    // directory above the root is owned by this user or root and writable by others only
    // with the sticky bit (/tmp), and the user may write there. On false, *why (when given)
    // says which check failed. Never throws.
    bool writable(std::string* why = nullptr, bool create = true) const;

    // What identifies the regular file at id's entry path in root (device, inode, size,
    // modification time), or nullopt where there is none: a stat, nothing read or checked. A
    // waiter for a peer's compile polls it for a file that was not there, or not that one,
    // when it began (load() then judges the entry). Never throws.
    struct FileStamp {
        uint64_t device = 0, inode = 0, size = 0;
        int64_t modified_ns = 0;
        bool operator==(const FileStamp& o) const {
            return device == o.device && inode == o.inode && size == o.size &&
                   modified_ns == o.modified_ns;
        }
    };
    std::optional<FileStamp> entry_file_stamp(const CacheEntryId& id) const;

    uint64_t max_bytes() const { return max_bytes_; }
    // Entries the size limit removed after this cache's stores (rope_jit_stats.disk_evictions:
    // a prewarm that says "written" can tell that the limit took some back).
    uint64_t evictions() const { return evictions_->load(std::memory_order_relaxed); }

    const std::string& root() const { return root_; }
    const std::vector<std::string>& read_only_roots() const { return read_only_roots_; }

    // What a path found by verify() is, by its name and place (before its content is read).
    enum class Found {
        Entry,     // named and placed like an entry: `ok` says whether it passed every check
        TempFile,  // ".tmp-*": a write in progress, or one a crash interrupted
        SetAside,  // "*.bad-*": an entry an earlier load found damaged and renamed
        Stray      // anything else: a file outside the layout, an entry in the wrong place
    };
    // One file or directory found under <root>/v1 by verify().
    struct EntryReport {
        std::string path;
        Found found = Found::Stray;
        bool ok = false;
        std::string problem;      // why it is not a usable entry; "" when ok
        uint64_t file_bytes = 0;  // st_size as lstat reports it (a directory's own size)
        bool is_directory = false;
        int64_t modified = 0;        // st_mtime, seconds since the epoch
        int64_t accessed = 0;        // st_atime, seconds since the epoch
        std::string key_hex;         // from the file name, when it has the entry form
        std::string spec_json;       // when ok
        bool untrusted = false;      // an entry that fails the trust rule; `problem` says why
        uint64_t payload_bytes = 0;  // when ok
        std::string nvrtc_version;   // from the path, when it has the entry layout
        std::string target;
        std::string kind;
    };
    // Walks <root>/v1 (any root, read-only ones included) and checks every entry the way
    // load() does, without changing anything (access times included where the file system
    // allows O_NOATIME: they tell prune which entries are used). Reports, besides entries,
    // untrusted entries (owned by another user, or below a directory others can write),
    // leftover temp files, entries set aside earlier, directories or other files in place of
    // entries or layout directories, entries whose key echo does not match their file name
    // and directories that cannot be listed. Foreign names (classify_layout_name) are not
    // reported, nor walked into. Depth first, names sorted within each directory; empty when
    // <root>/v1 does not exist.
    std::vector<EntryReport> verify(const std::string& root) const;

private:
    std::optional<CacheEntry> load_from(const std::string& root, const CacheEntryId& id, bool owned,
                                        const std::string* expected_spec_json) const;
    void evict(const CacheEntryId& stored, uint64_t stored_bytes) const;

    std::string root_;
    std::vector<std::string> read_only_roots_;
    uint64_t max_bytes_ = 0;
    std::chrono::milliseconds rescan_interval_;
    // What the last walk for the size limit found, shared by copies like evictions_. Atomics,
    // not a mutex: a fork() while another thread walks must not leave the child a lock that
    // no thread of it will release. Threads racing on them only move the next walk.
    struct LastWalk {
        std::atomic<uint64_t> tree{0};  // hash of the nvrtc<version> directory; 0: none yet
        std::atomic<std::chrono::steady_clock::rep> when{0};  // steady clock, since its epoch
        // Its entries' bytes after its evictions, plus this cache's stores since.
        std::atomic<uint64_t> bytes{0};
    };
    std::shared_ptr<LastWalk> last_walk_ = std::make_shared<LastWalk>();
    // Shared by copies, which are the same cache.
    std::shared_ptr<std::atomic<uint64_t>> evictions_ = std::make_shared<std::atomic<uint64_t>>(0);
};

// The trust rule for reading a cache (the rule ssh applies to its files): why the entries in
// directory `dir` of cache root `root` must not be trusted, or "". Every directory from "/"
// down to `dir` (symbolic links resolved) must be owned by this user or root; from the root
// down none may be writable by group or others (a sticky bit does not stop others creating
// files), above the root only with the sticky bit (as /tmp: others may create files there
// but not replace ours). A missing directory is no problem (a miss).
std::string trust_problem(const std::string& root, const std::string& dir);
// Why one file (its lstat or fstat) must not be trusted, or "": it must be owned by this
// user or root and not writable by group or others.
std::string untrusted_file_problem(const struct stat& st);

// The entry file format, little-endian:
//   "RJITCACH"            8 bytes
//   format version        u32 (kCacheFormatVersion)
//   key echo              64 bytes, the key_hex the entry is stored under
//   spec JSON length      u32, then the spec JSON bytes
//   payload length        u64
//   checksum              32 bytes: SHA-256 of every other byte of the file (the header
//                         fields, the spec JSON and the payload), so a flip anywhere is caught
//   payload
// Throws rope_jit::Error (ERROR_INVALID_ARGUMENT) for an invalid key or lengths over the
// limits above.
std::string serialize_cache_entry(const CacheEntryId& id, const CacheEntry& entry);

// The entry in `bytes`, or nullopt with *problem (when given) saying what is wrong: empty,
// truncated, bad magic, unknown format, key echo other than id.key_hex, lengths over the
// limits, trailing bytes, checksum mismatch. Only id.key_hex is used. Reads nothing outside
// `bytes` whatever they contain, and never throws except std::bad_alloc.
std::optional<CacheEntry> parse_cache_entry(const CacheEntryId& id, std::string_view bytes,
                                            std::string* problem);

}  // namespace rope_jit
