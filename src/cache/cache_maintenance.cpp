#include "cache/cache_maintenance.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include <fmt/format.h>

#include "common/bounded_json.h"
#include "common/error.h"
#include "jit/kernel_builder.h"
#include "ops/op_registry.h"
#include "jit/nvrtc_loader.h"

namespace rope_jit {

namespace {

// Deeper than any layout we write; a limit keeps a hostile tree from exhausting the stack.
constexpr int kMaxTreeDepth = 32;

std::string errno_text(int err) {
    return std::error_code(err, std::generic_category()).message();
}

// "v" followed by digits only: the top directory of one cache format.
bool is_format_dir_name(const std::string& name) {
    return name.size() >= 2 && name[0] == 'v' &&
           std::all_of(name.begin() + 1, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Whether every name in the tree below `path` (a "v<N>" directory) is a name of the cache
// layout at its depth, never following links: only then is the tree provably the cache's.
bool cache_shaped(const std::string& path, size_t depth = 0) {
    int error = 0;
    const std::vector<std::string> names = sorted_names(path, &error);
    if (error != 0 || depth > 3) return false;
    for (const std::string& name : names) {
        const LayoutName kind = classify_layout_name(depth, name);
        if (kind == LayoutName::Foreign) return false;
        struct stat st;
        if (lstat((path + "/" + name).c_str(), &st) != 0) return false;
        if (kind == LayoutName::Directory && S_ISDIR(st.st_mode) &&
            !cache_shaped(path + "/" + name, depth + 1))
            return false;
        if (kind != LayoutName::Directory && S_ISDIR(st.st_mode) &&
            !cache_file_directory_is_empty(path + "/" + name))
            return false;
    }
    return true;
}

// Bytes of every file below `path` (itself when it is not a directory), never following links.
uint64_t tree_bytes(const std::string& path, int depth = 0) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return 0;
    if (!S_ISDIR(st.st_mode) || depth > kMaxTreeDepth) return uint64_t(st.st_size);
    uint64_t total = 0;
    for (const std::string& name : sorted_names(path))
        total += tree_bytes(path + "/" + name, depth + 1);
    return total;
}

// Removes `path` and, for a directory, everything below it; links are unlinked, not followed.
// Adds what this call removed to *removed (what another process removed first is not
// counted). Returns "" or the first problem.
std::string remove_tree(const std::string& path, RemovedCount* removed, int depth = 0) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0)
        return errno == ENOENT ? "" : fmt::format("cannot stat '{}': {}", path, errno_text(errno));
    const bool directory = S_ISDIR(st.st_mode);
    if (directory) {
        if (depth > kMaxTreeDepth) return fmt::format("'{}' is nested too deeply to remove", path);
        for (const std::string& name : sorted_names(path)) {
            std::string problem = remove_tree(path + "/" + name, removed, depth + 1);
            if (!problem.empty()) return problem;
        }
    }
    if ((directory ? rmdir(path.c_str()) : unlink(path.c_str())) != 0)
        return errno == ENOENT ? ""  // another process removed it first
                               : fmt::format("cannot remove '{}': {}", path, errno_text(errno));
    ++removed->entries;
    if (!directory) removed->bytes += uint64_t(st.st_size);
    return {};
}

// Judges a valid entry against this build: ok when a call would load it, else why it is
// stale. The key hashes the stored spec JSON (of any op) with this build's templates and
// options, so recomputing it tells entries of another rope-jit build from current ones. The
// build's default options are judged first; an entry built with the options
// ROPE_JIT_NVRTC_EXTRA_OPTIONS gives now (an A/B run's) is current too. A malformed variable
// never makes an entry stale: the defaults decide then.
std::string stale_problem(const CacheItem& entry) {
    if (nvrtc_api() == nullptr) return {};  // nothing to judge against
    const std::string& current = nvrtc_version_string();
    if (entry.nvrtc_version != current)
        return fmt::format("built with NVRTC {}; this library compiles with NVRTC {}",
                           entry.nvrtc_version, current);
    auto matches = [&](const CompilePlan& plan) {
        return plan.entry.key_hex == entry.key_hex && plan.entry.kind == entry.kind;
    };
    try {
        if (matches(plan_compile(entry.spec_json, entry.target, false))) return {};
    } catch (const Error& e) {
        return fmt::format("target {} cannot be compiled by this library: {}", entry.target,
                           e.what());
    }
    try {
        if (matches(plan_compile(entry.spec_json, entry.target, true))) return {};
    } catch (const Error&) {
        // A malformed ROPE_JIT_NVRTC_EXTRA_OPTIONS: only the defaults judge.
    }
    return "written by another rope-jit build (kernel templates, options or spec layout "
           "differ) or with ROPE_JIT_NVRTC_EXTRA_OPTIONS other than this process's, or holding "
           "another kernel than its key names";
}

// A few words on the kernel: the describe() of the op the spec names (ops/op_registry.h), else
// the spec JSON.
std::string describe_spec(const std::string& spec_json) {
    if (const OpRegistration* op = op_of_spec_json(spec_json, nullptr))
        if (std::optional<std::string> description = op->describe(spec_json)) return *description;
    return spec_json.size() <= 160 ? spec_json : spec_json.substr(0, 157) + "...";
}

CacheItem item_from_report(DiskCache::EntryReport report) {
    CacheItem item;
    item.path = std::move(report.path);
    item.problem = report.problem;
    item.key_hex = std::move(report.key_hex);
    item.nvrtc_version = std::move(report.nvrtc_version);
    item.target = std::move(report.target);
    item.kind = std::move(report.kind);
    item.bytes = report.is_directory ? tree_bytes(item.path) : report.file_bytes;
    item.modified = report.modified;
    item.accessed = std::max(report.accessed, report.modified);
    switch (report.found) {
        case DiskCache::Found::TempFile: item.state = CacheItemState::Temp; break;
        case DiskCache::Found::SetAside: item.state = CacheItemState::SetAside; break;
        case DiskCache::Found::Stray: item.state = CacheItemState::Stray; break;
        case DiskCache::Found::Entry:
            item.state = report.ok ? CacheItemState::Ok : CacheItemState::Damaged;
            break;
    }
    if (report.untrusted) item.state = CacheItemState::Untrusted;
    // A stored spec this library would never write (not a JSON object, or nested past the
    // bound its readers keep) is damage: handing it to callers, who print it, would hand them
    // a value whose printing recursed past the stack (verify crashed on one, session 32).
    std::string spec_problem;
    if (report.ok && !parse_bounded_json(report.spec_json, &spec_problem).is_object()) {
        item.state = CacheItemState::Damaged;
        item.problem = "its stored spec is " +
                       (spec_problem.empty() ? std::string("not a JSON object") : spec_problem);
        return item;
    }
    if (report.ok) {
        item.payload_bytes = report.payload_bytes;
        item.spec_json = std::move(report.spec_json);
        item.spec_description = describe_spec(item.spec_json);
        item.problem = stale_problem(item);
        if (!item.problem.empty()) item.state = CacheItemState::Stale;
    }
    return item;
}

}  // namespace

