// Attention with rotary embeddings fused in (the flash_attn_with_rotary contract): the forward
// and the two kernels of the backward. The runtime prepends constexpr specialization constants
// (src/ops/attention/attention_spec.cpp, AttentionSpec::preamble) and compiles this file with NVRTC, without
// any CUDA toolkit header. The constants:
//   KIND                      0 forward, 1 backward dq, 2 backward dk/dv
//   DTYPE, TABLE_DTYPE        0 float32, 1 float16, 2 bfloat16 (q/k/v/out/grads; cos/sin)
//   HEAD_DIM, ROTARY_DIM      features; the first ROTARY_DIM rotate (0: no rotation)
//   INTERLEAVED, TABLE_FULL   pairs (2i, 2i+1) else (i, i + R/2); tables [P, R] vs [P, R/2]
//   HAS_POS_MASK              tokens without a position score unrotated (see rope_jit.h)
//   MASK_KIND, MASK_DTYPE     attn_mask: 0 none, 1 bool (uint8), 2 additive (of MASK_DTYPE)
//   CAUSAL, GQA_GROUP         top-left causal mask; Hq = GQA_GROUP * Hk
//   WRITE_LSE                 the forward writes the log-sum-exp
//   TENSOR_CORES              1: mma.sync (16-bit dtypes, sm_80+); 0: one warp per row
//   WGMMA, STAGES             the forward on warpgroup matrix products (sm_90a; see wg::),
//                             with STAGES key/value tiles in shared memory (2 or 3)
//   PRODUCER_WARPS            wgmma forward: 4 warps after the WARPS consumer warps load and
//                             rotate the tiles (forward_specialized), or 0: every warp does
//   CLUSTER                   forward_specialized: blocks per thread-block cluster sharing
//                             their key/value tiles (1: none)
//   TABLE_ASYNC               tables are staged with cp.async (aligned, unit column stride)
//   WARPS, M_TILES, BLOCK_N   warps per block, 16-row tiles each warp owns; streamed tile rows
//   COMPUTE_DK, COMPUTE_DV    which gradients a dk/dv kernel accumulates
//
// Scores are computed in base 2: s = (q . k) * scale * log2(e) + bias * log2(e), so the
// softmax uses exp2. A query that sees no key gets out = 0 and lse = -inf; the backward reads
// that lse as "P = 0" for the whole row.
//
// Tensor-core kernels (FlashAttention-2 style): a block keeps 16 * WARPS rows resident in
// shared memory (queries for the forward and dq, keys and values for dk/dv), each warp owning
// 16 of them, and streams tiles of BLOCK_N rows of the other side. A streamed tile of keys
// (or queries) arrives raw through cp.async into a staging buffer, with the table rows of its
// tokens, one tile ahead; between tiles every thread rotates a few 16-byte chunks of it in
// registers into the buffer the tensor cores read. Rotated q and k exist only in shared memory.

#include "attention_params.h"

namespace {

constexpr bool ROTATE = ROTARY_DIM > 0;
constexpr int HALF_R = ROTARY_DIM / 2;
constexpr int THREADS = WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return -pos_inf(); }

// ---- element types ------------------------------------------------------------------------

template <int DT> struct StorageOf { using type = unsigned short; };
template <> struct StorageOf<0> { using type = float; };
using T = typename StorageOf<DTYPE>::type;

// The float value of the bits of a 16-bit element (DT 1 fp16, 2 bf16).
template <int DT>
__device__ __forceinline__ float float_of_bits16(unsigned short bits) {
    if constexpr (DT == 1) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
        return f;
    } else {
        return __uint_as_float(static_cast<unsigned>(bits) << 16);
    }
}

template <int DT>
__device__ __forceinline__ float load_float(const void* base, long long index) {
    if constexpr (DT == 0) return static_cast<const float*>(base)[index];
    else return float_of_bits16<DT>(static_cast<const unsigned short*>(base)[index]);
}

// Round to nearest even, NaN kept a (quiet) NaN; written out so it needs no sm_80.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float v) {
    unsigned bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<unsigned short>(bits >> 16);
}

template <int DT>
__device__ __forceinline__ void store_float(void* base, long long index, float v) {
    if constexpr (DT == 0) {
        static_cast<float*>(base)[index] = v;
    } else if constexpr (DT == 1) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        static_cast<unsigned short*>(base)[index] = h;
    } else {
        static_cast<unsigned short*>(base)[index] = float_to_bf16_bits(v);
    }
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

// ---- tokens: positions, angles, masks -------------------------------------------------------

__device__ __forceinline__ bool positioned(const AttentionKernelParams& p, long long b, long long s) {
    if constexpr (!HAS_POS_MASK) return true;
    else return p.pos_mask[b * p.pos_mask_stride[0] + s * p.pos_mask_stride[1]] != 0;
}

__device__ __forceinline__ int table_column(int pair) { return TABLE_FULL && INTERLEAVED ? 2 * pair : pair; }

// cos and sin of pair `pair` at table row `row`, from the tables in global memory.
__device__ __forceinline__ void table_angle(const AttentionKernelParams& p, long long row, int pair, float* c,
                                            float* s) {
    const long long col = table_column(pair);
    *c = load_float<TABLE_DTYPE>(p.cos, row * p.cos_stride[0] + col * p.cos_stride[1]);
    *s = load_float<TABLE_DTYPE>(p.sin, row * p.sin_stride[0] + col * p.sin_stride[1]);
}

// The attn_mask term of score (i, j) in base 2: 0, the additive value, or -inf (masked out).
// Requires i < Sq and j < Sk.
__device__ __forceinline__ float mask_bias(const AttentionKernelParams& p, long long b, long long i, long long j) {
    if constexpr (MASK_KIND == 0) {
        return 0.f;
    } else {
        const long long at = b * p.mask_stride[0] + i * p.mask_stride[1] + j * p.mask_stride[2];
        if constexpr (MASK_KIND == 1) return static_cast<const unsigned char*>(p.attn_mask)[at] ? 0.f : neg_inf();
        else return load_float<MASK_DTYPE>(p.attn_mask, at) * LOG2E;
    }
}

// Pair partner and sign of feature d < ROTARY_DIM: rotated x[d] = x[d]*c + sign*x[partner]*s.
__device__ __forceinline__ void pair_of(int d, int* pair, int* partner, float* sign) {
    if constexpr (INTERLEAVED) {
        *pair = d >> 1;
        *partner = d ^ 1;
        *sign = (d & 1) ? 1.f : -1.f;
    } else {
        const bool first = d < HALF_R;
        *pair = first ? d : d - HALF_R;
        *partner = first ? d + HALF_R : d - HALF_R;
        *sign = first ? -1.f : 1.f;
    }
}

__device__ __forceinline__ const T* head_row(const void* base, const long long* stride, long long b, long long h,
                                             long long s) {
    return static_cast<const T*>(base) + b * stride[0] + h * stride[1] + s * stride[2];
}

__device__ __forceinline__ T* head_row_out(void* base, const long long* stride, long long b, long long h,
                                           long long s) {
    return static_cast<T*>(base) + b * stride[0] + h * stride[1] + s * stride[2];
}

// ============================================================================================
// CUDA-core kernels: one warp per query row (forward, dq) or key row (dk/dv); lane L owns
// features L, L + 32, ... For float32 inputs, and any case the tensor-core kernels do not take.
// ============================================================================================

namespace simt {

constexpr int U = (HEAD_DIM + 31) / 32;  // features per lane

// Feature d (< HEAD_DIM) of head vector x at token `row`, rotated when `rotate`.
__device__ __forceinline__ float feature(const AttentionKernelParams& p, const T* x, long long ds, int d,
                                         long long row, bool rotate) {
    const float v = load_float<DTYPE>(x, d * ds);
    if constexpr (!ROTATE) {
        return v;
    } else {
        if (!rotate || d >= ROTARY_DIM) return v;
        int pair, partner;
        float sign, c, s;
        pair_of(d, &pair, &partner, &sign);
        table_angle(p, row, pair, &c, &s);
        return v * c + sign * load_float<DTYPE>(x, partner * ds) * s;
    }
}

// Applies the transposed rotation of table row `row` to the lane-distributed vector g, through
// the warp's scratch (partners live in other lanes). Warp-uniform.
__device__ void rotate_back(const AttentionKernelParams& p, float (&g)[U], long long row, float* scratch, int lane) {
    if constexpr (ROTATE) {
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            if (d < HEAD_DIM) scratch[d] = g[u];
        }
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            if (d < ROTARY_DIM) {
                int pair, partner;
                float sign, c, s;
                pair_of(d, &pair, &partner, &sign);
                table_angle(p, row, pair, &c, &s);
                g[u] = scratch[d] * c - sign * scratch[partner] * s;
            }
        }
        __syncwarp();
    }
}

__device__ void forward(const AttentionKernelParams& p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_q;
    const long long bh = blockIdx.x % heads;
    const long long i = (blockIdx.x / heads) * WARPS + warp;
    if (i >= p.seqlen_q) return;
    const long long b = bh / p.heads_q, h = bh % p.heads_q, hk = h / GQA_GROUP;

    const T* q = head_row(p.q, p.q_stride, b, h, i);
    const bool q_pos = positioned(p, b, i);
    float q_rot[U], q_plain[U], o[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        q_plain[u] = d < HEAD_DIM ? load_float<DTYPE>(q, d * p.q_stride[3]) : 0.f;
        q_rot[u] = d < HEAD_DIM ? feature(p, q, p.q_stride[3], d, i, q_pos) : 0.f;
        o[u] = 0.f;
    }
    float m = neg_inf(), l = 0.f;
    const long long keys = CAUSAL ? (i + 1 < p.seqlen_k ? i + 1 : p.seqlen_k) : p.seqlen_k;
    for (long long j = 0; j < keys; ++j) {
        const float bias = mask_bias(p, b, i, j);
        if (bias == neg_inf()) continue;
        const T* k = head_row(p.k, p.k_stride, b, hk, j);
        const T* v = head_row(p.v, p.v_stride, b, hk, j);
        const bool k_pos = positioned(p, b, j);
        const bool rotated_pair = !HAS_POS_MASK || q_pos == k_pos;
        float part = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            if (d < HEAD_DIM)
                part += (rotated_pair ? q_rot[u] : q_plain[u]) * feature(p, k, p.k_stride[3], d, j, rotated_pair && k_pos);
        }
        const float s = warp_sum(part) * p.scale_log2 + bias;
        const float m_new = fmaxf(m, s);
        const float alpha = exp2_approx(m - m_new), pj = exp2_approx(s - m_new);
        l = l * alpha + pj;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            o[u] = o[u] * alpha + (d < HEAD_DIM ? pj * load_float<DTYPE>(v, d * p.v_stride[3]) : 0.f);
        }
        m = m_new;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* out = head_row_out(p.out, p.out_stride, b, h, i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        if (d < HEAD_DIM) store_float<DTYPE>(out, d * p.out_stride[3], o[u] * inv);
    }
    // -inf only for a row that sees no key; a NaN score (l NaN) gives a NaN lse.
    if (WRITE_LSE && lane == 0)
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
            l == 0.f ? neg_inf() : (m + __log2f(l)) * LN2;
}

__device__ void backward_dq(const AttentionKernelParams& p) {
    __shared__ float scratch[WARPS][U * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_q;
    const long long bh = blockIdx.x % heads;
    const long long i = (blockIdx.x / heads) * WARPS + warp;
    if (i >= p.seqlen_q) return;
    const long long b = bh / p.heads_q, h = bh % p.heads_q, hk = h / GQA_GROUP;

    const T* q = head_row(p.q, p.q_stride, b, h, i);
    const T* out = head_row(p.out, p.out_stride, b, h, i);
    const T* dout = head_row(p.dout, p.dout_stride, b, h, i);
    const bool q_pos = positioned(p, b, i);
    float q_rot[U], q_plain[U], g[U], dq_rot[U], dq_plain[U];
    float delta = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        const bool in = d < HEAD_DIM;
        q_plain[u] = in ? load_float<DTYPE>(q, d * p.q_stride[3]) : 0.f;
        q_rot[u] = in ? feature(p, q, p.q_stride[3], d, i, q_pos) : 0.f;
        g[u] = in ? load_float<DTYPE>(dout, d * p.dout_stride[3]) : 0.f;
        delta += in ? g[u] * load_float<DTYPE>(out, d * p.out_stride[3]) : 0.f;
        dq_rot[u] = dq_plain[u] = 0.f;
    }
    delta = warp_sum(delta);
    const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
    const long long keys = lse == neg_inf() ? 0 : CAUSAL ? (i + 1 < p.seqlen_k ? i + 1 : p.seqlen_k) : p.seqlen_k;
    const float L = lse * LOG2E;
    for (long long j = 0; j < keys; ++j) {
        const float bias = mask_bias(p, b, i, j);
        if (bias == neg_inf()) continue;
        const T* k = head_row(p.k, p.k_stride, b, hk, j);
        const T* v = head_row(p.v, p.v_stride, b, hk, j);
        const bool k_pos = positioned(p, b, j);
        const bool rotated_pair = !HAS_POS_MASK || q_pos == k_pos;
        float kvec[U];
        float part = 0.f, dp = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            const bool in = d < HEAD_DIM;
            kvec[u] = in ? feature(p, k, p.k_stride[3], d, j, rotated_pair && k_pos) : 0.f;
            part += (rotated_pair ? q_rot[u] : q_plain[u]) * kvec[u];
            dp += in ? g[u] * load_float<DTYPE>(v, d * p.v_stride[3]) : 0.f;
        }
        const float s = warp_sum(part) * p.scale_log2 + bias;
        const float pj = exp2_approx(s - L);
        const float ds = pj * (warp_sum(dp) - delta);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (rotated_pair) dq_rot[u] += ds * kvec[u];
            else dq_plain[u] += ds * kvec[u];
        }
    }
    if (q_pos) rotate_back(p, dq_rot, i, scratch[warp], lane);
    T* dq = head_row_out(p.dq, p.dq_stride, b, h, i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        if (d < HEAD_DIM) store_float<DTYPE>(dq, d * p.dq_stride[3], p.scale * (dq_rot[u] + dq_plain[u]));
    }
}

