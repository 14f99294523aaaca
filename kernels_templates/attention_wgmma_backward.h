// Attention templates: the sm_90a backward on warpgroup matrix products, in three kernels
// (FlashAttention-3's structure, with the rotation moved out of the main loop):
//   prepare   (KIND 3)  rotates q and k once into the workspace (attention_params.h), and per
//                       query row writes lse in base 2 and delta = dout . out
//   backward  (KIND 4)  one block per key block of one kv head: dK and dV accumulate in
//                       registers over every query tile of every query head of the GQA group;
//                       dQ is accumulated in float32 in the workspace (every thread adds its
//                       fragments by 16-byte atomic adds)
//   dq finish (KIND 5)  dq = the transposed rotation of scale * the accumulated dQ
// dK's transposed rotation happens in the backward's epilogue. The host zeroes the dQ
// accumulator before the backward runs.
//
// The accumulator's layout: per (batch, query head) and 64-row query tile, TILE_M * DP
// contiguous floats (the workspace's [B, Hq, Sq_padded, DP] bytes, permuted within the tile),
// in the order the backward's warpgroups hold them: the tile's two feature halves (DQ_N
// features each, one per warpgroup) one after the other, each as wgmma accumulator fragments,
// n-tile by n-tile, thread by thread (128 of a warpgroup), four floats a thread. So a warp's
// fragments of one n-tile are 512 contiguous bytes (fully coalesced 16-byte atomic adds), and
// only the dq finish kernel translates back to rows.
#ifndef ROPE_JIT_ATTENTION_WGMMA_BACKWARD_H
#define ROPE_JIT_ATTENTION_WGMMA_BACKWARD_H

