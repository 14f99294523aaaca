#include "cuda/cuda_driver.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/error.h"

namespace rope_jit {

namespace {

// cuGetProcAddress flags and query results (cuda.h: CUdriverProcAddress_flags,
// CUdriverProcAddressQueryResult).
constexpr std::uint64_t CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;
constexpr int CU_GET_PROC_ADDRESS_SUCCESS = 0;

// CUDA 12.0+ (cuGetProcAddress_v2) and 11.3-11.8 (cuGetProcAddress) signatures.
using GetProcAddressV2 = CUresult (*)(const char* symbol, void** function, int cuda_version,
                                      std::uint64_t flags, int* symbol_status);
using GetProcAddressV1 = CUresult (*)(const char* symbol, void** function, int cuda_version,
                                      std::uint64_t flags);

struct DriverState {
    CudaDriverApi api;
    bool loaded = false;
    std::string error;
};

std::string result_text(CUresult result) {
    std::string text = "CUresult " + std::to_string(result);
    if (result == CUDA_ERROR_STUB_LIBRARY) {
        text += " (CUDA_ERROR_STUB_LIBRARY: this is the toolkit's link-time stub, not a driver)";
    }
    return text;
}

// Resolves and initializes the driver in `library`. On failure `error` says why and the
// library is closed again; on success it stays open for good, since an initialized driver
// cannot be unloaded safely.
bool load_driver(const std::string& library, CudaDriverApi& api, std::string& error) {
    const std::string prefix = "CUDA driver " + library + ": ";
    void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        // dlerror already names the file.
        const char* reason = dlerror();
        error =
            reason != nullptr ? "CUDA driver: " + std::string(reason) : prefix + "dlopen failed";
        return false;
    }
    auto fail = [&](const std::string& reason) {
        error = prefix + reason;
        dlclose(handle);
        return false;
    };

