// RoPE kernel template. The runtime prepends a block of constexpr specialization constants
// (src/kernel_spec.cpp, KernelSpec::preamble) and compiles this file with NVRTC, without any
// CUDA toolkit header. The constants:
//   DTYPE, TABLE_DTYPE, XPOS_DTYPE, INV_FREQ_DTYPE   0 = float32, 1 = float16, 2 = bfloat16
//   BACKWARD_PASS                                    rotate by -angle (gradients)
//   HEAD_DIM, ROTARY_DIM, ROTARY_OFFSET              features; [OFFSET, OFFSET+DIM) rotate
//   INTERLEAVED                                      pairs (2i, 2i+1), else (i, i + R/2)
//   HAS_K, GQA_GROUP                                 k present; Hq = GQA_GROUP * Hk
//   POSITION_MODE                                    0 implicit, 1 per-token, 2 seqlen offsets
//   HAS_ROPE_INDICES                                 POSITION_MODE == 1
//   PACKED                                           sequences delimited by cu_seqlens
//   POSITIONS_INT64, SEQLEN_OFFSETS_INT64, CU_SEQLENS_INT64
//   ANGLES_FROM_INV_FREQ, TABLE_FULL                 angle source; table [P, R] vs [P, R/2]
//   HAS_XPOS, K_OWN_ANGLES                           k needs its own cos/sin (xPos, q offset)
//   IN_PLACE_Q, IN_PLACE_K                           outputs alias inputs (skip the copy)
//   VEC, VEC_LOADS                                   elements per access; aligned vector I/O
//   BLOCK_THREADS
//
// A block owns `tokens_per_block` consecutive tokens. It resolves their table rows once,
// computes or reads their cos/sin once into shared memory, then rotates every q and k head
// of those tokens from there: the tables are read once per token, not once per head.

#include "rope_params.h"

namespace {

constexpr int PAIRS = ROTARY_DIM / 2;
constexpr int ROLES = K_OWN_ANGLES ? 2 : 1;             // angle sets per token (q, and k)
constexpr int PAIRS_PER_ITEM = INTERLEAVED ? VEC / 2 : VEC;
constexpr int CHUNKS = PAIRS / PAIRS_PER_ITEM;          // work items per head
static_assert(PAIRS % PAIRS_PER_ITEM == 0, "the vector width must divide the pairs");
static_assert(!INTERLEAVED || VEC % 2 == 0, "interleaved items hold whole pairs");

// ---- element types --------------------------------------------------------------------

template <int DT> struct Storage { using type = unsigned short; };
template <> struct Storage<0> { using type = float; };

__device__ __forceinline__ float to_float(float v) { return v; }

template <int DT>
__device__ __forceinline__ float to_float16bits(unsigned short v) {
    if (DT == 1) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    return __uint_as_float(static_cast<unsigned>(v) << 16);  // bfloat16: the upper half
}

template <int DT>
__device__ __forceinline__ float load_float(const void* base, long long index) {
    if (DT == 0) return static_cast<const float*>(base)[index];
    return to_float16bits<DT>(static_cast<const unsigned short*>(base)[index]);
}

template <int DT>
__device__ __forceinline__ typename Storage<DT>::type from_float(float v) {
    if constexpr (DT == 0) {
        return v;
    } else if constexpr (DT == 1) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    } else {
        // Round to nearest even, keeping NaN a (quiet) NaN; written out so it needs no sm_80.
        unsigned bits = __float_as_uint(v);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
        bits += 0x7fffu + ((bits >> 16) & 1u);
        return static_cast<unsigned short>(bits >> 16);
    }
}

template <int DT>
__device__ __forceinline__ float storage_to_float(typename Storage<DT>::type v) {
    if constexpr (DT == 0) return v;
    else return to_float16bits<DT>(v);
}

using T = typename Storage<DTYPE>::type;

template <int N>
struct alignas(N * sizeof(T)) Pack {
    T v[N];
};

// N consecutive features of one head starting at `x`; one vector access when the host
// proved alignment and unit stride (VEC_LOADS), else N scalar accesses at `stride`.
template <int N>
__device__ __forceinline__ Pack<N> load_pack(const T* x, long long stride) {
    Pack<N> pack;
    if (VEC_LOADS) {
        pack = *reinterpret_cast<const Pack<N>*>(x);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) pack.v[j] = x[j * stride];
    }
    return pack;
}

template <int N>
__device__ __forceinline__ void store_pack(T* y, long long stride, const Pack<N>& pack) {
    if (VEC_LOADS) {
        *reinterpret_cast<Pack<N>*>(y) = pack;
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) y[j * stride] = pack.v[j];
    }
}

// ---- positions --------------------------------------------------------------------------

template <bool IS64>
__device__ __forceinline__ long long load_index(const void* base, long long index) {
    if (IS64) return static_cast<const long long*>(base)[index];
    return static_cast<const int*>(base)[index];
}

