// NVRTC, loaded with dlopen on first use so that librope_jit.so loads and runs its CPU path on
// machines without the CUDA toolkit. No NVRTC header is included: the few types used are
// declared here with the same layout.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "jit/nvrtc_identity.h"

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

// "MAJOR.MINOR" of the NVRTC kernels compile with ("13.0"); "" when there is none. Part of
// every cache key. Before NVRTC is loaded it comes from the identity memo when that is valid
// (jit/nvrtc_identity.h), without loading the library; otherwise this loads it. Once the
// library is loaded, its own values are returned (see nvrtc_loader.cpp on a memo that
// disagrees). The reference stays valid for the life of the process.
const std::string& nvrtc_version_string();

// The real architectures that NVRTC can emit code for, as numbers (75, 80, 90, 100...),
// ascending; empty when there is none. From the memo or the library, as nvrtc_version_string.
const std::vector<int>& nvrtc_supported_archs();

// Throws what require_nvrtc throws when neither the memo nor a library gives
// nvrtc_version_string and nvrtc_supported_archs; loads NVRTC only when the memo does not
// serve. For code that needs the identity but compiles nothing (cache keys, target choice).
void require_nvrtc_identity();

// The identity the memo under `root` records, when it is valid for the library the loader
// would pick now (the current environment's fingerprint; file unchanged); nullopt otherwise.
// Reads the memo whether or not NVRTC is loaded. Never throws except std::bad_alloc.
std::optional<NvrtcIdentity> nvrtc_identity_from_memo(const std::string& root);

// Writes the memo of the loaded NVRTC (loading it first if need be) under `root`, unless a
// valid memo with the same values is already there. false when no NVRTC is usable or nothing
// could be written (no error: a memo is only a shortcut). The first load calls it with the
// default cache root.
bool nvrtc_remember_identity(const std::string& root);

// "NVRTC_ERROR_COMPILATION" for a result, or "nvrtcResult N" when NVRTC is not loaded.
std::string nvrtc_error_name(nvrtcResult result);

}  // namespace rope_jit
