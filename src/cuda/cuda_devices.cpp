#include "cuda/cuda_devices.h"

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

namespace {

// The device of a context, remembered per thread for the last few contexts asked about: a
// process uses one context per device (or a handful), so this is a few compares on the
// launch path, also for a thread that alternates between devices.
CUdevice context_device(const CudaDriverApi& api, CUcontext context, CUcontext current) {
    struct Remembered {
        CUcontext context = nullptr;
        CUdevice device = -1;
    };
    constexpr size_t kRemembered = 8;
    thread_local Remembered remembered[kRemembered];
    thread_local size_t next_slot = 0;
    for (const Remembered& entry : remembered)
        if (entry.context == context) return entry.device;
    CUdevice device = -1;
    {
        ContextScope scope(api, context, current);
        check_cu(api.cuCtxGetDevice(&device), "cuCtxGetDevice");
    }
    remembered[next_slot] = {context, device};
    next_slot = (next_slot + 1) % kRemembered;
    return device;
}

int device_attribute(const CudaDriverApi& api, CUdevice device, int attribute, const char* name) {
    int value = 0;
    check_cu(api.cuDeviceGetAttribute(&value, attribute, device),
             fmt::format("cuDeviceGetAttribute({})", name).c_str());
    return value;
}

}  // namespace

CudaDevices::CudaDevices() : api_(require_cuda_driver()) {
    const int count = cuda_device_count();
    if (count == 0)
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE, "the CUDA driver reports no device");
    for (int ordinal = 0; ordinal < count; ++ordinal) {
        auto device = std::make_unique<Device>();
        CudaDevice& info = device->info;
        check_cu(api_.cuDeviceGet(&info.handle, ordinal), "cuDeviceGet");
        info.target = cuda_device_target(ordinal);
        info.multiprocessors = device_attribute(
            api_, info.handle, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "MULTIPROCESSOR_COUNT");
        const int major =
            device_attribute(api_, info.handle, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                             "COMPUTE_CAPABILITY_MAJOR");
        const int minor =
            device_attribute(api_, info.handle, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                             "COMPUTE_CAPABILITY_MINOR");
        info.compute_capability = major * 10 + minor;
        info.max_shared_optin = device_attribute(
            api_, info.handle, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN");
        devices_.push_back(std::move(device));
    }
}

CudaDevices::~CudaDevices() {
    for (const auto& device : devices_)
        if (device->primary != nullptr) api_.cuDevicePrimaryCtxRelease(device->info.handle);
}

void CudaDevices::check_ordinal(int ordinal, const char* argument) const {
    if (ordinal < 0 || ordinal >= device_count())
        fail_argument(fmt::format("{}: lives on CUDA device {}, but this machine has {} device(s)",
                                  argument, ordinal, device_count()));
}

CUcontext CudaDevices::primary_context(int ordinal) {
    Device& device = *devices_[size_t(ordinal)];
    std::call_once(device.primary_once, [&] {
        check_cu(api_.cuDevicePrimaryCtxRetain(&device.primary, device.info.handle),
                 "cuDevicePrimaryCtxRetain");
    });
    return device.primary;
}

int CudaDevices::ordinal_of(CUdevice device) const {
    for (size_t ordinal = 0; ordinal < devices_.size(); ++ordinal)
        if (devices_[ordinal]->info.handle == device) return int(ordinal);
    return -1;
}

LaunchContext CudaDevices::resolve_context(int ordinal, CUstream stream) {
    LaunchContext launch;
    check_cu(api_.cuCtxGetCurrent(&launch.current), "cuCtxGetCurrent");
    const CUdevice wanted = devices_[size_t(ordinal)]->info.handle;
    if (stream != nullptr) {
        // A stream belongs to one context: the launch runs there, on the tensors' device.
        check_cu(api_.cuStreamGetCtx(stream, &launch.context), "cuStreamGetCtx(args.stream)");
        if (launch.context != nullptr) {
            const CUdevice device = context_device(api_, launch.context, launch.current);
            if (device != wanted)
                fail_argument(fmt::format(
                    "stream: the stream belongs to CUDA device {}, but the tensors live on "
                    "device {}",
                    ordinal_of(device), ordinal));
            return launch;
        }
    }
    // The NULL stream (or a special handle such as CU_STREAM_LEGACY, which has no context of
    // its own) is the legacy default stream of the context the launch runs in: the current
    // one when it belongs to the tensors' device, else that device's primary context, the
    // one PyTorch and the CUDA runtime use. So a call with tensors on device 1 works while a
    // framework has device 0 current.
    if (launch.current != nullptr && context_device(api_, launch.current, launch.current) == wanted)
        launch.context = launch.current;
    else
        launch.context = primary_context(ordinal);
    return launch;
}

}  // namespace rope_jit
