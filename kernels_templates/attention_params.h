// Run-time arguments of the attention kernels, passed by value as their single parameter, the
// shared-memory layout of the tensor-core kernels and the launch plan (block size, rows per
// block, shared memory). Compiled twice: into the host (src/ops/attention/cuda_attention.cpp,
// attention_kernel_choice.cpp) and, embedded, into every attention kernel by NVRTC, so the two
// sides cannot disagree on the layout. Plain C++ only: kernels compile without any toolkit
// header.
#ifndef ROPE_JIT_ATTENTION_PARAMS_H
#define ROPE_JIT_ATTENTION_PARAMS_H

#include "host_device.h"

struct AttentionKernelParams {
    // [B, H, S, D] views; strides in elements. out is written by the forward and read by the
    // backward; lse ([B, Hq, Sq], float32) likewise (NULL in a forward without lse).
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;
    long long q_stride[4];
    long long k_stride[4];
    long long v_stride[4];
    long long out_stride[4];
    long long lse_stride[3];

    // Backward: dout read; dq, dk, dv written.
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    long long dout_stride[4];
    long long dq_stride[4];
    long long dk_stride[4];
    long long dv_stride[4];

    // Rotation tables [P, C] (NULL without rotation) and pos_mask as [B, N] (batch stride 0
    // for a 1-dim mask).
    const void* cos;
    const void* sin;
    long long cos_stride[2];
    long long sin_stride[2];
    const unsigned char* pos_mask;
    long long pos_mask_stride[2];

    // attn_mask as a [B, Sq, Sk] view (zero strides broadcast), or NULL.
    const void* attn_mask;
    long long mask_stride[3];

    long long batch;
    long long heads_q;
    long long heads_k;
    long long seqlen_q;
    long long seqlen_k;
    // Blocks along the sequence per (batch, head) in the grid; the grid is
    // sequence_blocks * batch * heads blocks.
    long long sequence_blocks;
    float scale;       // softmax scale
    float scale_log2;  // scale * log2(e): the kernels work in base 2

    // The forward with producer warps: the TMA descriptor (CUtensorMap) of v as a [B, H, S, D]
    // tensor, boxes of 64 features by block_n / cluster tokens, 128-byte swizzled.
    alignas(64) unsigned char v_map[128];

    // The sm_90 backward (kinds 3-5, see attention.cu), through a workspace the host allocates
    // per call: q and k rotated once ([B, Hq, Sq_padded, DP] and [B, Hk, Sk_padded, DP], DP the
    // padded head_dim, zero past the sequence and past head_dim), dq accumulated in float32
    // ([B, Hq, Sq_padded, DP]), and per query row the lse in base 2 (+inf for a row that sees
    // nothing or lies past Sq) and delta = dout . out ([B, Hq, Sq_padded] each).
    void* q_rot;
    void* k_rot;
    float* dq_accum;
    float* row_lse2;
    float* row_delta;
    long long seqlen_q_padded;  // a multiple of the backward's query tile (64)
    long long seqlen_k_padded;  // a multiple of its key block (128)
    // Blocks of the prepare kernel that rotate query rows; the rest rotate key rows.
    long long prepare_query_blocks;
    // TMA descriptors of the rotated q (boxes of 64 features by 64 tokens), the rotated k
    // (by block_n tokens) and dout (64 tokens); v's is v_map (block_n tokens).
    alignas(64) unsigned char q_map[128];
    alignas(64) unsigned char k_map[128];
    alignas(64) unsigned char dout_map[128];
};

// Query rows of one tile of the sm_90 backward, and the row multiple of the workspace's query
// rows; its key block (the multiple of the workspace's key rows).
constexpr int kAttentionBackwardQueryTile = 64;
constexpr int kAttentionBackwardKeyBlock = 128;

// Byte offsets of the shared-memory buffers of one block of a tensor-core kernel (kind 0
// forward, 1 backward dq, 2 backward dk/dv), and the total to launch with. Buffers a kernel
// does not use have size 0. Row buffers hold 16-bit elements with rows of (head_dim_padded +
// 8) elements: the 16-byte pad keeps ldmatrix free of bank conflicts. The wgmma forward's key
// and value tiles are the exception: unpadded and chunk-major (see tc::wg in attention.cu).
struct AttentionSmemLayout {
    // Forward/dq: the block's query rows and their plain copy (pos_mask), dout rows (dq),
    // and the streamed key tiles (raw keys staged, rotated keys, values in two buffers).
    // dk/dv: the block's key rows and values, and the streamed query tiles (raw queries and
    // out rows staged, rotated queries, dout in two buffers).
    // wgmma forward: q, then `stages` key tiles from k and `stages` value tiles from v0
    // (k_stage and v1 unused).
    int q, q_plain, q_stage, o_stage, dout0, dout1;
    int k, k_plain, k_stage, v0, v1;
    // The table rows of the streamed tile, staged raw (cos, then sin); the wgmma forward keeps
    // stages - 1 tiles' worth, each item's columns together.
    int cos_stage, sin_stage;
    // Per-row values of the backward: float row_a[queries], row_b[queries] (lse and delta of query rows;
    // dk/dv has a second row_a half where the next tile's lse lands), then unsigned char
    // positioned flags of the query and key rows.
    int row_a, row_b, q_flags, k_flags;
    // The wgmma forward with producer warps: the rotated query rows, 128-byte swizzled for
    // the tensor cores (q_tile; q is empty there), and 8-byte mbarriers, `stages` each of
    // landed, full and empty.
    int q_tile, barriers;
    // The sm_90 backward (kind 4): two tiles of dS^T (block_n keys by 64 queries, swizzled);
    // at head_dim 256 one, with P^T beside it (16-bit, swizzled) and dP^T (float32, plain).
    int ds, pt, dpt;
    int bytes;
};

