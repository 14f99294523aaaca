// Attention templates: masks and the online softmax. The attn_mask term of one score (CUDA-core
// kernels); for tensor-core tiles the scores scaled and masked (causal, attn_mask, sequence
// ends), the rotated/plain selection of pos_mask, the running max and sum, and the final
// normalization and store of output rows and lse.
#ifndef ROPE_JIT_ATTENTION_SOFTMAX_H
#define ROPE_JIT_ATTENTION_SOFTMAX_H

namespace {

// The attn_mask term of score (i, j) in base 2: 0, the additive value, or -inf (masked out).
// Requires i < Sq and j < Sk.
__device__ __forceinline__ float mask_bias(const AttentionKernelParams& p, long long b, long long i,
                                           long long j) {
    if constexpr (MASK_KIND == 0) {
        return 0.f;
    } else {
        const long long at = b * p.mask_stride[0] + i * p.mask_stride[1] + j * p.mask_stride[2];
        if constexpr (MASK_KIND == 1)
            return static_cast<const unsigned char*>(p.attn_mask)[at] ? 0.f : neg_inf();
        else
            return load_float<MASK_DTYPE>(p.attn_mask, at) * LOG2E;
    }
}

}  // namespace

namespace {

namespace tc {

// Scores of a 16 x 8*NT tile in base 2 with every mask applied: rows (queries, or keys when
// TRANSPOSED) at row_first + g (+8), columns at col_first + 8*nt + 2*(lane&3) (+1).
// Token indices are 32-bit here: the launcher refuses sequences of 2^31 tokens or more.
template <int NT, bool TRANSPOSED>
__device__ __forceinline__ void scale_and_mask(float (&s)[NT][4], const AttentionKernelParams& p,
                                               long long b, long long row_first,
                                               long long col_first, bool check_bounds,
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
            if (check_bounds && (j >= seqlen_k || i >= seqlen_q))
                x = neg_inf();
            else if (CAUSAL && check_causal && j > i)
                x = neg_inf();
            else if (MASK_KIND != 0 && i < seqlen_q && j < seqlen_k)
                x += mask_bias(p, b, i, j);
            s[nt][e] = x;
        }
    }
}

// With pos_mask: where a row token and a column token differ in having a position, the score
// is the plain product. `row_flags`/`col_flags` index by tile-local row and column.
template <int NT>
__device__ __forceinline__ void select_plain(float (&s)[NT][4], const float (&plain)[NT][4],
                                             const unsigned char* row_flags,
                                             const unsigned char* col_flags, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (row_flags[(lane >> 2) + 8 * (e >> 1)] !=
                col_flags[nt * 8 + 2 * (lane & 3) + (e & 1)])
                s[nt][e] = plain[nt][e];
}

// Splits dS into the part that flows through rotated vectors and the plain part.
template <int NT>
__device__ __forceinline__ void split_plain(float (&rot)[NT][4], float (&plain)[NT][4],
                                            const unsigned char* row_flags,
                                            const unsigned char* col_flags, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool rotated = row_flags[(lane >> 2) + 8 * (e >> 1)] ==
                                 col_flags[nt * 8 + 2 * (lane & 3) + (e & 1)];
            plain[nt][e] = rotated ? 0.f : rot[nt][e];
            if (!rotated) rot[nt][e] = 0.f;
        }
}

