// Attention templates: the primitives of the tensor-core kernels (sm_80 mma.sync and the sm_90
// forward): tile constants and the shared-memory layout (attention_smem_layout, also used by
// the host), cp.async copies, 16-bit packing, ldmatrix and mma, the small GEMMs over resident
// rows, row copies, the epilogue store, and the carving of shared memory into buffers.
#ifndef ROPE_JIT_ATTENTION_MMA_H
#define ROPE_JIT_ATTENTION_MMA_H

namespace {

namespace tc {

// ============================================================================================
// Tensor-core kernels (mma.sync m16n8k16, fp32 accumulators). Every function here is a template
// so that nothing of it reaches the PTX of a CUDA-core specialization.
// ============================================================================================

constexpr int DP = PLAN.head_dim_padded;  // head_dim padded to the mma k-step
constexpr int ROWE = DP + 8;              // elements per shared-memory row (16-byte pad)
constexpr int CHUNKS = DP / 8;            // 16-byte chunks per row
constexpr int DCHUNKS = HEAD_DIM / 8;     // chunks holding features (HEAD_DIM % 8 == 0)
constexpr int KSTEPS = DP / 16;
constexpr int DTILES = DP / 8;
constexpr int RESIDENT = PLAN.rows_per_block;                          // 16 * M_TILES * WARPS
constexpr int TCOLS = PLAN.table_columns;                              // table columns read
constexpr int TABLE_STEP = table_columns(TABLE_FULL, INTERLEAVED, 1);  // table columns per pair
constexpr int TBYTES = TABLE_DTYPE == 0 ? 4 : 2;
constexpr int TABLE_ROW_BYTES = PLAN.table_row_bytes;  // TCOLS * TBYTES when staged
constexpr int TABLE_CHUNKS = TABLE_ROW_BYTES / 16;
constexpr AttentionSmemLayout SMEM = PLAN.smem;

// Rotation work items of one row: a chunk of interleaved pairs, or (half style) a chunk of
// first halves with the chunk of their partners R/2 later; then the chunks past the rotary
// features, copied.
constexpr int ROT_ITEMS = !ROTATE ? 0 : INTERLEAVED ? ROTARY_DIM / 8 : ROTARY_DIM / 16;
constexpr int FIRST_PLAIN = ROTATE ? ROTARY_DIM / 8 : 0;
constexpr int ITEMS = ROT_ITEMS + CHUNKS - FIRST_PLAIN;

static_assert(!TENSOR_CORES || DTYPE != 0, "tensor-core kernels take 16-bit inputs");
static_assert(!TENSOR_CORES || HEAD_DIM % 8 == 0, "tensor-core kernels need head_dim % 8 == 0");
static_assert(!TENSOR_CORES || !ROTATE ||
                  (INTERLEAVED ? ROTARY_DIM % 8 == 0 : ROTARY_DIM % 16 == 0),
              "rotation by 16-byte chunks needs whole pairs per chunk");
static_assert(!TENSOR_CORES || BLOCK_N % 16 == 0, "streamed tiles are whole mma k-steps");
static_assert(!TENSOR_CORES || !ROTATE || !TABLE_ASYNC || TABLE_ROW_BYTES % 16 == 0,
              "staged table rows are 16-byte chunks");

struct alignas(16) U4 {
    unsigned w[4];
};

struct F2 {
    float x, y;
};

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    unsigned address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address)
        : "l"(pointer));
    return address;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Waits until at most `PENDING` of this thread's most recent copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

template <int D = DTYPE>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    if constexpr (D == 1)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
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
    return static_cast<unsigned>(
        (((lane & 7) + ((lane >> 4) << 3)) * ROWE + ((lane >> 3) & 1) * 8) * 2);
}
__device__ __forceinline__ unsigned bt_lane_offset(int lane) {
    return static_cast<unsigned>((((lane & 7) + ((lane >> 3) & 1) * 8) * ROWE + (lane >> 4) * 8) *
                                 2);
}

// c += a * b for one m16n8k16 tile (a: 4 registers of A, b0/b1: B).
template <int D = DTYPE>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
    if constexpr (D == 1)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, "
            "%7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[NT] += A B^T over the head dim: A = 16 rows at a_rows, B = 8*NT rows at b_rows (both
// shared-memory rows of ROWE elements). S = Q K^T, dP = dO V^T, and their transposes.
template <int NT>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], const T* a_rows, const T* b_rows,
                                         int lane) {
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
__device__ __forceinline__ void gemm_ab(float (&acc)[DTILES][4], const unsigned (&a)[KS][4],
                                        const T* b_rows, int lane) {
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
__device__ __forceinline__ void gemm_abt_mt(float (&acc)[MT][NT][4], const T* a_rows,
                                            const T* b_rows, int lane) {
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
__device__ __forceinline__ void gemm_ab_mt(float (&acc)[MT][DTILES][4],
                                           const unsigned (&a)[MT][KS][4], const T* b_rows,
                                           int lane) {
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
__device__ __forceinline__ void issue_rows(T* dst, const T* base, long long stride, long long row0,
                                           long long valid) {
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, ch = c - r * CHUNKS;
        const bool ok = row0 + r < valid && ch < DCHUNKS;
        cp_async16(dst + r * ROWE + ch * 8, ok ? base + (row0 + r) * stride + ch * 8 : base, ok);
    }
}

// Starts copying the cos/sin row bytes of tokens [row0, row0 + ROWS) (zero past `valid`).
template <int ROWS>
__device__ __forceinline__ void issue_table_rows(char* cos_dst, char* sin_dst,
                                                 const AttentionKernelParams& p, long long row0,
                                                 long long valid) {
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

// A warp's 16 shared staging rows of ROWE elements (the padded row layout).
struct PaddedRows {
    T* rows;
    // Element `element` of staging row `row`.
    __device__ __forceinline__ T* at(int row, int element) const {
        return rows + row * ROWE + element;
    }
};

// Stores a warp's 16 x HEAD_DIM result rows (accumulators times `scale`) through its own
// shared rows `stage` (PaddedRows, or any type with the same at()) to global rows
// first_row.. (those below `valid`), 16 bytes at a time; store_rows: through padded rows.
template <class Stage, int D = DTYPE>
__device__ __forceinline__ void store_staged_rows(const float (&acc)[DTILES][4], float scale0,
                                                  float scale1, const Stage& stage, T* base,
                                                  long long stride, long long first_row,
                                                  long long valid, int lane) {
    const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) {
        *reinterpret_cast<unsigned*>(stage.at(g, dt * 8 + t2)) =
            pack2(acc[dt][0] * scale0, acc[dt][1] * scale0);
        *reinterpret_cast<unsigned*>(stage.at(g + 8, dt * 8 + t2)) =
            pack2(acc[dt][2] * scale1, acc[dt][3] * scale1);
    }
    __syncwarp();
    for (int c = lane; c < 16 * DCHUNKS; c += 32) {
        const int row = c / DCHUNKS, ch = c - row * DCHUNKS;
        if (first_row + row < valid)
            *reinterpret_cast<U4*>(base + (first_row + row) * stride + ch * 8) =
                *reinterpret_cast<const U4*>(stage.at(row, ch * 8));
    }
    __syncwarp();
}
template <int D = DTYPE>
__device__ __forceinline__ void store_rows(const float (&acc)[DTILES][4], float scale0,
                                           float scale1, T* stage, T* base, long long stride,
                                           long long first_row, long long valid, int lane) {
    store_staged_rows(acc, scale0, scale1, PaddedRows{stage}, base, stride, first_row, valid,
                      lane);
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

}  // namespace tc

}  // namespace

#endif
