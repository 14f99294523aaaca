#include "ops/rope/cuda_backend.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/error.h"
#include "jit/kernel_source.h"
#include "rope_params.h"

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

// A host copy of the bytes a device view covers, and the same view over that copy.
TensorRef host_copy(const CudaDriverApi& api, const TensorRef& t, std::vector<char>& storage) {
    if (!t.present() || t.numel() == 0) return t;
    uintptr_t first, last;
    t.byte_extent(&first, &last);
    storage.resize(size_t(last - first + 1));
    check_cu(api.cuMemcpyDtoH(storage.data(), CUdeviceptr(first), storage.size()), "cuMemcpyDtoH (debug checks)");
    TensorRef copy = t;
    copy.data = storage.data() + (reinterpret_cast<uintptr_t>(t.data) - first);
    copy.device = {kDLCPU, 0};
    return copy;
}

}  // namespace

RopeLaunch plan_rope_launch(const KernelSpec& spec, int64_t heads_q, int64_t heads_k, int64_t units,
                            int64_t sms) {
    // Work items per head (ROT_ITEMS in rope.cu) and per token: one per chunk of output
    // features when an out-of-place call also copies unrotated features (CHUNK_ITEMS), else
    // one per chunk of pairs.
    const int64_t pairs = spec.rotary_dim / 2;
    const bool out_of_place_partial =
        spec.rotary_dim < spec.head_dim && !spec.in_place_q && (!spec.has_k || !spec.in_place_k);
    const int64_t head_items =
        rope_items_per_head(spec.interleaved, !spec.interleaved && out_of_place_partial, spec.rotary_dim, spec.vec);
    const int64_t items_per_token = std::max<int64_t>(1, (heads_q + heads_k) * head_items);
    // Blocks of whole tokens, sized to their items: a block of 256 threads for a token's 320
    // items ran a second, mostly idle round. Items per thread, measured on the H200
    // (bench/results/h200_kernel_tuning.json, "block_fit"): two half-style items (four
    // 16-byte loads) or eight interleaved ones (one load each) at about 256 threads a block;
    // one when the block also copies the unrotated features of out-of-place partial rotary.
    const int64_t items_per_thread = out_of_place_partial ? 1 : spec.interleaved ? 8 : 2;
    const int64_t max_threads = spec.block_threads;
    int64_t tokens = std::clamp<int64_t>(items_per_thread * 256 / items_per_token, 1, 64);
    while (tokens > 1 && (units + tokens - 1) / tokens < 2 * sms) tokens /= 2;
    // Shared memory (rope_params.h): per token, and the frequency gradient's per block.
    const int64_t roles = spec.k_own_angles ? 2 : 1;
    const bool shared_angles = spec.angles_from_inv_freq || spec.has_xpos || spec.mrope_axes > 0;
    const auto layout_for = [&](int64_t block_tokens) {
        return rope_smem_layout(int(block_tokens), int(roles), shared_angles ? int(pairs) : 0,
                                spec.mrope_axes > 0 ? spec.mrope_axes : int(roles), spec.freq_grad ? int(pairs) : 0);
    };
    constexpr int kSharedLimit = 48 * 1024;  // what a launch may take without opting in
    while (tokens > 1 && layout_for(tokens).bytes > kSharedLimit) tokens /= 2;
    const RopeSmemLayout layout = layout_for(tokens);
    if (layout.bytes > kSharedLimit)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("rope: one token's angles need {} bytes of shared memory, over the {} a block may use",
                                layout.bytes, kSharedLimit));
    const int64_t thread_work = (tokens * items_per_token + items_per_thread - 1) / items_per_thread;
    const int64_t threads = std::min<int64_t>(max_threads, (thread_work + 31) / 32 * 32);
    const int64_t blocks = (units + tokens - 1) / tokens;
    if (blocks > int64_t(0x7fffffff))
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED, fmt::format("q: {} tokens exceed one launch's grid", units));
    const unsigned shared_bytes = unsigned(layout.bytes);
    return RopeLaunch{blocks, threads, shared_bytes, int(tokens)};
}

