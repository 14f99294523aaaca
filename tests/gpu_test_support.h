// GPU test support shared by the gpu suites: the driver, the devices' primary contexts (device
// 0's current on the test's thread, as a framework would have it), a per-process kernel cache directory,
// runtimes, device mirrors of HostTensors, streams and graphs. Header-only: each suite is one
// translation unit of the test binary, so every definition here is inline.
#pragma once

#include <stdlib.h>  // mkdtemp

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "cuda/cuda_driver.h"
#include "rope_test_support.h"

namespace gpu_test {

using rope_jit::check_cu;
using rope_test::HostTensor;

// ------------------------------------------------------------------------------------------
// The driver, the primary context, the kernel cache directory and the runtimes
// ------------------------------------------------------------------------------------------

// The loaded driver; throws (rather than REQUIREs) so that worker threads may call it.
inline const rope_jit::CudaDriverApi& driver() {
    const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api();
    if (api == nullptr)
        throw std::runtime_error("no CUDA driver: " + rope_jit::cuda_driver_load_error());
    return *api;
}

// The number of CUDA devices the driver reports (0 without a driver or a device).
inline int device_count() {
    return rope_jit::cuda_device_count();
}

// Device `ordinal`'s primary context, retained once for the whole process and never released,
// as PyTorch does. Each thread that touches device memory makes it current first.
inline rope_jit::CUcontext primary_context(int ordinal = 0) {
    static std::mutex mutex;
    static std::map<int, rope_jit::CUcontext> retained;
    const std::lock_guard<std::mutex> lock(mutex);
    rope_jit::CUcontext& context = retained[ordinal];
    if (context == nullptr) {
        rope_jit::CUdevice device = 0;
        check_cu(driver().cuDeviceGet(&device, ordinal), "cuDeviceGet");
        check_cu(driver().cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
    }
    return context;
}

inline void make_primary_context_current(int ordinal = 0) {
    check_cu(driver().cuCtxSetCurrent(primary_context(ordinal)), "cuCtxSetCurrent");
}

inline void synchronize_context() {
    check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
}

// A directory made with mkdtemp, removed with everything in it when the process ends.
class TempDir {
public:
    explicit TempDir(const std::string& prefix) {
        std::string pattern =
            (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
        if (mkdtemp(pattern.data()) == nullptr)
            throw std::runtime_error("mkdtemp(" + pattern + "): " + std::strerror(errno));
        path_ = pattern;
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path_, ignored);
    }
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

// One fresh kernel cache per test process: tests never read the user's cache, and later tests
// load from disk what earlier runtimes compiled.
inline const std::string& kernel_cache_dir() {
    static const TempDir dir("rope_jit_gpu_tests_");
    return dir.path();
}

class RuntimeHandle {
public:
    // programmatic_launch: rope_jit_config.programmatic_launch (default: the library's).
    explicit RuntimeHandle(rope_jit_backend_kind backend, bool debug_checks = false,
                           int programmatic_launch = ROPE_JIT_PROGRAMMATIC_AUTO) {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = backend;
        config.cache_dir = kernel_cache_dir().c_str();
        config.debug_checks = debug_checks ? 1 : 0;
        config.programmatic_launch = programmatic_launch;
        const rope_jit_status status = rope_jit_runtime_create(&config, &handle_);
        const std::string message = rope_jit_last_error();
        const std::string call =
            std::string("rope_jit_runtime_create(") +
            (backend == ROPE_JIT_BACKEND_CUDA ? "ROPE_JIT_BACKEND_CUDA" : "ROPE_JIT_BACKEND_CPU") +
            ") -> " + rope_jit_status_name(status);
        INFO(call, ": ", message);
        REQUIRE(status == ROPE_JIT_OK);
    }
    RuntimeHandle(const RuntimeHandle&) = delete;
    RuntimeHandle& operator=(const RuntimeHandle&) = delete;
    ~RuntimeHandle() { rope_jit_runtime_free(handle_); }
    rope_jit_runtime* get() const { return handle_; }

private:
    rope_jit_runtime* handle_ = nullptr;
};

// What every GPU test starts from: a CUDA runtime, a CPU runtime to compare with, and device
// 0's primary context current on the test's thread. Creating the CUDA runtime comes first, so
// that on a machine without a GPU every test stops there with the library's own message.
struct GpuFixture {
    GpuFixture() : cuda_runtime(ROPE_JIT_BACKEND_CUDA), cpu_runtime(ROPE_JIT_BACKEND_CPU) {
        REQUIRE(rope_jit_backend(cuda_runtime.get()) == ROPE_JIT_BACKEND_CUDA);
        const std::string load_error = rope_jit::cuda_driver_load_error();
        INFO("CUDA driver: ", load_error);
        REQUIRE(rope_jit::cuda_driver_api() != nullptr);
        make_primary_context_current();
    }
    RuntimeHandle cuda_runtime, cpu_runtime;
};

// ------------------------------------------------------------------------------------------
// Device memory, streams, graphs
// ------------------------------------------------------------------------------------------

// HostTensor hands out its bytes only through a non-const accessor.
inline const std::vector<uint8_t>& bytes_of(const HostTensor& t) {
    return const_cast<HostTensor&>(t).bytes();
}

inline void* as_pointer(rope_jit::CUdeviceptr pointer) {
    return reinterpret_cast<void*>(static_cast<uintptr_t>(pointer));
}

// A HostTensor mirrored on the GPU: the whole backing buffer (padding included) copied to
// device memory, handed out as a DLTensor with the same shape and strides on {kDLCUDA, ordinal}.
class DeviceTensor {
public:
    explicit DeviceTensor(const HostTensor& host, int ordinal = 0)
        : shape_(host.shape()), strides_(host.strides()), size_(bytes_of(host).size()) {
        check_cu(driver().cuMemAlloc(&pointer_, size_), "cuMemAlloc");
        upload(host);
        tensor_ = *host.dl();
        tensor_.data = as_pointer(pointer_);
        tensor_.device = {kDLCUDA, ordinal};
        tensor_.shape = shape_.data();
        tensor_.strides = strides_.data();
    }
    DeviceTensor(const DeviceTensor&) = delete;
    DeviceTensor& operator=(const DeviceTensor&) = delete;
    ~DeviceTensor() {
        if (const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api())
            api->cuMemFree(pointer_);
    }

    const DLTensor* dl() const { return &tensor_; }
    rope_jit::CUdeviceptr pointer() const { return pointer_; }

    // Replaces the device bytes with host's, which must be a buffer of the same size. Returns
    // once the data is on the device: a copy from pageable memory may return before its DMA
    // ends, and work on a non-blocking stream is not ordered after it.
    void upload(const HostTensor& host) {
        const std::vector<uint8_t>& bytes = bytes_of(host);
        if (bytes.size() != size_)
            throw std::invalid_argument("DeviceTensor::upload: size differs");
        check_cu(driver().cuMemcpyHtoD(pointer_, bytes.data(), size_), "cuMemcpyHtoD");
        synchronize_context();
    }
    // Copies the device bytes into host (same size). The caller synchronizes the stream that
    // wrote them first.
    void download(HostTensor& host) const {
        std::vector<uint8_t>& bytes = host.bytes();
        if (bytes.size() != size_)
            throw std::invalid_argument("DeviceTensor::download: size differs");
        check_cu(driver().cuMemcpyDtoH(bytes.data(), pointer_, size_), "cuMemcpyDtoH");
    }

private:
    std::vector<int64_t> shape_, strides_;
    size_t size_ = 0;
    rope_jit::CUdeviceptr pointer_ = 0;
    DLTensor tensor_{};
};

class Stream {
public:
    Stream() {
        check_cu(driver().cuStreamCreate(&stream_, rope_jit::CU_STREAM_NON_BLOCKING),
                 "cuStreamCreate");
    }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    ~Stream() {
        if (const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api())
            api->cuStreamDestroy(stream_);
    }
    rope_jit::CUstream get() const { return stream_; }

private:
    rope_jit::CUstream stream_ = nullptr;
};

inline void synchronize(rope_jit::CUstream stream) {
    check_cu(driver().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

struct Graph {
    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
        const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api();
        if (api == nullptr) return;
        if (exec != nullptr) api->cuGraphExecDestroy(exec);
        if (graph != nullptr) api->cuGraphDestroy(graph);
    }
    rope_jit::CUgraph graph = nullptr;
    rope_jit::CUgraphExec exec = nullptr;
};

}  // namespace gpu_test
