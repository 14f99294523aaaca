// NVRTC, loaded with dlopen on first use so that librope_jit.so loads and runs its CPU path on
// machines without the CUDA toolkit. No NVRTC header is included: the few types used are
// declared here with the same layout.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

// The same tag as nvrtc.h, so a handle passes between this code and code that includes it.
struct _nvrtcProgram;

namespace rope_jit {

using nvrtcResult = int;
using nvrtcProgram = _nvrtcProgram*;

constexpr nvrtcResult NVRTC_SUCCESS = 0;
constexpr nvrtcResult NVRTC_ERROR_COMPILATION = 6;

// Every NVRTC entry point the runtime uses, one line each: name, return type, parameters.
// nvrtcGetSupportedArchs (NVRTC 11.2) is the newest, so older libraries are rejected.
#define ROPE_JIT_NVRTC_SYMBOLS(X)                                                     \
    X(nvrtcVersion, nvrtcResult, (int* major, int* minor))                            \
    X(nvrtcGetErrorString, const char*, (nvrtcResult result))                         \
    X(nvrtcCreateProgram, nvrtcResult,                                                \
      (nvrtcProgram * program, const char* source, const char* name, int num_headers, \
       const char* const* headers, const char* const* include_names))                 \
    X(nvrtcDestroyProgram, nvrtcResult, (nvrtcProgram * program))                     \
    X(nvrtcCompileProgram, nvrtcResult,                                               \
      (nvrtcProgram program, int num_options, const char* const* options))            \
    X(nvrtcGetProgramLogSize, nvrtcResult, (nvrtcProgram program, size_t * size))     \
    X(nvrtcGetProgramLog, nvrtcResult, (nvrtcProgram program, char* log))             \
    X(nvrtcGetPTXSize, nvrtcResult, (nvrtcProgram program, size_t * size))            \
    X(nvrtcGetPTX, nvrtcResult, (nvrtcProgram program, char* ptx))                    \
    X(nvrtcGetCUBINSize, nvrtcResult, (nvrtcProgram program, size_t * size))          \
    X(nvrtcGetCUBIN, nvrtcResult, (nvrtcProgram program, char* cubin))                \
    X(nvrtcGetNumSupportedArchs, nvrtcResult, (int* count))                           \
    X(nvrtcGetSupportedArchs, nvrtcResult, (int* archs))

struct NvrtcApi {
#define ROPE_JIT_NVRTC_FIELD_(name, ret, params) ret(*name) params = nullptr;
    ROPE_JIT_NVRTC_SYMBOLS(ROPE_JIT_NVRTC_FIELD_)
#undef ROPE_JIT_NVRTC_FIELD_
};

// The loaded API, or nullptr when no usable NVRTC was found (nvrtc_load_error() says why).
// The first call loads; later calls return the same pointer. Thread-safe. The library stays
// loaded for the life of the process.
//
// Search order: $ROPE_JIT_NVRTC_LIBRARY alone when set (a path or a soname); otherwise the
// sonames libnvrtc.so.13, .so.12, .so.11.2, libnvrtc.so through the loader path, then the same
// names in $CUDA_HOME, $CUDA_PATH and /usr/local/cuda (lib64/, then lib/).
const NvrtcApi* nvrtc_api();

// nvrtc_api(), or Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE) saying why there is none.
const NvrtcApi& require_nvrtc();

// Why nvrtc_api() returned nullptr: every library tried and its dlerror. "" when loaded.
const std::string& nvrtc_load_error();

// The file the library was loaded from, as the dynamic loader reports it; "" when not loaded.
const std::string& nvrtc_library_path();

// "MAJOR.MINOR" of the loaded NVRTC ("13.0"); "" when not loaded. Part of every cache key.
const std::string& nvrtc_version_string();

// The real architectures this NVRTC can emit code for, as numbers (75, 80, 90, 100...),
// ascending; empty when not loaded.
const std::vector<int>& nvrtc_supported_archs();

// "NVRTC_ERROR_COMPILATION" for a result, or "nvrtcResult N" when NVRTC is not loaded.
std::string nvrtc_error_name(nvrtcResult result);

}  // namespace rope_jit
