// QK-norm + RoPE kernel template: RMSNorm over each head's HEAD_DIM features, then the rotation
// of rope.cu (any pair style, tables or inv_freq, positions, varlen, GQA, xPos, M-RoPE), and in
// the backward the gradients of both (rope_jit_rope_args, "QK-norm"). The runtime prepends the
// same constants as for rope.cu (kernel_spec.cpp) plus QK_NORM, NORM_UNIT_OFFSET,
// NORM_WEIGHT_DTYPE and NORM_WEIGHT_GRAD.
//
// The norm needs a whole head row before any output: one warp owns one (token, head) row at a
// time, stages it in shared memory as float, reduces with shuffles, and writes it out; rows are
// taken grid-stride. Forward: y = rope(x * r * w'), r = 1/sqrt(mean(x^2) + eps). Backward (q and
// k hold dL/dy): g = the inverse rotation of dL/dy, xh = x * r, dL/dx = r (w' g - xh mean(w' g
// xh)), and dL/dw sums g xh, per block in shared memory, then once per block with atomics.
//
// Forward with a KV cache (KV_CACHE): k's rows go to their cache slots instead of k_out, and
// v's rows (V_DIM > 0) are copied into v's cache by warps of their own, one row each; FP8
// outputs (KV_FP8, Q_FP8) store float8 e4m3fn of value / scale.

#include "device_numeric.h"
#include "rope_norm_params.h"
#include "rope_device.h"

static_assert(QK_NORM, "rope_norm.cu is the QK-norm kernel");