const DiskCache& require_disk_cache(const DiskCache* disk) {
    if (disk == nullptr || disk->root().empty())
        throw Error(ROPE_JIT_ERROR_CACHE,
                    "this runtime has no disk cache directory (disk_cache = 0, or none of "
                    "ROPE_JIT_CACHE_DIR, "
                    "XDG_CACHE_HOME and HOME is set)");
    return *disk;
}

std::vector<CacheItem> scan_cache(const DiskCache& disk) {
    std::vector<CacheItem> items;
    const std::string& root = disk.root();
    if (root.empty()) return items;
    const std::string current_format = fmt::format("v{}", kCacheFormatVersion);
    // A root that is there but cannot be read must not pass for an empty cache.
    struct stat root_st;
    if (stat(root.c_str(), &root_st) != 0) {
        if (errno == ENOENT) return items;
        throw Error(ROPE_JIT_ERROR_CACHE, fmt::format("cannot use the cache directory '{}': {}",
                                                      root, errno_text(errno)));
    }
    if (!S_ISDIR(root_st.st_mode))
        throw Error(ROPE_JIT_ERROR_CACHE,
                    fmt::format("the cache directory '{}' is not a directory", root));
    int error = 0;
    const std::vector<std::string> names = sorted_names(root, &error);
    if (error != 0)
        throw Error(ROPE_JIT_ERROR_CACHE, fmt::format("cannot list the cache directory '{}': {}",
                                                      root, errno_text(error)));
    for (const std::string& name : names) {
        if (!is_format_dir_name(name)) continue;  // not the cache's: never touched
        const std::string path = root + "/" + name;
        struct stat st;
        if (lstat(path.c_str(), &st) != 0) continue;
        // The cache writes only directories here: a file named "v1" or "v2" (notes, in a root
        // given by mistake) is not the cache's, and prune must never remove it.
        if (!S_ISDIR(st.st_mode)) continue;
        if (name == current_format) {
            for (DiskCache::EntryReport& report : disk.verify(root))
                items.push_back(item_from_report(std::move(report)));
            continue;
        }
        // Another format's directory holds our layout, as v1 does; a "v2" with anything else
        // in it (a project's sources, say) is not the cache's either.
        if (!cache_shaped(path)) continue;
        CacheItem item;
        item.path = path;
        item.state = CacheItemState::Stale;
        item.problem = fmt::format("cache format {}; this library reads {}", name, current_format);
        item.bytes = tree_bytes(path);
        item.modified = int64_t(st.st_mtime);
        item.accessed = std::max(int64_t(st.st_atime), item.modified);
        items.push_back(std::move(item));
    }
    return items;
}

