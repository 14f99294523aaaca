// The NVRTC identity memo: what the kernel cache keys need from NVRTC (its version and the
// architectures it emits), remembered in a small file so that a process whose kernels are all
// disk hits learns them without loading the library.
//
// Why: libnvrtc.so is about 109 MB, and dlopen-ing it costs 7-10 ms with a warm page cache
// (measured on the H200 host and on the CPU build host, RTLD_NOW and RTLD_LAZY alike; about
// 90 ms with a cold one). On the warm path nothing is compiled, so that load was only asking
// for "13.0" and a list of numbers; it was most of the 13 ms before a fresh process's first
// fused attention forward (issue 19 wants the first forward+backward with a warm cache in
// 20 ms).
//
// The memo is trusted only while nothing that decides which library dlopen would pick has
// changed (the selection fingerprint below) and the library file it names is the very file
// that was loaded (device, inode, size, modification time). Anything else, a missing,
// damaged, untrusted or foreign memo included, means "load NVRTC as before". Writing is best
// effort and silent: a read-only or missing directory just means no memo.
//
// The memo is a pure function of its text, the current fingerprint and a stat function, so
// the decision is testable without processes or a second NVRTC (accept_nvrtc_memo).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rope_jit {

// What the cache keys use of an NVRTC: "MAJOR.MINOR" and its real architectures, ascending.
struct NvrtcIdentity {
    std::string version;
    std::vector<int> archs;
    bool operator==(const NvrtcIdentity& other) const {
        return version == other.version && archs == other.archs;
    }
    bool operator!=(const NvrtcIdentity& other) const { return !(*this == other); }
};

// A file as stat(2) (links followed) identifies it: replaced, rewritten or retargeted, it
// differs in one of these.
struct FileIdentity {
    uint64_t device = 0;
    uint64_t inode = 0;
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const FileIdentity& other) const {
        return device == other.device && inode == other.inode && size == other.size &&
               mtime_ns == other.mtime_ns;
    }
};

// stat(path), following links; nullopt when it fails.
std::optional<FileIdentity> file_identity(const std::string& path);

using FileIdentityLookup = std::function<std::optional<FileIdentity>(const std::string& path)>;
// An environment variable's value, "" when unset.
using EnvLookup = std::function<std::string(const char* name)>;

// What decides which library the loader would pick now, one line per input:
// ROPE_JIT_NVRTC_LIBRARY, LD_LIBRARY_PATH, CUDA_HOME and CUDA_PATH; the identity of
// /etc/ld.so.cache (ldconfig, which package managers run, rewrites it); `search_order` (the
// loader's candidate names, in order, so a build that searches differently does not trust
// another build's memo); and the identity of every directory the search names explicitly
// (LD_LIBRARY_PATH's and the candidates' own), whose modification time changes when a
// library appears in or leaves one. Not seen: a library copied into a system directory
// without running ldconfig.
std::vector<std::string> nvrtc_selection_fingerprint(const std::vector<std::string>& search_order,
                                                     const EnvLookup& env,
                                                     const FileIdentityLookup& identify);

// One memo: the library that was loaded, the fingerprint it was loaded under, and what it said.
struct NvrtcMemo {
    std::string library_path;  // as the dynamic loader reported it (nvrtc_library_path())
    FileIdentity library_file;
    std::vector<std::string> selection;  // nvrtc_selection_fingerprint at load time
    NvrtcIdentity identity;
};

// The memo's file name, at the top of the default cache root (DiskCache::default_root). Not a
// name of the cache layout, so rope-jit-cache's list, verify, prune and clear leave it alone.
constexpr const char* kNvrtcMemoFileName = "nvrtc-identity.json";

// The memo as a small JSON document.
std::string serialize_nvrtc_memo(const NvrtcMemo& memo);

// The identity `text` (a memo file's content) records, when it is a well-formed memo of this
// format whose fingerprint equals `selection` and whose library file `identify` finds
// unchanged; nullopt otherwise, with *why (when given) saying which check failed. Never
// throws except std::bad_alloc.
std::optional<NvrtcIdentity> accept_nvrtc_memo(std::string_view text,
                                               const std::vector<std::string>& selection,
                                               const FileIdentityLookup& identify,
                                               std::string* why = nullptr);

// The memo file's text under `root`, when there is one that the cache's trust rule accepts (a
// regular file owned by this user or root that no one else can write, below directories that
// pass trust_problem) and that is small enough to be a memo; nullopt otherwise. Never throws
// except std::bad_alloc.
std::optional<std::string> read_nvrtc_memo(const std::string& root);

// Writes `memo` under `root` (created like the cache's root when missing) through a temp file
// and a rename, so readers see the old memo or the new one, never a part. No fsync: a memo a
// crash truncates is refused by its reader and rewritten. Returns false when root is "" or
// not writable (DiskCache::writable) or a write fails; never throws, never warns.
bool write_nvrtc_memo(const std::string& root, const NvrtcMemo& memo);

}  // namespace rope_jit
