// Looking after a disk cache from outside the compile path (rope-jit-cache list, verify, prune,
// clear, and the rope_jit_cache_* C API): every item under a cache root, classified against
// what this library build would load, and the removal of one such item.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "rope_jit/rope_jit.h"

namespace rope_jit {

// The public rope_jit_cache_item_state values, so the C API passes them through.
enum class CacheItemState {
    Ok = ROPE_JIT_CACHE_ITEM_OK,               // a valid entry this build loads
    Stale = ROPE_JIT_CACHE_ITEM_STALE,         // valid, but never loaded by this build: another
                                               // NVRTC version, cache format or rope-jit build
    Damaged = ROPE_JIT_CACHE_ITEM_DAMAGED,     // placed like an entry but fails a check
    Temp = ROPE_JIT_CACHE_ITEM_TEMP,           // a write in progress, or one a crash interrupted
    SetAside = ROPE_JIT_CACHE_ITEM_SET_ASIDE,  // a damaged entry an earlier load renamed
    Stray = ROPE_JIT_CACHE_ITEM_STRAY,         // a layout name in the wrong place
    Untrusted = ROPE_JIT_CACHE_ITEM_UNTRUSTED  // an entry that fails the trust rule: never loaded
};

struct CacheItem {
    CacheItemState state = CacheItemState::Stray;
    std::string path;
    std::string problem;                               // why it is not ok; "" when ok
    std::string key_hex, nvrtc_version, target, kind;  // from the path, when entry-shaped
    std::string spec_json;                             // ok and stale entries
    std::string spec_description;  // KernelSpec::describe() of spec_json, when it parses
    uint64_t bytes = 0;            // on disk; a directory counts every file below it
    uint64_t payload_bytes = 0;    // ok and stale entries
    int64_t modified = 0;          // mtime, seconds since the epoch
    int64_t accessed = 0;          // max(atime, mtime): when it was last read, roughly
};

// *disk, when it is a cache with a root directory. Throws Error(CACHE) for a memory-only
// runtime (nullptr, or a root of "" when no default could be derived).
const DiskCache& require_disk_cache(const DiskCache* disk);

// Every item under disk.root(): what DiskCache::verify reports under <root>/v1, each entry
// judged against this build (see CacheItemState; a directory that cannot be listed is a
// stray item saying why), plus each other "v<N>" directory of the root whose whole tree has
// only names of the cache layout (classify_layout_name) as one stale item (another cache
// format). Nothing else in the root is reported: not the compile lock files of <root>/locks
// (compile_lock.h), which must stay for as long as any process may lock them, nor anything
// that is not the cache's (a project's files in a root given by mistake).
// Changes nothing. Empty when the root is "" or missing; throws Error(CACHE) when it is not
// a directory or cannot be listed.
// Without NVRTC an entry's NVRTC version and key cannot be judged: valid ones count as ok.
std::vector<CacheItem> scan_cache(const DiskCache& disk);

// Removes one item as scan_cache reports it: a file, or a directory with all it holds
// (symbolic links are removed, never followed). `path` must be provably the cache's: below
// <root>/v1, every part a name of the layout at its depth (classify_layout_name); or another
// "v<N>" directory of the root whose whole tree has only such names. No "." or ".." parts and
// no symbolic link on the way. An item already gone is no error (another prune got there
// first). Adds what this call removed to *removed (NULL: not counted), which is nothing for
// an item another process removed first, and what went before the failure when a removal
// fails partway, so that a caller's total of freed bytes stays true. Throws
// Error(INVALID_ARGUMENT) for any other path, Error(CACHE) when the root is "" or not
// writable by this user (see DiskCache::writable) or the removal fails.
struct RemovedCount {
    uint64_t entries = 0;  // files, links and directories
    uint64_t bytes = 0;    // the removed files' sizes
};
void remove_cache_item(const DiskCache& disk, const std::string& path, RemovedCount* removed);

}  // namespace rope_jit