namespace {

namespace tc {

namespace wg {

// ---- prepare and dq finish: 64 rows a block, one 16-byte item (rotate_rows' items) a thread
// at a time --------------------------------------------------------------------------------

constexpr int BWD_ROWS = kAttentionBackwardQueryTile;
constexpr int DQ_N = DP / 2;  // dq features per warpgroup (a half of the accumulator tile)

struct alignas(8) Float2 {
    float x, y;
};
struct alignas(16) Float4 {
    float v[4];
};

__device__ __forceinline__ U4 load_chunk(const T* row, int chunk) {
    return chunk < DCHUNKS ? *reinterpret_cast<const U4*>(row + chunk * 8) : U4{};
}

// Writes rows [row0, row0 + 64) of one head (`src` at its token 0, token stride `stride`)
// rotated into `dst` (the workspace: rows of DP elements): zero past `valid` and past
// head_dim.
template <int D = DTYPE>
__device__ void rotate_into_workspace(T* dst, const T* src, long long stride,
                                      const AttentionKernelParams& p, long long row0,
                                      long long valid) {
    for (int it = threadIdx.x; it < BWD_ROWS * ITEMS; it += THREADS) {
        const int r = it / ITEMS, k = it - r * ITEMS;
        const long long token = row0 + r;
        const bool inside = token < valid;
        const T* s_row = src + (inside ? token : 0) * stride;
        T* d_row = dst + r * DP;
        if (k >= ROT_ITEMS) {
            const int ch = FIRST_PLAIN + (k - ROT_ITEMS);
            *reinterpret_cast<U4*>(d_row + ch * 8) = inside ? load_chunk(s_row, ch) : U4{};
        } else if constexpr (INTERLEAVED) {
            U4 x = inside ? load_chunk(s_row, k) : U4{};
            if (inside) rotate_pairs_chunk<false>(x, p, nullptr, nullptr, 0, token, k * 4);
            *reinterpret_cast<U4*>(d_row + k * 8) = x;
        } else {
            const int ca = k, cb = k + ROTARY_DIM / 16;
            U4 xa = inside ? load_chunk(s_row, ca) : U4{};
            U4 xb = inside ? load_chunk(s_row, cb) : U4{};
            if (inside) rotate_halves_chunks<false>(xa, xb, p, nullptr, nullptr, 0, token, ca * 8);
            *reinterpret_cast<U4*>(d_row + ca * 8) = xa;
            *reinterpret_cast<U4*>(d_row + cb * 8) = xb;
        }
    }
}

// KIND 3. Blocks [0, prepare_query_blocks) take 64 query rows of one (batch, query head):
// rotated q, lse in base 2 and delta; the rest take 64 key rows of one (batch, kv head).
template <int D = DTYPE>
__device__ void prepare(const AttentionKernelParams& p) {
    const long long block = blockIdx.x;
    const bool queries = block < p.prepare_query_blocks;
    const long long local = queries ? block : block - p.prepare_query_blocks;
    const long long heads = queries ? p.heads_q : p.heads_k;
    const long long padded = queries ? p.seqlen_q_padded : p.seqlen_k_padded;
    const long long row_blocks = padded / BWD_ROWS;
    const long long bh = local / row_blocks;  // b * heads + h
    const long long b = bh / heads, h = bh % heads;
    const long long row0 = (local % row_blocks) * BWD_ROWS;
    const long long first = bh * padded + row0;  // the block's first workspace row
    if (!queries) {
        rotate_into_workspace(static_cast<T*>(p.k_rot) + first * DP,
                              head_row(p.k, p.k_stride, b, h, 0), p.k_stride[2], p, row0,
                              p.seqlen_k);
        return;
    }
    rotate_into_workspace(static_cast<T*>(p.q_rot) + first * DP, head_row(p.q, p.q_stride, b, h, 0),
                          p.q_stride[2], p, row0, p.seqlen_q);
    // delta and lse: one warp per row.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const T* dout_head = head_row(p.dout, p.dout_stride, b, h, 0);
    const T* out_head = head_row(p.out, p.out_stride, b, h, 0);
    for (int r = warp; r < BWD_ROWS; r += WARPS) {
        const long long i = row0 + r;
        float sum = 0.f;
        if (i < p.seqlen_q) {
            for (int ch = lane; ch < DCHUNKS; ch += 32) {
                const U4 g = load_chunk(dout_head + i * p.dout_stride[2], ch);
                const U4 o = load_chunk(out_head + i * p.out_stride[2], ch);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const F2 gg = unpack2(g.w[e]), oo = unpack2(o.w[e]);
                    sum += gg.x * oo.x + gg.y * oo.y;
                }
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            p.row_delta[first + r] = sum;
            p.row_lse2[first + r] = base2_lse(p, b, h, i);
        }
    }
}

// Rotation items of an output row (rotate_rows' items without the chunks past head_dim).
constexpr int OUT_ITEMS = ROT_ITEMS + DCHUNKS - FIRST_PLAIN;

// Reads the eight float32 features of chunk ch of a row into x: a plain row of DP features.
struct PlainRow {
    const float* row;
    __device__ __forceinline__ void operator()(int ch, float (&x)[8]) const {
        const Float4 lo = *reinterpret_cast<const Float4*>(row + ch * 8);
        const Float4 hi = *reinterpret_cast<const Float4*>(row + ch * 8 + 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[e] = lo.v[e];
            x[4 + e] = hi.v[e];
        }
    }
};

// The same from row r of a dQ accumulator tile (the layout in the header comment): a chunk's
// eight features are two of four threads' fragments (rows r and r + 8 of a warp share them).
struct AccumulatorRow {
    const float* tile;
    int r;
    __device__ __forceinline__ void operator()(int ch, float (&x)[8]) const {
        const int half = ch * 8 / DQ_N, nt = (ch * 8 - half * DQ_N) / 8;
        const int thread = (r >> 4) * 32 + (r & 7) * 4;  // of the quad holding row r
        const float* at = tile + half * BWD_ROWS * DQ_N + (nt * 128 + thread) * 4 + (r & 8) / 4;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const Float2 v = *reinterpret_cast<const Float2*>(at + c * 4);
            x[2 * c] = v.x;
            x[2 * c + 1] = v.y;
        }
    }
};

// Writes item k of a gradient row: the float32 accumulated row that `row` reads (DP features,
// rotated space; PlainRow or AccumulatorRow) times the softmax scale, rotated back by token
// `token`'s angles, into `out_row`.
template <class Row, int D = DTYPE>
__device__ __forceinline__ void store_rotated_back(const Row& row, T* out_row,
                                                   const AttentionKernelParams& p, long long token,
                                                   int k) {
    // Eight accumulated features of chunk ch, scaled.
    auto chunk = [&](int ch, float(&x)[8]) {
        row(ch, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] *= p.scale;
    };
    auto store = [&](int ch, const float(&x)[8]) {
        U4 u;
#pragma unroll
        for (int e = 0; e < 4; ++e) u.w[e] = pack2(x[2 * e], x[2 * e + 1]);
        *reinterpret_cast<U4*>(out_row + ch * 8) = u;
    };
    float xa[8];
    if (k >= ROT_ITEMS) {
        const int ch = FIRST_PLAIN + (k - ROT_ITEMS);
        chunk(ch, xa);
        store(ch, xa);
    } else if constexpr (INTERLEAVED) {
        // Pairs (2i, 2i + 1) of the chunk: the transposed rotation.
        chunk(k, xa);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float c, s;
            table_angle(p, token, k * 4 + e, &c, &s);
            const float x1 = xa[2 * e], x2 = xa[2 * e + 1];
            xa[2 * e] = x1 * c + x2 * s;
            xa[2 * e + 1] = x2 * c - x1 * s;
        }
        store(k, xa);
    } else {
        const int cb = k + ROTARY_DIM / 16;
        float xb[8];
        chunk(k, xa);
        chunk(cb, xb);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float c, s;
            table_angle(p, token, k * 8 + e, &c, &s);
            const float x1 = xa[e], x2 = xb[e];
            xa[e] = x1 * c + x2 * s;
            xb[e] = x2 * c - x1 * s;
        }
        store(k, xa);
        store(cb, xb);
    }
}

// KIND 5: dq rows [row0, row0 + 64) of one (batch, query head) from the float32 accumulator:
// scaled by the softmax scale and rotated back.
template <int D = DTYPE>
__device__ void finish_dq(const AttentionKernelParams& p) {
    const long long row_blocks = p.seqlen_q_padded / BWD_ROWS;
    const long long bh = blockIdx.x / row_blocks;
    const long long b = bh / p.heads_q, h = bh % p.heads_q;
    const long long row0 = (blockIdx.x % row_blocks) * BWD_ROWS;
    const float* tile = p.dq_accum + (bh * p.seqlen_q_padded + row0) * DP;
    T* dq_head = head_row_out(p.dq, p.dq_stride, b, h, 0);
    for (int it = threadIdx.x; it < BWD_ROWS * OUT_ITEMS; it += THREADS) {
        const int r = it / OUT_ITEMS, k = it - r * OUT_ITEMS;
        const long long token = row0 + r;
        if (token >= p.seqlen_q) continue;
        store_rotated_back(AccumulatorRow{tile, r}, dq_head + token * p.dq_stride[2], p, token, k);
    }
}