// 2^x for finite x <= 0 on the FMA pipe, not the multifunction unit that ex2 occupies (4
// results a clock per scheduler: a tile's exponentials take about half the time of its two
// products): x = j + f with j the nearest integer (rounded by adding 1.5 * 2^23, which leaves
// j in the low bits of the sum) and f in [-1/2, 1/2]; 2^f by a cubic (relative error 1e-4,
// below the 2^-8 of the bfloat16 probabilities); j added to its exponent. x is clamped at
// -125 (2^-125 rather than 0: only for scores without -inf, FlashAttention-4's trick); NaN
// stays NaN (max.NaN), as through ex2.
__device__ __forceinline__ float exp2_fma(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FA0000;" : "+f"(x));  // -125
    const float shifted = x + 12582912.f;
    const float f = x - (shifted - 12582912.f);
    const float p =
        fmaf(fmaf(fmaf(0.05583828f, f, 0.24263948f), f, 0.69313675f), f, 0.99992454f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}

// One step of the online softmax over a 16 x 8*NT score tile, one row pair per thread (rows g
// and g + 8): scores (base 2, masks applied, times `scale` > 0 still to apply) become
// probabilities relative to the running row maximum, the row sums move to the new maximum,
// and alphas[r] is the factor that moves row r's output accumulators there (rescale_output).
// FMA_QUARTERS > 0 (scores without -inf only): of every four 8-column groups that many take
// exp2_fma, the rest ex2. FIRST_PAIR: the maximum and the sum start from the first pair
// rather than from -inf and 0 (one instruction fewer each per row, the same values: a row of
// NaN scores leaves the running maximum as -inf would; 0 + x is x for the probabilities, all
// >= 0 or NaN).
template <int NT, int FMA_QUARTERS = 0, bool FIRST_PAIR = false>
__device__ __forceinline__ void softmax_probabilities(float (&s)[NT][4], float (&row_max)[2],
                                                      float (&row_sum)[2], float (&alphas)[2],
                                                      float scale = 1.f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = FIRST_PAIR ? fmaxf(s[0][2 * r], s[0][2 * r + 1]) : neg_inf();
#pragma unroll
        for (int nt = FIRST_PAIR ? 1 : 0; nt < NT; ++nt)
            mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float alpha = exp2_approx(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (FMA_QUARTERS > 0 && nt % 4 < FMA_QUARTERS) {
                s[nt][2 * r] = exp2_fma(fmaf(s[nt][2 * r], scale, -m_use));
                s[nt][2 * r + 1] = exp2_fma(fmaf(s[nt][2 * r + 1], scale, -m_use));
            } else {
                s[nt][2 * r] = exp2_approx(fmaf(s[nt][2 * r], scale, -m_use));
                s[nt][2 * r + 1] = exp2_approx(fmaf(s[nt][2 * r + 1], scale, -m_use));
            }
            sum = FIRST_PAIR && nt == 0 ? s[0][2 * r] + s[0][2 * r + 1]
                                        : sum + (s[nt][2 * r] + s[nt][2 * r + 1]);
        }
        row_sum[r] = row_sum[r] * alpha + sum;
        alphas[r] = alpha;
    }
}

// Moves a warp's output accumulators to the new row maxima (alphas from
// softmax_probabilities). SKIP_UNIT_RESCALE: the warp leaves them as they are when no row's
// maximum moved (every factor exactly 1, as exp2 of 0 is: the same values), which most tiles
// past the first few are.
template <bool SKIP_UNIT_RESCALE = false>
__device__ __forceinline__ void rescale_output(float (&o)[DTILES][4], const float (&alphas)[2]) {
    if (SKIP_UNIT_RESCALE && !__any_sync(FULL_MASK, alphas[0] != 1.f || alphas[1] != 1.f)) return;
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] *= alphas[e >> 1];
}

// Both: one step of the online softmax, the output accumulators rescaled (SKIP_UNIT_RESCALE
// also starts from the first pair: the wgmma forwards).
template <int NT, int FMA_QUARTERS = 0, bool SKIP_UNIT_RESCALE = false>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&row_max)[2],
                                               float (&row_sum)[2], float (&o)[DTILES][4],
                                               float scale = 1.f) {
    float alphas[2];
    softmax_probabilities<NT, FMA_QUARTERS, SKIP_UNIT_RESCALE>(s, row_max, row_sum, alphas,
                                                                scale);
    rescale_output<SKIP_UNIT_RESCALE>(o, alphas);
}

// Normalizes a warp's 16 output rows (first query first_row) by their softmax sums and writes
// them through `stage` (16 of the warp's own shared rows: PaddedRows or another type with its
// at()), with the log-sum-exp if asked.
template <class Stage, int D = DTYPE>
__device__ __forceinline__ void finish_rows(const float (&o)[DTILES][4], const float (&row_max)[2],
                                            float (&row_sum)[2], const Stage& stage,
                                            const AttentionKernelParams& p, long long b,
                                            long long h, long long first_row, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(FULL_MASK, row_sum[r], 2);
    }
    store_staged_rows(o, row_sum[0] > 0.f ? 1.f / row_sum[0] : 0.f,
                      row_sum[1] > 0.f ? 1.f / row_sum[1] : 0.f, stage,
                      head_row_out(p.out, p.out_stride, b, h, 0), p.out_stride[2], first_row,
                      p.seqlen_q, lane);
    if (WRITE_LSE && (lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const long long i = first_row + (lane >> 2) + 8 * r;
            if (i < p.seqlen_q)
                p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
                    row_sum[r] == 0.f ? neg_inf()
                                      : (row_max[r] + __log2f(row_sum[r])) * LN2;  // NaN stays NaN
        }
    }
}

}  // namespace tc

}  // namespace

#endif