__device__ void backward_dkdv(const AttentionKernelParams& p) {
    __shared__ float scratch[WARPS][U * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_k;
    const long long bh = blockIdx.x % heads;
    const long long j = (blockIdx.x / heads) * WARPS + warp;
    if (j >= p.seqlen_k) return;
    const long long b = bh / p.heads_k, hk = bh % p.heads_k;

    const T* k = head_row(p.k, p.k_stride, b, hk, j);
    const T* v = head_row(p.v, p.v_stride, b, hk, j);
    const bool k_pos = positioned(p, b, j);
    float k_rot[U], k_plain[U], vv[U], dk_rot[U], dk_plain[U], dv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        const bool in = d < HEAD_DIM;
        k_plain[u] = in ? load_float<DTYPE>(k, d * p.k_stride[3]) : 0.f;
        k_rot[u] = in ? feature(p, k, p.k_stride[3], d, j, k_pos) : 0.f;
        vv[u] = in ? load_float<DTYPE>(v, d * p.v_stride[3]) : 0.f;
        dk_rot[u] = dk_plain[u] = dv[u] = 0.f;
    }
    for (int g = 0; g < GQA_GROUP; ++g) {
        const long long h = hk * GQA_GROUP + g;
        for (long long i = CAUSAL ? j : 0; i < p.seqlen_q; ++i) {
            const float bias = mask_bias(p, b, i, j);
            if (bias == neg_inf()) continue;
            const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
            if (lse == neg_inf()) continue;
            const T* q = head_row(p.q, p.q_stride, b, h, i);
            const T* out = head_row(p.out, p.out_stride, b, h, i);
            const T* dout = head_row(p.dout, p.dout_stride, b, h, i);
            const bool q_pos = positioned(p, b, i);
            const bool rotated_pair = !HAS_POS_MASK || q_pos == k_pos;
            float qvec[U], gvec[U];
            float part = 0.f, dp = 0.f, delta = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int d = lane + 32 * u;
                const bool in = d < HEAD_DIM;
                qvec[u] = in ? feature(p, q, p.q_stride[3], d, i, rotated_pair && q_pos) : 0.f;
                gvec[u] = in ? load_float<DTYPE>(dout, d * p.dout_stride[3]) : 0.f;
                part += qvec[u] * (rotated_pair ? k_rot[u] : k_plain[u]);
                dp += gvec[u] * vv[u];
                delta += in ? gvec[u] * load_float<DTYPE>(out, d * p.out_stride[3]) : 0.f;
            }
            const float s = warp_sum(part) * p.scale_log2 + bias;
            const float pj = exp2_approx(s - lse * LOG2E);
            const float ds = pj * (warp_sum(dp) - warp_sum(delta));
#pragma unroll
            for (int u = 0; u < U; ++u) {
                dv[u] += pj * gvec[u];
                if (rotated_pair) dk_rot[u] += ds * qvec[u];
                else dk_plain[u] += ds * qvec[u];
            }
        }
    }
    if (k_pos) rotate_back(p, dk_rot, j, scratch[warp], lane);
    T* dk = head_row_out(p.dk, p.dk_stride, b, hk, j);
    T* dvp = head_row_out(p.dv, p.dv_stride, b, hk, j);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        if (d < HEAD_DIM) {
            store_float<DTYPE>(dk, d * p.dk_stride[3], p.scale * (dk_rot[u] + dk_plain[u]));
            store_float<DTYPE>(dvp, d * p.dv_stride[3], dv[u]);
        }
    }
}

}  // namespace simt

// ============================================================================================
// Tensor-core kernels (mma.sync m16n8k16, fp32 accumulators). Every function here is a template
// so that nothing of it reaches the PTX of a CUDA-core specialization.
// ============================================================================================

namespace tc {

constexpr int DP = (HEAD_DIM + 15) / 16 * 16;  // head_dim padded to the mma k-step
constexpr int ROWE = DP + 8;                    // elements per shared-memory row (16-byte pad)
constexpr int CHUNKS = DP / 8;                  // 16-byte chunks per row
constexpr int DCHUNKS = HEAD_DIM / 8;           // chunks holding features (HEAD_DIM % 8 == 0)
constexpr int KSTEPS = DP / 16;
constexpr int DTILES = DP / 8;
constexpr int RESIDENT = 16 * M_TILES * WARPS;
constexpr int TCOLS = !ROTATE ? 0 : (TABLE_FULL && INTERLEAVED) ? ROTARY_DIM : HALF_R;  // table columns read
constexpr int TABLE_STEP = TABLE_FULL && INTERLEAVED ? 2 : 1;                         // table columns per pair
constexpr int TBYTES = TABLE_DTYPE == 0 ? 4 : 2;
constexpr int TABLE_ROW_BYTES = ROTATE && TABLE_ASYNC ? TCOLS * TBYTES : 0;
constexpr int TABLE_CHUNKS = TABLE_ROW_BYTES / 16;
constexpr AttentionSmemLayout SMEM =
    attention_smem_layout(KIND, DP, WARPS, M_TILES, BLOCK_N, HAS_POS_MASK, TABLE_ROW_BYTES, WGMMA, STAGES,
                          PRODUCER_WARPS > 0);

// Rotation work items of one row: a chunk of interleaved pairs, or (half style) a chunk of
// first halves with the chunk of their partners R/2 later; then the chunks past the rotary
// features, copied.
constexpr int ROT_ITEMS = !ROTATE ? 0 : INTERLEAVED ? ROTARY_DIM / 8 : ROTARY_DIM / 16;
constexpr int FIRST_PLAIN = ROTATE ? ROTARY_DIM / 8 : 0;
constexpr int ITEMS = ROT_ITEMS + CHUNKS - FIRST_PLAIN;

static_assert(!TENSOR_CORES || DTYPE != 0, "tensor-core kernels take 16-bit inputs");
static_assert(!TENSOR_CORES || HEAD_DIM % 8 == 0, "tensor-core kernels need head_dim % 8 == 0");
static_assert(!TENSOR_CORES || !ROTATE || (INTERLEAVED ? ROTARY_DIM % 8 == 0 : ROTARY_DIM % 16 == 0),
              "rotation by 16-byte chunks needs whole pairs per chunk");
static_assert(!TENSOR_CORES || BLOCK_N % 16 == 0, "streamed tiles are whole mma k-steps");
static_assert(!TENSOR_CORES || !ROTATE || !TABLE_ASYNC || TABLE_ROW_BYTES % 16 == 0, "staged table rows are 16-byte chunks");

struct alignas(16) U4 {
    unsigned w[4];
};

struct F2 {
    float x, y;
};

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    unsigned address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most `PENDING` of this thread's most recent copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

template <int D = DTYPE>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    if constexpr (D == 1) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int D = DTYPE>
__device__ __forceinline__ F2 unpack2(unsigned u) {
    if constexpr (D == 1) {
        const unsigned short lo_bits = static_cast<unsigned short>(u & 0xffffu);
        const unsigned short hi_bits = static_cast<unsigned short>(u >> 16);
        F2 f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f.x) : "h"(lo_bits));
        asm("cvt.f32.f16 %0, %1;" : "=f"(f.y) : "h"(hi_bits));
        return f;
    } else {
        return F2{__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u)};
    }
}

// ldmatrix at a 32-bit shared address. Callers form addresses as one base per operand plus
// compile-time offsets, which ptxas folds into the instruction (a generic pointer converted
// per load would hold one register per distinct address).
template <int D = DTYPE>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

template <int D = DTYPE>
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Per-lane byte offsets of the ldmatrix addresses: an A tile (16 rows, k-step), a pair of B
// n-tiles of a [n][k] operand, and a pair of B n-tiles of a [k][n] operand (transposed load).
__device__ __forceinline__ unsigned a_lane_offset(int lane) {
    return static_cast<unsigned>(((lane & 15) * ROWE + (lane >> 4) * 8) * 2);
}
__device__ __forceinline__ unsigned b_lane_offset(int lane) {
    return static_cast<unsigned>((((lane & 7) + ((lane >> 4) << 3)) * ROWE + ((lane >> 3) & 1) * 8) * 2);
}
__device__ __forceinline__ unsigned bt_lane_offset(int lane) {
    return static_cast<unsigned>((((lane & 7) + ((lane >> 3) & 1) * 8) * ROWE + (lane >> 4) * 8) * 2);
}

// c += a * b for one m16n8k16 tile (a: 4 registers of A, b0/b1: B).
template <int D = DTYPE>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (D == 1)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[NT] += A B^T over the head dim: A = 16 rows at a_rows, B = 8*NT rows at b_rows (both
// shared-memory rows of ROWE elements). S = Q K^T, dP = dO V^T, and their transposes.
template <int NT>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], const T* a_rows, const T* b_rows, int lane) {
    static_assert(NT % 2 == 0, "pairs of n-tiles per ldmatrix");
    const unsigned a_base = shared_address(a_rows) + a_lane_offset(lane);
    const unsigned b_base = shared_address(b_rows) + b_lane_offset(lane);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, a_base + kk * 32);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            unsigned b[4];
            ldmatrix_x4(b, b_base + (nt * 8 * ROWE + kk * 16) * 2);
            mma(acc[nt], a, b[0], b[1]);
            mma(acc[nt + 1], a, b[2], b[3]);
        }
    }
}

// acc[DTILES] += A B over KS k-steps: A from registers (16 x 16*KS), B = 16*KS rows at
// b_rows (shared memory, [k][feature]). O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int KS>
__device__ __forceinline__ void gemm_ab(float (&acc)[DTILES][4], const unsigned (&a)[KS][4], const T* b_rows,
                                        int lane) {
    const unsigned b_base = shared_address(b_rows) + bt_lane_offset(lane);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int dt = 0; dt < DTILES; dt += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, b_base + (kk * 16 * ROWE + dt * 8) * 2);
            mma(acc[dt], a[kk], b[0], b[1]);
            mma(acc[dt + 1], a[kk], b[2], b[3]);
        }
    }
}

// gemm_abt for MT 16-row tiles of A (consecutive rows from a_rows): each B fragment is loaded
// once and used by every tile, which halves the shared-memory traffic of K and V at MT = 2.
template <int MT, int NT>
__device__ __forceinline__ void gemm_abt_mt(float (&acc)[MT][NT][4], const T* a_rows, const T* b_rows, int lane) {
    static_assert(NT % 2 == 0, "pairs of n-tiles per ldmatrix");
    const unsigned a_base = shared_address(a_rows) + a_lane_offset(lane);
    const unsigned b_base = shared_address(b_rows) + b_lane_offset(lane);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a_base + (mt * 16 * ROWE + kk * 16) * 2);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            unsigned b[4];
            ldmatrix_x4(b, b_base + (nt * 8 * ROWE + kk * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma(acc[mt][nt], a[mt], b[0], b[1]);
                mma(acc[mt][nt + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// gemm_ab for MT tiles of A fragments.
template <int MT, int KS>
__device__ __forceinline__ void gemm_ab_mt(float (&acc)[MT][DTILES][4], const unsigned (&a)[MT][KS][4],
                                           const T* b_rows, int lane) {
    const unsigned b_base = shared_address(b_rows) + bt_lane_offset(lane);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int dt = 0; dt < DTILES; dt += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, b_base + (kk * 16 * ROWE + dt * 8) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma(acc[mt][dt], a[mt][kk], b[0], b[1]);
                mma(acc[mt][dt + 1], a[mt][kk], b[2], b[3]);
            }
        }
    }
}

// The accumulators of a 16 x 8*NT tile as A fragments of the next product (FlashAttention-2's
// register reuse: the C layout of two n-tiles is the A layout of one k-step).
template <int NT>
__device__ __forceinline__ void to_a_fragments(unsigned (&a)[NT / 2][4], const float (&c)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        a[kk][0] = pack2(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = pack2(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// Starts copying rows [row0, row0 + ROWS) of one head (`base` at its token 0, token stride
// `stride`) into shared rows; rows at or past `valid` and features past HEAD_DIM read as 0.
template <int ROWS>
__device__ __forceinline__ void issue_rows(T* dst, const T* base, long long stride, long long row0, long long valid) {
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, ch = c - r * CHUNKS;
        const bool ok = row0 + r < valid && ch < DCHUNKS;
        cp_async16(dst + r * ROWE + ch * 8, ok ? base + (row0 + r) * stride + ch * 8 : base, ok);
    }
}

// Starts copying the cos/sin row bytes of tokens [row0, row0 + ROWS) (zero past `valid`).
template <int ROWS>
__device__ __forceinline__ void issue_table_rows(char* cos_dst, char* sin_dst, const AttentionKernelParams& p,
                                                 long long row0, long long valid) {
    if constexpr (ROTATE && TABLE_ASYNC) {
        for (int c = threadIdx.x; c < 2 * ROWS * TABLE_CHUNKS; c += THREADS) {
            const bool is_sin = c >= ROWS * TABLE_CHUNKS;
            const int rc = is_sin ? c - ROWS * TABLE_CHUNKS : c;
            const int r = rc / TABLE_CHUNKS, ch = rc - r * TABLE_CHUNKS;
            const bool ok = row0 + r < valid;
            const char* table = static_cast<const char*>(is_sin ? p.sin : p.cos);
            const long long stride = is_sin ? p.sin_stride[0] : p.cos_stride[0];
            const char* src = ok ? table + (row0 + r) * stride * TBYTES + ch * 16 : table;
            cp_async16((is_sin ? sin_dst : cos_dst) + r * TABLE_ROW_BYTES + ch * 16, src, ok);
        }
    }
}

// M consecutive columns from `first` of one staged table row, in the widest aligned vector
// loads: the rotation's chunking makes `first` * TBYTES a multiple of the run's byte size.
template <int M>
__device__ __forceinline__ void load_columns(const char* row, int first, float (&out)[M]) {
    const char* at = row + first * TBYTES;
    constexpr int BYTES = M * TBYTES;
    unsigned words[BYTES >= 4 ? BYTES / 4 : 1];
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int v = 0; v < BYTES / 16; ++v) {
            const U4 w = reinterpret_cast<const U4*>(at)[v];
#pragma unroll
            for (int e = 0; e < 4; ++e) words[4 * v + e] = w.w[e];
        }
    } else if constexpr (BYTES == 8) {
        const unsigned long long w = *reinterpret_cast<const unsigned long long*>(at);
        words[0] = static_cast<unsigned>(w);
        words[1] = static_cast<unsigned>(w >> 32);
    } else if constexpr (BYTES == 4) {
        words[0] = *reinterpret_cast<const unsigned*>(at);
    } else {
#pragma unroll
        for (int e = 0; e < M; ++e) out[e] = load_float<TABLE_DTYPE>(row, first + e);
        return;
    }
#pragma unroll
    for (int e = 0; e < M; ++e)
        out[e] = TBYTES == 4 ? __uint_as_float(words[e])
                             : load_float<TABLE_DTYPE>(reinterpret_cast<const unsigned short*>(words), e);
}

// cos/sin of the N consecutive pairs from `pair` for row r of a tile (token `token`): from the
// staged rows (vector reads), or from the tables in global memory.
template <int N, bool STAGED>
__device__ __forceinline__ void pair_angles(const AttentionKernelParams& p, const char* cos_rows, const char* sin_rows,
                                            int r, long long token, int pair, float (&c)[N], float (&s)[N]) {
    if constexpr (STAGED) {
        float cc[N * TABLE_STEP], ss[N * TABLE_STEP];
        load_columns<N * TABLE_STEP>(cos_rows + r * TABLE_ROW_BYTES, pair * TABLE_STEP, cc);
        load_columns<N * TABLE_STEP>(sin_rows + r * TABLE_ROW_BYTES, pair * TABLE_STEP, ss);
#pragma unroll
        for (int e = 0; e < N; ++e) {
            c[e] = cc[e * TABLE_STEP];
            s[e] = ss[e * TABLE_STEP];
        }
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) table_angle(p, token, pair + e, &c[e], &s[e]);
    }
}