// The table row of token (b, s) of q or k: positions, else s + seqlen_offsets[sequence],
// else s + position_offset (+ q_position_offset for q). Packed batches find their sequence
// in cu_seqlens and restart s at 0 in each.
__device__ long long table_row(const RopeKernelParams& p, long long b, long long s, bool is_k) {
    long long sequence = b, index = s;
    if (PACKED) {
        long long lo = 0, hi = p.num_sequences - 1;  // last sequence whose start <= s
        while (lo < hi) {
            const long long mid = (lo + hi + 1) / 2;
            if (load_index<CU_SEQLENS_INT64>(p.cu_seqlens, mid * p.cu_seqlens_stride) <= s) lo = mid;
            else hi = mid - 1;
        }
        sequence = lo;
        index = s - load_index<CU_SEQLENS_INT64>(p.cu_seqlens, lo * p.cu_seqlens_stride);
    }
    if (POSITION_MODE == 1)
        return load_index<POSITIONS_INT64>(p.positions, b * p.positions_stride[0] + s * p.positions_stride[1]);
    if (POSITION_MODE == 2)
        return index + load_index<SEQLEN_OFFSETS_INT64>(p.seqlen_offsets, sequence * p.seqlen_offsets_stride);
    return index + p.position_offset + (is_k ? 0 : p.q_position_offset);
}

__device__ __forceinline__ long long table_column(int pair) {
    return TABLE_FULL && INTERLEAVED ? 2 * pair : pair;
}

// cos and sin of one pair at one table row, with the backward sign and xPos folded in.
__device__ void pair_angle(const RopeKernelParams& p, long long row, int pair, bool is_k, float* c, float* s) {
    if (ANGLES_FROM_INV_FREQ) {
        // fp64 keeps p * inv_freq exact far beyond fp32's 2^24 positions; the reduction inside
        // sincos is then exact too.
        const double angle = double(row) * double(load_float<INV_FREQ_DTYPE>(p.inv_freq, pair * p.inv_freq_stride));
        double sd, cd;
        sincos(angle, &sd, &cd);
        *c = float(cd);
        *s = float(sd);
    } else {
        const long long col = table_column(pair);
        *c = load_float<TABLE_DTYPE>(p.cos, row * p.cos_stride[0] + col * p.cos_stride[1]);
        *s = load_float<TABLE_DTYPE>(p.sin, row * p.sin_stride[0] + col * p.sin_stride[1]);
    }
    if (BACKWARD_PASS) *s = -*s;
    if (HAS_XPOS) {
        const float scale = load_float<XPOS_DTYPE>(p.xpos, row * p.xpos_stride[0] + table_column(pair) * p.xpos_stride[1]);
        if (is_k) {
            *c /= scale;
            *s /= scale;
        } else {
            *c *= scale;
            *s *= scale;
        }
    }
}

// ---- rotation of one work item: PAIRS_PER_ITEM pairs of one head of one token ----------

__device__ __forceinline__ void rotate_item(const T* x, long long xs, T* y, long long ys, int chunk,
                                            const float* c, const float* s) {
    if (INTERLEAVED) {
        const long long d = ROTARY_OFFSET + chunk * VEC;
        Pack<VEC> v = load_pack<VEC>(x + d * xs, xs);
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            const float x1 = storage_to_float<DTYPE>(v.v[2 * j]), x2 = storage_to_float<DTYPE>(v.v[2 * j + 1]);
            v.v[2 * j] = from_float<DTYPE>(x1 * c[j] - x2 * s[j]);
            v.v[2 * j + 1] = from_float<DTYPE>(x2 * c[j] + x1 * s[j]);
        }
        store_pack<VEC>(y + d * ys, ys, v);
    } else {
        const long long d1 = ROTARY_OFFSET + chunk * VEC, d2 = d1 + PAIRS;
        Pack<VEC> a = load_pack<VEC>(x + d1 * xs, xs);
        Pack<VEC> b = load_pack<VEC>(x + d2 * xs, xs);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float x1 = storage_to_float<DTYPE>(a.v[j]), x2 = storage_to_float<DTYPE>(b.v[j]);
            a.v[j] = from_float<DTYPE>(x1 * c[j] - x2 * s[j]);
            b.v[j] = from_float<DTYPE>(x2 * c[j] + x1 * s[j]);
        }
        store_pack<VEC>(y + d1 * ys, ys, a);
        store_pack<VEC>(y + d2 * ys, ys, b);
    }
}

__device__ __forceinline__ const T* row_in(const void* base, const long long* st, long long b, long long h,
                                           long long s) {
    return static_cast<const T*>(base) + b * st[0] + h * st[1] + s * st[2];
}

