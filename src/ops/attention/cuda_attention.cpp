#include "ops/attention/cuda_attention.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "attention_params.h"
#include "common/error.h"
#include "cuda/memory_pool_warmup.h"
#include "jit/nvrtc_loader.h"
#include "ops/attention/attention_workspace.h"

namespace rope_jit {

namespace {

// A caller's workspace must be device memory of q's device: host memory, another GPU's or a
// pointer the driver does not know would fault inside a kernel (an error that poisons the
// context) instead of being refused. Asked of the driver with the call's context current;
// no synchronization, legal while a stream captures.
void check_workspace_memory(const CudaDriverApi& api, const AttentionProblem& p) {
    unsigned type = 0;
    const CUdeviceptr address = reinterpret_cast<CUdeviceptr>(p.workspace);
    if (api.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) !=
            CUDA_SUCCESS ||
        (type != CU_MEMORYTYPE_DEVICE && type != CU_MEMORYTYPE_UNIFIED))
        fail_argument(fmt::format("workspace: {} is not device memory the CUDA driver knows",
                                  static_cast<const void*>(p.workspace)));
    int ordinal = -1;
    if (api.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address) ==
            CUDA_SUCCESS &&
        ordinal != p.device.device_id)
        fail_argument(fmt::format("workspace: memory of device {}, but q is on device {}",
                                  ordinal, p.device.device_id));
}