// ---- the backward (KIND 4) ------------------------------------------------------------------
//
// A block owns BLOCK_N (128) keys of one (batch, kv head): two warpgroups of 64 keys each,
// every warp 16 of them. It iterates over the query tiles (64 rows) of each query head of the
// group that can see its keys; per tile, warpgroup g (keys K_g, values V_g):
//   S^T = K_g Q^T, dP^T = V_g dO^T             (both operands in shared memory)
//   P^T = exp2(S^T * scale - lse)              (while dP^T's product runs)
//   dS^T = P^T (dP^T - delta)
//   dV_g += P^T dO                             (P^T from registers)
//   dS^T into shared memory; barrier of both warpgroups
//   dQ[:, g half of the features] = dS K      (dS^T and K read transposed from shared memory)
//   dK_g += dS^T Q                             (dS^T from registers)
//   dQ into the workspace (atomic adds) while dK's product runs
// Thread 0 brings every tile in by TMA (rotated q and lse/delta rows from the workspace, dout
// from the caller's tensor), STAGES - 1 tiles ahead: the barrier of tile i proves tile i - 1's
// buffers free (both warpgroups waited for all their products of it), so tile i + STAGES - 1
// goes there. dS^T is double-buffered for the same reason.

constexpr int TILE_M = kAttentionBackwardQueryTile;
constexpr int Q_REGION = TILE_M * 128;   // one 64-feature region of a q/dout tile
constexpr int K_REGION = BLOCK_N * 128;  // of a key/value tile
constexpr int Q_TILE_BYTES = TILE_M * DP * 2;
constexpr int K_TILE_BYTES = BLOCK_N * DP * 2;
constexpr int DS_TILE_BYTES = BLOCK_N * TILE_M * 2;
constexpr int Q_STEPS = TILE_M / 16;  // k-steps over a query tile's rows

// Descriptors of a 128-byte-swizzled tile whose 64-feature regions are `region` bytes apart,
// as a base and the byte offset of k-step kk (the forward's Descriptor: one add per k-step):
// K-major (the k-step runs along the features: 32 bytes on within a region) and MN-major (the
// k-step runs along the rows: 16 rows on).
__device__ __forceinline__ Descriptor kmajor_base(unsigned tile) {
    return descriptor_base(tile, 16, 1024, true);
}
__device__ __forceinline__ constexpr unsigned kmajor_offset(int region, int kk) {
    return (kk >> 2) * region + (kk & 3) * 32;
}
__device__ __forceinline__ Descriptor mnmajor_base(unsigned tile, int region) {
    return descriptor_base(tile, region, 1024, true);
}
__device__ __forceinline__ constexpr unsigned mnmajor_offset(int kk) { return kk * 16 * 128; }
// The same descriptors built whole (backward_wide, whose descriptors do not spill).
__device__ __forceinline__ unsigned long long kmajor_descriptor(unsigned tile, int region, int kk) {
    return swizzled_descriptor(tile + kmajor_offset(region, kk), 16, 1024);
}
__device__ __forceinline__ unsigned long long mnmajor_descriptor(unsigned tile, int region,
                                                                 int kk) {
    return swizzled_descriptor(tile + mnmajor_offset(kk), region, 1024);
}

// The base of a descriptor of a tile resident across the loop over query tiles, made a value
// of this iteration: the compiler then adds each k-step's offset inside the loop rather than
// hoisting every k-step's descriptor out of it (24 registers in backward_narrow at head_dim
// 128, which spilled 40 bytes inside the loop: ptxas -v, CUDA 13.0).
__device__ __forceinline__ Descriptor this_iteration(Descriptor d) {
    asm volatile("" : "+r"(d.lo));
    return d;
}

// Copies `bytes` (a multiple of 16) from global `src` to shared `dst`, counted on `landed`.
__device__ __forceinline__ void copy_bulk(unsigned dst, const void* src, unsigned bytes,
                                          unsigned landed) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(landed)
        : "memory");
}

// Four float32 atomic adds at `at` (16-byte aligned; sm_90).
__device__ __forceinline__ void atomic_add4(float* at, const float (&x)[4]) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(at), "f"(x[0]), "f"(x[1]),
                 "f"(x[2]), "f"(x[3])
                 : "memory");
}

struct KeyBlock {
    long long b, hk, n0;
    int first_tile;      // the first query tile that sees a key of the block
    int tiles_per_head;  // query tiles per query head from there
    int iterations;      // tiles_per_head * GQA_GROUP
};

