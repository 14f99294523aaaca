#include "ops/attention/cuda_attention.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "attention_params.h"
#include "common/error.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_loader.h"

namespace rope_jit {

namespace {

constexpr const char* kAttentionTemplate = "attention.cu";
constexpr const char* kAttentionEntry = "attention_kernel";

// Encodes into `map` the TMA descriptor of a [B, H, S, D] tensor of 16-bit elements whose
// boxes are 64 features by `rows` tokens, landing 128-byte swizzled (the producer-warp
// forward's copies). The choice of
// kernels made sure of what TMA needs (16-byte aligned data, strides of whole 16 bytes); a
// dimension of one element gets a packed stride, since its stride is never used.
void encode_box_map(const CudaDriverApi& api, unsigned char (&map)[128], const TensorRef& t, int rows,
                    const char* name) {
    static_assert(sizeof(CUtensorMap) == 128 && alignof(CUtensorMap) == 64, "the driver's CUtensorMap");
    const unsigned long long dims[4] = {(unsigned long long)t.shape[3], (unsigned long long)t.shape[2],
                                        (unsigned long long)t.shape[1], (unsigned long long)t.shape[0]};
    unsigned long long strides[3];
    unsigned long long packed = (dims[0] * 2 + 15) / 16 * 16;  // bytes of one token, rounded
    for (int d = 0; d < 3; ++d) {
        const int axis = 2 - d;  // S, then H, then B
        strides[d] = t.shape[axis] > 1 ? (unsigned long long)t.strides[axis] * 2 : packed;
        packed = strides[d] * dims[d + 1];
    }
    // 64 features (128 bytes) of `rows` tokens, swizzled as the kernel's tiles are.
    const unsigned box[4] = {64, unsigned(rows), 1, 1};
    const unsigned element_strides[4] = {1, 1, 1, 1};
    CUtensorMap encoded;
    const CUresult result = api.cuTensorMapEncodeTiled(
        &encoded, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, t.data, dims, strides, box, element_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) throw_cuda_error(result, fmt::format("cuTensorMapEncodeTiled({})", name).c_str());
    std::memcpy(map, &encoded, sizeof encoded);
}

}  // namespace

bool nvrtc_runs_wgmma_forward(const std::string& nvrtc_version) {
    return std::atoi(nvrtc_version.c_str()) >= kWgmmaNvrtcMajor;
}

AttentionDevice attention_device(int compute_capability, int max_shared_bytes) {
    AttentionDevice device;
    device.compute_capability = compute_capability;
    device.max_shared_bytes = max_shared_bytes;
    device.wgmma = compute_capability == 90 && nvrtc_runs_wgmma_forward(nvrtc_version_string());
    const CudaDriverApi* api = cuda_driver_api();
    device.tma = device.wgmma && api != nullptr && api->cuTensorMapEncodeTiled != nullptr;
    return device;
}

std::string attention_target(const AttentionSpec& spec, const std::string& device_target) {
    if (!spec.wgmma) return device_target;
    if (device_target != "sm_90" && device_target != "sm_90a")
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("wgmma attention kernels run on sm_90 only, not {}", device_target));
    return "sm_90a";
}

KernelBinary build_attention_binary(const AttentionSpec& spec, const std::string& target, const DiskCache* disk,
                                    KernelStats& stats) {
    spec.validate();
    return build_kernel_binary(
        KernelRecipe{spec.to_json(), kAttentionTemplate,
                     [&spec] { return specialize_template(spec.preamble(), kAttentionTemplate); }},
        attention_target(spec, target), disk, stats);
}

