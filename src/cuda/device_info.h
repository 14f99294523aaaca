// What rope_jit_device_describe reports about one CUDA device of a runtime: its name from the
// driver and the compile target the device layer chose for it.
#pragma once

#include <string>

#include "cuda/cuda_devices.h"

namespace rope_jit {

struct DeviceDescription {
    std::string name;    // "NVIDIA H200"
    std::string target;  // "sm_90"
};

// Device `ordinal` of `devices` (nullptr: the CPU backend, which has none). Throws
// Error(INVALID_ARGUMENT) naming the ordinal when it is out of range, Error(CUDA) when the
// driver cannot name the device.
DeviceDescription describe_device(const CudaDevices* devices, int ordinal);

}  // namespace rope_jit