// Block x takes key block x / (B * Hk), so under a causal mask the blocks with the most query
// tiles (the first keys) start first.
__device__ __forceinline__ KeyBlock key_block(const AttentionKernelParams& p) {
    const long long heads = p.batch * p.heads_k;
    const long long bh = blockIdx.x % heads;
    KeyBlock k;
    k.b = bh / p.heads_k;
    k.hk = bh % p.heads_k;
    k.n0 = (blockIdx.x / heads) * BLOCK_N;
    const int q_tiles = static_cast<int>((p.seqlen_q + TILE_M - 1) / TILE_M);
    const int first = CAUSAL ? static_cast<int>(k.n0 / TILE_M) : 0;
    k.first_tile = first < q_tiles ? first : q_tiles;
    k.tiles_per_head = q_tiles - k.first_tile;
    k.iterations = k.tiles_per_head * GQA_GROUP;
    return k;
}

// Writes a warp's 16 accumulated rows (keys from `first_key`) of dk or dv, as the dtype, those
// inside the sequence; with ROTATE_BACK (dk) scaled and rotated back first.
template <bool ROTATE_BACK, int COLS, int D = DTYPE>
__device__ __forceinline__ void store_key_rows(float (&acc)[COLS / 8][4], void* base,
                                               const long long* stride, const KeyBlock& kb,
                                               const AttentionKernelParams& p, long long first_key,
                                               int first_feature, int lane) {
    static_assert(!ROTATE_BACK || COLS == DP, "rows rotated back whole");
    T* head = head_row_out(base, stride, kb.b, kb.hk, 0);
    const int t2 = 2 * (lane & 3);
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
        const long long key = first_key + (lane >> 2) + 8 * e2;
        if (key >= p.seqlen_k) continue;
        if constexpr (ROTATE_BACK) {
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt) {
                acc[dt][2 * e2] *= p.scale;
                acc[dt][2 * e2 + 1] *= p.scale;
            }
            rotate_back_row(acc, e2, p, key, lane);
        }
        T* row = head + key * stride[2] + first_feature;
#pragma unroll
        for (int dt = 0; dt < COLS / 8; ++dt)
            if (first_feature + dt * 8 < HEAD_DIM)
                *reinterpret_cast<unsigned*>(row + dt * 8 + t2) =
                    pack2(acc[dt][2 * e2], acc[dt][2 * e2 + 1]);
    }
}

// Named barriers of the head_dim 256 backward beside consumer_sync's (1), the warp reconverged
// first (consumer_sync says why).
__device__ __forceinline__ void named_sync(int id) {
    __syncwarp();
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Stores the two 16-bit rows (r0 and r0 + 8, r0 % 8 == lane / 4) of a warp's 16 x 64 score
// tile `x` (accumulator layout) into a 64-column swizzled tile: row = key, 128 bytes.
template <int NT>
__device__ __forceinline__ void store_swizzled_rows(char* tile, const float (&x)[NT][4], int r0,
                                                    int lane) {
    const int g = lane >> 2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int at = ((nt ^ g) << 4) + 4 * (lane & 3);
        *reinterpret_cast<unsigned*>(tile + r0 * 128 + at) = pack2(x[nt][0], x[nt][1]);
        *reinterpret_cast<unsigned*>(tile + (r0 + 8) * 128 + at) = pack2(x[nt][2], x[nt][3]);
    }
}

// P^T of a warp's 16 keys (from key_first) by the tile's queries (from m0), from the scores
// S^T in s (in place): masked scores and queries past Sq (lse +inf) give P = 0.
template <int NT>
__device__ __forceinline__ void key_probabilities(float (&s)[NT][4], const AttentionKernelParams& p,
                                                  const KeyBlock& kb, long long key_first,
                                                  long long m0, const float* lse, int lane) {
    const bool check_bounds = kb.n0 + BLOCK_N > p.seqlen_k;
    const bool check_causal = CAUSAL && kb.n0 + BLOCK_N - 1 > m0;
    float scale = p.scale_log2;
    if (check_bounds || check_causal || MASK_KIND != 0) {
        scale_and_mask<NT, true>(s, p, kb.b, key_first, m0, check_bounds, check_causal, lane);
        scale = 1.f;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const Float2 l = *reinterpret_cast<const Float2*>(lse + nt * 8 + 2 * (lane & 3));
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[nt][e] = exp2_approx(fmaf(s[nt][e], scale, -((e & 1) ? l.y : l.x)));
    }
}

// The accumulator tile of query rows [m0, m0 + 64) of head h, at warpgroup `group`'s half of
// the features (the layout in the header comment).
__device__ __forceinline__ float* dq_tile_half(const AttentionKernelParams& p, const KeyBlock& kb,
                                               long long h, long long m0, int group) {
    return p.dq_accum + ((kb.b * p.heads_q + h) * p.seqlen_q_padded + m0) * DP +
           group * TILE_M * DQ_N;
}

// Where this thread's dQ fragments of the tile at m0 of head h go (its first n-tile's).
__device__ __forceinline__ float* dq_fragments_at(const AttentionKernelParams& p,
                                                  const KeyBlock& kb, long long h, long long m0,
                                                  int group) {
    return dq_tile_half(p, kb, h, m0, group) + (threadIdx.x & 127) * 4;
}

