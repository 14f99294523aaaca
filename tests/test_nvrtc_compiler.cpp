#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/cuda_driver.h"
#include "common/error.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"

using namespace rope_jit;

namespace {

// No include at all: templates must compile where only libnvrtc is installed.
const char* const kTinyKernel = R"(
extern "C" __global__ void scale(float* data, float factor, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) data[i] *= factor;
}
)";

bool starts_with_elf_magic(const std::vector<char>& binary) {
    return binary.size() > 4 && binary[0] == '\x7f' && binary[1] == 'E' && binary[2] == 'L' &&
           binary[3] == 'F';
}

std::string text_of(const std::vector<char>& binary) {
    return std::string(binary.begin(), binary.end());
}

}  // namespace

TEST_CASE("NVRTC loads from the toolkit and reports its version and architectures") {
    const NvrtcApi* api = nvrtc_api();
    INFO("load error: " << nvrtc_load_error());
    REQUIRE(api != nullptr);
    CHECK(nvrtc_load_error().empty());
    CHECK(nvrtc_library_path().find("libnvrtc") != std::string::npos);

    const std::string& version = nvrtc_version_string();
    CAPTURE(version);
    const size_t dot = version.find('.');
    REQUIRE(dot != std::string::npos);
    CHECK(std::stoi(version.substr(0, dot)) >= 11);

    const std::vector<int>& archs = nvrtc_supported_archs();
    REQUIRE_FALSE(archs.empty());
    CHECK(std::is_sorted(archs.begin(), archs.end()));
    CHECK(std::find(archs.begin(), archs.end(), 80) != archs.end());
    CHECK(std::find(archs.begin(), archs.end(), 90) != archs.end());

    CHECK(nvrtc_error_name(NVRTC_ERROR_COMPILATION) == "NVRTC_ERROR_COMPILATION");
}

TEST_CASE("a kernel without includes compiles to a cubin for the exact architecture") {
    for (const std::string target : {"sm_80", "sm_90"}) {
        CAPTURE(target);
        const CompileResult result = compile_cuda(kTinyKernel, "tiny.cu", target, {});
        CHECK_FALSE(result.is_ptx);
        CHECK(result.target_used == target);
        CHECK(starts_with_elf_magic(result.binary));
        CHECK(result.milliseconds > 0.0);
        CHECK(result.options ==
              std::vector<std::string>{"-std=c++17", "--gpu-architecture=" + target});
    }
}

TEST_CASE("the options do not enable fast math and carry the caller's extra options") {
    const CompileResult result =
        compile_cuda(kTinyKernel, "tiny.cu", "sm_90", {"-DROPE_JIT_TEST=1", "-lineinfo"});
    CHECK(std::find(result.options.begin(), result.options.end(), "--use_fast_math") ==
          result.options.end());
    REQUIRE(result.options.size() == 4);
    CHECK(result.options[2] == "-DROPE_JIT_TEST=1");
    CHECK(result.options[3] == "-lineinfo");
}

TEST_CASE("a syntax error throws a compile error carrying the NVRTC log and the options") {
    const std::string broken = "extern \"C\" __global__ void broken(float* p) { p[0] = ; }\n";
    try {
        compile_cuda(broken, "broken_kernel.cu", "sm_90", {"-DMARKER_OPTION=7"});
        FAIL("compile_cuda accepted a syntax error");
    } catch (const Error& error) {
        const std::string message = error.what();
        CAPTURE(message);
        CHECK(error.status() == ROPE_JIT_ERROR_COMPILE);
        CHECK(message.find("broken_kernel.cu") != std::string::npos);
        CHECK(message.find("expected an expression") != std::string::npos);
        CHECK(message.find("-std=c++17") != std::string::npos);
        CHECK(message.find("--gpu-architecture=sm_90") != std::string::npos);
        CHECK(message.find("-DMARKER_OPTION=7") != std::string::npos);
    }
}

TEST_CASE("an unknown option is a compile error, not a crash") {
    CHECK_THROWS_AS(compile_cuda(kTinyKernel, "tiny.cu", "sm_90", {"--no-such-option"}), Error);
}

