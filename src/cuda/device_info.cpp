#include "cuda/device_info.h"

#include <fmt/format.h>

#include "cuda/cuda_driver.h"
#include "common/error.h"

namespace rope_jit {

DeviceDescription describe_device(const CudaBackend* backend, int ordinal) {
    const int count = backend ? backend->device_count() : 0;
    if (ordinal < 0 || ordinal >= count)
        fail_argument(fmt::format("ordinal: {} is not a device of this runtime, which has {}", ordinal, count));
    // The backend exists, so the driver loaded; its ordinals are the driver's.
    const CudaDriverApi& api = *cuda_driver_api();
    CUdevice device = 0;
    check_cu(api.cuDeviceGet(&device, ordinal), "cuDeviceGet");
    char name[256] = {};
    check_cu(api.cuDeviceGetName(name, int(sizeof name) - 1, device), "cuDeviceGetName");
    return DeviceDescription{name, backend->target(ordinal)};
}

}  // namespace rope_jit
