// Attention templates: rotation. The pair rule and table reads of one feature (CUDA-core
// kernels), and the rotation of 16-byte chunks of staged rows in registers (tensor-core
// kernels): angles from staged or global table rows, rotate_rows over a tile, and the
// transposed rotation of accumulated gradients.
#ifndef ROPE_JIT_ATTENTION_ROTARY_H
#define ROPE_JIT_ATTENTION_ROTARY_H

namespace {

// The column of pair `pair` in this kernel's tables (host_device.h states the rule).
__device__ __forceinline__ int table_column(int pair) {
    return ::table_column(TABLE_FULL, INTERLEAVED, pair);
}

// cos and sin of pair `pair` at table row `row`, from the tables in global memory.
__device__ __forceinline__ void table_angle(const AttentionKernelParams& p, long long row, int pair,
                                            float* c, float* s) {
    const long long col = table_column(pair);
    *c = load_float<TABLE_DTYPE>(p.cos, row * p.cos_stride[0] + col * p.cos_stride[1]);
    *s = load_float<TABLE_DTYPE>(p.sin, row * p.sin_stride[0] + col * p.sin_stride[1]);
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

}  // namespace

namespace {

namespace tc {

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
        out[e] = TBYTES == 4
                     ? __uint_as_float(words[e])
                     : load_float<TABLE_DTYPE>(reinterpret_cast<const unsigned short*>(words), e);
}

// cos/sin of the N consecutive pairs from `pair` for row r of a tile (token `token`): from the
// staged rows (vector reads), or from the tables in global memory.
template <int N, bool STAGED>
__device__ __forceinline__ void pair_angles(const AttentionKernelParams& p, const char* cos_rows,
                                            const char* sin_rows, int r, long long token, int pair,
                                            float (&c)[N], float (&s)[N]) {
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
__device__ __forceinline__ void rotate_pairs_chunk(U4& x, const AttentionKernelParams& p,
                                                   const char* cos_rows, const char* sin_rows,
                                                   int r, long long token, int pair0) {
    rotate_pair_chunk(x, [&](int e, float(&c)[2], float(&s)[2]) {
        pair_angles<2, STAGED>(p, cos_rows, sin_rows, r, token, pair0 + e, c, s);
    });
}
template <bool STAGED>
__device__ __forceinline__ void rotate_halves_chunks(U4& xa, U4& xb, const AttentionKernelParams& p,
                                                     const char* cos_rows, const char* sin_rows,
                                                     int r, long long token, int pair0) {
    rotate_half_chunks(xa, xb, [&](int e, float(&c)[2], float(&s)[2]) {
        pair_angles<2, STAGED>(p, cos_rows, sin_rows, r, token, pair0 + e, c, s);
    });
}

// Writes rows [0, ROWS) of `src` (raw, zero-filled) into `dst` rotated by the table rows of
// tokens row0 + r (tokens without a position and rows past `valid` stay as they are), their
// plain copy into `plain` (pos_mask), and each row's positioned flag into `flags`. dst may be
// src (in place). STAGED: the angles come from the staged table rows of the tile.
template <int ROWS, bool STAGED>
__device__ void rotate_rows(T* dst, T* plain, const T* src, const char* cos_rows,
                            const char* sin_rows, unsigned char* flags,
                            const AttentionKernelParams& p, long long b, long long row0,
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
            if (rotate)
                rotate_halves_chunks<STAGED>(xa, xb, p, cos_rows, sin_rows, r, token, ca * 8);
            *reinterpret_cast<U4*>(d_row + ca * 8) = xa;
            *reinterpret_cast<U4*>(d_row + cb * 8) = xb;
        }
    }
}

// Applies the transposed rotation of token `token` to one accumulator row (rows e2 = 0: c[.][0..1],
// e2 = 1: c[.][2..3]) of a 16 x DP tile whose column of (dt, e) is dt*8 + 2*(lane&3) + e.
template <int D = DTYPE>
__device__ __forceinline__ void rotate_back_row(float (&acc)[DTILES][4], int e2,
                                                const AttentionKernelParams& p, long long token,
                                                int lane) {
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
                    const float x1 = acc[dt][2 * e2 + e],
                                x2 = acc[dt + ROTARY_DIM / 16][2 * e2 + e];
                    acc[dt][2 * e2 + e] = x1 * c + x2 * s;
                    acc[dt + ROTARY_DIM / 16][2 * e2 + e] = x2 * c - x1 * s;
                }
            }
        }
    }
}

}  // namespace tc

}  // namespace

#endif