// Encodes into `map` the TMA descriptor of a [B, H, S, D] tensor of 16-bit elements whose
// boxes are 64 features by `rows` tokens, landing 128-byte swizzled (the producer-warp
// forward's and the sm_90 backward's copies). The choice of
// kernels made sure of what TMA needs (16-byte aligned data, strides of whole 16 bytes); a
// dimension of one element gets a packed stride, since its stride is never used.
void encode_box_map(const CudaDriverApi& api, unsigned char (&map)[128], const TensorRef& t,
                    int rows, const char* name) {
    static_assert(sizeof(CUtensorMap) == 128 && alignof(CUtensorMap) == 64,
                  "the driver's CUtensorMap");
    const unsigned long long dims[4] = {
        (unsigned long long)t.shape[3], (unsigned long long)t.shape[2],
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
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
        throw_cuda_error(result, fmt::format("cuTensorMapEncodeTiled({})", name).c_str());
    std::memcpy(map, &encoded, sizeof encoded);
}

// The backward problem training runs after the forward `p`: gradients shaped and laid out
// like the tensors they belong to (what autograd allocates), lse saved.
AttentionProblem expected_backward(const AttentionProblem& p) {
    AttentionProblem backward = p;
    backward.backward = true;
    backward.dout = p.out;
    backward.dq = p.q;
    backward.dk = p.k;
    backward.dv = p.v;
    return backward;
}

// A contiguous [B, H, S_padded, DP] 16-bit view of workspace memory, for encode_box_map.
TensorRef workspace_rows(const char* name, char* data, int64_t batch, int64_t heads, int64_t rows,
                         int64_t head_dim_padded) {
    TensorRef t;
    t.name = name;
    t.dtype = DType::BF16;
    t.data = data;
    t.ndim = 4;
    const int64_t shape[4] = {batch, heads, rows, head_dim_padded};
    const int64_t strides[4] = {heads * rows * head_dim_padded, rows * head_dim_padded,
                                head_dim_padded, 1};
    for (int d = 0; d < 4; ++d) {
        t.shape[d] = shape[d];
        t.strides[d] = strides[d];
    }
    return t;
}

// A stream-ordered allocation (cuMemAllocAsync): freed on its stream by free() or, on any way
// out of the call (an exception), by the destructor.
class StreamAllocation {
public:
    StreamAllocation(const CudaDriverApi& api, CUstream stream) : api_(api), stream_(stream) {}
    StreamAllocation(const StreamAllocation&) = delete;
    StreamAllocation& operator=(const StreamAllocation&) = delete;
    ~StreamAllocation() {
        if (pointer_ != 0) api_.cuMemFreeAsync(pointer_, stream_);
    }
    // False when the device's pool has no room or no pool (the caller does without); throws
    // on any other error, which a fallback would only hide.
    bool allocate(size_t bytes) {
        const CUresult result = api_.cuMemAllocAsync(&pointer_, bytes, stream_);
        if (result == CUDA_ERROR_OUT_OF_MEMORY || result == CUDA_ERROR_NOT_SUPPORTED) {
            pointer_ = 0;
            return false;
        }
        check_cu(result, "cuMemAllocAsync(attention workspace)");
        return true;
    }
    char* data() const { return reinterpret_cast<char*>(static_cast<uintptr_t>(pointer_)); }
    void free() {
        const CUdeviceptr pointer = pointer_;
        pointer_ = 0;
        if (pointer != 0)
            check_cu(api_.cuMemFreeAsync(pointer, stream_), "cuMemFreeAsync(workspace)");
    }

private:
    const CudaDriverApi& api_;
    CUstream stream_;
    CUdeviceptr pointer_ = 0;
};

// Blocks of the grid of `spec` for problem `p` (rows_per_block from the launch plan); for the
// sm_90 backward's kernels, from the workspace layout `w`.
int64_t grid_blocks(const AttentionSpec& spec, const AttentionProblem& p,
                    const AttentionWorkspaceLayout& w, long long* sequence_blocks) {
    const int64_t rows_per_block = attention_launch_plan(spec).rows_per_block;
    switch (AttentionKernelKind(spec.kind)) {
        case AttentionKernelKind::BackwardPrepare:
            *sequence_blocks = w.seqlen_q_padded / rows_per_block;
            return p.batch * (p.heads_q * w.seqlen_q_padded + p.heads_k * w.seqlen_k_padded) /
                   rows_per_block;
        case AttentionKernelKind::Backward:
            *sequence_blocks = (p.seqlen_k + rows_per_block - 1) / rows_per_block;
            return *sequence_blocks * p.batch * p.heads_k;
        case AttentionKernelKind::BackwardDqFinish:
            *sequence_blocks = w.seqlen_q_padded / rows_per_block;
            return *sequence_blocks * p.batch * p.heads_q;
        default: break;
    }
    const bool key_side = spec.kind == int32_t(AttentionKernelKind::BackwardDkDv);
    const int64_t rows = key_side ? p.seqlen_k : p.seqlen_q;
    const int64_t heads = key_side ? p.heads_k : p.heads_q;
    *sequence_blocks = (rows + rows_per_block - 1) / rows_per_block;
    return *sequence_blocks * p.batch * heads;
}

// The kernels index tokens with 32-bit integers.
void check_token_counts(const AttentionProblem& p) {
    if (p.seqlen_q >= (int64_t(1) << 31) || p.seqlen_k >= (int64_t(1) << 31))
        throw Error(
            ROPE_JIT_ERROR_UNSUPPORTED,
            fmt::format(
                "q: sequences of {} and {} tokens exceed the 2^31 the CUDA attention kernels index",
                p.seqlen_q, p.seqlen_k));
}

}  // namespace

bool nvrtc_runs_wgmma_forward(const std::string& nvrtc_version) {
    return std::atoi(nvrtc_version.c_str()) >= kWgmmaNvrtcMajor;
}