// Rotates one chunk of four interleaved pairs; angles(e, c, s) gives the cos and sin of pairs
// e and e + 1 of the chunk. Two pairs at a time keeps few angles live beside the caller's
// accumulators.
template <class Angles>
__device__ __forceinline__ void rotate_pair_chunk(U4& x, Angles angles) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
        float c[2], s[2];
        angles(e, c, s);
#pragma unroll
        for (int f = 0; f < 2; ++f) {
            const F2 v = unpack2(x.w[e + f]);
            x.w[e + f] = pack2(v.x * c[f] - v.y * s[f], v.y * c[f] + v.x * s[f]);
        }
    }
}

// Rotates a chunk of eight first-half features with the chunk of their partners R/2 later
// (half style); angles as for rotate_pair_chunk, over the eight pairs.
template <class Angles>
__device__ __forceinline__ void rotate_half_chunks(U4& xa, U4& xb, Angles angles) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float c[2], s[2];
        angles(2 * e, c, s);
        const F2 a = unpack2(xa.w[e]), bb = unpack2(xb.w[e]);
        xa.w[e] = pack2(a.x * c[0] - bb.x * s[0], a.y * c[1] - bb.y * s[1]);
        xb.w[e] = pack2(bb.x * c[0] + a.x * s[0], bb.y * c[1] + a.y * s[1]);
    }
}

// The same for pairs pair0.. of row r of a tile (token `token`), angles as pair_angles gives
// them.
template <bool STAGED>
__device__ __forceinline__ void rotate_pairs_chunk(U4& x, const AttentionKernelParams& p, const char* cos_rows,
                                                   const char* sin_rows, int r, long long token, int pair0) {
    rotate_pair_chunk(x, [&](int e, float (&c)[2], float (&s)[2]) {
        pair_angles<2, STAGED>(p, cos_rows, sin_rows, r, token, pair0 + e, c, s);
    });
}
template <bool STAGED>
__device__ __forceinline__ void rotate_halves_chunks(U4& xa, U4& xb, const AttentionKernelParams& p,
                                                     const char* cos_rows, const char* sin_rows, int r,
                                                     long long token, int pair0) {
    rotate_half_chunks(xa, xb, [&](int e, float (&c)[2], float (&s)[2]) {
        pair_angles<2, STAGED>(p, cos_rows, sin_rows, r, token, pair0 + e, c, s);
    });
}

// Writes rows [0, ROWS) of `src` (raw, zero-filled) into `dst` rotated by the table rows of
// tokens row0 + r (tokens without a position and rows past `valid` stay as they are), their
// plain copy into `plain` (pos_mask), and each row's positioned flag into `flags`. dst may be
// src (in place). STAGED: the angles come from the staged table rows of the tile.
template <int ROWS, bool STAGED>
__device__ void rotate_rows(T* dst, T* plain, const T* src, const char* cos_rows, const char* sin_rows,
                            unsigned char* flags, const AttentionKernelParams& p, long long b, long long row0,
                            long long valid) {
    for (int r = threadIdx.x; r < ROWS; r += THREADS)
        flags[r] = row0 + r < valid && positioned(p, b, row0 + r) ? 1 : 0;
    for (int it = threadIdx.x; it < ROWS * ITEMS; it += THREADS) {
        const int r = it / ITEMS, k = it - r * ITEMS;
        const T* s_row = src + r * ROWE;
        T* d_row = dst + r * ROWE;
        T* p_row = plain + r * ROWE;
        if (k >= ROT_ITEMS) {
            const int ch = FIRST_PLAIN + (k - ROT_ITEMS);
            const U4 x = *reinterpret_cast<const U4*>(s_row + ch * 8);
            if (dst != src) *reinterpret_cast<U4*>(d_row + ch * 8) = x;
            if constexpr (HAS_POS_MASK) *reinterpret_cast<U4*>(p_row + ch * 8) = x;
            continue;
        }
        const long long token = row0 + r;
        const bool rotate = token < valid && positioned(p, b, token);
        if constexpr (INTERLEAVED) {
            const int ch = k;
            U4 x = *reinterpret_cast<const U4*>(s_row + ch * 8);
            if constexpr (HAS_POS_MASK) *reinterpret_cast<U4*>(p_row + ch * 8) = x;
            if (rotate) rotate_pairs_chunk<STAGED>(x, p, cos_rows, sin_rows, r, token, ch * 4);
            *reinterpret_cast<U4*>(d_row + ch * 8) = x;
        } else {
            const int ca = k, cb = k + ROTARY_DIM / 16;
            U4 xa = *reinterpret_cast<const U4*>(s_row + ca * 8);
            U4 xb = *reinterpret_cast<const U4*>(s_row + cb * 8);
            if constexpr (HAS_POS_MASK) {
                *reinterpret_cast<U4*>(p_row + ca * 8) = xa;
                *reinterpret_cast<U4*>(p_row + cb * 8) = xb;
            }
            if (rotate) rotate_halves_chunks<STAGED>(xa, xb, p, cos_rows, sin_rows, r, token, ca * 8);
            *reinterpret_cast<U4*>(d_row + ca * 8) = xa;
            *reinterpret_cast<U4*>(d_row + cb * 8) = xb;
        }
    }
}

// Applies the transposed rotation of token `token` to one accumulator row (rows e2 = 0: c[.][0..1],
// e2 = 1: c[.][2..3]) of a 16 x DP tile whose column of (dt, e) is dt*8 + 2*(lane&3) + e.
template <int D = DTYPE>
__device__ __forceinline__ void rotate_back_row(float (&acc)[DTILES][4], int e2, const AttentionKernelParams& p,
                                                long long token, int lane) {
    if constexpr (ROTATE) {
        const int t2 = 2 * (lane & 3);
        if constexpr (INTERLEAVED) {
#pragma unroll
            for (int dt = 0; dt < ROTARY_DIM / 8; ++dt) {
                float c, s;
                table_angle(p, token, (dt * 8 + t2) / 2, &c, &s);
                const float x1 = acc[dt][2 * e2], x2 = acc[dt][2 * e2 + 1];
                acc[dt][2 * e2] = x1 * c + x2 * s;
                acc[dt][2 * e2 + 1] = x2 * c - x1 * s;
            }
        } else {
#pragma unroll
            for (int dt = 0; dt < ROTARY_DIM / 16; ++dt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float c, s;
                    table_angle(p, token, dt * 8 + t2 + e, &c, &s);
                    const float x1 = acc[dt][2 * e2 + e], x2 = acc[dt + ROTARY_DIM / 16][2 * e2 + e];
                    acc[dt][2 * e2 + e] = x1 * c + x2 * s;
                    acc[dt + ROTARY_DIM / 16][2 * e2 + e] = x2 * c - x1 * s;
                }
            }
        }
    }
}

// Stores a warp's 16 x HEAD_DIM result rows (accumulators times `scale`) through its own
// shared rows `stage` to global rows first_row.. (those below `valid`), 16 bytes at a time.
template <int D = DTYPE>
__device__ __forceinline__ void store_rows(const float (&acc)[DTILES][4], float scale0, float scale1, T* stage,
                                           T* base, long long stride, long long first_row, long long valid, int lane) {
    const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) {
        *reinterpret_cast<unsigned*>(stage + g * ROWE + dt * 8 + t2) = pack2(acc[dt][0] * scale0, acc[dt][1] * scale0);
        *reinterpret_cast<unsigned*>(stage + (g + 8) * ROWE + dt * 8 + t2) =
            pack2(acc[dt][2] * scale1, acc[dt][3] * scale1);
    }
    __syncwarp();
    for (int c = lane; c < 16 * DCHUNKS; c += 32) {
        const int row = c / DCHUNKS, ch = c - row * DCHUNKS;
        if (first_row + row < valid)
            *reinterpret_cast<U4*>(base + (first_row + row) * stride + ch * 8) =
                *reinterpret_cast<const U4*>(stage + row * ROWE + ch * 8);
    }
    __syncwarp();
}

// Scores of a 16 x 8*NT tile in base 2 with every mask applied: rows (queries, or keys when
// TRANSPOSED) at row_first + g (+8), columns at col_first + 8*nt + 2*(lane&3) (+1).
// Token indices are 32-bit here: the launcher refuses sequences of 2^31 tokens or more.
template <int NT, bool TRANSPOSED>
__device__ __forceinline__ void scale_and_mask(float (&s)[NT][4], const AttentionKernelParams& p, long long b,
                                               long long row_first, long long col_first, bool check_bounds,
                                               bool check_causal, int lane) {
    const int row0 = static_cast<int>(row_first) + (lane >> 2);
    const int col0 = static_cast<int>(col_first) + 2 * (lane & 3);
    const int seqlen_q = static_cast<int>(p.seqlen_q), seqlen_k = static_cast<int>(p.seqlen_k);
    const float scale = p.scale_log2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + 8 * (e >> 1), col = col0 + nt * 8 + (e & 1);
            const int i = TRANSPOSED ? col : row, j = TRANSPOSED ? row : col;
            float x = s[nt][e] * scale;
            if (check_bounds && (j >= seqlen_k || i >= seqlen_q)) x = neg_inf();
            else if (CAUSAL && check_causal && j > i) x = neg_inf();
            else if (MASK_KIND != 0 && i < seqlen_q && j < seqlen_k) x += mask_bias(p, b, i, j);
            s[nt][e] = x;
        }
    }
}

// With pos_mask: where a row token and a column token differ in having a position, the score
// is the plain product. `row_flags`/`col_flags` index by tile-local row and column.
template <int NT>
__device__ __forceinline__ void select_plain(float (&s)[NT][4], const float (&plain)[NT][4],
                                             const unsigned char* row_flags, const unsigned char* col_flags, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (row_flags[(lane >> 2) + 8 * (e >> 1)] != col_flags[nt * 8 + 2 * (lane & 3) + (e & 1)])
                s[nt][e] = plain[nt][e];
}

// Splits dS into the part that flows through rotated vectors and the plain part.
template <int NT>
__device__ __forceinline__ void split_plain(float (&rot)[NT][4], float (&plain)[NT][4], const unsigned char* row_flags,
                                            const unsigned char* col_flags, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool rotated = row_flags[(lane >> 2) + 8 * (e >> 1)] == col_flags[nt * 8 + 2 * (lane & 3) + (e & 1)];
            plain[nt][e] = rotated ? 0.f : rot[nt][e];
            if (!rotated) rot[nt][e] = 0.f;
        }
}

// One step of the online softmax over a 16 x 8*NT score tile, one row pair per thread (rows g
// and g + 8): scores (base 2, masks applied, times `scale` > 0 still to apply) become
// probabilities relative to the running row maximum, and the row sums and the output
// accumulators are rescaled to the new maximum.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&o)[DTILES][4], float scale = 1.f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float alpha = exp2_approx(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][2 * r] = exp2_approx(fmaf(s[nt][2 * r], scale, -m_use));
            s[nt][2 * r + 1] = exp2_approx(fmaf(s[nt][2 * r + 1], scale, -m_use));
            sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
            o[dt][2 * r] *= alpha;
            o[dt][2 * r + 1] *= alpha;
        }
    }
}

// Normalizes a warp's 16 output rows (first query first_row) by their softmax sums and writes
// them through `stage` (16 of the warp's own shared rows), with the log-sum-exp if asked.
template <int D = DTYPE>
__device__ __forceinline__ void finish_rows(const float (&o)[DTILES][4], const float (&row_max)[2],
                                            float (&row_sum)[2], T* stage, const AttentionKernelParams& p,
                                            long long b, long long h, long long first_row, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 2);
    }
    store_rows(o, row_sum[0] > 0.f ? 1.f / row_sum[0] : 0.f, row_sum[1] > 0.f ? 1.f / row_sum[1] : 0.f, stage,
               head_row_out(p.out, p.out_stride, b, h, 0), p.out_stride[2], first_row, p.seqlen_q, lane);
    if (WRITE_LSE && (lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const long long i = first_row + (lane >> 2) + 8 * r;
            if (i < p.seqlen_q)
                p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
                    row_sum[r] == 0.f ? neg_inf() : (row_max[r] + __log2f(row_sum[r])) * LN2;  // NaN stays NaN
        }
    }
}