// Adds a warpgroup's dQ fragments (64 queries of a tile, its DQ_N features) into the float32
// accumulator at `at` (dq_fragments_at): atomic adds of 16 bytes, a warp's 512 contiguous.
__device__ __forceinline__ void add_dq_fragments(const float (&dq)[DQ_N / 8][4], float* at) {
#pragma unroll
    for (int nt = 0; nt < DQ_N / 8; ++nt) atomic_add4(at + nt * 128 * 4, dq[nt]);
}

// A key block's resident keys and values and its stream of query tiles in shared memory,
// with their barriers: what both backward kernels share. Tile i (head head_of(i), rows from
// row_of(i)) lives in stage i % STAGES: its rotated queries and dout (one TMA box per 64
// features each) and its lse and delta rows, counted on the stage's barrier.
struct QueryStream {
    const AttentionKernelParams& p;
    char* smem;
    KeyBlock kb;
    unsigned full;         // STAGES barriers, one per stage
    unsigned keys_landed;  // the keys and values

    __device__ __forceinline__ char* q_tile(int i) const {
        return smem + SMEM.q + (i % STAGES) * Q_TILE_BYTES;
    }
    __device__ __forceinline__ char* dout_tile(int i) const {
        return smem + SMEM.dout0 + (i % STAGES) * Q_TILE_BYTES;
    }
    __device__ __forceinline__ const float* lse_rows(int i) const {
        return reinterpret_cast<const float*>(smem + SMEM.row_a) + (i % STAGES) * TILE_M;
    }
    __device__ __forceinline__ const float* delta_rows(int i) const {
        return reinterpret_cast<const float*>(smem + SMEM.row_b) + (i % STAGES) * TILE_M;
    }
    __device__ __forceinline__ long long head_of(int i) const {
        return kb.hk * GQA_GROUP + i / kb.tiles_per_head;
    }
    __device__ __forceinline__ long long row_of(int i) const {
        return static_cast<long long>(kb.first_tile + i % kb.tiles_per_head) * TILE_M;
    }
    // Thread 0: starts tile i's copies.
    __device__ __forceinline__ void issue(int i) const {
        const unsigned landed = full + (i % STAGES) * 8;
        barrier_arrive_expect(landed, 2 * Q_TILE_BYTES + 2 * TILE_M * 4);
        const long long h = head_of(i), m0 = row_of(i);
#pragma unroll
        for (int r = 0; r < DP / 64; ++r) {
            copy_box(shared_address(q_tile(i) + r * Q_REGION), p.q_map, r * 64,
                     static_cast<int>(m0), static_cast<int>(h), static_cast<int>(kb.b), landed);
            copy_box(shared_address(dout_tile(i) + r * Q_REGION), p.dout_map, r * 64,
                     static_cast<int>(m0), static_cast<int>(h), static_cast<int>(kb.b), landed);
        }
        const long long row = (kb.b * p.heads_q + h) * p.seqlen_q_padded + m0;
        copy_bulk(shared_address(lse_rows(i)), p.row_lse2 + row, TILE_M * 4, landed);
        copy_bulk(shared_address(delta_rows(i)), p.row_delta + row, TILE_M * 4, landed);
    }
    // Waits until tile i landed.
    __device__ __forceinline__ void wait(int i) const {
        barrier_wait(full + (i % STAGES) * 8, static_cast<unsigned>(i / STAGES) & 1u);
    }
};

// The block's stream, its barriers initialized; thread 0 has started the copies of the first
// STAGES - 1 query tiles, and the keys and values have landed.
template <int D = DTYPE>
__device__ __forceinline__ QueryStream start_query_stream(const AttentionKernelParams& p,
                                                          char* smem) {
    const unsigned barriers = shared_address(smem + SMEM.barriers);
    const QueryStream q{p, smem, key_block(p), barriers, barriers + STAGES * 8};
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(q.full + s * 8, 1);
        barrier_init(q.keys_landed, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0 && q.kb.iterations > 0) {
        barrier_arrive_expect(q.keys_landed, 2 * K_TILE_BYTES);
#pragma unroll
        for (int r = 0; r < DP / 64; ++r) {
            copy_box(shared_address(smem + SMEM.k + r * K_REGION), p.k_map, r * 64,
                     static_cast<int>(q.kb.n0), static_cast<int>(q.kb.hk), static_cast<int>(q.kb.b),
                     q.keys_landed);
            copy_box(shared_address(smem + SMEM.v0 + r * K_REGION), p.v_map, r * 64,
                     static_cast<int>(q.kb.n0), static_cast<int>(q.kb.hk), static_cast<int>(q.kb.b),
                     q.keys_landed);
        }
        for (int i = 0; i < STAGES - 1 && i < q.kb.iterations; ++i) q.issue(i);
    }
    if (q.kb.iterations > 0) barrier_wait(q.keys_landed, 0);
    return q;
}