CudaBackend::CudaBackend(const DiskCache* disk, KernelStats& stats, bool debug_checks)
    : api_(require_cuda_driver()), disk_(disk), stats_(stats), debug_checks_(debug_checks) {
    const int count = cuda_device_count();
    if (count == 0) throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE, "the CUDA driver reports no device");
    for (int ordinal = 0; ordinal < count; ++ordinal) {
        auto device = std::make_unique<Device>();
        check_cu(api_.cuDeviceGet(&device->handle, ordinal), "cuDeviceGet");
        device->target = cuda_device_target(ordinal);
        check_cu(api_.cuDeviceGetAttribute(&device->multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                           device->handle),
                 "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)");
        devices_.push_back(std::move(device));
    }
}

CudaBackend::~CudaBackend() {
    kernels_.unload_all(api_);
    for (const auto& device : devices_)
        if (device->primary != nullptr) api_.cuDevicePrimaryCtxRelease(device->handle);
}

CUcontext CudaBackend::primary_context(int ordinal) {
    Device& device = *devices_[size_t(ordinal)];
    std::call_once(device.primary_once, [&] {
        check_cu(api_.cuDevicePrimaryCtxRetain(&device.primary, device.handle), "cuDevicePrimaryCtxRetain");
    });
    return device.primary;
}

int CudaBackend::ordinal_of(CUdevice device) const {
    for (size_t ordinal = 0; ordinal < devices_.size(); ++ordinal)
        if (devices_[ordinal]->handle == device) return int(ordinal);
    return -1;
}

