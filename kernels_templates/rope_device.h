// Device functions both RoPE templates (rope.cu, rope_norm.cu) use, after the runtime's
// specialization constants (kernel_spec.cpp): element conversions, a token's table row, a
// pair's cos and sin, and a grid token's (batch row, index). Plain CUDA without toolkit headers.
#ifndef ROPE_JIT_ROPE_DEVICE_H
#define ROPE_JIT_ROPE_DEVICE_H

#include "device_numeric.h"
#include "rope_params.h"

namespace {

// Programmatic dependent launch (rope_jit_config.programmatic_launch). A plain launch returns
// from both at once.
// Waits until the grid before this one on the stream has completed and its memory is visible.
// Called before a kernel reads or writes any tensor.
__device__ __forceinline__ void await_preceding_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next programmatic grid launch once every block of this one has called it (or
// exited): its blocks then take free room on the multiprocessors and wait in
// await_preceding_grid. Called after this grid's own wait, so no more than two grids overlap.
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, at a kernel's start: the next grid's blocks are placed while this one's last wave runs.
__device__ __forceinline__ void wait_for_preceding_grid() {
    await_preceding_grid();
    allow_next_grid();
}

template <int DT>
__device__ __forceinline__ typename StorageOf<DT>::type from_float(float v) {
    if constexpr (DT == 0) {
        return v;
    } else if constexpr (DT == 1) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    } else {
#if __CUDA_ARCH__ >= 800
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
#else
        return float_to_bf16_bits(v);  // what cvt.rn.bf16.f32 does on sm_80+
#endif
    }
}

template <int DT>
__device__ __forceinline__ float storage_to_float(typename StorageOf<DT>::type v) {
    if constexpr (DT == 0)
        return v;
    else
        return float_of_bits16<DT>(v);
}

// QK-norm weights as stored (NORM_WEIGHT_DTYPE), and w' of a raw weight: w, or 1 + w (Gemma's
// unit offset; w + 0 would cost an add per feature: IEEE keeps it, for -0).
using NormWeight = typename StorageOf<NORM_WEIGHT_DTYPE>::type;
__device__ __forceinline__ float weight_value(NormWeight raw) {
    const float w = storage_to_float<NORM_WEIGHT_DTYPE>(raw);
    if constexpr (NORM_UNIT_OFFSET)
        return 1.0f + w;
    else
        return w;
}

// N QK-norm weights held as one vector: a vector load fills whole registers.
template <int N>
struct alignas(N * sizeof(NormWeight)) WeightPack {
    NormWeight v[N];
    __device__ __forceinline__ const NormWeight& operator[](int i) const { return v[i]; }
};

// N weights from feature d into *out: vectors of up to 16 bytes where VECTOR (the host proved
// the weights unit-stride and 16-byte aligned, NORM_WEIGHT_VEC_LOADS, and d is a multiple of
// N or of 16 bytes' worth), else one at a time, `ws` apart.
template <int N, bool VECTOR>
__device__ __forceinline__ void load_weight_pack(const NormWeight* w, long long ws, int d,
                                                 WeightPack<N>* out) {
    constexpr int M = N * sizeof(NormWeight) > 16 ? 16 / static_cast<int>(sizeof(NormWeight)) : N;
    if constexpr (VECTOR) {
        if constexpr (N == M) {
            *out = *reinterpret_cast<const WeightPack<N>*>(w + d);
        } else {
#pragma unroll
            for (int c = 0; c < N / M; ++c)
                reinterpret_cast<WeightPack<M>*>(out->v)[c] =
                    *reinterpret_cast<const WeightPack<M>*>(w + d + c * M);
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) out->v[j] = w[(d + j) * ws];
    }
}

template <bool IS64>
__device__ __forceinline__ long long load_index(const void* base, long long index) {
    if (IS64) return static_cast<const long long*>(base)[index];
    return static_cast<const int*>(base)[index];
}

// Token (b, s)'s sequence and its index in it: (b, s), except in packed batches, which find
// their sequence in cu_seqlens and restart s at 0 in each.
__device__ __forceinline__ void token_sequence(const RopeKernelParams& p, long long b, long long s,
                                               long long* sequence, long long* index) {
    *sequence = b;
    *index = s;
    if (PACKED) {
        long long lo = 0, hi = p.num_sequences - 1;  // last sequence whose start <= s
        while (lo < hi) {
            const long long mid = (lo + hi + 1) / 2;
            if (load_index<CU_SEQLENS_INT64>(p.cu_seqlens, mid * p.cu_seqlens_stride) <= s)
                lo = mid;
            else
                hi = mid - 1;
        }
        *sequence = lo;
        *index = s - load_index<CU_SEQLENS_INT64>(p.cu_seqlens, lo * p.cu_seqlens_stride);
    }
}

// The table row of token (b, s) of q or k: positions (of `axis` with M-RoPE), else
// s + seqlen_offsets[sequence], else s + position_offset (+ q_position_offset for q).
__device__ long long table_row(const RopeKernelParams& p, long long b, long long s, bool is_k,
                               int axis = 0) {
    long long sequence, index;
    token_sequence(p, b, s, &sequence, &index);
    if (HAS_ROPE_INDICES)
        return load_index<POSITIONS_INT64>(
            p.positions,
            axis * p.positions_axis_stride + b * p.positions_stride[0] + s * p.positions_stride[1]);
    if (POSITION_MODE == 2)
        return index + load_index<SEQLEN_OFFSETS_INT64>(p.seqlen_offsets,
                                                        sequence * p.seqlen_offsets_stride);
    return index + p.position_offset + (is_k ? 0 : p.q_position_offset);
}

// cos and sin of one pair at one table row, with the backward sign and xPos folded in.
__device__ void pair_angle(const RopeKernelParams& p, long long row, int pair, bool is_k, float* c,
                           float* s) {
    if (ANGLES_FROM_INV_FREQ) {
        // fp64 keeps p * inv_freq exact far beyond fp32's 2^24 positions; the reduction inside
        // sincos is then exact too.
        const double angle =
            double(row) * double(load_float<INV_FREQ_DTYPE>(p.inv_freq, pair * p.inv_freq_stride));
        double sd, cd;
        sincos(angle, &sd, &cd);
        *c = float(cd);
        *s = float(sd);
    } else {
        const long long col = table_column(TABLE_FULL, INTERLEAVED, pair);
        *c = load_float<TABLE_DTYPE>(p.cos, row * p.cos_stride[0] + col * p.cos_stride[1]);
        *s = load_float<TABLE_DTYPE>(p.sin, row * p.sin_stride[0] + col * p.sin_stride[1]);
    }
    if (BACKWARD_PASS) *s = -*s;
    if (HAS_XPOS) {
        const long long col = table_column(TABLE_FULL, INTERLEAVED, pair);
        const float scale =
            load_float<XPOS_DTYPE>(p.xpos, row * p.xpos_stride[0] + col * p.xpos_stride[1]);
        if (is_k) {
            *c /= scale;
            *s /= scale;
        } else {
            *c *= scale;
            *s *= scale;
        }
    }
}

// Token u of the grid as (batch row, index in it); 32-bit division when the sizes allow it.
__device__ __forceinline__ void split_token(const RopeKernelParams& p, long long u, long long* b,
                                            long long* s) {
    if (p.units <= 0x7fffffffLL) {
        const unsigned uu = static_cast<unsigned>(u), per_row = static_cast<unsigned>(p.seqlen_max);
        const unsigned row = uu / per_row;
        *b = row;
        *s = uu - row * per_row;
    } else {
        *b = u / p.seqlen_max;
        *s = u - *b * p.seqlen_max;
    }
}

// ---- KV cache and FP8 outputs ----------------------------------------------------------

// n = *quotient * d + *remainder for n >= 0, d > 0: a 32-bit division while both fit (always,
// in practice), else bit by bit. Not the compiler's 64-bit division, a called routine whose
// calling convention spills registers at the rope kernel's budget of 40 (measured with ptxas
// -v: 88 bytes of spills on the KV cache kernel's one-token path).
__device__ __forceinline__ void split_index(long long n, long long d, long long* quotient,
                                            long long* remainder) {
    if (n <= 0x7fffffffLL && d <= 0x7fffffffLL) {
        const unsigned q = static_cast<unsigned>(n) / static_cast<unsigned>(d);
        *quotient = q;
        *remainder = static_cast<unsigned>(n) - q * static_cast<unsigned>(d);
        return;
    }
    unsigned long long q = 0, r = 0;
    const unsigned long long un = static_cast<unsigned long long>(n);
    const unsigned long long ud = static_cast<unsigned long long>(d);
#pragma unroll 1
    for (int bit = 63; bit >= 0; --bit) {
        r = (r << 1) | ((un >> bit) & 1u);  // r < d < 2^63: no overflow
        if (r >= ud) {
            r -= ud;
            q |= 1ull << bit;
        }
    }
    *quotient = static_cast<long long>(q);
    *remainder = static_cast<long long>(r);
}

// Where token (b, s) of k goes in the cache ([blocks, Hk, slots, D] views): its block and slot,
// by the rules of rope_jit_rope_args (slot_mapping; or the token's cache position, a row of a
// contiguous cache or, through block_tables, a paged one). False for a token that writes
// nothing: a negative slot (padding), or any index out of range (never written out of bounds;
// the CPU backend and debug checks report those instead).
__device__ bool cache_slot(const RopeKernelParams& p, const RopeCacheParams& c, long long b,
                           long long s, long long* block, long long* slot) {
    if (KV_CACHE == 2) {
        const long long value = load_index<KV_INDEX_INT64>(
            c.slot_mapping, (b * p.seqlen_k + s) * c.slot_mapping_stride);
        if (value < 0) return false;
        split_index(value, c.cache_slots, block, slot);
        return *block < c.cache_blocks;
    }
    long long sequence, index, position;
    token_sequence(p, b, s, &sequence, &index);
    if (KV_SEQLEN_OFFSETS)
        position = index + load_index<SEQLEN_OFFSETS_INT64>(p.seqlen_offsets,
                                                            sequence * p.seqlen_offsets_stride);
    else if (HAS_ROPE_INDICES)
        position = load_index<POSITIONS_INT64>(
            p.positions, b * p.positions_stride[0] + s * p.positions_stride[1]);
    else
        position = index + p.position_offset;
    if (position < 0) return false;
    if (KV_CACHE == 1) {
        *block = sequence;
        *slot = position;
        return position < c.cache_slots;
    }
    long long entry, offset;
    split_index(position, c.cache_slots, &entry, &offset);
    if (entry >= c.max_blocks) return false;
    const long long table_block = load_index<KV_INDEX_INT64>(
        c.block_tables, sequence * c.block_tables_stride[0] + entry * c.block_tables_stride[1]);
    if (table_block < 0 || table_block >= c.cache_blocks) return false;
    *block = table_block;
    *slot = offset;
    return true;
}

// float8 e4m3fn of x: round to nearest even, saturating to +-448 (infinities included), NaN to
// 0x7f; the CPU reference's float_to_e4m3 (src/common/float8.h), written with bit operations.
__device__ __forceinline__ unsigned e4m3_bits(float x) {
    const unsigned bits = __float_as_uint(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fu;
    const float a = fminf(__uint_as_float(bits & 0x7fffffffu), 448.0f);
    if (a < 0.015625f)  // below 2^-6: subnormals, multiples of 2^-9 (8 of them round to 2^-6)
        return sign | static_cast<unsigned>(__float2int_rn(a * 512.0f));
    // Keep 3 of the 23 mantissa bits, ties to even (a carry moves into the exponent), and
    // rebias the exponent from 127 to 7.
    const unsigned ab = __float_as_uint(a);
    return sign | (((ab + 0x7ffffu + ((ab >> 20) & 1u)) >> 20) - (120u << 3));
}

// An FP8 output's scale, prepared once for fp8_quotient: its reciprocal, and (scales under
// 2^-64) a power of two that scale and values are both multiplied by, so that the quotient's
// residual cannot underflow.
struct Fp8Scale {
    float scale, inv, pre;
};

__device__ __forceinline__ Fp8Scale fp8_scale(float scale) {
    const float pre = scale < 5.42101086e-20f ? 1.84467441e19f : 1.0f;  // 2^-64, 2^64
    const float scaled = scale * pre;
    return Fp8Scale{scaled, __frcp_rn(scaled), pre};
}

// value / scale for the e4m3 byte, a few multiply-adds instead of a division (whose slow path
// is an out-of-line call) per element. The contract quantizes the IEEE fp32 quotient: value *
// inv lies within an ulp of it, and one correction by the exact residual rounds it correctly
// (Markstein's theorem) while the residual does not underflow, which `pre` ensures wherever
// the byte depends on the quotient (|quotient| >= 2^-11); a product of 0 or infinity is kept
// (signed zeros, overflow: saturated either way). Checked against fp32 division on 10^8
// random pairs, every finite scale, subnormal values included.
__device__ __forceinline__ float fp8_quotient(float value, const Fp8Scale& s) {
    const float x = __fmul_rn(value, s.pre);
    const float q = __fmul_rn(x, s.inv);
    const float fixed = __fmaf_rn(__fmaf_rn(-q, s.scale, x), s.inv, q);
    return q == 0.0f || fabsf(q) > 3.40282347e38f ? q : fixed;
}

// Two values as two e4m3fn bytes, lo first; sm_89+ converts them in one instruction with the
// same rounding, saturation and NaN.
__device__ __forceinline__ unsigned short e4m3x2_bits(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
#else
    return static_cast<unsigned short>(e4m3_bits(lo) | (e4m3_bits(hi) << 8));
#endif
}

// ---- The launch's argument block -----------------------------------------------------------

// A kernel's own arguments (RopeKernelParams, RopeNormParams), followed by RopeCacheParams when
// its spec has a KV cache or FP8 outputs. Enumerators and types, not constexpr variables
// (NVRTC makes those globals of every module).
enum : bool { CACHE_PARAMS = KV_CACHE != 0 || Q_FP8 };
template <class Own, bool CACHE = CACHE_PARAMS>
struct LaunchArgs {
    using type = Own;
};
template <class Own>
struct LaunchArgs<Own, true> {
    using type = WithCache<Own>;
};
template <class Own>
__device__ __forceinline__ const Own& own_args(const Own& a) {
    return a;
}
template <class Own>
__device__ __forceinline__ const Own& own_args(const WithCache<Own>& a) {
    return a.own;
}
template <class Own>
__device__ __forceinline__ const RopeCacheParams* cache_args(const Own&) {
    return nullptr;
}
template <class Own>
__device__ __forceinline__ const RopeCacheParams* cache_args(const WithCache<Own>& a) {
    return &a.cache;
}

// A programmatic launch's prologue (RopeKernelParams::programmatic): every 64-byte line of the
// argument block read once into the constant cache while the grid before this one still runs,
// so that the kernel's own reads after the wait hit. Every warp reads every line: split among
// the warps by warp index, the compiler issued them all anyway (speculated loads, then a
// select). A plain launch skips this: its misses, met one at a time, would only come earlier
// (session 10 measured that slower). The words read go to shared memory through an asm store:
// the compilers drop loads whose values go nowhere (NVVM also drops plain stores to a shared
// array nothing reads), and the store keeps the loads ahead of the wait that follows.
template <class Args>
__device__ __forceinline__ void fetch_argument_lines(const Args& args) {
    constexpr int kLineWords = 16;
    constexpr int kLines = (sizeof(Args) / 4 + kLineWords - 1) / kLineWords;
    __shared__ unsigned sink[32];
    const unsigned* words = reinterpret_cast<const unsigned*>(&args);
    unsigned fetched = 0;
#pragma unroll
    for (int line = 0; line < kLines; ++line) fetched ^= words[line * kLineWords];
    const unsigned at =
        static_cast<unsigned>(__cvta_generic_to_shared(&sink[threadIdx.x / 32 % 32]));
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(fetched) : "memory");
}

}  // namespace

#endif