ROPE_JIT_HOST_DEVICE constexpr int attention_align16(int bytes) {
    return (bytes + 15) / 16 * 16;
}

// Reserves `bytes` (rounded up to 16) at *at and returns their offset.
ROPE_JIT_HOST_DEVICE constexpr int attention_take(int* at, int bytes) {
    const int offset = *at;
    *at += attention_align16(bytes);
    return offset;
}

// Moves *at up to a multiple of `alignment` (a power of two).
ROPE_JIT_HOST_DEVICE constexpr void attention_align(int* at, int alignment) {
    *at = (*at + alignment - 1) / alignment * alignment;
}

// `block_n` is the streamed tile's rows; the resident rows are 16 * m_tiles * warps.
// `table_row_bytes` is the staged bytes of one table row (0: tables are not staged). The
// forward rotates each key tile in place and keeps one value buffer; dq stages raw keys and
// double-buffers values. The wgmma forward (sm_90) keeps `stages` key tiles (from k) and
// value tiles (from v0), each in the tensor cores' core-matrix layout (unpadded rows of
// head_dim_padded elements), and the table rows of the stages - 1 key tiles in flight; with
// `producer` warps, no staged table rows, tiles in the 128-byte-swizzle layout (which repeats
// every 1024 bytes, so they start at multiples of 1024), the query rows in that layout only
// (q_tile, no padded rows) and the barriers of the tile buffers.
// The sm_90 backward (kind 4): its key block's rotated keys and values (block_n rows each),
// `stages` tiles each of rotated queries and dout (64 rows) with their lse and delta rows, two
// dS^T tiles (at head_dim 256: one, beside a P^T tile and a float32 dP^T tile), all but dP^T
// 128-byte swizzled (1024-byte aligned), and the barriers: one per stage, one for the keys and
// values.
ROPE_JIT_HOST_DEVICE constexpr AttentionSmemLayout attention_backward_smem_layout(
    int head_dim_padded, int block_n, int stages) {
    AttentionSmemLayout l{};
    const int tile_m = kAttentionBackwardQueryTile;
    const bool wide = head_dim_padded > 128;
    int at = 0;
    int* const cursor = &at;
    l.k = attention_take(cursor, block_n * head_dim_padded * 2);
    l.v0 = attention_take(cursor, block_n * head_dim_padded * 2);
    l.q = attention_take(cursor, stages * tile_m * head_dim_padded * 2);
    l.dout0 = attention_take(cursor, stages * tile_m * head_dim_padded * 2);
    l.ds = attention_take(cursor, (wide ? 1 : 2) * block_n * tile_m * 2);
    l.pt = attention_take(cursor, wide ? block_n * tile_m * 2 : 0);
    l.dpt = attention_take(cursor, wide ? block_n * tile_m * 4 : 0);
    l.row_a = attention_take(cursor, stages * tile_m * 4);
    l.row_b = attention_take(cursor, stages * tile_m * 4);
    l.barriers = attention_take(cursor, (stages + 1) * 8);
    l.bytes = at;
    return l;
}