TEST_CASE("a GPU newer than NVRTC gets PTX for the newest architecture it supports") {
    const int newest = nvrtc_supported_archs().back();
    const std::string expected = "compute_" + std::to_string(newest);
    CHECK(choose_target_for_device(99, 9) == expected);

    const CompileResult result = compile_cuda(kTinyKernel, "tiny.cu", "sm_999", {});
    CHECK(result.is_ptx);
    CHECK(result.target_used == expected);
    CHECK(std::find(result.options.begin(), result.options.end(),
                    "--gpu-architecture=" + expected) != result.options.end());
    REQUIRE_FALSE(result.binary.empty());
    // cuModuleLoadData reads PTX as a C string.
    CHECK(result.binary.back() == '\0');
    const std::string ptx = text_of(result.binary);
    CHECK(ptx.find(".target sm_" + std::to_string(newest)) != std::string::npos);
    CHECK(ptx.find(".entry scale") != std::string::npos);
}

TEST_CASE("a GPU NVRTC supports gets a cubin for its own architecture") {
    CHECK(choose_target_for_device(9, 0) == "sm_90");
    CHECK(choose_target_for_device(8, 0) == "sm_80");
}

TEST_CASE("the target decision follows the supported list, not a table") {
    const std::vector<int> supported = {75, 80, 86, 89, 90};
    CHECK(choose_target("sm_86", supported) == "sm_86");
    CHECK(choose_target("sm_90a", supported) == "sm_90a");
    CHECK(choose_target("compute_80", supported) == "compute_80");
    CHECK(choose_target("sm_100", supported) == "compute_90");
    CHECK(choose_target("sm_120", supported) == "compute_90");
    SUBCASE("an unlisted architecture between two listed ones gets PTX of the lower one") {
        CHECK(choose_target("sm_87", supported) == "compute_86");
    }
    SUBCASE("the architecture a chosen target compiles for (what __CUDA_ARCH__ / 10 is)") {
        CHECK(target_arch(choose_target("sm_90", supported)) == 90);
        CHECK(target_arch(choose_target("sm_90a", supported)) == 90);
        CHECK(target_arch(choose_target("sm_87", supported)) == 86);
        CHECK(target_arch(choose_target("sm_120", supported)) == 90);
        CHECK(target_arch(choose_target("sm_90", {75, 80, 86})) == 86);  // an NVRTC before sm_90
        CHECK_THROWS_AS(target_arch("gfx90a"), Error);
    }
    SUBCASE("a GPU older than every supported architecture is unsupported") {
        try {
            choose_target("sm_70", supported);
            FAIL("sm_70 accepted");
        } catch (const Error& error) {
            CHECK(error.status() == ROPE_JIT_ERROR_UNSUPPORTED);
            CHECK(std::string(error.what()).find("sm_75") != std::string::npos);
        }
    }
    SUBCASE("an arch-specific target NVRTC does not know cannot fall back to PTX") {
        try {
            choose_target("sm_100a", supported);
            FAIL("sm_100a accepted");
        } catch (const Error& error) {
            CHECK(error.status() == ROPE_JIT_ERROR_UNSUPPORTED);
        }
    }
    SUBCASE("malformed targets are invalid arguments") {
        for (const char* bad :
             {"", "sm_", "sm_9", "90", "sm_90x", "compute_", "gfx90a", "sm_12345678901234567890"}) {
            CAPTURE(bad);
            try {
                choose_target(bad, supported);
                FAIL("accepted");
            } catch (const Error& error) {
                CHECK(error.status() == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            }
        }
    }
}

TEST_CASE("without a GPU the driver loader fails cleanly and reports no device") {
    if (cuda_driver_api() != nullptr) {
        MESSAGE("a CUDA driver is present; nothing to check here");
        return;
    }
    CHECK_FALSE(cuda_driver_load_error().empty());
    CHECK(cuda_device_count() == 0);
    try {
        cuda_device_target(0);
        FAIL("cuda_device_target succeeded without a driver");
    } catch (const Error& error) {
        CHECK(error.status() == ROPE_JIT_ERROR_BACKEND_UNAVAILABLE);
    }
    CHECK(cuda_error_text(CUDA_ERROR_NO_DEVICE) == "CUresult 100");
    try {
        check_cu(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc");
        FAIL("check_cu did not throw");
    } catch (const Error& error) {
        CHECK(error.status() == ROPE_JIT_ERROR_CUDA);
        CHECK(std::string(error.what()).rfind("cuMemAlloc: ", 0) == 0);
    }
    CHECK_NOTHROW(check_cu(CUDA_SUCCESS, "cuInit"));
}

TEST_CASE("a missing driver library or the toolkit's stub is rejected with a reason") {
    const std::string missing = cuda_driver_probe("/nonexistent/libcuda.so.1");
    CHECK(missing.find("/nonexistent/libcuda.so.1") != std::string::npos);

    // The stub only exists where the toolkit is installed; it must never count as a driver.
    const std::string stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
    const std::string reason = cuda_driver_probe(stub);
    CAPTURE(reason);
    CHECK_FALSE(reason.empty());
}

// Run only where a GPU is: a CPU-only run excludes them with -tse=gpu.
TEST_SUITE("gpu") {
    namespace {

    const CudaDriverApi& require_driver() {
        const CudaDriverApi* api = cuda_driver_api();
        INFO("driver load error: " << cuda_driver_load_error());
        REQUIRE(api != nullptr);
        REQUIRE(cuda_device_count() > 0);
        return *api;
    }

    // Makes device 0's primary context current for the test's duration, the way a framework's
    // context would be when the runtime is called.
    class PrimaryContext {
    public:
        explicit PrimaryContext(const CudaDriverApi& api) : api_(api) {
            check_cu(api_.cuDeviceGet(&device_, 0), "cuDeviceGet");
            check_cu(api_.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
            check_cu(api_.cuCtxPushCurrent(context_), "cuCtxPushCurrent");
        }
        PrimaryContext(const PrimaryContext&) = delete;
        PrimaryContext& operator=(const PrimaryContext&) = delete;
        ~PrimaryContext() {
            CUcontext popped = nullptr;
            api_.cuCtxPopCurrent(&popped);
            api_.cuDevicePrimaryCtxRelease(device_);
        }
        CUcontext context() const { return context_; }

    private:
        const CudaDriverApi& api_;
        CUdevice device_ = 0;
        CUcontext context_ = nullptr;
    };

    // Loads `binary`, runs scale(data, 3, n) on `stream` (through a captured graph when asked) and
    // returns what came back.
    std::vector<float> run_scale(const CudaDriverApi& api, const CompileResult& compiled,
                                 CUstream stream, bool through_graph) {
        CUmodule module = nullptr;
        check_cu(api.cuModuleLoadData(&module, compiled.binary.data()), "cuModuleLoadData");
        CUfunction function = nullptr;
        check_cu(api.cuModuleGetFunction(&function, module, "scale"), "cuModuleGetFunction");

        const int n = 1000;
        std::vector<float> host(n);
        for (int i = 0; i < n; ++i) host[static_cast<size_t>(i)] = static_cast<float>(i);
        const size_t bytes = host.size() * sizeof(float);
        CUdeviceptr data = 0;
        check_cu(api.cuMemAlloc(&data, bytes), "cuMemAlloc");
        check_cu(api.cuMemcpyHtoD(data, host.data(), bytes), "cuMemcpyHtoD");

        float factor = 3.0f;
        int count = n;
        void* params[] = {&data, &factor, &count};
        auto launch = [&] {
            check_cu(api.cuLaunchKernel(function, (n + 255) / 256, 1, 1, 256, 1, 1, 0, stream,
                                        params, nullptr),
                     "cuLaunchKernel");
        };
        if (through_graph) {
            check_cu(api.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                     "cuStreamBeginCapture");
            launch();
            CUgraph graph = nullptr;
            check_cu(api.cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
            CUgraphExec exec = nullptr;
            check_cu(api.cuGraphInstantiate(&exec, graph, 0), "cuGraphInstantiate");
            check_cu(api.cuGraphLaunch(exec, stream), "cuGraphLaunch");
            check_cu(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
            check_cu(api.cuGraphExecDestroy(exec), "cuGraphExecDestroy");
            check_cu(api.cuGraphDestroy(graph), "cuGraphDestroy");
        } else {
            launch();
            check_cu(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
        }
        check_cu(api.cuMemcpyDtoH(host.data(), data, bytes), "cuMemcpyDtoH");
        check_cu(api.cuMemFree(data), "cuMemFree");
        check_cu(api.cuModuleUnload(module), "cuModuleUnload");
        return host;
    }

    void check_scaled(const std::vector<float>& values) {
        for (size_t i = 0; i < values.size(); ++i) {
            if (values[i] != 3.0f * static_cast<float>(i)) {
                CAPTURE(i);
                CHECK(values[i] == 3.0f * static_cast<float>(i));
                return;
            }
        }
    }

    }  // namespace

    TEST_CASE("the driver loads, counts the devices and names the device's target") {
        const CudaDriverApi& api = require_driver();
        int version = 0;
        check_cu(api.cuDriverGetVersion(&version), "cuDriverGetVersion");
        CHECK(version >= 11040);
        const std::string target = cuda_device_target(0);
        CAPTURE(target);
        CHECK(target.rfind("sm_", 0) == 0);
        CHECK(cuda_error_text(CUDA_ERROR_INVALID_VALUE).rfind("CUDA_ERROR_INVALID_VALUE: ", 0) ==
              0);
        CHECK_THROWS_AS(cuda_device_target(cuda_device_count()), Error);
    }

    TEST_CASE("a cubin for the device's own architecture loads and runs, also from a graph") {
        const CudaDriverApi& api = require_driver();
        PrimaryContext context(api);
        int major = 0;
        int minor = 0;
        check_cu(api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0),
                 "cuDeviceGetAttribute");
        check_cu(api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
                 "cuDeviceGetAttribute");
        const CompileResult compiled =
            compile_cuda(kTinyKernel, "tiny.cu", choose_target_for_device(major, minor), {});
        CAPTURE(compiled.target_used);

        CUstream stream = nullptr;
        check_cu(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        CUcontext stream_context = nullptr;
        check_cu(api.cuStreamGetCtx(stream, &stream_context), "cuStreamGetCtx");
        CHECK(stream_context == context.context());
        CUdevice current = -1;
        check_cu(api.cuCtxGetDevice(&current), "cuCtxGetDevice");
        CHECK(current == 0);

        SUBCASE("launched directly") {
            check_scaled(run_scale(api, compiled, stream, false));
        }
        SUBCASE("captured in a graph") {
            check_scaled(run_scale(api, compiled, stream, true));
        }
        check_cu(api.cuStreamDestroy(stream), "cuStreamDestroy");
    }

    TEST_CASE("PTX for an older architecture is JIT-compiled by the driver and runs") {
        const CudaDriverApi& api = require_driver();
        PrimaryContext context(api);
        const std::string oldest = "compute_" + std::to_string(nvrtc_supported_archs().front());
        const CompileResult compiled = compile_cuda(kTinyKernel, "tiny.cu", oldest, {});
        REQUIRE(compiled.is_ptx);
        check_scaled(run_scale(api, compiled, nullptr, false));
    }

    TEST_CASE("device pointers report their device and events time the stream") {
        const CudaDriverApi& api = require_driver();
        PrimaryContext context(api);
        CUdeviceptr data = 0;
        check_cu(api.cuMemAlloc(&data, 1 << 20), "cuMemAlloc");
        unsigned memory_type = 0;
        check_cu(api.cuPointerGetAttribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, data),
                 "cuPointerGetAttribute(MEMORY_TYPE)");
        CHECK(memory_type == CU_MEMORYTYPE_DEVICE);
        int ordinal = -1;
        check_cu(api.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, data),
                 "cuPointerGetAttribute(DEVICE_ORDINAL)");
        CHECK(ordinal == 0);

        CUevent start = nullptr;
        CUevent stop = nullptr;
        check_cu(api.cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate");
        check_cu(api.cuEventCreate(&stop, CU_EVENT_DEFAULT), "cuEventCreate");
        check_cu(api.cuEventRecord(start, nullptr), "cuEventRecord");
        check_cu(api.cuMemsetD8(data, 7, 1 << 20), "cuMemsetD8");
        check_cu(api.cuEventRecord(stop, nullptr), "cuEventRecord");
        check_cu(api.cuEventSynchronize(stop), "cuEventSynchronize");
        float ms = -1.0f;
        check_cu(api.cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
        CHECK(ms >= 0.0f);
        unsigned char byte = 0;
        check_cu(api.cuMemcpyDtoH(&byte, data + 12345, 1), "cuMemcpyDtoH");
        CHECK(byte == 7);
        check_cu(api.cuEventDestroy(start), "cuEventDestroy");
        check_cu(api.cuEventDestroy(stop), "cuEventDestroy");
        check_cu(api.cuMemFree(data), "cuMemFree");
        check_cu(api.cuCtxSynchronize(), "cuCtxSynchronize");
    }

}  // TEST_SUITE("gpu")