// ---- head_dim 256 (KIND 4 with DP 256) ------------------------------------------------------
//
// dK and dV of 128 keys at 256 features would take 256 accumulator registers a thread; here a
// block owns 64 keys, both warpgroups take all 64 (wgmma's rows) and split the work:
//   warpgroup 0: S^T = K Q^T -> P^T;  warpgroup 1: dP^T = V dO^T -> shared (float32)
//   barrier 2; warpgroup 0: dS^T = P^T (dP^T - delta); P^T and dS^T into shared; barrier 3
//   warpgroup g, its 128 features: dV += P^T dO, dK += dS^T Q, dQ = dS K (shared operands)
// Barrier 2 also proves both warpgroups done with the previous tile (they waited for its
// products), so P^T, dS^T, dP^T and the previous tile's q/dout stage are free from there. At
// the end dK goes through shared memory (float32), where each thread finds its pairs' partners
// for the transposed rotation.
template <int D = DTYPE>
__device__ void backward_wide(const AttentionKernelParams& p, char* smem) {
    static_assert(WARPS == 8 && BLOCK_N == 64 && STAGES == 2 && DP == 256 && !HAS_POS_MASK,
                  "two warpgroups over 64 keys, head_dim padded to 256, no pos_mask");
    static_assert(2 * Q_TILE_BYTES >= BLOCK_N * DP * 4, "dK's float32 rows fit the q stages");
    constexpr int NT = TILE_M / 8;
    constexpr int HALF = DP / 2;  // features of each warpgroup's products
    const QueryStream stream = start_query_stream(p, smem);
    const KeyBlock& kb = stream.kb;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp >> 2;
    char* const k_tile = smem + SMEM.k;
    char* const v_tile = smem + SMEM.v0;
    char* const pt_tile = smem + SMEM.pt;
    char* const ds_tile = smem + SMEM.ds;
    float* const dpt = reinterpret_cast<float*>(smem + SMEM.dpt);

    const int g = lane >> 2;
    const int r0 = (warp & 3) * 16 + g;                   // this thread's key rows r0 and r0 + 8
    const long long key_first = kb.n0 + (warp & 3) * 16;  // the warp's first key
    const unsigned k_address = shared_address(k_tile), v_address = shared_address(v_tile);
    const unsigned pt_address = shared_address(pt_tile), ds_address = shared_address(ds_tile);
    float dv[HALF / 8][4], dk[HALF / 8][4];
    zero(dv);
    zero(dk);
    for (int i = 0; i < kb.iterations; ++i) {
        const long long h = stream.head_of(i), m0 = stream.row_of(i);
        stream.wait(i);
        const unsigned q_address = shared_address(stream.q_tile(i));
        const unsigned dout_address = shared_address(stream.dout_tile(i));

        // S^T (warpgroup 0) or dP^T (warpgroup 1).
        float s[NT][4];
        zero(s);
        fence_registers(s);
        __syncwarp();
        fence_operands();
        const unsigned a_rows = group == 0 ? k_address : v_address;
        const unsigned b_rows = group == 0 ? q_address : dout_address;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
            wgmma_ss<TILE_M>(s, kmajor_descriptor(a_rows, K_REGION, kk),
                             kmajor_descriptor(b_rows, Q_REGION, kk));
        commit();
        wait_all();
        fence_registers(s);

        if (group == 1) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = nt * 8 + 2 * (lane & 3);
                *reinterpret_cast<Float2*>(dpt + r0 * TILE_M + col) = Float2{s[nt][0], s[nt][1]};
                *reinterpret_cast<Float2*>(dpt + (r0 + 8) * TILE_M + col) =
                    Float2{s[nt][2], s[nt][3]};
            }
        } else {
            key_probabilities(s, p, kb, key_first, m0, stream.lse_rows(i), lane);
        }
        // dP^T there; the previous tile done with by both warpgroups. One bar.sync that both
        // reach (warpgroup 1 has nothing to do before barrier 3 anyway): with a bar.arrive in
        // warpgroup 1, racecheck reported hazards in the dK epilogue; with a bar.sync in each
        // branch, synccheck reported the barrier divergent.
        named_sync(2);
        if (group == 0) {
            if (threadIdx.x == 0 && i + 1 < kb.iterations) stream.issue(i + 1);
            store_swizzled_rows(pt_tile, s, r0, lane);
            const float* delta = stream.delta_rows(i);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = nt * 8 + 2 * (lane & 3);
                const Float2 dl = *reinterpret_cast<const Float2*>(delta + col);
                const Float2 d0 = *reinterpret_cast<const Float2*>(dpt + r0 * TILE_M + col);
                const Float2 d1 = *reinterpret_cast<const Float2*>(dpt + (r0 + 8) * TILE_M + col);
                s[nt][0] *= d0.x - dl.x;
                s[nt][1] *= d0.y - dl.y;
                s[nt][2] *= d1.x - dl.x;
                s[nt][3] *= d1.y - dl.y;
            }
            store_swizzled_rows(ds_tile, s, r0, lane);
            fence_async_proxy();
        }
        named_sync(3);  // P^T and dS^T there, for both warpgroups' tensor cores

        const unsigned dout_half = dout_address + group * 2 * Q_REGION;
        const unsigned q_half = q_address + group * 2 * Q_REGION;
        fence_registers(dv);
        fence_registers(dk);
        __syncwarp();
        fence_operands();
#pragma unroll
        for (int kk = 0; kk < Q_STEPS; ++kk)
            wgmma_ss<128, 0, 1>(dv, kmajor_descriptor(pt_address, TILE_M * 128, kk),
                                mnmajor_descriptor(dout_half, Q_REGION, kk));
