// The compute capabilities of this machine's GPUs from NVML (libnvidia-ml.so.1, loaded at run
// time), for `rope-jit-cache prewarm` without --target. NVML answers in ~16 ms, where cuInit,
// which the runtime's device list needs, takes 180-230 ms on the H200 machine (run EO, session
// 30): time a prewarm spent before compiling anything.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace rope_jit_cache {

struct LocalGpu {
    std::string name;  // "NVIDIA H200"
    int major = 0, minor = 0;
};

// Every GPU NVML lists, in its order; nullopt where NVML is missing, fails or lists none,
// where CUDA_VISIBLE_DEVICES is set (NVML lists every GPU, CUDA only the visible ones) and
// where ROPE_JIT_CUDA_LIBRARY is (the runtime loads that driver library): the caller then asks
// the runtime. Never throws except std::bad_alloc.
std::optional<std::vector<LocalGpu>> local_gpus_from_nvml();

}  // namespace rope_jit_cache