// Pointers into one block's shared memory. The second of a double buffer is found by its
// constant distance from the first: a select or an array indexed at run time sends the whole
// struct to local memory.
struct Buffers {
    T *q, *q_plain, *q_stage, *o_stage, *dout0, *dout1, *k, *k_plain, *k_stage, *v0, *v1;
    char *cos_stage, *sin_stage;
    float *row_a, *row_b;
    unsigned char *q_flags, *k_flags;

    __device__ __forceinline__ T* dout(int buffer) const {
        return dout0 + buffer * ((SMEM.dout1 - SMEM.dout0) / static_cast<int>(sizeof(T)));
    }
    __device__ __forceinline__ T* v(int buffer) const {
        return v0 + buffer * ((SMEM.v1 - SMEM.v0) / static_cast<int>(sizeof(T)));
    }
};

template <int D = DTYPE>
__device__ __forceinline__ Buffers carve(char* smem) {
    Buffers m;
    m.q = reinterpret_cast<T*>(smem + SMEM.q);
    m.q_plain = reinterpret_cast<T*>(smem + SMEM.q_plain);
    m.q_stage = reinterpret_cast<T*>(smem + SMEM.q_stage);
    m.o_stage = reinterpret_cast<T*>(smem + SMEM.o_stage);
    m.dout0 = reinterpret_cast<T*>(smem + SMEM.dout0);
    m.dout1 = reinterpret_cast<T*>(smem + SMEM.dout1);
    m.k = reinterpret_cast<T*>(smem + SMEM.k);
    m.k_plain = reinterpret_cast<T*>(smem + SMEM.k_plain);
    m.k_stage = reinterpret_cast<T*>(smem + SMEM.k_stage);
    m.v0 = reinterpret_cast<T*>(smem + SMEM.v0);
    m.v1 = reinterpret_cast<T*>(smem + SMEM.v1);
    m.cos_stage = smem + SMEM.cos_stage;
    m.sin_stage = smem + SMEM.sin_stage;
    m.row_a = reinterpret_cast<float*>(smem + SMEM.row_a);
    m.row_b = reinterpret_cast<float*>(smem + SMEM.row_b);
    m.q_flags = reinterpret_cast<unsigned char*>(smem + SMEM.q_flags);
    m.k_flags = reinterpret_cast<unsigned char*>(smem + SMEM.k_flags);
    return m;
}

// ---- forward and dq: resident queries, streamed keys ----------------------------------------

// What a forward block works on: query rows [m0, m0 + RESIDENT) of head h in batch b (blocks
// take the longest causal rows first), the rows of its heads, and the BLOCK_N-key tiles those
// queries see.
struct QueryBlock {
    long long b, h, m0;
    const T *q_head, *k_head, *v_head;
    int tiles;
};

template <int D = DTYPE>
__device__ __forceinline__ QueryBlock query_block(const AttentionKernelParams& p) {
    const long long heads = p.batch * p.heads_q;
    const long long bh = blockIdx.x % heads;
    QueryBlock qb;
    qb.b = bh / p.heads_q;
    qb.h = bh % p.heads_q;
    qb.m0 = (p.sequence_blocks - 1 - blockIdx.x / heads) * RESIDENT;
    const long long hk = qb.h / GQA_GROUP;
    qb.q_head = head_row(p.q, p.q_stride, qb.b, qb.h, 0);
    qb.k_head = head_row(p.k, p.k_stride, qb.b, hk, 0);
    qb.v_head = head_row(p.v, p.v_stride, qb.b, hk, 0);
    const long long key_end =
        CAUSAL ? (qb.m0 + RESIDENT < p.seqlen_k ? qb.m0 + RESIDENT : p.seqlen_k) : p.seqlen_k;
    qb.tiles = static_cast<int>((key_end + BLOCK_N - 1) / BLOCK_N);
    return qb;
}

// The key stream of the dq kernel: tile t of keys rotated in m.k (and plain in m.k_plain),
// its values in m.v(t & 1); tile t + 1 (raw keys in m.k_stage) in flight.
template <int D = DTYPE>
__device__ __forceinline__ void issue_key_tile(const Buffers& m, const AttentionKernelParams& p, const T* k_head,
                                               const T* v_head, long long n0, int buffer) {
    issue_rows<BLOCK_N>(m.k_stage, k_head, p.k_stride[2], n0, p.seqlen_k);
    issue_table_rows<BLOCK_N>(m.cos_stage, m.sin_stage, p, n0, p.seqlen_k);
    issue_rows<BLOCK_N>(m.v(buffer), v_head, p.v_stride[2], n0, p.seqlen_k);
}

// The forward (FlashAttention-2's pipeline with the rotation added): per key tile t, with K_t
// rotated in m.k and V_t arriving in m.v0,
//   S = Q K_t^T; masks; online softmax          (V_t lands meanwhile)
//   barrier; K_{t+1} raw and its table rows start arriving into m.k and the staging rows
//   O += P V_t                                   (K_{t+1} lands meanwhile)
//   barrier; V_{t+1} starts arriving; K_{t+1} is rotated in place; barrier
// Three barriers per tile, 2 blocks per multiprocessor (two 16-row tiles per warp at
// head_dim <= 128), so one block's barriers and rotation overlap the other's matrix products.
template <int D = DTYPE>
__device__ void forward(const AttentionKernelParams& p, char* smem) {
    constexpr int NT = BLOCK_N / 8;
    constexpr int WARP_ROWS = 16 * M_TILES;
    const Buffers m = carve(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const auto [b, h, m0, q_head, k_head, v_head, tiles] = query_block(p);

    issue_rows<RESIDENT>(m.q, q_head, p.q_stride[2], m0, p.seqlen_q);
    if (tiles > 0) {
        issue_rows<BLOCK_N>(m.k, k_head, p.k_stride[2], 0, p.seqlen_k);
        issue_table_rows<BLOCK_N>(m.cos_stage, m.sin_stage, p, 0, p.seqlen_k);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    if (tiles > 0) issue_rows<BLOCK_N>(m.v0, v_head, p.v_stride[2], 0, p.seqlen_k);
    cp_async_commit();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0, p.seqlen_q);
    if (tiles > 0)
        rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k, m.cos_stage, m.sin_stage, m.k_flags, p, b, 0, p.seqlen_k);
    __syncthreads();

    const T* q_rows = m.q + warp * WARP_ROWS * ROWE;
    const T* q_plain_rows = m.q_plain + warp * WARP_ROWS * ROWE;
    const long long row_first = m0 + warp * WARP_ROWS;
    float o[M_TILES][DTILES][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        zero(o[mt]);
        row_max[mt][0] = row_max[mt][1] = neg_inf();
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        float s[M_TILES][NT][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) zero(s[mt]);
        gemm_abt_mt<M_TILES, NT>(s, q_rows, m.k, lane);
        if constexpr (HAS_POS_MASK) {
            float plain[M_TILES][NT][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) zero(plain[mt]);
            gemm_abt_mt<M_TILES, NT>(plain, q_plain_rows, m.k_plain, lane);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                select_plain<NT>(s[mt], plain[mt], m.q_flags + warp * WARP_ROWS + mt * 16, m.k_flags, lane);
        }
        const bool check_bounds = n0 + BLOCK_N > p.seqlen_k, check_causal = n0 + BLOCK_N - 1 > row_first;
        unsigned pa[M_TILES][NT / 2][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            scale_and_mask<NT, false>(s[mt], p, b, row_first + mt * 16, n0, check_bounds, check_causal, lane);
            online_softmax<NT>(s[mt], row_max[mt], row_sum[mt], o[mt]);
            to_a_fragments<NT>(pa[mt], s[mt]);
        }

        cp_async_wait_all();  // V_t
        __syncthreads();      // and every warp is done with m.k
        if (t + 1 < tiles) {
            issue_rows<BLOCK_N>(m.k, k_head, p.k_stride[2], n0 + BLOCK_N, p.seqlen_k);
            issue_table_rows<BLOCK_N>(m.cos_stage, m.sin_stage, p, n0 + BLOCK_N, p.seqlen_k);
        }
        cp_async_commit();
        gemm_ab_mt<M_TILES, NT / 2>(o, pa, m.v0, lane);

        cp_async_wait_all();  // K_{t+1}
        __syncthreads();      // and every warp is done with m.v0
        if (t + 1 < tiles) {
            issue_rows<BLOCK_N>(m.v0, v_head, p.v_stride[2], n0 + BLOCK_N, p.seqlen_k);
            cp_async_commit();
            rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k, m.cos_stage, m.sin_stage, m.k_flags, p, b,
                                              n0 + BLOCK_N, p.seqlen_k);
        }
        __syncthreads();
    }

    // Only this warp reads its query rows: it may stage its output there.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        finish_rows(o[mt], row_max[mt], row_sum[mt], m.q + (warp * WARP_ROWS + mt * 16) * ROWE, p, b, h,
                    row_first + mt * 16, lane);
}

// lse of a row in base 2, as the backward uses it: +inf for rows that see no key or lie past
// Sq, which makes every P of the row exp2(x - inf) = 0.
template <int D = DTYPE>
__device__ __forceinline__ float base2_lse(const AttentionKernelParams& p, long long b, long long h, long long i) {
    if (i >= p.seqlen_q) return pos_inf();
    const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
    return lse == neg_inf() ? pos_inf() : lse * LOG2E;
}

// delta_i = dout_i . out_i for `rows` rows whose dout is in shared rows `dout_rows`, their out
// in global memory (`out_rows`, or in shared rows `out_stage` when given); one warp per row.
template <int D = DTYPE>
__device__ __forceinline__ void row_deltas(float* delta, int rows, const T* dout_rows, const T* out_stage,
                                           const T* out_head, long long out_stride, long long row0, long long valid,
                                           int warp, int lane) {
    for (int r = warp; r < rows; r += WARPS) {
        float sum = 0.f;
        if (row0 + r < valid) {
            for (int ch = lane; ch < DCHUNKS; ch += 32) {
                const U4 g = *reinterpret_cast<const U4*>(dout_rows + r * ROWE + ch * 8);
                const U4 o = out_stage != nullptr ? *reinterpret_cast<const U4*>(out_stage + r * ROWE + ch * 8)
                                                  : *reinterpret_cast<const U4*>(out_head + (row0 + r) * out_stride + ch * 8);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const F2 gg = unpack2(g.w[e]), oo = unpack2(o.w[e]);
                    sum += gg.x * oo.x + gg.y * oo.y;
                }
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) delta[r] = sum;
    }
}

template <int D = DTYPE>
__device__ void backward_dq(const AttentionKernelParams& p, char* smem) {
    const Buffers m = carve(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_q;
    const long long bh = blockIdx.x % heads;
    const long long m_block = p.sequence_blocks - 1 - blockIdx.x / heads;
    const long long b = bh / p.heads_q, h = bh % p.heads_q, hk = h / GQA_GROUP;
    const long long m0 = m_block * RESIDENT;
    const T* k_head = head_row(p.k, p.k_stride, b, hk, 0);
    const T* v_head = head_row(p.v, p.v_stride, b, hk, 0);
    const long long key_end = CAUSAL ? (m0 + RESIDENT < p.seqlen_k ? m0 + RESIDENT : p.seqlen_k) : p.seqlen_k;
    const int tiles = static_cast<int>((key_end + BLOCK_N - 1) / BLOCK_N);

    issue_rows<RESIDENT>(m.q, head_row(p.q, p.q_stride, b, h, 0), p.q_stride[2], m0, p.seqlen_q);
    issue_rows<RESIDENT>(m.dout(0), head_row(p.dout, p.dout_stride, b, h, 0), p.dout_stride[2], m0, p.seqlen_q);
    if (tiles > 0) issue_key_tile(m, p, k_head, v_head, 0, 0);
    cp_async_commit();
    for (int r = threadIdx.x; r < RESIDENT; r += THREADS) m.row_a[r] = base2_lse(p, b, h, m0 + r);
    cp_async_wait_all();
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0, p.seqlen_q);
    if (tiles > 0)
        rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k_stage, m.cos_stage, m.sin_stage, m.k_flags, p, b, 0,
                                          p.seqlen_k);
    row_deltas(m.row_b, RESIDENT, m.dout(0), nullptr, head_row(p.out, p.out_stride, b, h, 0), p.out_stride[2], m0,
               p.seqlen_q, warp, lane);
    __syncthreads();

    const T* q_rows = m.q + warp * 16 * ROWE;
    const T* q_plain_rows = m.q_plain + warp * 16 * ROWE;
    const T* dout_rows = m.dout(0) + warp * 16 * ROWE;
    const unsigned char* row_flags = m.q_flags + warp * 16;
    const int g = lane >> 2;
    const float row_lse[2] = {m.row_a[warp * 16 + g], m.row_a[warp * 16 + g + 8]};
    const float row_delta[2] = {m.row_b[warp * 16 + g], m.row_b[warp * 16 + g + 8]};
    float dq[DTILES][4];
    zero(dq);
    float dq_plain[DTILES][4];  // unused (and optimized away) without pos_mask
    zero(dq_plain);
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        if (t + 1 < tiles) issue_key_tile(m, p, k_head, v_head, n0 + BLOCK_N, (t + 1) & 1);
        cp_async_commit();

        float s[BLOCK_N / 8][4];
        zero(s);
        gemm_abt<BLOCK_N / 8>(s, q_rows, m.k, lane);
        if constexpr (HAS_POS_MASK) {
            float plain[BLOCK_N / 8][4];
            zero(plain);
            gemm_abt<BLOCK_N / 8>(plain, q_plain_rows, m.k_plain, lane);
            select_plain<BLOCK_N / 8>(s, plain, row_flags, m.k_flags, lane);
        }
        scale_and_mask<BLOCK_N / 8, false>(s, p, b, m0 + warp * 16, n0, n0 + BLOCK_N > p.seqlen_k,
                                           n0 + BLOCK_N - 1 > m0, lane);
        float ds[BLOCK_N / 8][4];
        zero(ds);
        gemm_abt<BLOCK_N / 8>(ds, dout_rows, m.v(t & 1), lane);
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float prob = exp2_approx(s[nt][e] - row_lse[e >> 1]);
                ds[nt][e] = prob * (ds[nt][e] - row_delta[e >> 1]);
            }
        if constexpr (HAS_POS_MASK) {
            float ds_plain[BLOCK_N / 8][4];
            split_plain<BLOCK_N / 8>(ds, ds_plain, row_flags, m.k_flags, lane);
            unsigned a_plain[BLOCK_N / 16][4];
            to_a_fragments<BLOCK_N / 8>(a_plain, ds_plain);
            gemm_ab<BLOCK_N / 16>(dq_plain, a_plain, m.k_plain, lane);
        }
        unsigned a[BLOCK_N / 16][4];
        to_a_fragments<BLOCK_N / 8>(a, ds);
        gemm_ab<BLOCK_N / 16>(dq, a, m.k, lane);

        cp_async_wait_all();
        __syncthreads();
        if (t + 1 < tiles)
            rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k_stage, m.cos_stage, m.sin_stage, m.k_flags, p, b,
                                              n0 + BLOCK_N, p.seqlen_k);
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long i = m0 + warp * 16 + g + 8 * r;
        if (ROTATE && i < p.seqlen_q && row_flags[g + 8 * r]) rotate_back_row(dq, r, p, i, lane);
    }
    if constexpr (HAS_POS_MASK) {
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[dt][e] += dq_plain[dt][e];
    }
    T* stage = m.q + warp * 16 * ROWE;
    store_rows(dq, p.scale, p.scale, stage, head_row_out(p.dq, p.dq_stride, b, h, 0), p.dq_stride[2], m0 + warp * 16,
               p.seqlen_q, lane);
}