#pragma unroll
        for (int kk = 0; kk < Q_STEPS; ++kk)
            wgmma_ss<128, 0, 1>(dk, kmajor_descriptor(ds_address, TILE_M * 128, kk),
                                mnmajor_descriptor(q_half, Q_REGION, kk));
        commit();
        float dq[HALF / 8][4];
        zero(dq);
        fence_registers(dq);
        __syncwarp();
        fence_operands();
        const unsigned k_half = k_address + group * 2 * K_REGION;
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            wgmma_ss<128, 1, 1>(dq, mnmajor_descriptor(ds_address, TILE_M * 128, kk),
                                mnmajor_descriptor(k_half, K_REGION, kk));
        commit();
        wait_all();
        fence_registers(dq);
        fence_registers(dv);
        fence_registers(dk);

        add_dq_fragments(dq, dq_fragments_at(p, kb, h, m0, group));
    }

    // dV: this warpgroup's half of the features, straight from the accumulators.
    store_key_rows<false, HALF>(dv, p.dv, p.dv_stride, kb, p, key_first, group * HALF, lane);
    // dK: float32 rows in shared memory (over the q stages, once both warpgroups are done
    // with them; no copy is in flight), then scaled and rotated back item by item.
    consumer_sync();
    float* const dk_rows = reinterpret_cast<float*>(smem + SMEM.q);
#pragma unroll
    for (int dt = 0; dt < HALF / 8; ++dt) {
        const int col = group * HALF + dt * 8 + 2 * (lane & 3);
        *reinterpret_cast<Float2*>(dk_rows + r0 * DP + col) = Float2{dk[dt][0], dk[dt][1]};
        *reinterpret_cast<Float2*>(dk_rows + (r0 + 8) * DP + col) = Float2{dk[dt][2], dk[dt][3]};
    }
    consumer_sync();
    T* const dk_head = head_row_out(p.dk, p.dk_stride, kb.b, kb.hk, 0);
    for (int it = threadIdx.x; it < BLOCK_N * OUT_ITEMS; it += THREADS) {
        const int r = it / OUT_ITEMS, k = it - r * OUT_ITEMS;
        const long long key = kb.n0 + r;
        if (key < p.seqlen_k)
            store_rotated_back(PlainRow{dk_rows + r * DP}, dk_head + key * p.dk_stride[2], p, key,
                               k);
    }
}

// dS^T (as A fragments, rounded as the products use them) into its tile: row = key, 64
// queries of 128 bytes, swizzled; a quarter warp's eight rows fall in eight different 16-byte
// lanes. The warp's rows: 16 * (warp % 4) of warpgroup `group`'s 64.
template <int PSTEPS>
__device__ __forceinline__ void store_ds_rows(char* ds_tile, const unsigned (&dsa)[PSTEPS][4],
                                              int group, int warp, int lane) {
    const int g = lane >> 2;
    const int r0 = group * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < 2 * PSTEPS; ++nt) {
        const int at = ((nt ^ g) << 4) + 4 * (lane & 3);
        *reinterpret_cast<unsigned*>(ds_tile + r0 * 128 + at) = dsa[nt / 2][(nt & 1) * 2];
        *reinterpret_cast<unsigned*>(ds_tile + (r0 + 8) * 128 + at) = dsa[nt / 2][(nt & 1) * 2 + 1];
    }
}

