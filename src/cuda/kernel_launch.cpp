#include "cuda/kernel_launch.h"

#include "rope_jit/rope_jit.h"

namespace rope_jit {

bool programmatic_launch_requested(const CudaDriverApi& api, int setting) {
    if (setting != ROPE_JIT_PROGRAMMATIC_AUTO) return setting == ROPE_JIT_PROGRAMMATIC_ON;
    int version = 0;
    return api.cuDriverGetVersion != nullptr && api.cuDriverGetVersion(&version) == CUDA_SUCCESS &&
           version >= kProgrammaticGraphDriverVersion;
}

bool launches_programmatically(const CudaDriverApi& api, bool requested, int compute_capability,
                               int kernel_arch) {
    return requested && compute_capability >= 90 && kernel_arch >= 90 &&
           api.cuLaunchKernelEx != nullptr;
}

void launch_kernel(const CudaDriverApi& api, const KernelLaunch& launch, CUstream stream,
                   bool programmatic, const char* what) {
    void* kernel_args[] = {launch.arguments};
    if (programmatic) {
        CUlaunchAttribute attribute{};
        attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmatic_stream_serialization_allowed = 1;
        CUlaunchConfig config{};
        config.grid_x = launch.blocks;
        config.grid_y = config.grid_z = 1;
        config.block_x = launch.threads;
        config.block_y = config.block_z = 1;
        config.shared_bytes = launch.shared_bytes;
        config.stream = stream;
        config.attrs = &attribute;
        config.num_attrs = 1;
        check_cu(api.cuLaunchKernelEx(&config, launch.function, kernel_args, nullptr), what);
        return;
    }
    check_cu(api.cuLaunchKernel(launch.function, launch.blocks, 1, 1, launch.threads, 1, 1,
                                launch.shared_bytes, stream, kernel_args, nullptr),
             what);
}

}  // namespace rope_jit