ROPE_JIT_HOST_DEVICE constexpr AttentionSmemLayout attention_smem_layout(
    int kind, int head_dim_padded, int warps, int m_tiles, int block_n, bool pos_mask,
    int table_row_bytes, bool wgmma, int stages, bool producer) {
    if (kind == 4) return attention_backward_smem_layout(head_dim_padded, block_n, stages);
    if (kind == 3 || kind == 5) return AttentionSmemLayout{};  // row kernels: no shared memory
    AttentionSmemLayout l{};
    const int row_bytes = (head_dim_padded + 8) * 2;
    const int tile_row_bytes = wgmma ? head_dim_padded * 2 : row_bytes;  // rows of streamed tiles
    const int tiles = wgmma ? stages : 1;  // key (and value) tiles held
    const int resident = 16 * m_tiles * warps;
    const int queries = kind == 2 ? block_n : resident;  // query rows held at once
    const int keys = kind == 2 ? resident : block_n;     // key rows held at once
    int at = 0;
    int* const cursor = &at;
    // (The wgmma forward with producers keeps its query rows in q_tile alone.)
    l.q = attention_take(cursor, producer ? 0 : queries * row_bytes);
    l.q_plain = attention_take(cursor, pos_mask ? queries * row_bytes : 0);
    l.q_stage = attention_take(cursor, kind == 2 ? queries * row_bytes : 0);
    l.o_stage = attention_take(cursor, kind == 2 ? queries * row_bytes : 0);
    l.dout0 = attention_take(cursor, kind != 0 ? queries * row_bytes : 0);
    l.dout1 = attention_take(cursor, kind == 2 ? queries * row_bytes : 0);
    if (producer) attention_align(cursor, 1024);
    l.k = attention_take(cursor, tiles * keys * tile_row_bytes);
    l.k_plain = attention_take(cursor, pos_mask ? keys * row_bytes : 0);
    l.k_stage = attention_take(cursor, kind == 1 ? keys * row_bytes : 0);
    l.v0 = attention_take(cursor, tiles * keys * tile_row_bytes);
    l.v1 = attention_take(cursor, kind == 1 ? keys * row_bytes : 0);
    const int staged_rows = producer ? 0 : (kind == 2 ? queries : keys) * (wgmma ? stages - 1 : 1);
    l.cos_stage = attention_take(cursor, staged_rows * table_row_bytes);
    l.sin_stage = attention_take(cursor, staged_rows * table_row_bytes);
    l.row_a = attention_take(cursor,
                             kind == 0 ? 0 : (kind == 2 ? 2 : 1) * queries * 4);  // the backward's
    l.row_b = attention_take(cursor, kind == 0 ? 0 : queries * 4);
    l.q_flags = attention_take(cursor, queries);
    l.k_flags = attention_take(cursor, keys);
    if (producer) attention_align(cursor, 1024);
    l.q_tile = attention_take(cursor, producer ? queries * head_dim_padded * 2 : 0);
    l.barriers = attention_take(cursor, producer ? 3 * stages * 8 : 0);
    l.bytes = at;
    return l;
}

// What the host launcher and the kernel both derive from a spec's fields: one function, so a
// one-sided edit cannot launch a kernel with a grid, block or shared-memory size it does not
// expect. The host calls it with an AttentionSpec's fields (attention_kernel_choice.cpp), the
// kernel with its specialization constants (attention_common.h).
struct AttentionLaunchPlan {
    int head_dim_padded;       // head_dim rounded up to the mma k-step (16)
    int table_columns;         // columns of a table row the kernel reads (0 without rotation)
    int table_row_bytes;       // bytes of one table row staged in shared memory (0: read in place)
    int rows_per_block;        // sequence rows a block owns: 16 * m_tiles * warps on tensor cores,
                               // one per warp on CUDA cores
    int threads;               // threads of a block: computing warps and producer warps
    int shared_bytes;          // dynamic shared memory of a block (0 for the CUDA-core kernels)
    AttentionSmemLayout smem;  // its buffers (computed for every spec; used by tensor cores)
};

// `kind` 0 forward, 1 dq, 2 dk/dv; `table_dtype` 0 float32, else 16-bit; `table_async` tables
// staged with cp.async; the rest as the AttentionSpec fields of the same names.
ROPE_JIT_HOST_DEVICE constexpr AttentionLaunchPlan attention_launch_plan(
    int kind, int head_dim, int rotary_dim, bool interleaved, bool table_full, int table_dtype,
    bool table_async, bool pos_mask, bool tensor_cores, bool wgmma, int warps, int m_tiles,
    int block_n, int stages, int producer_warps) {
    AttentionLaunchPlan plan{};
    plan.head_dim_padded = (head_dim + 15) / 16 * 16;
    plan.table_columns = table_columns(table_full, interleaved, rotary_dim / 2);
    plan.table_row_bytes =
        rotary_dim > 0 && table_async ? plan.table_columns * (table_dtype == 0 ? 4 : 2) : 0;
    plan.rows_per_block = tensor_cores ? 16 * m_tiles * warps : warps;
    plan.threads = (warps + producer_warps) * 32;
    plan.smem = attention_smem_layout(kind, plan.head_dim_padded, warps, m_tiles, block_n, pos_mask,
                                      plan.table_row_bytes, wgmma, stages, producer_warps > 0);
    plan.shared_bytes = tensor_cores ? plan.smem.bytes : 0;
    // The sm_90 backward: the prepare and dq-finish kernels work through 64-row blocks; the
    // main kernel owns block_n keys.
    if (kind == 3 || kind == 5)
        plan.rows_per_block = kAttentionBackwardQueryTile;
    else if (kind == 4)
        plan.rows_per_block = block_n;
    return plan;
}

#endif
