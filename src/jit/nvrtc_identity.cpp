#include "jit/nvrtc_identity.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "cache/disk_cache.h"

namespace rope_jit {

namespace {

using nlohmann::json;

// Bumped when the memo's fields change; a memo of another format is refused (and rewritten).
constexpr int kMemoFormat = 1;
// A memo is a few hundred bytes (the fingerprint names a few directories); anything much
// larger is not one, and is not read.
constexpr off_t kMaxMemoBytes = 64 * 1024;

std::string identity_text(const std::optional<FileIdentity>& id) {
    if (!id) return "missing";
    return fmt::format("dev={} ino={} size={} mtime_ns={}", id->device, id->inode, id->size,
                       id->mtime_ns);
}

// "13.0": digits, a dot, digits. It names a cache directory, so nothing else may pass.
bool is_version(const std::string& text) {
    const size_t dot = text.find('.');
    auto digits = [](std::string_view part) {
        return !part.empty() && part.size() <= 4 &&
               part.find_first_not_of("0123456789") == std::string_view::npos;
    };
    return dot != std::string::npos && digits(std::string_view(text).substr(0, dot)) &&
           digits(std::string_view(text).substr(dot + 1));
}

}  // namespace

std::optional<FileIdentity> file_identity(const std::string& path) {
    struct stat st;
    if (path.empty() || stat(path.c_str(), &st) != 0) return std::nullopt;
    FileIdentity id;
    id.device = uint64_t(st.st_dev);
    id.inode = uint64_t(st.st_ino);
    id.size = uint64_t(st.st_size);
    id.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec);
    return id;
}

