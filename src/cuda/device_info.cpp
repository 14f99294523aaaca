#include "cuda/device_info.h"

#include <fmt/format.h>

#include "cuda/cuda_driver.h"
#include "common/error.h"

namespace rope_jit {

DeviceDescription describe_device(const CudaDevices* devices, int ordinal) {
    const int count = devices ? devices->device_count() : 0;
    if (ordinal < 0 || ordinal >= count)
        fail_argument(fmt::format("ordinal: {} is not a device of this runtime, which has {}",
                                  ordinal, count));
    const CudaDevice& device = devices->device(ordinal);
    char name[256] = {};
    check_cu(devices->api().cuDeviceGetName(name, int(sizeof name) - 1, device.handle),
             "cuDeviceGetName");
    return DeviceDescription{name, device.target};
}

}  // namespace rope_jit