// ---- dk/dv: resident keys and values, streamed query tiles ----------------------------------

template <int D = DTYPE>
__device__ __forceinline__ void issue_query_tile(const Buffers& m, const AttentionKernelParams& p, long long b,
                                                 long long h, long long m0, int buffer) {
    issue_rows<BLOCK_N>(m.q_stage, head_row(p.q, p.q_stride, b, h, 0), p.q_stride[2], m0, p.seqlen_q);
    issue_table_rows<BLOCK_N>(m.cos_stage, m.sin_stage, p, m0, p.seqlen_q);
    issue_rows<BLOCK_N>(m.dout(buffer), head_row(p.dout, p.dout_stride, b, h, 0), p.dout_stride[2], m0, p.seqlen_q);
    issue_rows<BLOCK_N>(m.o_stage, head_row(p.out, p.out_stride, b, h, 0), p.out_stride[2], m0, p.seqlen_q);
    for (int r = threadIdx.x; r < BLOCK_N; r += THREADS) {
        const bool ok = m0 + r < p.seqlen_q;
        cp_async4(m.row_a + BLOCK_N + r, ok ? p.lse + b * p.lse_stride[0] + h * p.lse_stride[1] + (m0 + r) * p.lse_stride[2] : p.lse,
                  ok);
    }
}

// After a query tile's copies landed: rotate it, and turn its lse into the base-2 form and
// its out rows into deltas.
template <int D = DTYPE>
__device__ __forceinline__ void prepare_query_tile(const Buffers& m, const AttentionKernelParams& p, long long b,
                                                   long long m0, int buffer, int warp, int lane) {
    rotate_rows<BLOCK_N, TABLE_ASYNC>(m.q, m.q_plain, m.q_stage, m.cos_stage, m.sin_stage, m.q_flags, p, b, m0,
                                      p.seqlen_q);
    for (int r = threadIdx.x; r < BLOCK_N; r += THREADS) {
        const float lse = m.row_a[BLOCK_N + r];
        m.row_a[r] = m0 + r >= p.seqlen_q || lse == neg_inf() ? pos_inf() : lse * LOG2E;
    }
    row_deltas(m.row_b, BLOCK_N, m.dout(buffer), m.o_stage, nullptr, 0, m0, p.seqlen_q, warp, lane);
}

template <int D = DTYPE>
__device__ void backward_dkdv(const AttentionKernelParams& p, char* smem) {
    const Buffers m = carve(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_k;
    const long long bh = blockIdx.x % heads;
    const long long n_block = blockIdx.x / heads;  // the keys seen by the most queries (causal) first
    const long long b = bh / p.heads_k, hk = bh % p.heads_k;
    const long long n0 = n_block * RESIDENT;
    const long long tile_begin = CAUSAL ? n0 / BLOCK_N : 0;
    const long long tile_end = (p.seqlen_q + BLOCK_N - 1) / BLOCK_N;
    const long long per_head = tile_end > tile_begin ? tile_end - tile_begin : 0;
    const long long steps = per_head * GQA_GROUP;

    issue_rows<RESIDENT>(m.k, head_row(p.k, p.k_stride, b, hk, 0), p.k_stride[2], n0, p.seqlen_k);
    issue_rows<RESIDENT>(m.v(0), head_row(p.v, p.v_stride, b, hk, 0), p.v_stride[2], n0, p.seqlen_k);
    if (steps > 0) issue_query_tile(m, p, b, hk * GQA_GROUP, tile_begin * BLOCK_N, 0);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.k, m.k_plain, m.k, nullptr, nullptr, m.k_flags, p, b, n0, p.seqlen_k);
    if (steps > 0) prepare_query_tile(m, p, b, tile_begin * BLOCK_N, 0, warp, lane);
    __syncthreads();

    const T* k_rows = m.k + warp * 16 * ROWE;
    const T* k_plain_rows = m.k_plain + warp * 16 * ROWE;
    const T* v_rows = m.v(0) + warp * 16 * ROWE;
    const unsigned char* row_flags = m.k_flags + warp * 16;
    float dv[DTILES][4];  // accumulators a pass does not use are optimized away
    zero(dv);
    float dk[DTILES][4];
    zero(dk);
    float dk_plain[DTILES][4];
    zero(dk_plain);
    for (long long step = 0; step < steps; ++step) {
        const long long h = hk * GQA_GROUP + step / per_head;
        const long long m0 = (tile_begin + step % per_head) * BLOCK_N;
        const int buffer = static_cast<int>(step & 1);
        long long next_h = 0, next_m0 = 0;
        if (step + 1 < steps) {
            next_h = hk * GQA_GROUP + (step + 1) / per_head;
            next_m0 = (tile_begin + (step + 1) % per_head) * BLOCK_N;
            issue_query_tile(m, p, b, next_h, next_m0, buffer ^ 1);
        }
        cp_async_commit();

        // S^T = K Q^T: rows are this warp's keys, columns the tile's queries.
        float s[BLOCK_N / 8][4];
        zero(s);
        gemm_abt<BLOCK_N / 8>(s, k_rows, m.q, lane);
        if constexpr (HAS_POS_MASK) {
            float plain[BLOCK_N / 8][4];
            zero(plain);
            gemm_abt<BLOCK_N / 8>(plain, k_plain_rows, m.q_plain, lane);
            select_plain<BLOCK_N / 8>(s, plain, row_flags, m.q_flags, lane);
        }
        scale_and_mask<BLOCK_N / 8, true>(s, p, b, n0 + warp * 16, m0, true, m0 < n0 + RESIDENT, lane);
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = exp2_approx(s[nt][e] - m.row_a[nt * 8 + 2 * (lane & 3) + (e & 1)]);
        if constexpr (COMPUTE_DV) {
            unsigned pa[BLOCK_N / 16][4];
            to_a_fragments<BLOCK_N / 8>(pa, s);
            gemm_ab<BLOCK_N / 16>(dv, pa, m.dout(buffer), lane);
        }
        if constexpr (COMPUTE_DK) {
            // dP^T = V dO^T, then dS^T = P^T (dP^T - delta).
            float ds[BLOCK_N / 8][4];
            zero(ds);
            gemm_abt<BLOCK_N / 8>(ds, v_rows, m.dout(buffer), lane);
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    ds[nt][e] = s[nt][e] * (ds[nt][e] - m.row_b[nt * 8 + 2 * (lane & 3) + (e & 1)]);
            if constexpr (HAS_POS_MASK) {
                float ds_plain[BLOCK_N / 8][4];
                split_plain<BLOCK_N / 8>(ds, ds_plain, row_flags, m.q_flags, lane);
                unsigned a_plain[BLOCK_N / 16][4];
                to_a_fragments<BLOCK_N / 8>(a_plain, ds_plain);
                gemm_ab<BLOCK_N / 16>(dk_plain, a_plain, m.q_plain, lane);
            }
            unsigned a[BLOCK_N / 16][4];
            to_a_fragments<BLOCK_N / 8>(a, ds);
            gemm_ab<BLOCK_N / 16>(dk, a, m.q, lane);
        }

        cp_async_wait_all();
        __syncthreads();
        if (step + 1 < steps) prepare_query_tile(m, p, b, next_m0, buffer ^ 1, warp, lane);
        __syncthreads();
    }

    const int g = lane >> 2;
    const long long first = n0 + warp * 16;
    if constexpr (COMPUTE_DK) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const long long j = first + g + 8 * r;
            if (ROTATE && j < p.seqlen_k && row_flags[g + 8 * r]) rotate_back_row(dk, r, p, j, lane);
        }
        if constexpr (HAS_POS_MASK) {
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) dk[dt][e] += dk_plain[dt][e];
        }
        // Only this warp reads its key rows: it may stage its results there.
        store_rows(dk, p.scale, p.scale, m.k + warp * 16 * ROWE, head_row_out(p.dk, p.dk_stride, b, hk, 0),
                   p.dk_stride[2], first, p.seqlen_k, lane);
    }
    if constexpr (COMPUTE_DV)
        store_rows(dv, 1.f, 1.f, m.v(0) + warp * 16 * ROWE, head_row_out(p.dv, p.dv_stride, b, hk, 0), p.dv_stride[2],
                   first, p.seqlen_k, lane);
}

// ---- the forward on sm_90: warpgroup matrix products ----------------------------------------
//
// WGMMA: each warpgroup (4 warps) owns 64 query rows, rotated once in shared memory and loaded
// from there as the A operand (registers) of every tile's S = Q K^T; the tensor cores read key
// and value tiles from shared memory through matrix descriptors. STAGES tiles of BLOCK_N keys (and values) are in shared memory, STAGES - 1 of
// them arriving, with one barrier per tile:
//   top of tile t: K_{t+S-1}, its table rows and V_{t+S-1} start arriving (cp.async)
//   S = Q K_t^T; masks; online softmax; O += P V_t (issued, runs on)
//   once K_{t+1} landed, each thread rotates the chunks it copied itself (no barrier needed)
//   wait for O; make the shared-memory writes visible to the tensor cores; barrier
// A streamed tile is stored "chunk-major": 16-byte chunk c of row r at (c * BLOCK_N + r) * 16,
// so eight consecutive rows of one chunk form one 128-byte core matrix of the wgmma layout.

namespace wg {

// Operand lists of the wgmma wrappers: accumulators d[N/8][4] as %0.. (N/2 registers), then
// A's four registers, B's descriptor and the transpose flag.
#define ROPE_JIT_WGMMA_D64 \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
    "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
    "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
    "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define ROPE_JIT_WGMMA_REGS64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ROPE_JIT_WGMMA_ARGS64 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
#define ROPE_JIT_WGMMA_D128 \
    ROPE_JIT_WGMMA_D64, \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
    "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
    "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define ROPE_JIT_WGMMA_REGS128 \
    ROPE_JIT_WGMMA_REGS64 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ROPE_JIT_WGMMA_ARGS128 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"

// One wgmma with A in registers (a), B by descriptor (b), the accumulators d, scale-d true;
// SHAPE_TYPES names shape and types, N selects the operand lists above.
#define ROPE_JIT_WGMMA(SHAPE_TYPES, N)                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES " {" \
                 ROPE_JIT_WGMMA_REGS##N ROPE_JIT_WGMMA_ARGS##N                                        \
                 : ROPE_JIT_WGMMA_D##N                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B))

template <int TRANS_B, int D = DTYPE>
__device__ __forceinline__ void wgmma_n64(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b) {
    if constexpr (D == 1) ROPE_JIT_WGMMA("m64n64k16.f32.f16.f16", 64);
    else ROPE_JIT_WGMMA("m64n64k16.f32.bf16.bf16", 64);
}

template <int TRANS_B, int D = DTYPE>
__device__ __forceinline__ void wgmma_n128(float (&d)[16][4], const unsigned (&a)[4], unsigned long long b) {
    if constexpr (D == 1) ROPE_JIT_WGMMA("m64n128k16.f32.f16.f16", 128);
    else ROPE_JIT_WGMMA("m64n128k16.f32.bf16.bf16", 128);
}

// d (64 x N over the warpgroup) += A (registers, 64 x 16) * B (shared memory, 16 x N);
// TRANS_B: B is stored N-major (values) rather than K-major (keys).
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma(float (&d)[N / 8][4], const unsigned (&a)[4], unsigned long long b) {
    static_assert(N == 64 || N == 128, "wgmma tiles of 64 or 128 columns");
    if constexpr (N == 64) wgmma_n64<TRANS_B>(d, a, b);
    else wgmma_n128<TRANS_B>(d, a, b);
}

// The same with A from shared memory too (descriptor a), neither operand transposed.
#define ROPE_JIT_WGMMA_SS_ARGS64 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
#define ROPE_JIT_WGMMA_SS_ARGS128 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
#define ROPE_JIT_WGMMA_SS(SHAPE_TYPES, N)                                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES " {" \
                 ROPE_JIT_WGMMA_REGS##N ROPE_JIT_WGMMA_SS_ARGS##N                                     \
                 : ROPE_JIT_WGMMA_D##N                                                                \
                 : "l"(a), "l"(b))

