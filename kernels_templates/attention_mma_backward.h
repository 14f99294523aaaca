// Attention templates: the backward on mma.sync: dq (resident queries, streamed keys) and
// dk/dv (resident keys and values, streamed query tiles).
#ifndef ROPE_JIT_ATTENTION_MMA_BACKWARD_H
#define ROPE_JIT_ATTENTION_MMA_BACKWARD_H

namespace {

namespace tc {

// lse of a row in base 2, as the backward uses it: +inf for rows that see no key or lie past
// Sq, which makes every P of the row exp2(x - inf) = 0.
template <int D = DTYPE>
__device__ __forceinline__ float base2_lse(const AttentionKernelParams& p, long long b, long long h,
                                           long long i) {
    if (i >= p.seqlen_q) return pos_inf();
    const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
    return lse == neg_inf() ? pos_inf() : lse * LOG2E;
}

// delta_i = dout_i . out_i for `rows` rows whose dout is in shared rows `dout_rows`, their out
// in global memory (`out_rows`, or in shared rows `out_stage` when given); one warp per row.
template <int D = DTYPE>
__device__ __forceinline__ void row_deltas(float* delta, int rows, const T* dout_rows,
                                           const T* out_stage, const T* out_head,
                                           long long out_stride, long long row0, long long valid,
                                           int warp, int lane) {
    for (int r = warp; r < rows; r += WARPS) {
        float sum = 0.f;
        if (row0 + r < valid) {
            for (int ch = lane; ch < DCHUNKS; ch += 32) {
                const U4 g = *reinterpret_cast<const U4*>(dout_rows + r * ROWE + ch * 8);
                const U4 o =
                    out_stage != nullptr
                        ? *reinterpret_cast<const U4*>(out_stage + r * ROWE + ch * 8)
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

// The blocks dq and dk/dv share. Rows are this warp's 16 resident rows (queries for dq, keys
// for dk/dv), columns the streamed tile's BLOCK_N rows; `plain` buffers and flags serve
// pos_mask (a rotated score where both tokens are positioned, else a plain one).

// s = rows . tile^T over the head dim, with pos_mask's plain scores where a token is
// unpositioned.
template <int NT>
__device__ __forceinline__ void tile_scores(float (&s)[NT][4], const T* rows, const T* plain_rows,
                                            const T* tile, const T* tile_plain,
                                            const unsigned char* row_flags,
                                            const unsigned char* tile_flags, int lane) {
    zero(s);
    gemm_abt<NT>(s, rows, tile, lane);
    if constexpr (HAS_POS_MASK) {
        float plain[NT][4];
        zero(plain);
        gemm_abt<NT>(plain, plain_rows, tile_plain, lane);
        select_plain<NT>(s, plain, row_flags, tile_flags, lane);
    }
}

// acc += ds . tile (the gradient of the resident rows), the pairs of unpositioned tokens into
// acc_plain (pos_mask): they are not rotated back.
template <int NT>
__device__ __forceinline__ void accumulate_gradient(float (&acc)[DTILES][4],
                                                    float (&acc_plain)[DTILES][4],
                                                    float (&ds)[NT][4], const T* tile,
                                                    const T* tile_plain,
                                                    const unsigned char* row_flags,
                                                    const unsigned char* tile_flags, int lane) {
    if constexpr (HAS_POS_MASK) {
        float ds_plain[NT][4];
        split_plain<NT>(ds, ds_plain, row_flags, tile_flags, lane);
        unsigned a_plain[NT / 2][4];
        to_a_fragments<NT>(a_plain, ds_plain);
        gemm_ab<NT / 2>(acc_plain, a_plain, tile_plain, lane);
    }
    unsigned a[NT / 2][4];
    to_a_fragments<NT>(a, ds);
    gemm_ab<NT / 2>(acc, a, tile, lane);
}

// The gradient accumulated for the warp's rows first.. as it is stored: rotated back where
// the row is positioned (and below `valid`), plus its plain part (pos_mask).
template <int D = DTYPE>
__device__ __forceinline__ void finish_gradient(float (&acc)[DTILES][4],
                                                const float (&acc_plain)[DTILES][4],
                                                const unsigned char* row_flags,
                                                const AttentionKernelParams& p, long long first,
                                                long long valid, int lane) {
    const int g = lane >> 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long i = first + g + 8 * r;
        if (ROTATE && i < valid && row_flags[g + 8 * r]) rotate_back_row(acc, r, p, i, lane);
    }
    if constexpr (HAS_POS_MASK) {
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[dt][e] += acc_plain[dt][e];
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
    const long long key_end =
        CAUSAL ? (m0 + RESIDENT < p.seqlen_k ? m0 + RESIDENT : p.seqlen_k) : p.seqlen_k;
    const int tiles = static_cast<int>((key_end + BLOCK_N - 1) / BLOCK_N);

    issue_rows<RESIDENT>(m.q, head_row(p.q, p.q_stride, b, h, 0), p.q_stride[2], m0, p.seqlen_q);
    issue_rows<RESIDENT>(m.dout(0), head_row(p.dout, p.dout_stride, b, h, 0), p.dout_stride[2], m0,
                         p.seqlen_q);
    if (tiles > 0) issue_key_tile(m, p, k_head, v_head, 0, 0);
    cp_async_commit();
    for (int r = threadIdx.x; r < RESIDENT; r += THREADS) m.row_a[r] = base2_lse(p, b, h, m0 + r);
    cp_async_wait_all();
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0,
                                 p.seqlen_q);
    if (tiles > 0)
        rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k_stage, m.cos_stage, m.sin_stage,
                                          m.k_flags, p, b, 0, p.seqlen_k);
    row_deltas(m.row_b, RESIDENT, m.dout(0), nullptr, head_row(p.out, p.out_stride, b, h, 0),
               p.out_stride[2], m0, p.seqlen_q, warp, lane);
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
        tile_scores(s, q_rows, q_plain_rows, m.k, m.k_plain, row_flags, m.k_flags, lane);
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
        accumulate_gradient(dq, dq_plain, ds, m.k, m.k_plain, row_flags, m.k_flags, lane);

        cp_async_wait_all();
        __syncthreads();
        if (t + 1 < tiles)
            rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k_stage, m.cos_stage, m.sin_stage,
                                              m.k_flags, p, b, n0 + BLOCK_N, p.seqlen_k);
        __syncthreads();
    }

    finish_gradient(dq, dq_plain, row_flags, p, m0 + warp * 16, p.seqlen_q, lane);
    T* stage = m.q + warp * 16 * ROWE;
    store_rows(dq, p.scale, p.scale, stage, head_row_out(p.dq, p.dq_stride, b, h, 0),
               p.dq_stride[2], m0 + warp * 16, p.seqlen_q, lane);
}

// ---- dk/dv: resident keys and values, streamed query tiles ----------------------------------

template <int D = DTYPE>
__device__ __forceinline__ void issue_query_tile(const Buffers& m, const AttentionKernelParams& p,
                                                 long long b, long long h, long long m0,
                                                 int buffer) {
    issue_rows<BLOCK_N>(m.q_stage, head_row(p.q, p.q_stride, b, h, 0), p.q_stride[2], m0,
                        p.seqlen_q);
    issue_table_rows<BLOCK_N>(m.cos_stage, m.sin_stage, p, m0, p.seqlen_q);
    issue_rows<BLOCK_N>(m.dout(buffer), head_row(p.dout, p.dout_stride, b, h, 0), p.dout_stride[2],
                        m0, p.seqlen_q);
    issue_rows<BLOCK_N>(m.o_stage, head_row(p.out, p.out_stride, b, h, 0), p.out_stride[2], m0,
                        p.seqlen_q);
    for (int r = threadIdx.x; r < BLOCK_N; r += THREADS) {
        const bool ok = m0 + r < p.seqlen_q;
        cp_async4(
            m.row_a + BLOCK_N + r,
            ok ? p.lse + b * p.lse_stride[0] + h * p.lse_stride[1] + (m0 + r) * p.lse_stride[2]
               : p.lse,
            ok);
    }
}

// After a query tile's copies landed: rotate it, and turn its lse into the base-2 form and
// its out rows into deltas.
template <int D = DTYPE>
__device__ __forceinline__ void prepare_query_tile(const Buffers& m, const AttentionKernelParams& p,
                                                   long long b, long long m0, int buffer, int warp,
                                                   int lane) {
    rotate_rows<BLOCK_N, TABLE_ASYNC>(m.q, m.q_plain, m.q_stage, m.cos_stage, m.sin_stage,
                                      m.q_flags, p, b, m0, p.seqlen_q);
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
    const long long n_block =
        blockIdx.x / heads;  // the keys seen by the most queries (causal) first
    const long long b = bh / p.heads_k, hk = bh % p.heads_k;
    const long long n0 = n_block * RESIDENT;
    const long long tile_begin = CAUSAL ? n0 / BLOCK_N : 0;
    const long long tile_end = (p.seqlen_q + BLOCK_N - 1) / BLOCK_N;
    const long long per_head = tile_end > tile_begin ? tile_end - tile_begin : 0;
    const long long steps = per_head * GQA_GROUP;

    issue_rows<RESIDENT>(m.k, head_row(p.k, p.k_stride, b, hk, 0), p.k_stride[2], n0, p.seqlen_k);
    issue_rows<RESIDENT>(m.v(0), head_row(p.v, p.v_stride, b, hk, 0), p.v_stride[2], n0,
                         p.seqlen_k);
    if (steps > 0) issue_query_tile(m, p, b, hk * GQA_GROUP, tile_begin * BLOCK_N, 0);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.k, m.k_plain, m.k, nullptr, nullptr, m.k_flags, p, b, n0,
                                 p.seqlen_k);
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
        tile_scores(s, k_rows, k_plain_rows, m.q, m.q_plain, row_flags, m.q_flags, lane);
        scale_and_mask<BLOCK_N / 8, true>(s, p, b, n0 + warp * 16, m0, true, m0 < n0 + RESIDENT,
                                          lane);
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[nt][e] = exp2_approx(s[nt][e] - m.row_a[nt * 8 + 2 * (lane & 3) + (e & 1)]);
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
            accumulate_gradient(dk, dk_plain, ds, m.q, m.q_plain, row_flags, m.q_flags, lane);
        }

        cp_async_wait_all();
        __syncthreads();
        if (step + 1 < steps) prepare_query_tile(m, p, b, next_m0, buffer ^ 1, warp, lane);
        __syncthreads();
    }

    const long long first = n0 + warp * 16;
    if constexpr (COMPUTE_DK) {
        finish_gradient(dk, dk_plain, row_flags, p, first, p.seqlen_k, lane);
        // Only this warp reads its key rows: it may stage its results there.
        store_rows(dk, p.scale, p.scale, m.k + warp * 16 * ROWE,
                   head_row_out(p.dk, p.dk_stride, b, hk, 0), p.dk_stride[2], first, p.seqlen_k,
                   lane);
    }
    if constexpr (COMPUTE_DV)
        store_rows(dv, 1.f, 1.f, m.v(0) + warp * 16 * ROWE,
                   head_row_out(p.dv, p.dv_stride, b, hk, 0), p.dv_stride[2], first, p.seqlen_k,
                   lane);
}

}  // namespace tc

}  // namespace

#endif
