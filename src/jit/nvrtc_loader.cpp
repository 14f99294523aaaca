#include "jit/nvrtc_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/error.h"

namespace rope_jit {

namespace {

struct NvrtcState {
    NvrtcApi api;
    bool loaded = false;
    std::string error;
    std::string path;
    std::string version;
    std::vector<int> archs;
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
    state.version = std::to_string(major) + "." + std::to_string(minor);
    state.archs = std::move(archs);
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

const NvrtcState& state() {
    static const NvrtcState instance = load();
    return instance;
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
    return state().version;
}

const std::vector<int>& nvrtc_supported_archs() {
    return state().archs;
}

std::string nvrtc_error_name(nvrtcResult result) {
    if (const NvrtcApi* api = nvrtc_api()) {
        if (const char* name = api->nvrtcGetErrorString(result)) return name;
    }
    return "nvrtcResult " + std::to_string(result);
}

}  // namespace rope_jit