// d (64 x N over the warpgroup) += A (shared memory, 64 x 16, K-major) * B (shared memory,
// 16 x N, K-major).
template <int N, int D = DTYPE>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], unsigned long long a, unsigned long long b) {
    static_assert(N == 64 || N == 128, "wgmma tiles of 64 or 128 columns");
    if constexpr (N == 64) {
        if constexpr (D == 1) ROPE_JIT_WGMMA_SS("m64n64k16.f32.f16.f16", 64);
        else ROPE_JIT_WGMMA_SS("m64n64k16.f32.bf16.bf16", 64);
    } else {
        if constexpr (D == 1) ROPE_JIT_WGMMA_SS("m64n128k16.f32.f16.f16", 128);
        else ROPE_JIT_WGMMA_SS("m64n128k16.f32.bf16.bf16", 128);
    }
}

// Orders this thread's register writes before the next wgmma reads them.
__device__ __forceinline__ void fence_operands() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Makes this thread's shared-memory writes (stores and completed cp.async) visible to the
// tensor cores, which read through the async proxy; a barrier must follow.
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A shared-memory matrix descriptor without swizzling: start address, the byte distance of
// core matrices along K (leading) and along M/N (stride), each in 16-byte units.
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading, unsigned stride) {
    return static_cast<unsigned long long>((address >> 4) & 0x3fffu) |
           static_cast<unsigned long long>((leading >> 4) & 0x3fffu) << 16 |
           static_cast<unsigned long long>((stride >> 4) & 0x3fffu) << 32;
}

// The same with 128-byte swizzling (layout type 1 in bits 62-63): the 8-row, 1024-byte
// pattern of swizzled_offset, the distance of its repeats along M/N (stride) and, for
// N-major operands, of 64-element regions (leading).
__device__ __forceinline__ unsigned long long swizzled_descriptor(unsigned address, unsigned leading, unsigned stride) {
    return descriptor(address, leading, stride) | 1ull << 62;
}

constexpr int CHUNK_STRIDE = BLOCK_N * 16;  // bytes between chunk c and c + 1 of a tile row
// Keys (B of S = Q K^T, K-major): the next 16 features are 2 chunks on, 8 rows are 128 bytes.
constexpr unsigned K_LEADING = CHUNK_STRIDE, K_STRIDE = 128, K_STEP = 2 * CHUNK_STRIDE;
// Values (B of O += P V, N-major): the next 8 keys are 128 bytes on, 8 features one chunk.
constexpr unsigned V_LEADING = 128, V_STRIDE = CHUNK_STRIDE, V_STEP = 256;

// SWIZZLED (the producer-warp forward, whose tiles TMA copies): a tile is DP / 64 regions of
// 64 features, each BLOCK_N rows of 128 bytes, and chunk c of row r sits at chunk
// (c ^ r) % 8 of its row (TMA's SWIZZLE_128B, which wgmma reads by swizzled descriptors).
// Copies then move 128-byte rows rather than 16-byte chunks, and eight rows of one chunk
// still fall in eight different banks.
constexpr bool SWIZZLED = PRODUCER_WARPS > 0;
constexpr int REGION_BYTES = BLOCK_N * 128;
static_assert(!SWIZZLED || DP % 64 == 0, "swizzled tiles are whole 64-feature regions");
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
    return (chunk >> 3) * REGION_BYTES + row * 128 + (((chunk ^ row) & 7) << 4);
}
// The descriptors of k-step kk of a key tile (16 features: 32 bytes on within a region) and
// of a value tile (16 keys: 16 rows on).
__device__ __forceinline__ unsigned long long key_descriptor(unsigned tile, int kk) {
    if constexpr (SWIZZLED) return swizzled_descriptor(tile + (kk >> 2) * REGION_BYTES + (kk & 3) * 32, 16, 1024);
    else return descriptor(tile + kk * K_STEP, K_LEADING, K_STRIDE);
}
// The query rows of a warpgroup (A of S = Q K^T, K-major) in the same layout as a 64-row key
// tile: the descriptor of k-step kk.
constexpr int QUERY_REGION_BYTES = 64 * 128;
constexpr int QUERY_GROUP_BYTES = 64 * DP * 2;  // one warpgroup's query rows
__device__ __forceinline__ unsigned long long query_descriptor(unsigned group_tile, int kk) {
    return swizzled_descriptor(group_tile + (kk >> 2) * QUERY_REGION_BYTES + (kk & 3) * 32, 16, 1024);
}
__device__ __forceinline__ unsigned long long value_descriptor(unsigned tile, int kk) {
    if constexpr (SWIZZLED) return swizzled_descriptor(tile + kk * 16 * 128, REGION_BYTES, 1024);
    else return descriptor(tile + kk * V_STEP, V_LEADING, V_STRIDE);
}

// Who loads what of a streamed tile: the tile is cut into units of 8 rows x 4 items (rotation
// items, numbered as in rotate_rows: chunks of interleaved pairs or first-half chunks with their
// partners, then plain chunks; for values, chunks); warp w takes units w, w + WARPS, ... and in
// a unit lane l takes row l % 8 and item l / 8. Each quarter warp then stores 8 consecutive
// rows of one chunk (one 128-byte core matrix: no bank conflicts) and each row is read 64
// bytes at a time (whole 32-byte sectors). The thread that copies a key chunk also rotates
// it, so the rotation needs no barrier after the copies. Rotating items stage the table
// columns of their own pairs: ITEM_TABLE_BYTES per item and table.
constexpr int ROW_UNITS = BLOCK_N / 8;
constexpr int KEY_PASSES = (ROW_UNITS * ((ITEMS + 3) / 4) + WARPS - 1) / WARPS;
constexpr int VALUE_PASSES = (ROW_UNITS * ((CHUNKS + 3) / 4) + WARPS - 1) / WARPS;
constexpr int ITEM_PAIRS = INTERLEAVED ? 4 : 8;
constexpr int ITEM_TABLE_BYTES = ITEM_PAIRS * TABLE_STEP * TBYTES;
static_assert(!WGMMA || !ROTATE || !TABLE_ASYNC || ITEM_TABLE_BYTES % 8 == 0, "staged table pieces of 8 or 16 bytes");

// Row and item of this thread in pass `pass` over a tile of `items` items per row; false past
// the tile.
__device__ __forceinline__ bool unit_slot(int pass, int items, int* row, int* item) {
    const int unit = static_cast<int>(threadIdx.x >> 5) + WARPS * pass, lane = threadIdx.x & 31;
    *row = (unit % ROW_UNITS) * 8 + (lane & 7);
    *item = (unit / ROW_UNITS) * 4 + (lane >> 3);
    return unit < ROW_UNITS * ((items + 3) / 4) && *item < items;
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 8 : 0)
                 : "memory");
}

// Starts copying key rows [n0, n0 + BLOCK_N) into `tile` (chunk-major, zero past Sk and past
// head_dim), with the table columns of each rotating item.
template <int D = DTYPE>
__device__ __forceinline__ void copy_key_chunks(char* tile, char* cos_stage, char* sin_stage,
                                               const AttentionKernelParams& p, const T* k_head, long long n0) {
#pragma unroll
    for (int pass = 0; pass < KEY_PASSES; ++pass) {
        int row, k;
        if (!unit_slot(pass, ITEMS, &row, &k)) continue;
        const long long token = n0 + row;
        const bool ok = token < p.seqlen_k;
        const T* src = k_head + (ok ? token : 0) * p.k_stride[2];
        char* const dst = tile + row * 16;
        if (k < ROT_ITEMS) {
            cp_async16(dst + k * CHUNK_STRIDE, src + k * 8, ok);
            if constexpr (!INTERLEAVED)
                cp_async16(dst + (k + ROTARY_DIM / 16) * CHUNK_STRIDE, src + (k + ROTARY_DIM / 16) * 8, ok);
            if constexpr (TABLE_ASYNC) {
                // The item's table columns start k * ITEM_TABLE_BYTES into the token's rows.
                const char* cos_src =
                    static_cast<const char*>(p.cos) + (ok ? token : 0) * p.cos_stride[0] * TBYTES + k * ITEM_TABLE_BYTES;
                const char* sin_src =
                    static_cast<const char*>(p.sin) + (ok ? token : 0) * p.sin_stride[0] * TBYTES + k * ITEM_TABLE_BYTES;
                char* cos_dst = cos_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
                char* sin_dst = sin_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
                if constexpr (ITEM_TABLE_BYTES == 8) {
                    cp_async8(cos_dst, cos_src, ok);
                    cp_async8(sin_dst, sin_src, ok);
                } else {
#pragma unroll
                    for (int piece = 0; piece < ITEM_TABLE_BYTES; piece += 16) {
                        cp_async16(cos_dst + piece, cos_src + piece, ok);
                        cp_async16(sin_dst + piece, sin_src + piece, ok);
                    }
                }
            }
        } else {
            const int ch = FIRST_PLAIN + (k - ROT_ITEMS);
            cp_async16(dst + ch * CHUNK_STRIDE, src + (ch < DCHUNKS ? ch : 0) * 8, ok && ch < DCHUNKS);
        }
    }
}

// Rotates, in place, the key chunks this thread copied with copy_key_chunks, once its own
// copies completed (no other thread touches them).
template <int D = DTYPE>
__device__ __forceinline__ void rotate_key_chunks(char* tile, const char* cos_stage, const char* sin_stage,
                                                const AttentionKernelParams& p, long long n0) {
    if constexpr (ROTATE) {
#pragma unroll
        for (int pass = 0; pass < KEY_PASSES; ++pass) {
            int row, k;
            if (!unit_slot(pass, ITEMS, &row, &k) || k >= ROT_ITEMS) continue;
            const long long token = n0 + row;
            if (token >= p.seqlen_k) continue;  // zero rows; the tables may not reach them
            // Staged angles: this item's own columns (row 0 of its stage, pairs from 0).
            const char* cos_rows = cos_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
            const char* sin_rows = sin_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
            const int pair0 = TABLE_ASYNC ? 0 : k * ITEM_PAIRS;
            U4* xa = reinterpret_cast<U4*>(tile + row * 16 + k * CHUNK_STRIDE);
            if constexpr (INTERLEAVED) {
                U4 x = *xa;
                rotate_pairs_chunk<TABLE_ASYNC>(x, p, cos_rows, sin_rows, 0, token, pair0);
                *xa = x;
            } else {
                U4* xb = reinterpret_cast<U4*>(tile + row * 16 + (k + ROTARY_DIM / 16) * CHUNK_STRIDE);
                U4 a = *xa, bb = *xb;
                rotate_halves_chunks<TABLE_ASYNC>(a, bb, p, cos_rows, sin_rows, 0, token, pair0);
                *xa = a;
                *xb = bb;
            }
        }
    }
}

// Starts copying value rows [n0, n0 + BLOCK_N) into `tile` (chunk-major).
template <int D = DTYPE>
__device__ __forceinline__ void copy_value_chunks(char* tile, const AttentionKernelParams& p, const T* v_head,
                                                 long long n0) {
#pragma unroll
    for (int pass = 0; pass < VALUE_PASSES; ++pass) {
        int row, ch;
        if (!unit_slot(pass, CHUNKS, &row, &ch)) continue;
        const long long token = n0 + row;
        const bool ok = token < p.seqlen_k && ch < DCHUNKS;
        cp_async16(tile + row * 16 + ch * CHUNK_STRIDE, v_head + (ok ? token * p.v_stride[2] + ch * 8 : 0), ok);
    }
}

// Compiler-level fences on registers a wgmma reads or writes asynchronously: the empty asm
// "modifies" them, so no use of an accumulator moves above the wait before it, and no input
// register is reused before the wait after it.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(r[i][0]), "+f"(r[i][1]), "+f"(r[i][2]), "+f"(r[i][3])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

// One key tile for a warp's 16 query rows (first row row_first) of a warpgroup whose first row
// is group_first: S = Q K^T on the tensor cores (`q_operand`: this lane's A fragments to reload
// from shared memory, or with SWIZZLED the warpgroup's swizzled query rows, which the tensor
// cores read themselves; the rotated keys in key_tile), the masks and the online softmax, then O += P V (values in
// value_tile) issued with P in `pa`. The caller waits for that product (wgmma wait) before it
// reads `o` or lets go of `pa`, so it may overlap other work with it. Both wgmma forwards run
// their tiles through here.
template <int PSTEPS, int D = DTYPE>
__device__ __forceinline__ void attend_tile(float (&o)[DTILES][4], unsigned (&pa)[PSTEPS][4],
                                            float (&row_max)[2], float (&row_sum)[2], unsigned q_operand,
                                            const char* key_tile, const char* value_tile,
                                            const AttentionKernelParams& p, long long b, long long row_first,
                                            long long group_first, long long n0, int lane) {
    constexpr int NT = BLOCK_N / 8;
    static_assert(PSTEPS == NT / 2, "P fragments: one per 16 keys of the tile");
    float s[NT][4];
    zero(s);
    const unsigned k_address = shared_address(key_tile);
    if constexpr (SWIZZLED) {
        fence_registers(s);
        __syncwarp();  // wgmma instructions are warp-aligned: every lane at the same one
        fence_operands();
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
            wgmma_ss<BLOCK_N>(s, query_descriptor(q_operand, kk), key_descriptor(k_address, kk));
        commit();
        wait_all();
        fence_registers(s);
    } else {
        unsigned qa[KSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qa[kk], q_operand + kk * 32);
        fence_registers(s);
        __syncwarp();
        fence_operands();
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) wgmma<BLOCK_N, 0>(s, qa[kk], key_descriptor(k_address, kk));
        commit();
        wait_all();
        fence_registers(s);
        fence_registers(qa);
    }

    // Tiles inside the sequence and below the diagonal need no mask: the softmax then applies
    // the scale itself, in the exponent's multiply-add. The choice is the same for the whole
    // warpgroup (its first row decides), whose warps must meet at the same wgmma.
    const bool check_bounds = n0 + BLOCK_N > p.seqlen_k;
    const bool check_causal = CAUSAL && n0 + BLOCK_N - 1 > group_first;
    float scale = p.scale_log2;
    if (check_bounds || check_causal || MASK_KIND != 0 || !(scale > 0.f)) {
        scale_and_mask<NT, false>(s, p, b, row_first, n0, check_bounds, check_causal, lane);
        scale = 1.f;
    }
    online_softmax<NT>(s, row_max, row_sum, o, scale);
    to_a_fragments<NT>(pa, s);

    fence_registers(o);
    fence_registers(pa);
    __syncwarp();
    fence_operands();
    const unsigned v_address = shared_address(value_tile);
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) wgmma<DP, 1>(o, pa[kk], value_descriptor(v_address, kk));
    commit();
}

