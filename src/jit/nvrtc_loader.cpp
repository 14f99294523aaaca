#include "jit/nvrtc_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cache/disk_cache.h"
#include "common/error.h"
#include "common/log.h"

namespace rope_jit {

namespace {

struct NvrtcState {
    NvrtcApi api;
    bool loaded = false;
    std::string error;
    std::string path;
    NvrtcIdentity identity;
};

std::string env_or_empty(const char* name) {
    const char* value = std::getenv(name);
    return value != nullptr ? std::string(value) : std::string();
}

std::vector<std::string> candidate_libraries() {
    const std::string forced = env_or_empty("ROPE_JIT_NVRTC_LIBRARY");
    // An explicit choice is honoured alone: silently falling back to another NVRTC would change
    // the version in the cache keys behind the user's back.
    if (!forced.empty()) return {forced};

    // Newest first: a newer NVRTC knows more architectures. The unversioned name comes last
    // because it only exists with a full toolkit and could be any version.
    const std::vector<std::string> sonames = {"libnvrtc.so.13", "libnvrtc.so.12",
                                              "libnvrtc.so.11.2", "libnvrtc.so"};
    std::vector<std::string> candidates = sonames;

    // The toolkit installs NVRTC outside the loader path unless ldconfig or LD_LIBRARY_PATH was
    // set up, so look where it usually lives too.
    std::vector<std::string> roots;
    for (const char* variable : {"CUDA_HOME", "CUDA_PATH"}) {
        const std::string root = env_or_empty(variable);
        if (!root.empty()) roots.push_back(root);
    }
    roots.push_back("/usr/local/cuda");
    for (const std::string& root : roots) {
        for (const char* subdir : {"/lib64/", "/lib/"}) {
            for (const std::string& soname : sonames) {
                std::string path = root + subdir + soname;
                if (std::find(candidates.begin(), candidates.end(), path) == candidates.end()) {
                    candidates.push_back(std::move(path));
                }
            }
        }
    }
    return candidates;
}

std::string loaded_path(void* handle, const std::string& fallback) {
    link_map* map = nullptr;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
        map->l_name[0] != '\0') {
        return map->l_name;
    }
    return fallback;
}

// Resolves every symbol and queries the version and architectures. Returns "" on success,
// otherwise why this library is unusable.
std::string try_library(void* handle, NvrtcState& state) {
    NvrtcApi api;
#define ROPE_JIT_NVRTC_RESOLVE_(name, ret, params)                         \
    api.name = reinterpret_cast<decltype(api.name)>(dlsym(handle, #name)); \
    if (api.name == nullptr) return "missing symbol " #name " (NVRTC older than 11.2?)";
    ROPE_JIT_NVRTC_SYMBOLS(ROPE_JIT_NVRTC_RESOLVE_)
#undef ROPE_JIT_NVRTC_RESOLVE_

    int major = 0;
    int minor = 0;
    if (api.nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return "nvrtcVersion failed";
    int count = 0;
    if (api.nvrtcGetNumSupportedArchs(&count) != NVRTC_SUCCESS || count <= 0) {
        return "nvrtcGetNumSupportedArchs failed";
    }
    std::vector<int> archs(static_cast<size_t>(count));
    if (api.nvrtcGetSupportedArchs(archs.data()) != NVRTC_SUCCESS) {
        return "nvrtcGetSupportedArchs failed";
    }
    std::sort(archs.begin(), archs.end());

    state.api = api;
    state.identity.version = std::to_string(major) + "." + std::to_string(minor);
    state.identity.archs = std::move(archs);
    return "";
}

NvrtcState load() {
    NvrtcState state;
    std::string failures;
    for (const std::string& name : candidate_libraries()) {
        // RTLD_LOCAL: NVRTC's symbols must not satisfy lookups of other libraries in the process
        // (a framework may bring its own NVRTC of another version).
        void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle == nullptr) {
            // dlerror already names the file.
            const char* reason = dlerror();
            failures += "\n  ";
            failures += reason != nullptr ? std::string(reason) : name + ": dlopen failed";
            continue;
        }
        const std::string problem = try_library(handle, state);
        if (problem.empty()) {
            state.loaded = true;
            state.path = loaded_path(handle, name);
            return state;
        }
        failures += "\n  " + name + ": " + problem;
        dlclose(handle);
    }
    state.error =
        "no usable NVRTC library (set ROPE_JIT_NVRTC_LIBRARY to its path); tried:" + failures;
    return state;
}

// Set once state() has run load(), successful or not: from then on the library's own values
// are the identity, whatever the memo said.
std::atomic<bool> g_library_tried{false};
// Set when nvrtc_version_string or nvrtc_supported_archs answered from the memo, so that a
// later load can tell whether values already handed out disagree with the library's.
std::atomic<bool> g_memo_served{false};

// What decides, in this process's environment, which library load() would pick.
std::vector<std::string> current_selection() {
    return nvrtc_selection_fingerprint(candidate_libraries(), env_or_empty, file_identity);
}

std::optional<NvrtcIdentity> memo_under(const std::string& root,
                                        const std::vector<std::string>& selection) {
    const std::optional<std::string> text = read_nvrtc_memo(root);
    if (!text) return std::nullopt;
    return accept_nvrtc_memo(*text, selection, file_identity);
}

// The memo of the default cache root, read once per process (before any load).
const std::optional<NvrtcIdentity>& memo_identity() {
    static const std::optional<NvrtcIdentity> memo =
        memo_under(DiskCache::default_root(), current_selection());
    return memo;
}

bool remember(const NvrtcState& loaded, const std::string& root) {
    if (!loaded.loaded) return false;
    std::vector<std::string> selection = current_selection();
    // Rewriting an equal memo would only cost every process that compiles a write.
    if (memo_under(root, selection) == std::optional<NvrtcIdentity>(loaded.identity))
        return true;
    const std::optional<FileIdentity> file = file_identity(loaded.path);
    if (!file) return false;  // a path the loader reported but stat cannot see: no memo
    NvrtcMemo memo;
    memo.library_path = loaded.path;
    memo.library_file = *file;
    memo.selection = std::move(selection);
    memo.identity = loaded.identity;
    return write_nvrtc_memo(root, memo);
}

NvrtcState load_and_remember() {
    NvrtcState state = load();
    if (!state.loaded) return state;
    remember(state, DiskCache::default_root());
    // The memo's checks make a disagreement all but impossible (the same file, the same
    // environment), but a hand-edited memo or a file rewritten within one mtime tick could
    // cause one. From here on the library's values are returned: they are what NVRTC really
    // compiles with, so keys computed from them name what is stored. Keys computed earlier
    // from the memo can only address entries (a lookup that misses or hits an entry of that
    // other version, valid in itself); build_kernel_binary plans again after loading NVRTC
    // and before compiling, so no kernel is ever stored under a key that names another NVRTC.
    // A warning, because choices already made from the memo's version (the attention wgmma
    // check) keep it for the runtime that made them.
    if (g_memo_served.load() && memo_identity() && *memo_identity() != state.identity) {
        auto describe = [](const NvrtcIdentity& id) {
            return fmt::format("NVRTC {} for sm_{} to sm_{} ({} architectures)", id.version,
                               id.archs.front(), id.archs.back(), id.archs.size());
        };
        log_warning(fmt::format(
            "the NVRTC identity memo in '{}' said {}, but {} is {}; using the library's "
            "values from now on (the memo is rewritten)",
            DiskCache::default_root(), describe(*memo_identity()), state.path,
            describe(state.identity)));
    }
    return state;
}

const NvrtcState& state() {
    static const NvrtcState instance = load_and_remember();
    g_library_tried.store(true);
    return instance;
}

// The identity every key uses: the library's once it was tried, else the memo's when valid,
// else the library's (which loads it). Each object returned lives as long as the process.
const NvrtcIdentity& identity() {
    if (!g_library_tried.load()) {
        if (const std::optional<NvrtcIdentity>& memo = memo_identity()) {
            g_memo_served.store(true);
            return *memo;
        }
    }
    return state().identity;
}

}  // namespace

const NvrtcApi* nvrtc_api() {
    const NvrtcState& s = state();
    return s.loaded ? &s.api : nullptr;
}

const NvrtcApi& require_nvrtc() {
    const NvrtcApi* api = nvrtc_api();
    if (api == nullptr)
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE,
                    "NVRTC is not available: " + nvrtc_load_error());
    return *api;
}

const std::string& nvrtc_load_error() {
    return state().error;
}

const std::string& nvrtc_library_path() {
    return state().path;
}

const std::string& nvrtc_version_string() {
    return identity().version;
}

const std::vector<int>& nvrtc_supported_archs() {
    return identity().archs;
}

void require_nvrtc_identity() {
    if (identity().version.empty()) require_nvrtc();
}

std::optional<NvrtcIdentity> nvrtc_identity_from_memo(const std::string& root) {
    return memo_under(root, current_selection());
}

bool nvrtc_remember_identity(const std::string& root) {
    return remember(state(), root);
}

std::string nvrtc_error_name(nvrtcResult result) {
    if (const NvrtcApi* api = nvrtc_api()) {
        if (const char* name = api->nvrtcGetErrorString(result)) return name;
    }
    return "nvrtcResult " + std::to_string(result);
}

}  // namespace rope_jit
