// The CUDA driver, loaded with dlopen on first use so that librope_jit.so loads and runs its
// CPU path on machines without a GPU. No CUDA header is included: the few types and values
// used are declared here with the same layout and numbers as cuda.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// The same tags as cuda.h, so handles pass unchanged between this code and code that
// includes cuda.h (a benchmark, a framework's stream).
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;

namespace rope_jit {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = CUctx_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;
using CUgraph = CUgraph_st*;
using CUgraphExec = CUgraphExec_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_STUB_LIBRARY = 34;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;

// CUdevice_attribute
constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;

// CUfunction_attribute
constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;

// CUpointer_attribute, and the CUmemorytype values CU_POINTER_ATTRIBUTE_MEMORY_TYPE returns
constexpr int CU_POINTER_ATTRIBUTE_CONTEXT = 1;
constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
constexpr unsigned CU_MEMORYTYPE_HOST = 1;
constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;
constexpr unsigned CU_MEMORYTYPE_ARRAY = 3;
constexpr unsigned CU_MEMORYTYPE_UNIFIED = 4;

// Stream, event and capture flags
constexpr unsigned CU_STREAM_DEFAULT = 0;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DEFAULT = 0;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr int CU_STREAM_CAPTURE_MODE_GLOBAL = 0;
constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;  // CUstreamCaptureStatus

// The driver ABI every entry point is requested at through cuGetProcAddress. Pinning it keeps
// each pointer's signature the one declared below on newer drivers: CUDA 13 changed
// cuCtxGetDevice and cuCtxSynchronize, 12.5 added a three-argument cuStreamGetCtx.
constexpr int ROPE_JIT_CUDA_ABI_VERSION = 12000;

// Every driver entry point the runtime, its tests and its benchmark use, one line each: the
// field, the name asked of cuGetProcAddress (the base name: the driver picks the _v2/_v3 that
// matches ROPE_JIT_CUDA_ABI_VERSION) and the parameters. All return CUresult.
// cuGraphInstantiate is requested as cuGraphInstantiateWithFlags, the one name whose signature
// never changed (12.0 repointed cuGraphInstantiate at it; before that it took a log buffer).
#define ROPE_JIT_CUDA_SYMBOLS(X)                                                                  \
    X(cuInit, "cuInit", (unsigned flags))                                                         \
    X(cuDriverGetVersion, "cuDriverGetVersion", (int* version))                                   \
    X(cuGetErrorName, "cuGetErrorName", (CUresult error, const char** name))                      \
    X(cuGetErrorString, "cuGetErrorString", (CUresult error, const char** message))               \
    X(cuDeviceGetCount, "cuDeviceGetCount", (int* count))                                         \
    X(cuDeviceGet, "cuDeviceGet", (CUdevice * device, int ordinal))                               \
    X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int* value, int attribute, CUdevice dev))    \
    X(cuDeviceGetName, "cuDeviceGetName", (char* name, int length, CUdevice device))              \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext * ctx, CUdevice dev))      \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", (CUdevice device))                  \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext * ctx))                                      \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext ctx))                                        \
    X(cuCtxPushCurrent, "cuCtxPushCurrent", (CUcontext ctx))                                      \
    X(cuCtxPopCurrent, "cuCtxPopCurrent", (CUcontext * ctx))                                      \
    X(cuCtxGetDevice, "cuCtxGetDevice", (CUdevice * device))                                      \
    X(cuCtxSynchronize, "cuCtxSynchronize", ())                                                   \
    X(cuStreamGetCtx, "cuStreamGetCtx", (CUstream stream, CUcontext * ctx))                       \
    X(cuModuleLoadData, "cuModuleLoadData", (CUmodule * module, const void* image))               \
    X(cuModuleUnload, "cuModuleUnload", (CUmodule module))                                        \
    X(cuModuleGetFunction, "cuModuleGetFunction",                                                 \
      (CUfunction * function, CUmodule module, const char* name))                                 \
    X(cuLaunchKernel, "cuLaunchKernel",                                                           \
      (CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,  \
       unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream stream, void** params, \
       void** extra))                                                                             \
    X(cuFuncSetAttribute, "cuFuncSetAttribute", (CUfunction f, int attribute, int value))         \
    X(cuPointerGetAttribute, "cuPointerGetAttribute",                                             \
      (void* data, int attribute, CUdeviceptr pointer))                                           \
    X(cuMemAlloc, "cuMemAlloc", (CUdeviceptr * pointer, size_t bytes))                            \
    X(cuMemFree, "cuMemFree", (CUdeviceptr pointer))                                              \
    X(cuMemcpyHtoD, "cuMemcpyHtoD", (CUdeviceptr dst, const void* src, size_t bytes))             \
    X(cuMemcpyDtoH, "cuMemcpyDtoH", (void* dst, CUdeviceptr src, size_t bytes))                   \
    X(cuMemcpyDtoD, "cuMemcpyDtoD", (CUdeviceptr dst, CUdeviceptr src, size_t bytes))             \
    X(cuMemsetD8, "cuMemsetD8", (CUdeviceptr dst, unsigned char value, size_t count))             \
    X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync",                                                     \
      (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                          \
    X(cuMemsetD32Async, "cuMemsetD32Async",                                                       \
      (CUdeviceptr dst, unsigned value, size_t count, CUstream stream))                           \
    X(cuMemAllocAsync, "cuMemAllocAsync", (CUdeviceptr * pointer, size_t bytes, CUstream stream)) \
    X(cuMemFreeAsync, "cuMemFreeAsync", (CUdeviceptr pointer, CUstream stream))                   \
    X(cuMemsetD2D32Async, "cuMemsetD2D32Async",                                                   \
      (CUdeviceptr dst, size_t pitch, unsigned value, size_t width, size_t height,                \
       CUstream stream))                                                                          \
    X(cuStreamCreate, "cuStreamCreate", (CUstream * stream, unsigned flags))                      \
    X(cuStreamDestroy, "cuStreamDestroy", (CUstream stream))                                      \
    X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream stream))                              \
    X(cuStreamIsCapturing, "cuStreamIsCapturing", (CUstream stream, int* status))                 \
    X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", (int* mode))        \
    X(cuStreamBeginCapture, "cuStreamBeginCapture", (CUstream stream, int mode))                  \
    X(cuStreamEndCapture, "cuStreamEndCapture", (CUstream stream, CUgraph * graph))               \
    X(cuGraphInstantiate, "cuGraphInstantiateWithFlags",                                          \
      (CUgraphExec * exec, CUgraph graph, unsigned long long flags))                              \
    X(cuGraphLaunch, "cuGraphLaunch", (CUgraphExec exec, CUstream stream))                        \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", (CUgraphExec exec))                               \
    X(cuGraphDestroy, "cuGraphDestroy", (CUgraph graph))                                          \
    X(cuEventCreate, "cuEventCreate", (CUevent * event, unsigned flags))                          \
    X(cuEventRecord, "cuEventRecord", (CUevent event, CUstream stream))                           \
    X(cuEventSynchronize, "cuEventSynchronize", (CUevent event))                                  \
    X(cuEventElapsedTime, "cuEventElapsedTime", (float* ms, CUevent start, CUevent end))          \
    X(cuEventDestroy, "cuEventDestroy", (CUevent event))

