// Attention templates: the sm_80 forward on mma.sync (FlashAttention-2 style): resident query
// rows, streamed and rotated key tiles; also the query block and key stream the dq kernel
// shares.
#ifndef ROPE_JIT_ATTENTION_MMA_FORWARD_H
#define ROPE_JIT_ATTENTION_MMA_FORWARD_H

namespace {

namespace tc {

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
__device__ __forceinline__ void issue_key_tile(const Buffers& m, const AttentionKernelParams& p,
                                               const T* k_head, const T* v_head, long long n0,
                                               int buffer) {
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
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0,
                                 p.seqlen_q);
    if (tiles > 0)
        rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k, m.cos_stage, m.sin_stage, m.k_flags,
                                          p, b, 0, p.seqlen_k);
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
                select_plain<NT>(s[mt], plain[mt], m.q_flags + warp * WARP_ROWS + mt * 16,
                                 m.k_flags, lane);
        }
        const bool check_bounds = n0 + BLOCK_N > p.seqlen_k,
                   check_causal = n0 + BLOCK_N - 1 > row_first;
        unsigned pa[M_TILES][NT / 2][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            scale_and_mask<NT, false>(s[mt], p, b, row_first + mt * 16, n0, check_bounds,
                                      check_causal, lane);
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
            rotate_rows<BLOCK_N, TABLE_ASYNC>(m.k, m.k_plain, m.k, m.cos_stage, m.sin_stage,
                                              m.k_flags, p, b, n0 + BLOCK_N, p.seqlen_k);
        }
        __syncthreads();
    }

    // Only this warp reads its query rows: it may stage its output there.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        finish_rows(o[mt], row_max[mt], row_sum[mt],
                    PaddedRows{m.q + (warp * WARP_ROWS + mt * 16) * ROWE}, p, b, h,
                    row_first + mt * 16, lane);
}

}  // namespace tc

}  // namespace

#endif
