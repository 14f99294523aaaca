#include "local_gpus.h"

#include <dlfcn.h>

#include <cstdlib>

namespace rope_jit_cache {

namespace {

// NVML's entry points, as its header declares them (nvmlReturn_t is an int, 0 = success;
// a device is an opaque pointer).
using NvmlDevice = void*;
using InitFn = int (*)();
using CountFn = int (*)(unsigned*);
using HandleFn = int (*)(unsigned, NvmlDevice*);
using NameFn = int (*)(NvmlDevice, char*, unsigned);
using CapabilityFn = int (*)(NvmlDevice, int*, int*);
using ShutdownFn = int (*)();

}  // namespace

std::optional<std::vector<LocalGpu>> local_gpus_from_nvml() {
    // Where CUDA sees other GPUs than NVML lists, or the runtime loads another driver library.
    if (std::getenv("CUDA_VISIBLE_DEVICES") != nullptr ||
        std::getenv("ROPE_JIT_CUDA_LIBRARY") != nullptr)
        return std::nullopt;
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return std::nullopt;
    const auto init = reinterpret_cast<InitFn>(dlsym(library, "nvmlInit_v2"));
    const auto count = reinterpret_cast<CountFn>(dlsym(library, "nvmlDeviceGetCount_v2"));
    const auto handle = reinterpret_cast<HandleFn>(dlsym(library, "nvmlDeviceGetHandleByIndex_v2"));
    const auto name = reinterpret_cast<NameFn>(dlsym(library, "nvmlDeviceGetName"));
    const auto capability =
        reinterpret_cast<CapabilityFn>(dlsym(library, "nvmlDeviceGetCudaComputeCapability"));
    const auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(library, "nvmlShutdown"));
    std::optional<std::vector<LocalGpu>> gpus;
    if (init && count && handle && name && capability && shutdown && init() == 0) {
        unsigned devices = 0;
        bool ok = count(&devices) == 0 && devices > 0;
        std::vector<LocalGpu> found;
        for (unsigned i = 0; ok && i < devices; ++i) {
            NvmlDevice device = nullptr;
            LocalGpu gpu;
            char text[96] = {};
            ok = handle(i, &device) == 0 && capability(device, &gpu.major, &gpu.minor) == 0 &&
                 gpu.major > 0;
            if (ok && name(device, text, sizeof(text)) == 0) gpu.name = text;
            found.push_back(gpu);
        }
        if (ok) gpus = std::move(found);
        shutdown();
    }
    // NVML stays loaded: unloading a driver library is not worth its risks in a short-lived tool.
    return gpus;
}

}  // namespace rope_jit_cache