LaunchContext CudaBackend::resolve_context(int ordinal, CUstream stream) {
    LaunchContext launch;
    check_cu(api_.cuCtxGetCurrent(&launch.current), "cuCtxGetCurrent");
    const CUdevice wanted = devices_[size_t(ordinal)]->handle;
    if (stream != nullptr) {
        // A stream belongs to one context: the launch runs there, on the tensors' device.
        check_cu(api_.cuStreamGetCtx(stream, &launch.context), "cuStreamGetCtx(args.stream)");
        if (launch.context != nullptr) {
            const CUdevice device = context_device(api_, launch.context, launch.current);
            if (device != wanted)
                fail_argument(fmt::format("stream: the stream belongs to CUDA device {}, but the tensors live on "
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

LoadedKernel CudaBackend::kernel_for(const KernelSpec& spec, CUcontext context, int ordinal) {
    if (LoadedKernel hit = kernels_.find(spec, context); hit.function != nullptr) {
        stats_.memory_hits.fetch_add(1, std::memory_order_relaxed);
        return hit;
    }
    // The caller made `context` current (rope()'s ContextScope): the module loads there.
    return kernels_.get_or_build(spec, context, [&] {
        const KernelBinary binary = build_kernel_binary(spec, devices_[size_t(ordinal)]->target, disk_, stats_);
        return load_kernel_module(api_, binary.image, kKernelEntry);
    });
}

void CudaBackend::check_positions_on_device(const RopeProblem& problem, CUstream stream) {
    // Debug mode only: waits for the stream so the indices it produces are final, then
    // checks host copies with the CPU backend's rules.
    check_cu(api_.cuStreamSynchronize(stream), "cuStreamSynchronize (debug checks)");
    RopeProblem copy = problem;
    std::vector<char> positions, offsets, cu_seqlens;
    copy.positions = host_copy(api_, problem.positions, positions);
    copy.seqlen_offsets = host_copy(api_, problem.seqlen_offsets, offsets);
    copy.cu_seqlens = host_copy(api_, problem.cu_seqlens, cu_seqlens);
    check_positions_on_host(copy);
}

void CudaBackend::rope(const RopeProblem& p, void* stream_handle) {
    const int ordinal = p.device.device_id;
    if (ordinal < 0 || ordinal >= device_count())
        fail_argument(fmt::format("q: lives on CUDA device {}, but this machine has {} device(s)", ordinal,
                                  device_count()));
    CUstream stream = static_cast<CUstream>(stream_handle);
    const LaunchContext launch = resolve_context(ordinal, stream);
    ContextScope scope(api_, launch.context, launch.current);
    if (debug_checks_) check_positions_on_device(p, stream);

    const KernelSpec spec = make_kernel_spec(p);
    const LoadedKernel kernel = kernel_for(spec, launch.context, ordinal);

    RopeKernelParams params{};
    params.q = p.q.data;
    params.q_out = p.q_out.data;
    copy_strides(params.q_stride, p.q, 4);
    copy_strides(params.q_out_stride, p.q_out, 4);
    if (p.has_k) {
        params.k = p.k.data;
        params.k_out = p.k_out.data;
        copy_strides(params.k_stride, p.k, 4);
        copy_strides(params.k_out_stride, p.k_out, 4);
    }
    if (p.angles == AngleSource::Table) {
        params.cos = p.cos.data;
        params.sin = p.sin.data;
        copy_strides(params.cos_stride, p.cos, 2);
        copy_strides(params.sin_stride, p.sin, 2);
    } else {
        params.inv_freq = p.inv_freq.data;
        params.inv_freq_stride = p.inv_freq.strides[0];
    }
    if (p.has_xpos) {
        params.xpos = p.xpos_scale.data;
        copy_strides(params.xpos_stride, p.xpos_scale, 2);
    }
    if (p.positions.present()) {
        // With M-RoPE, positions lead with an axis; each axis is an [S], [B, S] or [T] view.
        const TensorRef axis = p.position_axis(0);
        params.positions = axis.data;
        // [S] and packed [T] are read at (0, s): their batch stride is 0.
        params.positions_stride[0] = axis.ndim == 2 ? axis.strides[0] : 0;
        params.positions_stride[1] = axis.strides[axis.ndim - 1];
        if (p.multi_section()) {
            params.positions_axis_stride = p.positions.strides[0];
            if (p.pair_axis.size() > sizeof params.pair_axis)
                throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                            fmt::format("mrope_sections: the CUDA kernels take at most {} pairs with M-RoPE, got {}",
                                        sizeof params.pair_axis, p.pair_axis.size()));
            for (size_t i = 0; i < p.pair_axis.size(); ++i) params.pair_axis[i] = (unsigned char)p.pair_axis[i];
        }
    }
    if (p.has_freq_grad) {
        params.q_saved = p.q_saved.data;
        copy_strides(params.q_saved_stride, p.q_saved, 4);
        if (p.has_k) {
            params.k_saved = p.k_saved.data;
            copy_strides(params.k_saved_stride, p.k_saved, 4);
        }
        params.inv_freq_grad = reinterpret_cast<float*>(p.inv_freq_grad.data);
        params.inv_freq_grad_stride = p.inv_freq_grad.strides[0];
    }
    if (p.seqlen_offsets.present()) {
        params.seqlen_offsets = p.seqlen_offsets.data;
        params.seqlen_offsets_stride = p.seqlen_offsets.strides[0];
    }
    if (p.cu_seqlens.present()) {
        params.cu_seqlens = p.cu_seqlens.data;
        params.cu_seqlens_stride = p.cu_seqlens.strides[0];
    }
    params.batch = p.batch;
    params.seqlen_q = p.seqlen_q;
    params.seqlen_k = p.has_k ? p.seqlen_k : 0;
    params.seqlen_max = std::max(params.seqlen_q, params.seqlen_k);
    params.heads_q = p.heads_q;
    params.heads_k = p.heads_k;
    params.num_sequences = p.num_sequences;
    params.position_offset = p.position_offset;
    params.q_position_offset = p.q_position_offset;
    params.units = p.batch * params.seqlen_max;

    const RopeLaunch launch_shape =
        plan_rope_launch(spec, p.heads_q, p.has_k ? p.heads_k : 0, params.units,
                         devices_[size_t(ordinal)]->multiprocessors);
    params.tokens_per_block = launch_shape.tokens_per_block;
    const int64_t blocks = launch_shape.blocks;
    const int64_t threads = launch_shape.threads;
    const unsigned shared_bytes = launch_shape.shared_bytes;
    if (p.has_freq_grad) {
        // The kernel adds into the gradient: zero it first, ordered on the same stream.
        check_cu(api_.cuMemsetD2D32Async(CUdeviceptr(params.inv_freq_grad),
                                         size_t(params.inv_freq_grad_stride) * sizeof(float), 0u, 1,
                                         size_t(p.pairs()), stream),
                 "cuMemsetD2D32Async(inv_freq_grad)");
    }
    if (blocks == 0) return;  // no token: nothing to rotate (a gradient was still zeroed)

    void* kernel_args[] = {&params};
    check_cu(api_.cuLaunchKernel(kernel.function, unsigned(blocks), 1, 1, unsigned(threads), 1, 1,
                                 shared_bytes, stream, kernel_args, nullptr),
             "cuLaunchKernel(rope_kernel)");
    stats_.launches.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace rope_jit
