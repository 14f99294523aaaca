// ROPE_JIT_HOST_DEVICE marks the functions that the parameter headers (rope_params.h,
// attention_params.h) share between the host launchers and the kernels NVRTC compiles.
#ifndef ROPE_JIT_HOST_DEVICE_H
#define ROPE_JIT_HOST_DEVICE_H

#if defined(__CUDACC__)
#define ROPE_JIT_HOST_DEVICE __host__ __device__
#else
#define ROPE_JIT_HOST_DEVICE
#endif

#endif
