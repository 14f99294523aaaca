// The on-disk kernel cache (DESIGN.md, "The disk cache"): one file per compiled kernel under a
// root directory. Files are published by rename, so readers never lock and never see a
// partial file; every read is checked, so a damaged file is a miss that the caller recompiles,
// never a crash. Nothing here throws out of load() or store(): a cache problem degrades to a
// warning and an in-memory run.
#pragma once

#include <cstdint>
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
// Lengths above these are taken as corruption rather than trusted for an allocation.
constexpr uint32_t kCacheMaxSpecBytes = 1u << 20;
constexpr uint64_t kCacheMaxPayloadBytes = uint64_t(1) << 30;

// The names in `dir` but "." and "..", sorted; `*error` (when given) is errno when it cannot
// be listed, else 0. Shared by the cache's walks (verify here, scan and removal in
// cache_maintenance).
std::vector<std::string> sorted_names(const std::string& dir, int* error = nullptr);

class DiskCache {
public:
    // root: the writable root, "" for none (then only read_only_roots are read).
    // read_only_roots: searched after root, in order; never written, never modified.
    // Touches nothing on disk: directories are created by the first store() or writable().
    DiskCache(std::string root, std::vector<std::string> read_only_roots);

    // $ROPE_JIT_CACHE_DIR, else $XDG_CACHE_HOME/rope_jit (when absolute, as the XDG spec
    // requires), else $HOME/.cache/rope_jit; "" when none is set (empty counts as unset).
    static std::string default_root();
    // $ROPE_JIT_CACHE_RO_DIRS split at ':', empty parts dropped.
    static std::vector<std::string> default_read_only_roots();

    // <root>/v1/nvrtc<ver>/<target>/<first 2 hex of key>/<key>.<kind>. Throws rope_jit::Error
    // (ERROR_INVALID_ARGUMENT) for an invalid id.
    std::string entry_path(const std::string& root, const CacheEntryId& id) const;

    // The first valid entry for id in root, then in each read-only root; nullopt for a miss.
    // A file there that fails any check (unreadable, truncated, wrong magic, format, key echo
    // or checksum, a directory or other non-file in its place) counts as a miss and gets a
    // warning; in root it is also renamed to <path>.bad-<pid>-<n> so the next store replaces
    // it. root is not read when it is unsafe (see writable()); a read-only root is skipped,
    // with one warning, when it or a directory below it on the entry's path is world-writable
    // without the sticky bit (it may belong to another user). Never throws.
    std::optional<CacheEntry> load(const CacheEntryId& id) const;

    // Writes the entry under root atomically (temp file ".tmp-..." in the entry's directory,
    // fsync, rename over the final path; directories created with mode 0700). Concurrent
    // stores of one id from any threads or processes are safe: the last rename wins and
    // every reader sees one complete entry. Returns false, with one warning per root per
    // process, when root is "" or unusable (see writable()) or a write fails (disk full...);
    // no temp file is left behind. Never throws.
    bool store(const CacheEntryId& id, const CacheEntry& entry) const;

    // Whether store() can write under root: it exists or can be created (this creates
    // <root>/v1), it and <root>/v1 are directories owned by this user and not world-writable
    // without the sticky bit (others could plant or swap entries), and the user may write
    // there. On false, *why (when given) says which check failed. Never throws.
    bool writable(std::string* why = nullptr) const;

    const std::string& root() const { return root_; }
    const std::vector<std::string>& read_only_roots() const { return read_only_roots_; }

    // What a path found by verify() is, by its name and place (before its content is read).
    enum class Found {
        entry,      // named and placed like an entry: `ok` says whether it passed every check
        temp_file,  // ".tmp-*": a write in progress, or one a crash interrupted
        set_aside,  // "*.bad-*": an entry an earlier load found damaged and renamed
        stray       // anything else: a file outside the layout, an entry in the wrong place
    };
    // One file or directory found under <root>/v1 by verify().
    struct EntryReport {
        std::string path;
        Found found = Found::stray;
        bool ok = false;
        std::string problem;         // why it is not a usable entry; "" when ok
        uint64_t file_bytes = 0;     // st_size as lstat reports it (a directory's own size)
        bool is_directory = false;
        int64_t modified = 0;        // st_mtime, seconds since the epoch
        int64_t accessed = 0;        // st_atime, seconds since the epoch
        std::string key_hex;         // from the file name, when it has the entry form
        std::string spec_json;       // when ok
        uint64_t payload_bytes = 0;  // when ok
        std::string nvrtc_version;   // from the path, when it has the entry layout
        std::string target;
        std::string kind;
    };
    // Walks <root>/v1 (any root, read-only ones included) and checks every entry the way
    // load() does, without changing anything (access times included where the file system
    // allows O_NOATIME: they tell prune which entries are used). Reports, besides entries,
    // leftover temp files,
    // entries set aside earlier, directories or other files in place of entries, files
    // outside the layout and entries whose key echo does not match their file name. Depth
    // first, names sorted within each directory; empty when <root>/v1 does not exist.
    std::vector<EntryReport> verify(const std::string& root) const;

private:
    std::optional<CacheEntry> load_from(const std::string& root, const CacheEntryId& id,
                                        bool owned) const;

    std::string root_;
    std::vector<std::string> read_only_roots_;
};

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