std::vector<std::string> nvrtc_selection_fingerprint(const std::vector<std::string>& search_order,
                                                     const EnvLookup& env,
                                                     const FileIdentityLookup& identify) {
    std::vector<std::string> lines;
    for (const char* name : {"ROPE_JIT_NVRTC_LIBRARY", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH"})
        lines.push_back(fmt::format("env {}={}", name, env(name)));
    lines.push_back("file /etc/ld.so.cache " + identity_text(identify("/etc/ld.so.cache")));
    for (const std::string& candidate : search_order) lines.push_back("search " + candidate);

    // The loader splits LD_LIBRARY_PATH at ':' and ';'; an absolute candidate is looked up in
    // its own directory only.
    std::vector<std::string> dirs;
    const std::string library_path = env("LD_LIBRARY_PATH");
    size_t start = 0;
    while (start <= library_path.size()) {
        const size_t end = std::min(library_path.find_first_of(":;", start), library_path.size());
        if (end > start) dirs.push_back(library_path.substr(start, end - start));
        start = end + 1;
    }
    for (const std::string& candidate : search_order) {
        const size_t slash = candidate.rfind('/');
        if (slash != std::string::npos) dirs.push_back(candidate.substr(0, slash + 1));
    }
    std::vector<std::string> seen;
    for (const std::string& dir : dirs) {
        if (std::find(seen.begin(), seen.end(), dir) != seen.end()) continue;
        seen.push_back(dir);
        lines.push_back("dir " + dir + " " + identity_text(identify(dir)));
    }
    return lines;
}

std::string serialize_nvrtc_memo(const NvrtcMemo& memo) {
    const json document = {
        {"what", "rope-jit NVRTC identity memo (jit/nvrtc_identity.h); safe to delete"},
        {"format", kMemoFormat},
        {"library",
         {{"path", memo.library_path},
          {"device", memo.library_file.device},
          {"inode", memo.library_file.inode},
          {"size", memo.library_file.size},
          {"mtime_ns", memo.library_file.mtime_ns}}},
        {"selection", memo.selection},
        {"version", memo.identity.version},
        {"archs", memo.identity.archs}};
    return document.dump(1) + "\n";
}

std::optional<NvrtcIdentity> accept_nvrtc_memo(std::string_view text,
                                               const std::vector<std::string>& selection,
                                               const FileIdentityLookup& identify,
                                               std::string* why) {
    auto refuse = [&](std::string problem) -> std::optional<NvrtcIdentity> {
        if (why) *why = std::move(problem);
        return std::nullopt;
    };
    const json document = parse_bounded_json(text);
    if (document.is_discarded() || !document.is_object()) return refuse("not a JSON object");
    try {
        if (document.at("format") != kMemoFormat) return refuse("another memo format");
        // Checked first: it is what changes when the environment does.
        if (document.at("selection").get<std::vector<std::string>>() != selection)
            return refuse("the library selection (environment, ld.so.cache, directories) changed");
        const json& library = document.at("library");
        const std::string path = library.at("path").get<std::string>();
        FileIdentity recorded;
        recorded.device = library.at("device").get<uint64_t>();
        recorded.inode = library.at("inode").get<uint64_t>();
        recorded.size = library.at("size").get<uint64_t>();
        recorded.mtime_ns = library.at("mtime_ns").get<int64_t>();
        const std::optional<FileIdentity> now = identify(path);
        if (!now || !(*now == recorded))
            return refuse(fmt::format("the library '{}' is not the file that was loaded", path));
        NvrtcIdentity identity;
        identity.version = document.at("version").get<std::string>();
        identity.archs = document.at("archs").get<std::vector<int>>();
        if (!is_version(identity.version)) return refuse("a malformed version");
        // What nvrtc_supported_archs promises: a non-empty ascending list of sm numbers.
        const std::vector<int>& archs = identity.archs;
        if (archs.empty() || !std::is_sorted(archs.begin(), archs.end()) || archs.front() < 10 ||
            archs.back() > 9999)
            return refuse("a malformed architecture list");
        if (why) why->clear();
        return identity;
    } catch (const json::exception& e) {
        return refuse(std::string("a malformed memo: ") + e.what());
    }
}

std::optional<std::string> read_nvrtc_memo(const std::string& root) {
    if (root.empty()) return std::nullopt;
    const std::string path = root + "/" + kNvrtcMemoFileName;
    // No link: a memo is a file this library wrote, never one pointed at. O_NONBLOCK: a FIFO
    // in its place would otherwise hang every process that asks for NVRTC's identity (fstat
    // below then refuses it, as it does any file that is not a regular one).
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return std::nullopt;
    std::optional<std::string> text;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= kMaxMemoBytes &&
        untrusted_file_problem(st).empty() && trust_problem(root, root).empty()) {
        std::string bytes(size_t(st.st_size) + 1, '\0');
        size_t got = 0;
        for (;;) {
            const ssize_t n = read(fd, &bytes[got], bytes.size() - got);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            got += size_t(n);
            if (got == bytes.size()) break;  // grew since fstat: being rewritten, or not ours
        }
        if (got < bytes.size()) {
            bytes.resize(got);
            text = std::move(bytes);
        }
    }
    close(fd);
    return text;
}

bool write_nvrtc_memo(const std::string& root, const NvrtcMemo& memo) {
    try {
        // Only into a root that exists: a process whose runtimes use their own cache_dir must
        // not find a cache made in the default place. Then the cache's own checks: a root
        // others could write is not written (nor read) here.
        struct stat root_stat {};
        if (root.empty() || stat(root.c_str(), &root_stat) != 0 || !S_ISDIR(root_stat.st_mode))
            return false;
        if (!DiskCache(root, {}).writable()) return false;
        static std::atomic<unsigned> counter{0};
        const std::string path = root + "/" + kNvrtcMemoFileName;
        const std::string temp = fmt::format("{}/.{}.tmp-{}-{}", root, kNvrtcMemoFileName,
                                             unsigned(getpid()), counter.fetch_add(1));
        const std::string text = serialize_nvrtc_memo(memo);
        const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) return false;
        size_t written = 0;
        while (written < text.size()) {
            const ssize_t n = write(fd, text.data() + written, text.size() - written);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            written += size_t(n);
        }
        const bool ok = close(fd) == 0 && written == text.size() &&
                        rename(temp.c_str(), path.c_str()) == 0;
        if (!ok) unlink(temp.c_str());
        return ok;
    } catch (...) {
        return false;  // out of memory: no memo, which only costs the next process a load
    }
}

}  // namespace rope_jit