template <int D = DTYPE>
__device__ void forward(const AttentionKernelParams& p, char* smem) {
    static_assert(WARPS % 4 == 0 && M_TILES == 1 && !HAS_POS_MASK, "warpgroups of 16-row warps, no pos_mask");
    static_assert(STAGES == 2 || STAGES == 3, "two or three tiles in shared memory");
    const Buffers m = carve(smem);
    // Tile t lives in buffer t % STAGES; its table rows in stage t % (STAGES - 1).
    constexpr int TILE_BYTES = BLOCK_N * DP * 2, TABLE_STAGE_BYTES = BLOCK_N * TABLE_ROW_BYTES;
    auto key_tile = [&](int t) { return smem + SMEM.k + (t % STAGES) * TILE_BYTES; };
    auto value_tile = [&](int t) { return smem + SMEM.v0 + (t % STAGES) * TILE_BYTES; };
    auto cos_stage = [&](int t) { return smem + SMEM.cos_stage + (t % (STAGES - 1)) * TABLE_STAGE_BYTES; };
    auto sin_stage = [&](int t) { return smem + SMEM.sin_stage + (t % (STAGES - 1)) * TABLE_STAGE_BYTES; };
    // Starts tile t's copies (keys with their table rows, values) as one copy group.
    auto issue_tile = [&](int t, const T* k_head, const T* v_head) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        copy_key_chunks(key_tile(t), cos_stage(t), sin_stage(t), p, k_head, n0);
        copy_value_chunks(value_tile(t), p, v_head, n0);
    };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const auto [b, h, m0, q_head, k_head, v_head, tiles] = query_block(p);

    // Copy groups: the queries with tile 0, then one per tile (empty past the last), so that
    // "all but the newest STAGES - 2 groups" is always "up to the next tile".
    issue_rows<RESIDENT>(m.q, q_head, p.q_stride[2], m0, p.seqlen_q);
    if (tiles > 0) issue_tile(0, k_head, v_head);
    cp_async_commit();
#pragma unroll
    for (int t = 1; t < STAGES - 1; ++t) {
        if (t < tiles) issue_tile(t, k_head, v_head);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    if (tiles > 0) rotate_key_chunks(key_tile(0), cos_stage(0), sin_stage(0), p, 0);
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0, p.seqlen_q);
    fence_async_proxy();
    __syncthreads();

    // This warp's 16 rotated query rows stay in shared memory; each tile reloads them as A
    // fragments. (Held in registers across the loop, ptxas 13.0 gave the fragments' registers
    // to the P fragments of the same shape (head_dim == BLOCK_N), and the second tile
    // multiplied P by K.)
    const unsigned q_fragments = shared_address(m.q + warp * 16 * ROWE) + a_lane_offset(lane);
    const long long row_first = m0 + warp * 16;
    float o[DTILES][4];
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    zero(o);
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        if (t + STAGES - 1 < tiles) issue_tile(t + STAGES - 1, k_head, v_head);
        cp_async_commit();

        unsigned pa[BLOCK_N / 16][4];
        attend_tile(o, pa, row_max, row_sum, q_fragments, key_tile(t), value_tile(t), p, b, row_first,
                    m0 + (warp >> 2) * 64, n0, lane);

        cp_async_wait<STAGES - 2>();  // tile t + 1
        if (t + 1 < tiles) rotate_key_chunks(key_tile(t + 1), cos_stage(t + 1), sin_stage(t + 1), p, n0 + BLOCK_N);
        __syncwarp();  // the rotation branches per lane; the wait is warp-aligned
        wait_all();
        fence_registers(o);
        fence_registers(pa);
        fence_async_proxy();
        __syncthreads();
    }
    finish_rows(o, row_max, row_sum, m.q + warp * 16 * ROWE, p, b, h, row_first, lane);
}

// ---- the warp-specialized forward: producer warps load and rotate, consumers compute ----
//
// PRODUCER_WARPS (4) warps after the WARPS consumer warps fill STAGES key/value buffers; the
// consumers (warpgroups of 64 query rows, as in forward) wait for a tile's keys (`full`) and
// values (`landed`), compute, and signal `empty` when they are done with its buffers. No
// block-wide barrier in the loop: the consumer warpgroups drift apart, so one's softmax
// overlaps another's tensor-core work, and loading and rotating overlap both. The tensor cores
// read everything from shared memory: the rotated query rows (q_tile), keys and values, all
// 128-byte swizzled (SWIZZLED).
//
// Values arrive through the tensor memory accelerator (TMA): one copy per 64-feature region
// of a tile lands its rows swizzled, zero past the sequence and past head_dim, and signals the
// buffer's `landed` barrier by bytes. Keys go through the producers' registers, rotated there
// (below), and the producers arrive on `full` once they are stored. (Copied 16 bytes a thread,
// or by TMA one 16-byte chunk column at a time, the tiles cost more L2 requests than the
// tensor cores need time: that bound the forward.)
//
// CLUSTER > 1: the CLUSTER blocks of a thread-block cluster are consecutive query heads of
// one GQA group (same keys, same query rows). Each block copies only its share of every value
// tile's rows (SHARE_ROWS of them), multicast into the buffers of every block, so values cross
// from L2 once per cluster. A buffer is free again once the consumers of every block are done
// with it: `empty` counts them all.
constexpr int PRODUCER_THREADS = PRODUCER_WARPS * 32;
constexpr int SHARE_ROWS = BLOCK_N / CLUSTER;      // key rows of a tile each block copies
constexpr int TILE_BOXES = DP / 64;                // TMA copies of one value tile
// Swizzled TMA boxes land where the pattern starts: tile buffers at multiples of 1024 bytes
// (the shares of 8-row multiples are too).
static_assert(PRODUCER_WARPS == 0 || (SMEM.k % 1024 == 0 && SMEM.v0 % 1024 == 0 && SMEM.q_tile % 1024 == 0),
              "swizzled tiles 1024-byte aligned");
static_assert(CLUSTER == 1 || (PRODUCER_WARPS > 0 && SHARE_ROWS % 8 == 0 && GQA_GROUP % CLUSTER == 0),
              "clusters of producer blocks over whole 8-row shares of a GQA group");

// mbarrier operations on 8-byte barriers in shared memory (addresses from shared_address, or
// shared::cluster addresses from cluster_address for the remote arrive).
__device__ __forceinline__ void barrier_init(unsigned address, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned address) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(address) : "memory");
}
// Arrives, and expects `bytes` more of asynchronous copies in the current phase.
__device__ __forceinline__ void barrier_arrive_expect(unsigned address, unsigned bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(address),
                 "r"(bytes)
                 : "memory");
}
// Arrives on the barrier at `address` (shared::cluster, possibly another block's), releasing
// this thread's earlier writes at cluster scope.
__device__ __forceinline__ void barrier_arrive_cluster(unsigned address) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(address) : "memory");
}
// Waits until the phase of parity `parity` (the barrier's n-th completion has parity n & 1)
// has completed; with CLUSTER > 1 acquiring at cluster scope (arrivals and copies come from
// other blocks too).
__device__ __forceinline__ void barrier_wait(unsigned address, unsigned parity) {
    if constexpr (CLUSTER > 1)
        asm volatile(
            "{\n.reg .pred done;\nretry:\n"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra retry;\n}\n" ::"r"(address),
            "r"(parity)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred done;\nretry:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra retry;\n}\n" ::"r"(address),
            "r"(parity)
            : "memory");
}
// A barrier among the consumer warps.
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory"); }

// Thread-block cluster helpers: this block's rank, the shared::cluster address of a shared
// address in block `rank`, and a barrier of every thread of the cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ unsigned cluster_address(unsigned address, unsigned rank) {
    unsigned mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Copies one box of a [B, H, S, D] tensor (`map`: its TMA descriptor, in the kernel's
// parameters) from feature `feature`, token `token` of head `head`, batch `batch` into shared
// `dst`, counting its bytes on `landed`; with CLUSTER > 1 into the same place of every block.
__device__ __forceinline__ void copy_box(unsigned dst, const void* map, int feature, int token, int head, int batch,
                                         unsigned landed) {
    const unsigned long long descriptor = reinterpret_cast<unsigned long long>(map);
    if constexpr (CLUSTER > 1)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
            "l"(descriptor), "r"(feature), "r"(token), "r"(head), "r"(batch), "r"(landed),
            "h"(static_cast<unsigned short>((1u << CLUSTER) - 1u))
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
            "l"(descriptor), "r"(feature), "r"(token), "r"(head), "r"(batch), "r"(landed)
            : "memory");
}

// The pipeline's shared state: buffers and barriers (this block's shared addresses), and the
// shared::cluster address of this block's shared memory in each block of the cluster.
struct Pipeline {
    char* smem;
    unsigned landed, full, empty;
    unsigned window[CLUSTER];

    static constexpr int TILE_BYTES = BLOCK_N * DP * 2;
    __device__ __forceinline__ char* key_tile(int t) const { return smem + SMEM.k + (t % STAGES) * TILE_BYTES; }
    __device__ __forceinline__ char* value_tile(int t) const { return smem + SMEM.v0 + (t % STAGES) * TILE_BYTES; }
    __device__ __forceinline__ unsigned landed_of(int t) const { return landed + (t % STAGES) * 8; }
    __device__ __forceinline__ unsigned full_of(int t) const { return full + (t % STAGES) * 8; }
    __device__ __forceinline__ unsigned empty_of(int t) const { return empty + (t % STAGES) * 8; }
    // The parity of tile t's phase of its buffer's barriers (tile t is their (t / STAGES)-th use).
    __device__ __forceinline__ static unsigned phase_of(int t) { return static_cast<unsigned>(t / STAGES) & 1u; }
    // Block `rank`'s address of this block's shared `address`.
    __device__ __forceinline__ unsigned in_block(unsigned address, int rank) const {
        return window[rank] + (address - shared_address(smem));
    }
};

// ---- the producers' keys: through registers, rotated on the way ----
//
// Each producer thread loads its items of the next key tile (key chunks and table columns)
// from global memory into registers while the consumers work on earlier tiles, then rotates
// them there and stores them into the tile's buffer: shared memory sees each key once,
// written, and then only the tensor cores' reads. (Landed by TMA and rotated in place, a tile
// was read and written back once more, beside staged table rows written and read: that
// traffic competed with the tensor cores for shared memory and bound the forward.)
// A thread keeps one item number (items numbered as in rotate_rows) in every row it takes:
// ITEM_SLOTS consecutive threads cover a row (those past ITEMS idle), eight of them reading 128
// consecutive bytes, and a pass of the producers covers ROWS_PER_PASS rows. Rows a pass apart
// are a multiple of 8 apart, so a thread's swizzle pattern, its table columns and its address
// steps are the same in every row: the producers compute addresses once per tile, not per
// item. (The producers, one warp beside two consumer warps on each scheduler, are the
// forward's critical path: instructions they save are time.)
constexpr int ITEM_SLOTS = ITEMS <= 4 ? 4 : ITEMS <= 8 ? 8 : ITEMS <= 16 ? 16 : 32;
constexpr int ROWS_PER_PASS = PRODUCER_THREADS > 0 ? PRODUCER_THREADS / ITEM_SLOTS : 1;
constexpr int KEY_LOADS = PRODUCER_WARPS > 0 ? BLOCK_N / ROWS_PER_PASS : 1;  // rows per thread and tile
static_assert(PRODUCER_WARPS == 0 || (ITEMS <= 32 && ROWS_PER_PASS % 8 == 0 && BLOCK_N % ROWS_PER_PASS == 0),
              "producer passes of whole 8-row swizzle patterns");
// Raw table bits of one rotation item's ITEM_PAIRS pairs: the columns' bytes as they are
// (TABLE_STEP 1), or one word per pair, a 16-bit value in its low half (TABLE_STEP 2: every
// other column). Kept raw so that no instruction waits for the loads before the tile's turn.
constexpr int ITEM_WORDS = TABLE_STEP == 1 ? ITEM_PAIRS * TBYTES / 4 : ITEM_PAIRS;
static_assert(TABLE_STEP == 2 || ITEM_WORDS == 2 || ITEM_WORDS % 4 == 0, "table pieces of 8 bytes or whole 16");

__device__ __forceinline__ U4 load_global16(const void* at) {
    U4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
                 : "l"(at));
    return v;
}

// The raw table bits of an item's pairs (`at`: the first one's column in its table row).
__device__ __forceinline__ void load_item_table(unsigned (&words)[ITEM_WORDS], const char* at) {
    if constexpr (TABLE_STEP == 2) {
#pragma unroll
        for (int e = 0; e < ITEM_PAIRS; ++e) {
            if constexpr (TBYTES == 4) asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(words[e]) : "l"(at + 8 * e));
            else asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=r"(words[e]) : "l"(at + 4 * e));
        }
    } else if constexpr (ITEM_WORDS % 4 == 0) {
#pragma unroll
        for (int v = 0; v < ITEM_WORDS / 4; ++v) {
            const U4 w = load_global16(at + 16 * v);
#pragma unroll
            for (int e = 0; e < 4; ++e) words[4 * v + e] = w.w[e];
        }
    } else {
        asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(words[0]), "=r"(words[1]) : "l"(at));
    }
}