// A TMA descriptor (cuda.h: CUtensorMap) and the cuTensorMapEncodeTiled arguments the
// attention forward uses (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion,
// ...FloatOOBfill).
struct alignas(64) CUtensorMap {
    unsigned long long opaque[16];
};
constexpr int CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1;
constexpr int CU_TENSOR_MAP_INTERLEAVE_NONE = 0;
constexpr int CU_TENSOR_MAP_SWIZZLE_128B = 3;
constexpr int CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3;
constexpr int CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0;  // out-of-bounds elements read as zero
using CuTensorMapEncodeTiled = CUresult (*)(CUtensorMap* map, int data_type, unsigned rank,
                                            void* address, const unsigned long long* dims,
                                            const unsigned long long* strides, const unsigned* box,
                                            const unsigned* element_strides, int interleave,
                                            int swizzle, int l2_promotion, int oob_fill);

// A launch with attributes (cuda.h: CUlaunchConfig, CUlaunchAttribute and its 64-byte value
// union), for the one attribute used: programmatic stream serialization (programmatic
// dependent launch, sm_90 and later).
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
struct alignas(8) CUlaunchAttribute {
    int id;
    char pad[4];
    union {
        char bytes[64];
        unsigned programmatic_stream_serialization_allowed;
    } value;
};
struct CUlaunchConfig {
    unsigned grid_x, grid_y, grid_z;
    unsigned block_x, block_y, block_z;
    unsigned shared_bytes;
    CUstream stream;
    CUlaunchAttribute* attrs;
    unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72 && sizeof(CUlaunchConfig) == 56,
              "the layouts of cuda.h's CUlaunchAttribute and CUlaunchConfig");
