#include "cuda/memory_pool_warmup.h"

namespace rope_jit {

namespace {

void touch_pool(const CudaDriverApi& api, CUcontext context) {
    // A new thread's calls count as unsafe during another thread's global-mode capture (the
    // default of torch.cuda.graph), which they would invalidate. This thread touches only its
    // own stream, so it may say so; the mode dies with the thread.
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (api.cuThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS) return;
    if (api.cuCtxSetCurrent(context) != CUDA_SUCCESS) return;
    CUstream stream = nullptr;
    if (api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
        CUdeviceptr pointer = 0;
        if (api.cuMemAllocAsync(&pointer, 1, stream) == CUDA_SUCCESS)
            api.cuMemFreeAsync(pointer, stream);
        // Released once its work is done; nothing waits for it.
        api.cuStreamDestroy(stream);
    }
    api.cuCtxSetCurrent(nullptr);
}

}  // namespace

MemoryPoolWarmup::MemoryPoolWarmup(const CudaDriverApi& api, CUcontext context) {
    try {
        thread_ = std::thread(touch_pool, std::cref(api), context);
    } catch (...) {
        // No thread to spare (or no memory for one): the caller's allocation pays the setup.
    }
}

MemoryPoolWarmup::~MemoryPoolWarmup() {
    if (thread_.joinable()) thread_.join();
}

bool stream_not_capturing(const CudaDriverApi& api, CUstream stream) {
    int status = -1;
    return api.cuStreamIsCapturing(stream, &status) == CUDA_SUCCESS &&
           status == CU_STREAM_CAPTURE_STATUS_NONE;
}

}  // namespace rope_jit
