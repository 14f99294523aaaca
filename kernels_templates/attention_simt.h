// Attention templates: the CUDA-core kernels (forward, dq, dk/dv), one warp per row.
#ifndef ROPE_JIT_ATTENTION_SIMT_H
#define ROPE_JIT_ATTENTION_SIMT_H

namespace {

// ============================================================================================
// CUDA-core kernels: one warp per query row (forward, dq) or key row (dk/dv); lane L owns
// features L, L + 32, ... For float32 inputs, and any case the tensor-core kernels do not take.
// ============================================================================================

namespace simt {

constexpr int U = (HEAD_DIM + 31) / 32;  // features per lane

// Feature d (< HEAD_DIM) of head vector x at token `row`, rotated when `rotate`.
__device__ __forceinline__ float feature(const AttentionKernelParams& p, const T* x, long long ds,
                                         int d, long long row, bool rotate) {
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
__device__ void rotate_back(const AttentionKernelParams& p, float (&g)[U], long long row,
                            float* scratch, int lane) {
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
    const long long i = (blockIdx.x / heads) * PLAN.rows_per_block + warp;
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
                part += (rotated_pair ? q_rot[u] : q_plain[u]) *
                        feature(p, k, p.k_stride[3], d, j, rotated_pair && k_pos);
        }
        const float s = warp_sum(part) * p.scale_log2 + bias;
        const float m_new = fmaxf(m, s);
        const float alpha = exp2_approx(m - m_new), pj = exp2_approx(s - m_new);
        l = l * alpha + pj;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            o[u] =
                o[u] * alpha + (d < HEAD_DIM ? pj * load_float<DTYPE>(v, d * p.v_stride[3]) : 0.f);
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
    const long long i = (blockIdx.x / heads) * PLAN.rows_per_block + warp;
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
    const long long keys = lse == neg_inf() ? 0
                           : CAUSAL         ? (i + 1 < p.seqlen_k ? i + 1 : p.seqlen_k)
                                            : p.seqlen_k;
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
            if (rotated_pair)
                dq_rot[u] += ds * kvec[u];
            else
                dq_plain[u] += ds * kvec[u];
        }
    }
    if (q_pos) rotate_back(p, dq_rot, i, scratch[warp], lane);
    T* dq = head_row_out(p.dq, p.dq_stride, b, h, i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int d = lane + 32 * u;
        if (d < HEAD_DIM)
            store_float<DTYPE>(dq, d * p.dq_stride[3], p.scale * (dq_rot[u] + dq_plain[u]));
    }
}

__device__ void backward_dkdv(const AttentionKernelParams& p) {
    __shared__ float scratch[WARPS][U * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long heads = p.batch * p.heads_k;
    const long long bh = blockIdx.x % heads;
    const long long j = (blockIdx.x / heads) * PLAN.rows_per_block + warp;
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
            const float lse =
                p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
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
                if (rotated_pair)
                    dk_rot[u] += ds * qvec[u];
                else
                    dk_plain[u] += ds * qvec[u];
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

}  // namespace

#endif