void remove_cache_item(const DiskCache& disk, const std::string& path, RemovedCount* removed) {
    const std::string& root = disk.root();
    if (root.empty()) throw Error(ROPE_JIT_ERROR_CACHE, "this runtime has no disk cache directory");
    // Items are reported as root + "/" + their path below it, whether or not root ends in '/'.
    size_t start = root.size();
    if (path.compare(0, root.size(), root) == 0 && path.size() > start && path[start] == '/')
        ++start;
    if (path.compare(0, root.size(), root) != 0 || (root.back() != '/' && start == root.size()) ||
        start == path.size())
        fail_argument(fmt::format("path: '{}' is not inside the cache directory '{}'", path, root));
    std::vector<std::string> parts;
    for (;;) {
        const size_t slash = path.find('/', start);
        parts.push_back(
            path.substr(start, slash == std::string::npos ? std::string::npos : slash - start));
        if (slash == std::string::npos) break;
        start = slash + 1;
    }
    for (const std::string& part : parts)
        if (part.empty() || part == "." || part == "..")
            fail_argument(fmt::format("path: '{}' has an empty, '.' or '..' component", path));
    struct stat st;
    if (!is_format_dir_name(parts[0]))
        fail_argument(fmt::format("path: '{}' is not in a cache format directory (v<N>) of '{}'",
                                  path, root));
    // Only what is provably the cache's: layout names in v1, or a whole other-format tree of them.
    const bool current = parts[0] == fmt::format("v{}", kCacheFormatVersion);
    bool ours = current ? parts.size() <= 5 : parts.size() == 1;
    for (size_t i = 1; ours && i < parts.size(); ++i) {
        const LayoutName kind = classify_layout_name(i - 1, parts[i]);
        const bool last = i + 1 == parts.size();
        ours = kind != LayoutName::Foreign && (last || kind == LayoutName::Directory);
    }
    // A layout directory goes only with a tree of layout names, a directory under a name the
    // cache gives files (entry, temp, set-aside) only empty: the cache never writes one, so
    // what it holds is someone else's.
    const bool whole_tree =
        parts.size() == 1 ||
        classify_layout_name(parts.size() - 2, parts.back()) == LayoutName::Directory;
    // The cache writes only directories at the root's top level: a file or link named "v2"
    // there is someone's (the walk does not report it either).
    const bool found = lstat(path.c_str(), &st) == 0;
    const bool top_level_non_directory = parts.size() == 1 && found && !S_ISDIR(st.st_mode);
    // A directory this user cannot list cannot be judged, or emptied: say why, rather than
    // call it foreign.
    if (ours && found && S_ISDIR(st.st_mode)) {
        int error = 0;
        sorted_names(path, &error);
        if (error != 0 && error != ENOENT)
            throw Error(ROPE_JIT_ERROR_CACHE, fmt::format("cannot remove '{}': cannot list it: {}",
                                                          path, errno_text(error)));
    }
    if (!ours || top_level_non_directory ||
        (whole_tree && found && S_ISDIR(st.st_mode) &&
         !cache_shaped(path, current ? parts.size() - 1 : 0)))
        fail_argument(
            fmt::format("path: '{}' is not an item of the cache layout under '{}'; only "
                        "names the cache writes are removed",
                        path, root));
    if (!whole_tree && found && S_ISDIR(st.st_mode) && !cache_file_directory_is_empty(path))
        fail_argument(fmt::format(
            "path: '{}' is a directory named like a cache file that holds files the cache never "
            "writes; it is not removed",
            path));

    if (lstat(root.c_str(), &st) != 0) return;  // no cache, so nothing to remove
    std::string why;
    // (Checked without creating anything: a removal made an empty <root>/v1 where the root
    // held only another format's tree.)
    if (!disk.writable(&why, /*create=*/false))
        throw Error(ROPE_JIT_ERROR_CACHE, fmt::format("cannot remove '{}': {}", path, why));
    std::string walked = root;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
        walked += "/" + parts[i];
        if (lstat(walked.c_str(), &st) != 0) {
            if (errno == ENOENT) return;  // already gone
            throw Error(ROPE_JIT_ERROR_CACHE,
                        fmt::format("cannot use '{}': {}", walked, errno_text(errno)));
        }
        if (!S_ISDIR(st.st_mode))
            fail_argument(fmt::format(
                "path: '{}' is not a directory of the cache (a link or a file)", walked));
    }
    RemovedCount uncounted;
    const std::string problem = remove_tree(path, removed != nullptr ? removed : &uncounted);
    if (!problem.empty()) throw Error(ROPE_JIT_ERROR_CACHE, problem);
}

}  // namespace rope_jit