template <int D = DTYPE>
__device__ void backward_narrow(const AttentionKernelParams& p, char* smem) {
    static_assert(
        WARPS == 8 && BLOCK_N == 128 && STAGES >= 2 && (DP == 64 || DP == 128) && !HAS_POS_MASK,
        "two warpgroups over 128 keys, head_dim padded to 64 or 128, no pos_mask");
    constexpr int NT = TILE_M / 8;  // n-tiles of a score tile (queries)
    const QueryStream stream = start_query_stream(p, smem);
    const KeyBlock& kb = stream.kb;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The warpgroup, broadcast from lane 0: ptxas then knows it is the same in every lane, and
    // the branches on it (masked_out) are not divergent paths, which made it wait after every
    // product (wgmma serialized: C7520).
    const int group = __shfl_sync(FULL_MASK, warp >> 2, 0);
    char* const k_tile = smem + SMEM.k;
    char* const v_tile = smem + SMEM.v0;

    // This warp's 16 keys: rows 16 * (warp % 4) of its warpgroup's 64.
    const long long key_first = kb.n0 + group * 64 + (warp & 3) * 16;
    // A of S^T and dP^T: the warpgroup's keys and values, K-major.
    const Descriptor k_rows = kmajor_base(shared_address(k_tile) + group * 64 * 128);
    const Descriptor v_rows = kmajor_base(shared_address(v_tile) + group * 64 * 128);
    // B of dQ: this warpgroup's DQ_N features of the keys (a region, or half of one).
    const Descriptor k_features = mnmajor_base(
        shared_address(k_tile) + (DP == 128 ? group * K_REGION : group * DQ_N * 2), K_REGION);
    float dv[DTILES][4], dk[DTILES][4];
    zero(dv);
    zero(dk);
    for (int i = 0; i < kb.iterations; ++i) {
        const long long h = stream.head_of(i), m0 = stream.row_of(i);
        stream.wait(i);
        const unsigned q_address = shared_address(stream.q_tile(i));
        const unsigned dout_address = shared_address(stream.dout_tile(i));
        // B of S^T (K-major) and of dK (MN-major): q; of dP^T and dV: dout.
        const Descriptor q_kmajor = kmajor_base(q_address);
        const Descriptor q_mnmajor = mnmajor_base(q_address, Q_REGION);
        const Descriptor dout_kmajor = kmajor_base(dout_address);
        const Descriptor dout_mnmajor = mnmajor_base(dout_address, Q_REGION);

        // Under a causal mask a warpgroup whose keys all come after the tile's queries (on the
        // diagonal) has P = dS = 0: it only writes its zero dS^T rows for the dQ product.
        const bool masked_out = CAUSAL && kb.n0 + group * 64 > m0 + TILE_M - 1;
        char* const ds_tile = smem + SMEM.ds + (i & 1) * DS_TILE_BYTES;
        unsigned pa[Q_STEPS][4], dsa[Q_STEPS][4];
        if (masked_out) {
#pragma unroll
            for (int k = 0; k < Q_STEPS; ++k) pa[k][0] = pa[k][1] = pa[k][2] = pa[k][3] = 0u;
            store_ds_rows(ds_tile, pa, group, warp, lane);
        } else {
            float s[NT][4], dp[NT][4];
            zero(s);
            zero(dp);
            fence_registers(s);
            fence_registers(dp);
            __syncwarp();
            fence_operands();
            const Descriptor keys = this_iteration(k_rows), values = this_iteration(v_rows);
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
                wgmma_ss<TILE_M>(s, keys.at(kmajor_offset(K_REGION, kk)),
                                 q_kmajor.at(kmajor_offset(Q_REGION, kk)));
            commit();
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
                wgmma_ss<TILE_M>(dp, values.at(kmajor_offset(K_REGION, kk)),
                                 dout_kmajor.at(kmajor_offset(Q_REGION, kk)));
            commit();
            // P^T while dP^T's product runs, then dS^T = P^T (dP^T - delta).
            wait_pending<1>();
            fence_registers(s);
            key_probabilities(s, p, kb, key_first, m0, stream.lse_rows(i), lane);
            wait_all();
            fence_registers(dp);
            const float* delta = stream.delta_rows(i);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const Float2 dl = *reinterpret_cast<const Float2*>(delta + nt * 8 + 2 * (lane & 3));
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    dp[nt][e] = s[nt][e] * (dp[nt][e] - ((e & 1) ? dl.y : dl.x));
            }
            to_a_fragments<NT>(pa, s);
            to_a_fragments<NT>(dsa, dp);
            store_ds_rows(ds_tile, dsa, group, warp, lane);

            fence_registers(dv);
            fence_registers(dk);
            fence_registers(pa);
            fence_registers(dsa);
            __syncwarp();
            fence_operands();
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; ++kk)
                wgmma<DP, 1>(dv, pa[kk], dout_mnmajor.at(mnmajor_offset(kk)));
            commit();
        }

        // Both warpgroups' dS^T rows, for the tensor cores; tile i - 1 is done with.
        fence_async_proxy();
        consumer_sync();  // both warpgroups
        if (threadIdx.x == 0 && i + STAGES - 1 < kb.iterations) stream.issue(i + STAGES - 1);

        float dq[DQ_N / 8][4];
        zero(dq);
        fence_registers(dq);
        __syncwarp();
        fence_operands();
        // The address of the atomic adds now: computed after the wait below, its 64-bit
        // arithmetic delayed them (ptxas does not move it above the branch on masked_out).
        float* const dq_at = dq_fragments_at(p, kb, h, m0, group);
        const Descriptor ds = mnmajor_base(shared_address(ds_tile), TILE_M * 128);
        const Descriptor features = this_iteration(k_features);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            wgmma_ss<DQ_N, 1, 1>(dq, ds.at(mnmajor_offset(kk)), features.at(mnmajor_offset(kk)));
        commit();
        // dK's product after dQ's (FlashAttention-3's order), so that dQ leaves while dK's
        // product runs.
        if (!masked_out) {
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; ++kk)
                wgmma<DP, 1>(dk, dsa[kk], q_mnmajor.at(mnmajor_offset(kk)));
            commit();
            wait_pending<1>();  // dV's and dQ's products
        } else {
            wait_all();  // dQ's
        }
        fence_registers(dq);
        fence_registers(dv);
        fence_registers(pa);
        // dQ: the warpgroup's 64 queries of the tile by its DQ_N features.
        add_dq_fragments(dq, dq_at);
        wait_all();  // dK's: dS^T's registers are rewritten next tile
        fence_registers(dk);
        fence_registers(dsa);
    }

    store_key_rows<false, DP>(dv, p.dv, p.dv_stride, kb, p, key_first, 0, lane);
    store_key_rows<true, DP>(dk, p.dk, p.dk_stride, kb, p, key_first, 0, lane);
}

// KIND 4: head_dim padded to 256 splits the features between the warpgroups (backward_wide),
// 64 and 128 the keys (backward_narrow).
template <int D = DTYPE>
__device__ void backward(const AttentionKernelParams& p, char* smem) {
    if constexpr (DP > 128)
        backward_wide(p, smem);
    else
        backward_narrow(p, smem);
}

}  // namespace wg

}  // namespace tc

}  // namespace

#endif
