// The CUDA devices of a runtime: enumerated once at creation with the attributes launchers
// need (compile target, multiprocessors, compute capability, opt-in shared memory), their
// primary contexts (retained on first use, released with the object), and the context a launch
// on a caller's stream runs in. Owned by the runtime and shared by every op's launcher, which
// only builds its problem's parameters and launches.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_driver.h"

namespace rope_jit {

// Where a launch runs, and what was current when the call came in (for the ContextScope that
// makes the launch context current).
struct LaunchContext {
    CUcontext context = nullptr;
    CUcontext current = nullptr;
};

// What launchers read of one device; fixed after enumeration.
struct CudaDevice {
    CUdevice handle = 0;
    std::string target;          // "sm_90": what kernels for it compile for
    int compute_capability = 0;  // 90 for 9.0
    int multiprocessors = 1;
    int max_shared_optin = 0;  // dynamic shared memory a block may opt in to, bytes
};

class CudaDevices {
public:
    // Throws Error(BACKEND_UNAVAILABLE) without a driver or a device.
    CudaDevices();
    ~CudaDevices();
    CudaDevices(const CudaDevices&) = delete;
    CudaDevices& operator=(const CudaDevices&) = delete;

    const CudaDriverApi& api() const { return api_; }
    int device_count() const { return int(devices_.size()); }
    // Device `ordinal`, which must be in [0, device_count()).
    const CudaDevice& device(int ordinal) const { return devices_.at(size_t(ordinal))->info; }
    const std::string& target(int ordinal) const { return device(ordinal).target; }

    // Returns when `ordinal` (where the tensors named `argument` live) is a device of this
    // machine, else fails with INVALID_ARGUMENT naming the argument.
    void check_ordinal(int ordinal, const char* argument) const;

    // The context a launch on `stream` for device `ordinal` runs in: the stream's (which must
    // belong to that device, else fail_argument); for the NULL stream the current context when
    // it belongs to that device, else the device's primary context. Also returns the current
    // context.
    LaunchContext resolve_context(int ordinal, CUstream stream);

private:
    struct Device {
        CudaDevice info;
        CUcontext primary = nullptr;  // retained on first use, released at destruction
        std::once_flag primary_once;
    };

    CUcontext primary_context(int ordinal);
    // The ordinal of a device handle; -1 for one the runtime does not know.
    int ordinal_of(CUdevice device) const;

    const CudaDriverApi& api_;
    std::vector<std::unique_ptr<Device>> devices_;
};

}  // namespace rope_jit