KernelRecipe attention_recipe_with_backward(const AttentionSpec& spec, const AttentionProblem& p,
                                            const AttentionDevice& device) {
    KernelRecipe recipe = attention_recipe(spec);
    if (!p.backward && p.has_lse) {
        // Every kernel of the forward call names them (on sm_90 the prepare kernel builds
        // before the forward), so that they are queued at the first of them to compile.
        // Called on the caller's thread during the forward call, so the problem's views of
        // the caller's tensors are still valid.
        recipe.follow_ups = [backward = expected_backward(p), device] {
            std::vector<KernelRecipe> recipes;
            for (const AttentionSpec& kernel : choose_attention_specs(backward, device))
                recipes.push_back(attention_recipe(kernel));
            return recipes;
        };
    }
    return recipe;
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

CudaAttention::CudaAttention(CudaDevices& devices, KernelLoader& kernels, KernelStats& stats)
    : devices_(devices),
      kernels_(kernels),
      stats_(stats),
      override_(attention_kernel_override_from_environment()),
      pool_used_(std::make_unique<std::atomic<bool>[]>(size_t(devices_.device_count()))) {
    // pool_used_ starts false: make_unique value-initializes its atomics.
    for (int ordinal = 0; ordinal < devices_.device_count(); ++ordinal) {
        const CudaDevice& device = devices_.device(ordinal);
        attention_devices_.push_back(
            attention_device(device.compute_capability, device.max_shared_optin));
    }
}

CudaAttention::Plan CudaAttention::plan(const AttentionProblem& p) const {
    Plan plan;
    plan.kernels = choose_attention_specs(p, device_of(p), override_);
    plan.workspace = attention_workspace_for(p, plan.kernels);
    // "workspace=0" in the override: as if the workspace could not be allocated.
    if (override_.no_workspace && plan.workspace.bytes != 0) without_workspace(p, plan);
    return plan;
}

void CudaAttention::without_workspace(const AttentionProblem& p, Plan& plan) const {
    AttentionProblem without = p;
    without.no_workspace = true;
    plan.kernels = choose_attention_specs(without, device_of(p), override_);
    plan.workspace = AttentionWorkspaceLayout{};
    plan.workspace_fallback = true;
}

size_t CudaAttention::workspace_bytes(const AttentionProblem& p) const {
    devices_.check_ordinal(p.device.device_id, "q");
    if (p.batch == 0 || p.heads_q == 0) return 0;
    check_token_counts(p);
    return plan(p).workspace.bytes;
}

void CudaAttention::run(const AttentionProblem& p, void* stream_handle) {
    const int ordinal = p.device.device_id;
    devices_.check_ordinal(ordinal, "q");
    if (p.batch == 0 || p.heads_q == 0) return;
    check_token_counts(p);
    // The kernels and the workspace they need (what workspace_bytes tells callers); a
    // caller's workspace too small is refused before anything is loaded or enqueued.
    Plan plan = this->plan(p);
    check_caller_workspace(p, plan.workspace);
    const std::vector<AttentionSpec>& specs = plan.kernels;
    const AttentionWorkspaceLayout& workspace_layout = plan.workspace;
    const bool allocates = workspace_layout.bytes != 0 && p.workspace == nullptr;

    CUstream stream = static_cast<CUstream>(stream_handle);
    const CudaDriverApi& api = devices_.api();
    const LaunchContext launch = devices_.resolve_context(ordinal, stream);
    ContextScope scope(api, launch.context, launch.current);
    if (p.workspace != nullptr && workspace_layout.bytes != 0) check_workspace_memory(api, p);

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

    const AttentionDevice& device = device_of(p);
    // Every kernel is loaded (compiled where it must be) before the first launch, so a failure
    // to compile or load enqueues nothing. (A failed launch after others leaves the outputs
    // unspecified.)
    auto recipe_for = [&](const AttentionSpec& spec) {
        return attention_recipe_with_backward(spec, p, device);
    };
    auto load_kernels = [&] {
        std::vector<LoadedKernel> kernels;
        for (const AttentionSpec& spec : specs)
            kernels.push_back(kernels_.kernel_for(SpecKey::of(kAttentionOp, spec), launch.context,
                                                  devices_.target(ordinal),
                                                  [&] { return recipe_for(spec); }));
        return kernels;
    };
    std::vector<LoadedKernel> kernels;
    std::atomic<bool>& pool_used = pool_used_[size_t(ordinal)];
    if (allocates && !pool_used.load(std::memory_order_relaxed) &&
        stream_not_capturing(api, stream) && !pool_used.exchange(true)) {
        // The first workspace allocated on a device sets up its memory pool (about 10 ms):
        // done on a second thread while this one loads the kernels. (Later calls allocate
        // first, so that a call without room loads only the kernels it runs.)
        MemoryPoolWarmup warmup(api, launch.context);
        kernels = load_kernels();
    }

    // The workspace: the caller's, else stream-ordered from the device's pool (no
    // synchronization, and capturable in a CUDA graph), else none (the fallback).
    StreamAllocation allocation(api, stream);
    char* workspace = nullptr;
    if (workspace_layout.bytes != 0) {
        if (p.workspace != nullptr)
            workspace = p.workspace;
        else if (allocation.allocate(workspace_layout.bytes))
            workspace = allocation.data();
        else {
            without_workspace(p, plan);  // no room: the kernels without one run
            kernels.clear();
        }
    }
    if (workspace != nullptr) {
        // The sm_90 backward (prepare, backward, dq finish) or a forward whose producers take
        // rotated keys by TMA (prepare, forward).
        const AttentionSpec& main = specs[1];
        const bool backward = main.kind == int32_t(AttentionKernelKind::Backward);
        const int dp = attention_launch_plan(main).head_dim_padded;
        params.q_rot = workspace + workspace_layout.q_rot;
        params.k_rot = workspace + workspace_layout.k_rot;
        params.dq_accum = reinterpret_cast<float*>(workspace + workspace_layout.dq_accum);
        params.row_lse2 = reinterpret_cast<float*>(workspace + workspace_layout.row_lse2);
        params.row_delta = reinterpret_cast<float*>(workspace + workspace_layout.row_delta);
        params.seqlen_q_padded = workspace_layout.seqlen_q_padded;
        params.seqlen_k_padded = workspace_layout.seqlen_k_padded;
        params.prepare_query_blocks =
            p.batch * p.heads_q * workspace_layout.seqlen_q_padded / kAttentionBackwardQueryTile;
        // The forward's producers copy block_n / cluster keys a block (a share of each tile
        // with clusters); the backward copies its whole 128-key block. (The head_dim 256
        // forward, without producers, copies its keys by cp.async: no TMA there.)
        if (backward || main.producer_warps > 0)
            encode_box_map(api, params.k_map,
                           workspace_rows("k", workspace + workspace_layout.k_rot, p.batch,
                                          p.heads_k, workspace_layout.seqlen_k_padded, dp),
                           main.block_n / main.cluster, "rotated k");
        if (backward) {
            encode_box_map(api, params.q_map,
                           workspace_rows("q", workspace + workspace_layout.q_rot, p.batch,
                                          p.heads_q, workspace_layout.seqlen_q_padded, dp),
                           kAttentionBackwardQueryTile, "rotated q");
            encode_box_map(api, params.v_map, p.v, main.block_n, "v");
            encode_box_map(api, params.dout_map, p.dout, kAttentionBackwardQueryTile, "dout");
        }
    }
    if (kernels.empty()) kernels = load_kernels();
    if (workspace != nullptr)
        check_cu(api.cuMemsetD32Async(CUdeviceptr(params.dq_accum), 0u,
                                      workspace_layout.dq_accum_bytes / 4, stream),
                 "cuMemsetD32Async(dq accumulator)");
    for (size_t n = 0; n < specs.size(); ++n) {
        const AttentionSpec& spec = specs[n];
        const int64_t blocks = grid_blocks(spec, p, workspace_layout, &params.sequence_blocks);
        if (blocks == 0) continue;
        if (blocks > int64_t(0x7fffffff))
            throw Error(
                ROPE_JIT_ERROR_UNSUPPORTED,
                fmt::format("q: {} blocks exceed one launch's grid ({})", blocks, spec.describe()));
        if (spec.producer_warps > 0)
            encode_box_map(api, params.v_map, p.v, spec.block_n / spec.cluster, "v");
        if (spec.keys_by_tma && spec.rotary_dim == 0)  // unrotated keys: k itself
            encode_box_map(api, params.k_map, p.k, spec.block_n / spec.cluster, "k");
        void* kernel_args[] = {&params};
        check_cu(api.cuLaunchKernel(kernels[n].function, unsigned(blocks), 1, 1,
                                    unsigned(spec.threads()), 1, 1, unsigned(spec.shared_bytes()),
                                    stream, kernel_args, nullptr),
                 "cuLaunchKernel(attention_kernel)");
        stats_.launches.fetch_add(1, std::memory_order_relaxed);
    }
    if (plan.workspace_fallback)
        stats_.attention_workspace_fallbacks.fetch_add(1, std::memory_order_relaxed);
    allocation.free();
}

}  // namespace rope_jit