// The angle (cos or sin) of pair e of an item from its raw table bits.
__device__ __forceinline__ float item_angle(const unsigned (&words)[ITEM_WORDS], int e) {
    if constexpr (TBYTES == 4) return __uint_as_float(words[e]);
    else {
        const unsigned bits = TABLE_STEP == 2 ? words[e] : words[e / 2] >> (16 * (e % 2));
        return float_of_bits16<TABLE_DTYPE>(static_cast<unsigned short>(bits & 0xffffu));
    }
}

// What a producer thread loads and where it stores, the same in every tile: its item, the
// byte offsets of its chunks in a key row and of its columns in a table row, its first row in
// a tile and where that row's chunks go in the tile buffer.
struct KeyItems {
    bool active, rotated;
    int row0, store_a, store_b;
    int chunk_a, chunk_b, column;
    long long key_step, cos_step, sin_step;  // bytes between a thread's rows (a pass apart)
};

template <int D = DTYPE>
__device__ __forceinline__ KeyItems key_items(const AttentionKernelParams& p, int thread) {
    KeyItems k;
    const int item = thread % ITEM_SLOTS;
    k.active = item < ITEMS;
    k.rotated = ROTATE && item < ROT_ITEMS;
    k.row0 = thread / ITEM_SLOTS;
    const int chunk = item < ROT_ITEMS ? item : FIRST_PLAIN + item - ROT_ITEMS;
    const int partner = chunk + ROTARY_DIM / 16;  // half style: the chunk of the partners
    k.chunk_a = chunk * 16;
    k.chunk_b = partner * 16;
    k.store_a = swizzled_offset(k.row0, chunk);
    k.store_b = swizzled_offset(k.row0, partner);
    k.column = table_column(item * ITEM_PAIRS) * TBYTES;
    k.key_step = ROWS_PER_PASS * p.k_stride[2] * static_cast<long long>(sizeof(T));
    k.cos_step = ROWS_PER_PASS * p.cos_stride[0] * TBYTES;
    k.sin_step = ROWS_PER_PASS * p.sin_stride[0] * TBYTES;
    return k;
}

struct KeyLoads {
    U4 a[KEY_LOADS], b[KEY_LOADS];  // an item's chunk, and (half style) its partner chunk
    unsigned cos[KEY_LOADS][ITEM_WORDS], sin[KEY_LOADS][ITEM_WORDS];
};

// Starts loading this thread's items of the key tile from token n0: rows past the sequence
// and chunks past head_dim load nothing and stay zero, with zero angles (CHECKED; a tile
// wholly inside the sequence takes the path without the checks).
template <bool CHECKED, int D = DTYPE>
__device__ __forceinline__ void load_keys(KeyLoads& r, const KeyItems& k, const AttentionKernelParams& p,
                                          const T* k_head, long long n0) {
    const long long row = n0 + k.row0;
    const char* key = reinterpret_cast<const char*>(k_head + row * p.k_stride[2]);
    const char* cos = static_cast<const char*>(p.cos) + row * p.cos_stride[0] * TBYTES + k.column;
    const char* sin = static_cast<const char*>(p.sin) + row * p.sin_stride[0] * TBYTES + k.column;
#pragma unroll
    for (int j = 0; j < KEY_LOADS; ++j) {
        const bool valid = !CHECKED || row + j * ROWS_PER_PASS < p.seqlen_k;
        // (Chunks past head_dim are zero in every tile, as the query rows' are.)
        r.a[j] = valid && k.active && k.chunk_a < DCHUNKS * 16 ? load_global16(key + k.chunk_a) : U4{};
        if (CHECKED) {
            r.b[j] = U4{};
#pragma unroll
            for (int e = 0; e < ITEM_WORDS; ++e) r.cos[j][e] = r.sin[j][e] = 0u;
        }
        if (valid && k.rotated) {
            if constexpr (!INTERLEAVED) r.b[j] = load_global16(key + k.chunk_b);
            load_item_table(r.cos[j], cos);
            load_item_table(r.sin[j], sin);
        }
        key += k.key_step;
        cos += k.cos_step;
        sin += k.sin_step;
    }
}

// Rotates this thread's loaded items and stores them into the key tile at `tile`.
template <int D = DTYPE>
__device__ __forceinline__ void store_keys(KeyLoads& r, const KeyItems& k, char* tile) {
    if (!k.active) return;
#pragma unroll
    for (int j = 0; j < KEY_LOADS; ++j) {
        char* const row = tile + j * ROWS_PER_PASS * 128;  // whole swizzle patterns on
        U4 x = r.a[j];
        if (k.rotated) {
            const auto angles = [&](int e, float (&c)[2], float (&s)[2]) {
#pragma unroll
                for (int f = 0; f < 2; ++f) {
                    c[f] = item_angle(r.cos[j], e + f);
                    s[f] = item_angle(r.sin[j], e + f);
                }
            };
            if constexpr (INTERLEAVED) {
                rotate_pair_chunk(x, angles);
            } else {
                U4 y = r.b[j];
                rotate_half_chunks(x, y, angles);
                *reinterpret_cast<U4*>(row + k.store_b) = y;
            }
        }
        *reinterpret_cast<U4*>(row + k.store_a) = x;
    }
}

// Loads tile t's keys: the checked path only for a tile that reaches past the sequence.
template <int D = DTYPE>
__device__ __forceinline__ void load_key_tile(KeyLoads& r, const KeyItems& k, const AttentionKernelParams& p,
                                              const T* k_head, int t) {
    const long long n0 = static_cast<long long>(t) * BLOCK_N;
    if (n0 + BLOCK_N <= p.seqlen_k) load_keys<false>(r, k, p, k_head, n0);
    else load_keys<true>(r, k, p, k_head, n0);
}

// The producers. Values arrive by TMA, issued STAGES - 1 tiles ahead (this block's share of
// each tile's rows). Keys go through the producers' registers one tile ahead: tile t's are
// loaded while tile t - 1's are stored, so their latency overlaps the waits for the
// consumers. A tile's buffer is reused once the consumers released the tile STAGES before.
template <int D = DTYPE>
__device__ void produce(const Pipeline& pipe, const AttentionKernelParams& p, const T* k_head, long long b,
                        long long hk, int tiles, int rank) {
    const int thread = static_cast<int>(threadIdx.x) - THREADS;
    // The TILE_BOXES value boxes of a tile go to lane 0 of each producer warp in turn, then
    // lane 1, ...
    const int box = (thread & 31) * PRODUCER_WARPS + (thread >> 5);
    auto issue_values = [&](int t) {
        if (thread == 0) barrier_arrive_expect(pipe.landed_of(t), Pipeline::TILE_BYTES);
        if (box < TILE_BOXES)
            copy_box(shared_address(pipe.value_tile(t) + swizzled_offset(rank * SHARE_ROWS, box * 8)), p.v_map, box * 64,
                     t * BLOCK_N + rank * SHARE_ROWS, static_cast<int>(hk), static_cast<int>(b), pipe.landed_of(t));
    };
    for (int t = 0; t < STAGES - 1 && t < tiles; ++t) issue_values(t);
    const KeyItems items = key_items(p, thread);
    KeyLoads keys;
    if (tiles > 0) load_key_tile(keys, items, p, k_head, 0);
    for (int t = 0; t < tiles; ++t) {
        if (t >= STAGES) barrier_wait(pipe.empty_of(t - STAGES), Pipeline::phase_of(t - STAGES));
        store_keys(keys, items, pipe.key_tile(t));
        fence_async_proxy();  // the keys, for the tensor cores
        barrier_arrive(pipe.full_of(t));
        if (t + 1 < tiles) load_key_tile(keys, items, p, k_head, t + 1);
        const int next = t + STAGES - 1;
        if (next < tiles) {
            if (t >= 1) barrier_wait(pipe.empty_of(t - 1), Pipeline::phase_of(t - 1));
            issue_values(next);
        }
    }
}

template <int D = DTYPE>
__device__ void forward_specialized(const AttentionKernelParams& p, char* smem) {
    static_assert(WARPS % 4 == 0 && PRODUCER_WARPS == 4 && M_TILES == 1 && !HAS_POS_MASK,
                  "consumer warpgroups of 16-row warps, one producer warpgroup, no pos_mask");
    static_assert(STAGES == 2 || STAGES == 3, "two or three tiles in shared memory");
    static_assert(TABLE_ASYNC || !ROTATE, "the producers load table columns in 8- or 16-byte pieces");
    const Buffers m = carve(smem);
    Pipeline pipe;
    pipe.smem = smem;
    pipe.landed = shared_address(smem + SMEM.barriers);
    pipe.full = pipe.landed + STAGES * 8;
    pipe.empty = pipe.full + STAGES * 8;
    const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0u;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) pipe.window[r] = CLUSTER > 1 ? cluster_address(shared_address(smem), r) : 0u;
    const auto [b, h, m0, q_head, k_head, v_head, tiles] = query_block(p);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(pipe.landed + s * 8, 1);
            barrier_init(pipe.full + s * 8, PRODUCER_THREADS);
            barrier_init(pipe.empty + s * 8, CLUSTER * THREADS);
        }
        // The initialized barriers, visible to the TMA unit (async proxy) and, in a cluster, to
        // the other blocks.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // The last barrier of the whole block (cluster): producers and consumers part here, and
    // no block writes into another before that one's barriers exist.
    if constexpr (CLUSTER > 1) cluster_sync();
    else __syncthreads();

    if (threadIdx.x >= THREADS) {
        produce(pipe, p, k_head, b, h / GQA_GROUP, tiles, static_cast<int>(rank));
        if constexpr (CLUSTER > 1) cluster_sync();  // no block exits while another may still use it
        return;
    }

    // Consumers: the block's query rows, rotated, then the key tiles as they come.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    issue_rows<RESIDENT>(m.q, q_head, p.q_stride[2], m0, p.seqlen_q);
    cp_async_commit();
    cp_async_wait_all();
    consumer_sync();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0, p.seqlen_q);
    consumer_sync();
    // The rotated rows once more, swizzled, where the tensor cores read them: warpgroup g's
    // 64 rows as a 64-row key tile would be.
    char* const q_tile = smem + SMEM.q_tile;
    for (int it = threadIdx.x; it < RESIDENT * CHUNKS; it += THREADS) {
        const int row = it / CHUNKS, chunk = it % CHUNKS;
        *reinterpret_cast<U4*>(q_tile + (row >> 6) * QUERY_GROUP_BYTES + (chunk >> 3) * QUERY_REGION_BYTES +
                               (row & 63) * 128 + (((chunk ^ row) & 7) << 4)) =
            *reinterpret_cast<const U4*>(m.q + row * ROWE + chunk * 8);
    }
    fence_async_proxy();
    consumer_sync();

    const unsigned q_group_tile = shared_address(q_tile + (warp >> 2) * QUERY_GROUP_BYTES);
    const long long row_first = m0 + warp * 16;
    const long long group_first = m0 + (warp >> 2) * 64;  // this warpgroup's first query row
    float o[DTILES][4];
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    zero(o);
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        barrier_wait(pipe.full_of(t), Pipeline::phase_of(t));    // keys stored
        barrier_wait(pipe.landed_of(t), Pipeline::phase_of(t));  // values landed
        // A causal warpgroup whose rows all end before the tile skips it (it still releases
        // the buffer: every consumer arrives once per tile).
        if (!CAUSAL || n0 <= group_first + 63) {
            unsigned pa[BLOCK_N / 16][4];
            attend_tile(o, pa, row_max, row_sum, q_group_tile, pipe.key_tile(t), pipe.value_tile(t), p, b, row_first,
                        group_first, n0, lane);
            wait_all();
            fence_registers(o);
            fence_registers(pa);
        }
        if constexpr (CLUSTER > 1) {
#pragma unroll
            for (int r = 0; r < CLUSTER; ++r) barrier_arrive_cluster(pipe.in_block(pipe.empty_of(t), r));
        } else {
            barrier_arrive(pipe.empty_of(t));
        }
    }
    finish_rows(o, row_max, row_sum, m.q + warp * 16 * ROWE, p, b, h, row_first, lane);
    if constexpr (CLUSTER > 1) cluster_sync();
}

}  // namespace wg

}  // namespace tc

}  // namespace

// The preamble defines ROPE_JIT_CLUSTER_DIMS as __cluster_dims__(CLUSTER, 1, 1) for clusters
// of more than one block (sm_90 only).
#ifndef ROPE_JIT_CLUSTER_DIMS
#define ROPE_JIT_CLUSTER_DIMS
#endif

// Two blocks per multiprocessor for the FlashAttention-2 layout of the forward (up to 255
// registers at 128 threads); no constraint otherwise.
extern "C" __global__ void ROPE_JIT_CLUSTER_DIMS __launch_bounds__((WARPS + PRODUCER_WARPS) * 32, TENSOR_CORES && KIND == 0 && M_TILES == 2 && WARPS <= 4 ? 2 : 1)
    attention_kernel(const __grid_constant__ AttentionKernelParams p) {
    if constexpr (TENSOR_CORES) {
        extern __shared__ __align__(1024) char smem[];  // swizzled TMA boxes land 1024-byte aligned
        if constexpr (KIND == 0 && WGMMA && PRODUCER_WARPS > 0) tc::wg::forward_specialized(p, smem);
        else if constexpr (KIND == 0 && WGMMA) tc::wg::forward(p, smem);
        else if constexpr (KIND == 0) tc::forward(p, smem);
        else if constexpr (KIND == 1) tc::backward_dq(p, smem);
        else tc::backward_dkdv(p, smem);
    } else {
        if constexpr (KIND == 0) simt::forward(p);
        else if constexpr (KIND == 1) simt::backward_dq(p);
        else simt::backward_dkdv(p);
    }
}