using CuLaunchKernelEx = CUresult (*)(const CUlaunchConfig* config, CUfunction function,
                                      void** params, void** extra);

struct CudaDriverApi {
#define ROPE_JIT_CUDA_FIELD_(field, query, params) CUresult(*field) params = nullptr;
    ROPE_JIT_CUDA_SYMBOLS(ROPE_JIT_CUDA_FIELD_)
#undef ROPE_JIT_CUDA_FIELD_
    // CUDA 12.0 and later; nullptr on an older driver (no TMA kernels then).
    CuTensorMapEncodeTiled cuTensorMapEncodeTiled = nullptr;
    // CUDA 12.0 and later; nullptr on an older driver (no programmatic launches then).
    CuLaunchKernelEx cuLaunchKernelEx = nullptr;
};

// The loaded and initialized driver, or nullptr when there is none, it lacks an entry point
// (drivers older than CUDA 11.4), or cuInit fails (no GPU, a stub library): then
// cuda_driver_load_error() says why. The first call loads and calls cuInit(0); later calls
// return the same pointer. Thread-safe. The library stays loaded for the life of the process.
//
// Library: $ROPE_JIT_CUDA_LIBRARY when set (a path or a soname), else libcuda.so.1. Never the
// toolkit's unversioned libcuda.so, which on most systems is the link-time stub.
const CudaDriverApi* cuda_driver_api();

// Why cuda_driver_api() returned nullptr; "" when it did not.
const std::string& cuda_driver_load_error();

// Loads `library` as cuda_driver_api() would, without touching the process-wide instance:
// "" when it would be usable, else why not. Lets tests check that a stub or missing driver
// fails cleanly without deciding the fate of every later test.
std::string cuda_driver_probe(const std::string& library);

// cuda_driver_api(), or Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE) saying why there is none.
const CudaDriverApi& require_cuda_driver();

// Makes `context` current on the calling thread for a scope, when it is not `current` (the
// caller's cuCtxGetCurrent) already, and restores the previous one at the end. With PyTorch
// the current context is normally the one wanted, so the common case pushes nothing. A thread
// with no current context keeps `context` afterwards (nothing to restore), as after a CUDA
// runtime call.
class ContextScope {
public:
    ContextScope(const CudaDriverApi& api, CUcontext context, CUcontext current);
    ~ContextScope();
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

private:
    const CudaDriverApi& api_;
    bool pushed_ = false;
};

// The number of visible CUDA devices; 0 when the driver is unavailable or reports an error.
int cuda_device_count();

// "sm_90" for a device of compute capability 9.0. Throws Error(ROPE_JIT_ERROR_BACKEND_
// UNAVAILABLE) without a driver, Error(ROPE_JIT_ERROR_CUDA) for a bad ordinal.
std::string cuda_device_target(int device);

// "<name>: <message>" for a CUresult ("CUDA_ERROR_NO_DEVICE: no CUDA-capable device is
// detected"), or "CUresult N" when the driver cannot name it.
std::string cuda_error_text(CUresult result);

// Throws Error(ROPE_JIT_ERROR_CUDA, "<what>: <name>: <message>").
[[noreturn]] void throw_cuda_error(CUresult result, const char* what);

// Inline so that the success test on the launch path costs a compare, not a call.
inline void check_cu(CUresult result, const char* what) {
    if (result != CUDA_SUCCESS) throw_cuda_error(result, what);
}

}  // namespace rope_jit