CudaAttention::CudaAttention(CudaBackend& backend, const DiskCache* disk, KernelStats& stats)
    : api_(require_cuda_driver()), backend_(backend), disk_(disk), stats_(stats),
      override_(attention_kernel_override_from_environment()) {
    for (int ordinal = 0; ordinal < backend_.device_count(); ++ordinal) {
        CUdevice device = 0;
        check_cu(api_.cuDeviceGet(&device, ordinal), "cuDeviceGet");
        int major = 0, minor = 0, shared = 0;
        check_cu(api_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
                 "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)");
        check_cu(api_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
                 "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)");
        check_cu(api_.cuDeviceGetAttribute(&shared, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
                 "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)");
        devices_.push_back(attention_device(major * 10 + minor, shared));
    }
}

CudaAttention::~CudaAttention() { kernels_.unload_all(api_); }

LoadedKernel CudaAttention::kernel_for(const AttentionSpec& spec, CUcontext context, int ordinal) {
    if (LoadedKernel hit = kernels_.find(spec, context); hit.function != nullptr) {
        stats_.memory_hits.fetch_add(1, std::memory_order_relaxed);
        return hit;
    }
    // The caller made `context` current (run()'s ContextScope): the module loads there.
    return kernels_.get_or_build(spec, context, [&] {
        const KernelBinary binary = build_attention_binary(spec, backend_.target(ordinal), disk_, stats_);
        const LoadedKernel kernel = load_kernel_module(api_, binary.image, kAttentionEntry);
        // Blocks of the tensor-core kernels take more than the default 48 KiB of shared memory.
        if (spec.shared_bytes() > 48 * 1024) {
            const CUresult result = api_.cuFuncSetAttribute(
                kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.shared_bytes());
            if (result != CUDA_SUCCESS) {
                api_.cuModuleUnload(kernel.module);
                throw_cuda_error(result, "loading attention_kernel");
            }
        }
        return kernel;
    });
}

void CudaAttention::run(const AttentionProblem& p, void* stream_handle) {
    const int ordinal = p.device.device_id;
    if (ordinal < 0 || ordinal >= backend_.device_count())
        fail_argument(fmt::format("q: lives on CUDA device {}, but this machine has {} device(s)", ordinal,
                                  backend_.device_count()));
    if (p.batch == 0 || p.heads_q == 0) return;
    // The kernels index tokens with 32-bit integers.
    if (p.seqlen_q >= (int64_t(1) << 31) || p.seqlen_k >= (int64_t(1) << 31))
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("q: sequences of {} and {} tokens exceed the 2^31 the CUDA attention kernels index",
                                p.seqlen_q, p.seqlen_k));
    CUstream stream = static_cast<CUstream>(stream_handle);
    const LaunchContext launch = backend_.resolve_context(ordinal, stream);
    ContextScope scope(api_, launch.context, launch.current);

    AttentionKernelParams params{};
    params.q = p.q.data;
    params.k = p.k.data;
    params.v = p.v.data;
    params.out = p.out.data;
    copy_strides(params.q_stride, p.q, 4);
    copy_strides(params.k_stride, p.k, 4);
    copy_strides(params.v_stride, p.v, 4);
    copy_strides(params.out_stride, p.out, 4);
    if (p.has_lse) {
        params.lse = reinterpret_cast<float*>(p.lse.data);
        copy_strides(params.lse_stride, p.lse, 3);
    }
    if (p.backward) {
        params.dout = p.dout.data;
        params.dq = p.dq.data;
        params.dk = p.dk.data;
        params.dv = p.dv.data;
        copy_strides(params.dout_stride, p.dout, 4);
        copy_strides(params.dq_stride, p.dq, 4);
        copy_strides(params.dk_stride, p.dk, 4);
        copy_strides(params.dv_stride, p.dv, 4);
    }
    if (p.rotate) {
        params.cos = p.cos.data;
        params.sin = p.sin.data;
        copy_strides(params.cos_stride, p.cos, 2);
        copy_strides(params.sin_stride, p.sin, 2);
    }
    if (p.has_pos_mask) {
        params.pos_mask = reinterpret_cast<const unsigned char*>(p.pos_mask.data);
        copy_strides(params.pos_mask_stride, p.pos_mask, 2);
    }
    if (p.mask_kind != AttentionMaskKind::None) {
        params.attn_mask = p.attn_mask.data;
        copy_strides(params.mask_stride, p.attn_mask, 3);
    }
    params.batch = p.batch;
    params.heads_q = p.heads_q;
    params.heads_k = p.heads_k;
    params.seqlen_q = p.seqlen_q;
    params.seqlen_k = p.seqlen_k;
    params.scale = float(p.scale);
    params.scale_log2 = float(p.scale * 1.4426950408889634);

    for (const AttentionSpec& spec : choose_attention_specs(p, devices_[size_t(ordinal)], override_)) {
        const bool key_side = spec.kind == int32_t(AttentionKernelKind::BackwardDkDv);
        const int64_t rows = key_side ? p.seqlen_k : p.seqlen_q;
        const int64_t heads = key_side ? p.heads_k : p.heads_q;
        const int64_t rows_per_block = attention_launch_plan(spec).rows_per_block;
        params.sequence_blocks = (rows + rows_per_block - 1) / rows_per_block;
        const int64_t blocks = params.sequence_blocks * p.batch * heads;
        if (blocks == 0) continue;
        if (blocks > int64_t(0x7fffffff))
            throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                        fmt::format("q: {} blocks exceed one launch's grid ({})", blocks, spec.describe()));
        if (spec.producer_warps > 0) encode_box_map(api_, params.v_map, p.v, spec.block_n / spec.cluster, "v");
        const LoadedKernel kernel = kernel_for(spec, launch.context, ordinal);
        void* kernel_args[] = {&params};
        check_cu(api_.cuLaunchKernel(kernel.function, unsigned(blocks), 1, 1, unsigned(spec.threads()), 1, 1,
                                     unsigned(spec.shared_bytes()), stream, kernel_args, nullptr),
                 "cuLaunchKernel(attention_kernel)");
        stats_.launches.fetch_add(1, std::memory_order_relaxed);
    }
}

}  // namespace rope_jit