    // Only cuGetProcAddress comes from dlsym: asking it for the rest, at a pinned ABI version,
    // yields the variant whose signature is declared in cuda_driver.h, whereas dlsym("cuMemAlloc")
    // would give the CUDA 2.x 32-bit-size entry point.
    auto get_v2 = reinterpret_cast<GetProcAddressV2>(dlsym(handle, "cuGetProcAddress_v2"));
    auto get_v1 = reinterpret_cast<GetProcAddressV1>(dlsym(handle, "cuGetProcAddress"));
    if (get_v2 == nullptr && get_v1 == nullptr) {
        return fail("no cuGetProcAddress (driver older than CUDA 11.3)");
    }
    // Legacy default stream: a NULL stream from the caller means what it means to PyTorch and
    // to the runtime API compiled without --default-stream per-thread.
    auto get = [&](const char* symbol, void** function) -> std::string {
        CUresult result = CUDA_SUCCESS;
        int status = CU_GET_PROC_ADDRESS_SUCCESS;
        if (get_v2 != nullptr) {
            result = get_v2(symbol, function, ROPE_JIT_CUDA_ABI_VERSION,
                            CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
        } else {
            result = get_v1(symbol, function, ROPE_JIT_CUDA_ABI_VERSION,
                            CU_GET_PROC_ADDRESS_LEGACY_STREAM);
        }
        if (result != CUDA_SUCCESS) {
            return std::string("cuGetProcAddress(") + symbol + ") failed: " + result_text(result);
        }
        if (status != CU_GET_PROC_ADDRESS_SUCCESS || *function == nullptr) {
            return std::string("the driver lacks ") + symbol + " (older than CUDA 11.4?)";
        }
        return "";
    };

    CudaDriverApi resolved;
#define ROPE_JIT_CUDA_RESOLVE_(field, query, params)                           \
    {                                                                          \
        void* function = nullptr;                                              \
        const std::string problem = get(query, &function);                     \
        if (!problem.empty()) return fail(problem);                            \
        resolved.field = reinterpret_cast<decltype(resolved.field)>(function); \
    }
    ROPE_JIT_CUDA_SYMBOLS(ROPE_JIT_CUDA_RESOLVE_)
#undef ROPE_JIT_CUDA_RESOLVE_
    {
        void* function = nullptr;
        if (get("cuTensorMapEncodeTiled", &function).empty())
            resolved.cuTensorMapEncodeTiled = reinterpret_cast<CuTensorMapEncodeTiled>(function);
        function = nullptr;
        if (get("cuLaunchKernelEx", &function).empty())
            resolved.cuLaunchKernelEx = reinterpret_cast<CuLaunchKernelEx>(function);
    }

    const CUresult init = resolved.cuInit(0);
    if (init != CUDA_SUCCESS) {
        const char* name = nullptr;
        const char* message = nullptr;
        std::string text = result_text(init);
        if (resolved.cuGetErrorName(init, &name) == CUDA_SUCCESS && name != nullptr &&
            resolved.cuGetErrorString(init, &message) == CUDA_SUCCESS && message != nullptr) {
            text = std::string(name) + ": " + message;
        }
        return fail("cuInit failed: " + text);
    }
    api = resolved;
    return true;
}

DriverState load() {
    DriverState state;
    const char* forced = std::getenv("ROPE_JIT_CUDA_LIBRARY");
    const std::string library =
        forced != nullptr && forced[0] != '\0' ? std::string(forced) : "libcuda.so.1";
    state.loaded = load_driver(library, state.api, state.error);
    return state;
}

const DriverState& state() {
    static const DriverState instance = load();
    return instance;
}

}  // namespace

const CudaDriverApi* cuda_driver_api() {
    const DriverState& s = state();
    return s.loaded ? &s.api : nullptr;
}

const std::string& cuda_driver_load_error() {
    return state().error;
}

std::string cuda_driver_probe(const std::string& library) {
    CudaDriverApi api;
    std::string error;
    load_driver(library, api, error);
    return error;
}

int cuda_device_count() {
    static const int count = [] {
        const CudaDriverApi* api = cuda_driver_api();
        int n = 0;
        if (api == nullptr || api->cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
        return n;
    }();
    return count;
}

std::string cuda_device_target(int device) {
    const CudaDriverApi* api = cuda_driver_api();
    if (api == nullptr) {
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE,
                    "no CUDA driver: " + cuda_driver_load_error());
    }
    CUdevice handle = 0;
    check_cu(api->cuDeviceGet(&handle, device),
             ("cuDeviceGet(" + std::to_string(device) + ")").c_str());
    int major = 0;
    int minor = 0;
    check_cu(
        api->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
        "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)");
    check_cu(
        api->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle),
        "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)");
    return "sm_" + std::to_string(major * 10 + minor);
}

std::string cuda_error_text(CUresult result) {
    const CudaDriverApi* api = cuda_driver_api();
    const char* name = nullptr;
    const char* message = nullptr;
    if (api != nullptr && api->cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) {
        if (api->cuGetErrorString(result, &message) == CUDA_SUCCESS && message != nullptr) {
            return std::string(name) + ": " + message;
        }
        return name;
    }
    return result_text(result);
}

void throw_cuda_error(CUresult result, const char* what) {
    throw Error(ROPE_JIT_ERROR_CUDA, std::string(what) + ": " + cuda_error_text(result));
}

const CudaDriverApi& require_cuda_driver() {
    const CudaDriverApi* api = cuda_driver_api();
    if (api == nullptr)
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE,
                    "CUDA driver not available: " + cuda_driver_load_error());
    return *api;
}

ContextScope::ContextScope(const CudaDriverApi& api, CUcontext context, CUcontext current)
    : api_(api) {
    if (context == current) return;
    if (current == nullptr) {
        // A thread with no context (PyTorch's autograd threads, a fresh std::thread) keeps the
        // launch context, as the CUDA runtime's first call on a thread does: restoring "none"
        // would leave the next runtime API user (cuBLAS) without a context.
        check_cu(api_.cuCtxSetCurrent(context), "cuCtxSetCurrent");
        return;
    }
    check_cu(api_.cuCtxPushCurrent(context), "cuCtxPushCurrent");
    pushed_ = true;
}

ContextScope::~ContextScope() {
    if (pushed_) {
        CUcontext popped = nullptr;
        api_.cuCtxPopCurrent(&popped);
    }
}

}  // namespace rope_jit