namespace {

using T = typename StorageOf<DTYPE>::type;

enum : int {
    PAIRS = ROTARY_DIM / 2,
    WARP = 32,
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Whether feature d of a head is rotated, and then its pair, whether it is the pair's first
// feature, and its partner feature.
struct FeaturePair {
    bool rotated, first;
    int pair, partner;
};

__device__ __forceinline__ FeaturePair feature_pair(int d) {
    FeaturePair f{false, false, 0, 0};
    if (PROPORTIONAL) {
        const int half = HEAD_DIM / 2, i = d < half ? d : d - half;
        if (i >= PAIRS) return f;
        f.rotated = true;
        f.first = d < half;
        f.pair = i;
        f.partner = f.first ? d + half : d - half;
        return f;
    }
    const int e = d - ROTARY_OFFSET;
    if (e < 0 || e >= ROTARY_DIM) return f;
    f.rotated = true;
    if (INTERLEAVED) {
        f.pair = e / 2;
        f.first = e % 2 == 0;
        f.partner = f.first ? d + 1 : d - 1;
    } else {
        f.first = e < PAIRS;
        f.pair = f.first ? e : e - PAIRS;
        f.partner = f.first ? d + PAIRS : d - PAIRS;
    }
    return f;
}

// Feature d of the rotated row v (a warp's staged row): (x1 c - x2 s) for a pair's first
// feature, (x2 c + x1 s) for its second, v[d] outside the pairs. The angles come with the
// backward sign and xPos applied (pair_angle).
__device__ __forceinline__ float rotated_feature(const RopeKernelParams& p, const float* v, int d,
                                                 const long long* rows, bool is_k) {
    const FeaturePair f = feature_pair(d);
    if (!f.rotated) return v[d];
    const long long row = rows[MROPE_AXES > 0 ? p.pair_axis[f.pair] : 0];
    float c, s;
    pair_angle(p, row, f.pair, is_k, &c, &s);
    const float x1 = f.first ? v[d] : v[f.partner];
    const float x2 = f.first ? v[f.partner] : v[d];
    return f.first ? x1 * c - x2 * s : x2 * c + x1 * s;
}

__device__ __forceinline__ float weight_at(const void* w, long long stride, int d) {
    return load_float<NORM_WEIGHT_DTYPE>(w, d * stride) + (NORM_UNIT_OFFSET ? 1.0f : 0.0f);
}

// The launch's argument block: RopeNormParams, followed by RopeCacheParams for a KV cache or
// FP8 outputs. Enumerators and types, not constexpr variables (globals of every module).
enum : bool { CACHE_PARAMS = KV_CACHE != 0 || Q_FP8 };
template <bool CACHE>
struct NormLaunchParams {
    using type = RopeNormParams;
};
template <>
struct NormLaunchParams<true> {
    using type = RopeNormCacheParams;
};
__device__ __forceinline__ const RopeNormParams& norm_args(const RopeNormParams& a) {
    return a;
}
__device__ __forceinline__ const RopeNormParams& norm_args(const RopeNormCacheParams& a) {
    return a.norm;
}
__device__ __forceinline__ const RopeCacheParams* cache_args(const RopeNormParams&) {
    return nullptr;
}
__device__ __forceinline__ const RopeCacheParams* cache_args(const RopeNormCacheParams& a) {
    return &a.cache;
}

// Stores one result: of q's dtype at y, or (fp8) float8 e4m3fn of value / scale at y8.
__device__ __forceinline__ void store_result(T* y, unsigned char* y8, bool fp8, long long index,
                                             float value, float scale) {
    if ((KV_FP8 || Q_FP8) && fp8)
        y8[index] = static_cast<unsigned char>(e4m3_bits(__fdiv_rn(value, scale)));
    else
        y[index] = from_float<DTYPE>(value);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(WARP* kRopeNormMaxWarps)
    rope_norm_kernel(const typename NormLaunchParams<CACHE_PARAMS>::type args) {
    extern __shared__ __align__(16) char shared[];
    const RopeNormParams& np = norm_args(args);
    const RopeCacheParams* cache = cache_args(args);  // KV cache and FP8 scales, or NULL
    const RopeKernelParams& p = np.rope;
    float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
    if constexpr (CACHE_PARAMS) {
        if (Q_FP8 && cache->q_scale != nullptr) q_scale = *cache->q_scale;
        if (KV_FP8 && cache->k_scale != nullptr) k_scale = *cache->k_scale;
        if (KV_FP8 && V_DIM > 0 && cache->v_scale != nullptr) v_scale = *cache->v_scale;
    }
    const int warp = static_cast<int>(threadIdx.x) / WARP;
    const int lane = static_cast<int>(threadIdx.x) % WARP;
    float* row = reinterpret_cast<float*>(shared) + warp * 2 * HEAD_DIM;     // the staged row
    float* grad = row + HEAD_DIM;                                            // backward: g
    float* dw = reinterpret_cast<float*>(shared) + np.warps * 2 * HEAD_DIM;  // [2][HEAD_DIM]
    if (NORM_WEIGHT_GRAD) {
        for (int d = threadIdx.x; d < 2 * HEAD_DIM; d += blockDim.x) dw[d] = 0.0f;
        __syncthreads();
    }

    const int heads_k = HAS_K ? static_cast<int>(p.heads_k) : 0;
    const int heads_q = HAS_K ? heads_k * GQA_GROUP : static_cast<int>(p.heads_q);
    // Rows of a token: q's heads, k's, and (KV cache with v) v's, copied by warps of their own.
    const int heads_v = KV_CACHE != 0 && V_DIM > 0 ? heads_k : 0;
    const int heads_all = heads_q + heads_k + heads_v;
    const long long rows_total = p.units * heads_all;
    const float inv_d = 1.0f / HEAD_DIM;
    for (long long r = static_cast<long long>(blockIdx.x) * np.warps + warp; r < rows_total;
         r += static_cast<long long>(gridDim.x) * np.warps) {
        const long long u = r / heads_all;
        int h = static_cast<int>(r - u * heads_all);
        long long b, s;
        split_token(p, u, &b, &s);
        if constexpr (KV_CACHE != 0 && V_DIM > 0) {
            if (h >= heads_q + heads_k) {  // a row of v: copied (or quantized) into v's cache
                h -= heads_q + heads_k;
                long long block, slot;
                if (s >= p.seqlen_k || !cache_slot(p, *cache, b, s, &block, &slot)) continue;
                const T* v = static_cast<const T*>(cache->v) + b * cache->v_stride[0] +
                             h * cache->v_stride[1] + s * cache->v_stride[2];
                const long long out = block * cache->v_cache_stride[0] +
                                      h * cache->v_cache_stride[1] +
                                      slot * cache->v_cache_stride[2];
                for (int d = lane; d < V_DIM; d += WARP) {
                    const T value = v[d * cache->v_stride[3]];
                    const long long at = out + d * cache->v_cache_stride[3];
                    if (KV_FP8)
                        static_cast<unsigned char*>(cache->v_cache)[at] =
                            static_cast<unsigned char>(
                                e4m3_bits(__fdiv_rn(storage_to_float<DTYPE>(value), v_scale)));
                    else
                        static_cast<T*>(cache->v_cache)[at] = value;
                }
                continue;
            }
        }
        const bool is_k = HAS_K && h >= heads_q;
        if (is_k) h -= heads_q;
        if (s >= (is_k ? p.seqlen_k : p.seqlen_q)) continue;  // the whole warp skips the row
        // Where k's row goes with a KV cache (k_out is the cache's view): its slot, if any.
        long long k_base = b * p.k_out_stride[0] + s * p.k_out_stride[2];
        if constexpr (KV_CACHE != 0) {
            if (is_k) {
                long long block, slot;
                if (!cache_slot(p, *cache, b, s, &block, &slot)) continue;
                k_base = block * p.k_out_stride[0] + slot * p.k_out_stride[2];
            }
        }
        const bool fp8 = is_k ? KV_FP8 : Q_FP8;
        const float scale = is_k ? k_scale : q_scale;
        unsigned char* y8 = nullptr;
        const T* x;
        T* y;
        const T* x0 = nullptr;  // backward: the forward's input
        long long xs, ys, x0s = 0;
        const void* w;
        long long ws;
        if (is_k) {
            x = static_cast<const T*>(p.k) + b * p.k_stride[0] + h * p.k_stride[1] +
                s * p.k_stride[2];
            y = static_cast<T*>(p.k_out) + k_base + h * p.k_out_stride[1];
            if (KV_FP8) y8 = static_cast<unsigned char*>(p.k_out) + k_base + h * p.k_out_stride[1];
            xs = p.k_stride[3], ys = p.k_out_stride[3];
            w = np.k_weight, ws = np.k_weight_stride;
            if (BACKWARD_PASS) {
                x0 = static_cast<const T*>(np.k_input) + b * np.k_input_stride[0] +
                     h * np.k_input_stride[1] + s * np.k_input_stride[2];
                x0s = np.k_input_stride[3];
            }
        } else {
            x = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] +
                s * p.q_stride[2];
            y = static_cast<T*>(p.q_out) + b * p.q_out_stride[0] + h * p.q_out_stride[1] +
                s * p.q_out_stride[2];
            if (Q_FP8)
                y8 = static_cast<unsigned char*>(p.q_out) + b * p.q_out_stride[0] +
                     h * p.q_out_stride[1] + s * p.q_out_stride[2];
            xs = p.q_stride[3], ys = p.q_out_stride[3];
            w = np.q_weight, ws = np.q_weight_stride;
            if (BACKWARD_PASS) {
                x0 = static_cast<const T*>(np.q_input) + b * np.q_input_stride[0] +
                     h * np.q_input_stride[1] + s * np.q_input_stride[2];
                x0s = np.q_input_stride[3];
            }
        }
        // The token's table rows: one per position axis with M-RoPE.
        long long rows[MROPE_AXES > 0 ? MROPE_AXES : 1];
        if (MROPE_AXES > 0) {
            for (int axis = 0; axis < MROPE_AXES; ++axis)
                rows[axis] = table_row(p, b, s, false, axis);
        } else {
            rows[0] = table_row(p, b, s, is_k);
        }

        if (!BACKWARD_PASS) {
            float sum = 0.0f;
            for (int d = lane; d < HEAD_DIM; d += WARP) {
                const float v = storage_to_float<DTYPE>(x[d * xs]);
                row[d] = v;
                sum += v * v;
            }
            const float rms = rsqrtf(warp_sum(sum) * inv_d + np.eps);  // every lane's loads done
            for (int d = lane; d < HEAD_DIM; d += WARP) row[d] *= rms * weight_at(w, ws, d);
            __syncwarp();
            for (int d = lane; d < HEAD_DIM; d += WARP)
                store_result(y, y8, fp8, d * ys, rotated_feature(p, row, d, rows, is_k), scale);
        } else {
            for (int d = lane; d < HEAD_DIM; d += WARP) row[d] = storage_to_float<DTYPE>(x[d * xs]);
            __syncwarp();
            float sum = 0.0f;
            for (int d = lane; d < HEAD_DIM; d += WARP) {
                grad[d] = rotated_feature(p, row, d, rows, is_k);  // g, by the inverse rotation
                const float v = storage_to_float<DTYPE>(x0[d * x0s]);
                sum += v * v;
            }
            const float rms = rsqrtf(warp_sum(sum) * inv_d + np.eps);
            float dot = 0.0f;
            for (int d = lane; d < HEAD_DIM; d += WARP) {
                const float xh = storage_to_float<DTYPE>(x0[d * x0s]) * rms;
                dot += weight_at(w, ws, d) * grad[d] * xh;
                if (NORM_WEIGHT_GRAD) atomicAdd(&dw[(is_k ? HEAD_DIM : 0) + d], grad[d] * xh);
            }
            const float mean = warp_sum(dot) * inv_d;  // every lane's reads of x are done too
            for (int d = lane; d < HEAD_DIM; d += WARP) {
                const float xh = storage_to_float<DTYPE>(x0[d * x0s]) * rms;
                y[d * ys] = from_float<DTYPE>(rms * (weight_at(w, ws, d) * grad[d] - xh * mean));
            }
        }
        __syncwarp();  // the row's buffers are free for the warp's next row
    }

    if (NORM_WEIGHT_GRAD) {
        // One global add per feature and block: the block's sums were gathered in shared memory.
        __syncthreads();
        for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
            if (np.q_weight_grad != nullptr)
                atomicAdd(np.q_weight_grad + d * np.q_weight_grad_stride, dw[d]);
            if (HAS_K && np.k_weight_grad != nullptr)
                atomicAdd(np.k_weight_grad + d * np.k_weight_grad_stride, dw[HEAD_DIM + d]);
        }
    }
}