__device__ __forceinline__ T* row_out(void* base, const long long* st, long long b, long long h, long long s) {
    return static_cast<T*>(base) + b * st[0] + h * st[1] + s * st[2];
}

}  // namespace

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS) rope_kernel(const RopeKernelParams p) {
    extern __shared__ float shared[];
    const int tpb = p.tokens_per_block;
    float* s_cos = shared;                         // [tpb][ROLES][PAIRS]
    float* s_sin = s_cos + tpb * ROLES * PAIRS;    // [tpb][ROLES][PAIRS]
    long long* s_row = reinterpret_cast<long long*>(s_sin + tpb * ROLES * PAIRS);  // [tpb][ROLES]
    const long long first = static_cast<long long>(blockIdx.x) * tpb;
    const long long heads_k = HAS_K ? p.heads_k : 0;
    const long long heads_q = HAS_K ? heads_k * GQA_GROUP : p.heads_q;
    const long long heads = heads_q + heads_k;

    // 1. Table rows of this block's tokens (for q, and for k when it has its own angles).
    for (int i = threadIdx.x; i < tpb * ROLES; i += BLOCK_THREADS) {
        const long long u = first + i / ROLES;
        long long row = 0;
        if (u < p.units) row = table_row(p, u / p.seqlen_max, u % p.seqlen_max, i % ROLES == 1);
        s_row[i] = row;
    }
    __syncthreads();

    // 2. Their cos/sin, once per token, shared by all heads.
    for (int i = threadIdx.x; i < tpb * ROLES * PAIRS; i += BLOCK_THREADS) {
        const int set = i / PAIRS;  // token * ROLES + role
        if (first + set / ROLES >= p.units) break;
        pair_angle(p, s_row[set], i % PAIRS, set % ROLES == 1, &s_cos[i], &s_sin[i]);
    }
    __syncthreads();

    // 3. Rotate: consecutive threads take consecutive chunks of one head, so accesses coalesce.
    const long long items = static_cast<long long>(tpb) * heads * CHUNKS;
    for (long long item = threadIdx.x; item < items; item += BLOCK_THREADS) {
        const int chunk = static_cast<int>(item % CHUNKS);
        const long long rest = item / CHUNKS;
        long long h = rest % heads;
        const int token = static_cast<int>(rest / heads);
        const long long u = first + token;
        if (u >= p.units) break;
        const long long b = u / p.seqlen_max, s = u % p.seqlen_max;
        const bool is_k = h >= heads_q;
        if (is_k) {
            h -= heads_q;
            if (s >= p.seqlen_k) continue;
        } else if (s >= p.seqlen_q) {
            continue;
        }
        const int set = token * ROLES + (ROLES == 2 && is_k ? 1 : 0);
        const float* c = s_cos + set * PAIRS + chunk * PAIRS_PER_ITEM;
        const float* sn = s_sin + set * PAIRS + chunk * PAIRS_PER_ITEM;
        if (is_k)
            rotate_item(row_in(p.k, p.k_stride, b, h, s), p.k_stride[3], row_out(p.k_out, p.k_out_stride, b, h, s),
                        p.k_out_stride[3], chunk, c, sn);
        else
            rotate_item(row_in(p.q, p.q_stride, b, h, s), p.q_stride[3], row_out(p.q_out, p.q_out_stride, b, h, s),
                        p.q_out_stride[3], chunk, c, sn);
    }

    // 4. Out of place, the features outside the rotary range are copied unchanged.
    constexpr int UNROTATED = HEAD_DIM - ROTARY_DIM;
    if (UNROTATED > 0 && (!IN_PLACE_Q || (HAS_K && !IN_PLACE_K))) {
        const long long copies = static_cast<long long>(tpb) * heads * UNROTATED;
        for (long long item = threadIdx.x; item < copies; item += BLOCK_THREADS) {
            const int f = static_cast<int>(item % UNROTATED);
            const long long rest = item / UNROTATED;
            long long h = rest % heads;
            const long long u = first + rest / heads;
            if (u >= p.units) break;
            const long long b = u / p.seqlen_max, s = u % p.seqlen_max;
            const long long d = f < ROTARY_OFFSET ? f : f + ROTARY_DIM;
            const bool is_k = h >= heads_q;
            if (is_k) {
                h -= heads_q;
                if (IN_PLACE_K || s >= p.seqlen_k) continue;
                row_out(p.k_out, p.k_out_stride, b, h, s)[d * p.k_out_stride[3]] =
                    row_in(p.k, p.k_stride, b, h, s)[d * p.k_stride[3]];
            } else {
                if (IN_PLACE_Q || s >= p.seqlen_q) continue;
                row_out(p.q_out, p.q_out_stride, b, h, s)[d * p.q_out_stride[3]] =
                    row_in(p.q, p.q_stride, b, h, s)[d * p.q_stride[3]];
            }
        }
    }
}
