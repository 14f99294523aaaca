// Attention templates: the sm_90a forward on warpgroup matrix products (wgmma): instruction
// wrappers, matrix descriptors, tile copies and rotation into the core-matrix layout, and the
// forward in which every warp loads and computes.
#ifndef ROPE_JIT_ATTENTION_WGMMA_H
#define ROPE_JIT_ATTENTION_WGMMA_H

namespace {

namespace tc {

// ---- the forward on sm_90: warpgroup matrix products ----------------------------------------
//
// WGMMA: each warpgroup (4 warps) owns 64 query rows, rotated once in shared memory and loaded
// from there as the A operand (registers) of every tile's S = Q K^T; the tensor cores read key
// and value tiles from shared memory through matrix descriptors. STAGES tiles of BLOCK_N keys (and values) are in shared memory, STAGES - 1 of
// them arriving, with one barrier per tile:
//   top of tile t: K_{t+S-1}, its table rows and V_{t+S-1} start arriving (cp.async)
//   S = Q K_t^T; masks; online softmax; O += P V_t (issued, runs on)
//   once K_{t+1} landed, each thread rotates the chunks it copied itself (no barrier needed)
//   wait for O; make the shared-memory writes visible to the tensor cores; barrier
// A streamed tile is stored "chunk-major": 16-byte chunk c of row r at (c * BLOCK_N + r) * 16,
// so eight consecutive rows of one chunk form one 128-byte core matrix of the wgmma layout.

namespace wg {

// Operand lists of the wgmma wrappers: accumulators d[N/8][4] as %0.. (N/2 registers), then
// A's four registers, B's descriptor and the transpose flag.
#define ROPE_JIT_WGMMA_D64                                                                        \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
        "+f"(d[7][2]), "+f"(d[7][3])
#define ROPE_JIT_WGMMA_REGS64                                                \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ROPE_JIT_WGMMA_ARGS64 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
#define ROPE_JIT_WGMMA_D128                                                                        \
    ROPE_JIT_WGMMA_D64, "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), \
        "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),               \
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),            \
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),            \
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]),            \
        "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]),            \
        "+f"(d[15][2]), "+f"(d[15][3])
#define ROPE_JIT_WGMMA_REGS128                                                         \
    ROPE_JIT_WGMMA_REGS64                                                              \
    ", "                                                                               \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ROPE_JIT_WGMMA_ARGS128 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
// m64n256k16 (the value product at head_dim 256): 128 accumulators.
#define ROPE_JIT_WGMMA_D256                                                              \
    ROPE_JIT_WGMMA_D128, "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), \
        "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]),  \
        "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]),  \
        "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]),  \
        "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]),  \
        "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]),  \
        "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]),  \
        "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]),  \
        "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]),  \
        "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]),  \
        "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]),  \
        "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]),  \
        "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
#define ROPE_JIT_WGMMA_REGS256                                                 \
    ROPE_JIT_WGMMA_REGS128                                                     \
    ", "                                                                       \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, "             \
    "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, "             \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "             \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
    "%124, %125, %126, %127"
#define ROPE_JIT_WGMMA_ARGS256 "}, {%128, %129, %130, %131}, %132, p, 1, 1, %133;\n}\n"

// One wgmma with A in registers (a), B by descriptor (b), the accumulators d, scale-d true;
// SHAPE_TYPES names shape and types, N selects the operand lists above.
#define ROPE_JIT_WGMMA(SHAPE_TYPES, N)                                                      \
    asm volatile(                                                                           \
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES \
        " {" ROPE_JIT_WGMMA_REGS##N ROPE_JIT_WGMMA_ARGS##N                                  \
        : ROPE_JIT_WGMMA_D##N                                                               \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B))

template <int TRANS_B, int D = DTYPE>
__device__ __forceinline__ void wgmma_n64(float (&d)[8][4], const unsigned (&a)[4],
                                          unsigned long long b) {
    if constexpr (D == 1)
        ROPE_JIT_WGMMA("m64n64k16.f32.f16.f16", 64);
    else
        ROPE_JIT_WGMMA("m64n64k16.f32.bf16.bf16", 64);
}

template <int TRANS_B, int D = DTYPE>
__device__ __forceinline__ void wgmma_n128(float (&d)[16][4], const unsigned (&a)[4],
                                           unsigned long long b) {
    if constexpr (D == 1)
        ROPE_JIT_WGMMA("m64n128k16.f32.f16.f16", 128);
    else
        ROPE_JIT_WGMMA("m64n128k16.f32.bf16.bf16", 128);
}

template <int TRANS_B, int D = DTYPE>
__device__ __forceinline__ void wgmma_n256(float (&d)[32][4], const unsigned (&a)[4],
                                           unsigned long long b) {
    if constexpr (D == 1)
        ROPE_JIT_WGMMA("m64n256k16.f32.f16.f16", 256);
    else
        ROPE_JIT_WGMMA("m64n256k16.f32.bf16.bf16", 256);
}

// d (64 x N over the warpgroup) += A (registers, 64 x 16) * B (shared memory, 16 x N);
// TRANS_B: B is stored N-major (values) rather than K-major (keys).
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma(float (&d)[N / 8][4], const unsigned (&a)[4],
                                      unsigned long long b) {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma tiles of 64, 128 or 256 columns");
    if constexpr (N == 64)
        wgmma_n64<TRANS_B>(d, a, b);
    else if constexpr (N == 128)
        wgmma_n128<TRANS_B>(d, a, b);
    else
        wgmma_n256<TRANS_B>(d, a, b);
}

// The same with A from shared memory too (descriptor a), each operand K-major (0) or MN-major
// (1, "transposed"): TRANS_A and TRANS_B.
#define ROPE_JIT_WGMMA_D32                                                                        \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define ROPE_JIT_WGMMA_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define ROPE_JIT_WGMMA_SS_ARGS32 "}, %16, %17, p, 1, 1, %18, %19;\n}\n"
#define ROPE_JIT_WGMMA_SS_ARGS64 "}, %32, %33, p, 1, 1, %34, %35;\n}\n"
#define ROPE_JIT_WGMMA_SS_ARGS128 "}, %64, %65, p, 1, 1, %66, %67;\n}\n"
#define ROPE_JIT_WGMMA_SS(SHAPE_TYPES, N)                                                   \
    asm volatile(                                                                           \
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES \
        " {" ROPE_JIT_WGMMA_REGS##N ROPE_JIT_WGMMA_SS_ARGS##N                               \
        : ROPE_JIT_WGMMA_D##N                                                               \
        : "l"(a), "l"(b), "n"(TRANS_A), "n"(TRANS_B))

// d (64 x N over the warpgroup) += A (shared memory, 64 x 16) * B (shared memory, 16 x N),
// each stored K-major unless its TRANS flag says MN-major.
template <int N, int TRANS_A = 0, int TRANS_B = 0, int D = DTYPE>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], unsigned long long a,
                                         unsigned long long b) {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma tiles of 32, 64 or 128 columns");
    if constexpr (N == 32) {
        if constexpr (D == 1)
            ROPE_JIT_WGMMA_SS("m64n32k16.f32.f16.f16", 32);
        else
            ROPE_JIT_WGMMA_SS("m64n32k16.f32.bf16.bf16", 32);
    } else if constexpr (N == 64) {
        if constexpr (D == 1)
            ROPE_JIT_WGMMA_SS("m64n64k16.f32.f16.f16", 64);
        else
            ROPE_JIT_WGMMA_SS("m64n64k16.f32.bf16.bf16", 64);
    } else {
        if constexpr (D == 1)
            ROPE_JIT_WGMMA_SS("m64n128k16.f32.f16.f16", 128);
        else
            ROPE_JIT_WGMMA_SS("m64n128k16.f32.bf16.bf16", 128);
    }
}

// Orders this thread's register writes before the next wgmma reads them.
__device__ __forceinline__ void fence_operands() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Waits until at most N of this warp's committed wgmma groups are pending (the older ones are
// done).
template <int N>
__device__ __forceinline__ void wait_pending() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's shared-memory writes (stores and completed cp.async) visible to the
// tensor cores, which read through the async proxy; a barrier must follow.
__device__ __forceinline__ void fence_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A shared-memory matrix descriptor without swizzling: start address, the byte distance of
// core matrices along K (leading) and along M/N (stride), each in 16-byte units.
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading,
                                                         unsigned stride) {
    return static_cast<unsigned long long>((address >> 4) & 0x3fffu) |
           static_cast<unsigned long long>((leading >> 4) & 0x3fffu) << 16 |
           static_cast<unsigned long long>((stride >> 4) & 0x3fffu) << 32;
}

// The same with 128-byte swizzling (layout type 1 in bits 62-63): the 8-row, 1024-byte
// pattern of swizzled_offset, the distance of its repeats along M/N (stride) and, for
// N-major operands, of 64-element regions (leading).
__device__ __forceinline__ unsigned long long swizzled_descriptor(unsigned address,
                                                                  unsigned leading,
                                                                  unsigned stride) {
    return descriptor(address, leading, stride) | 1ull << 62;
}

constexpr int CHUNK_STRIDE = BLOCK_N * 16;  // bytes between chunk c and c + 1 of a tile row
// Keys (B of S = Q K^T, K-major): the next 16 features are 2 chunks on, 8 rows are 128 bytes.
constexpr unsigned K_LEADING = CHUNK_STRIDE, K_STRIDE = 128, K_STEP = 2 * CHUNK_STRIDE;
// Values (B of O += P V, N-major): the next 8 keys are 128 bytes on, 8 features one chunk.
constexpr unsigned V_LEADING = 128, V_STRIDE = CHUNK_STRIDE, V_STEP = 256;

// SWIZZLED (the producer-warp forward, whose tiles TMA copies): a tile is DP / 64 regions of
// 64 features, each BLOCK_N rows of 128 bytes, and chunk c of row r sits at chunk
// (c ^ r) % 8 of its row (TMA's SWIZZLE_128B, which wgmma reads by swizzled descriptors).
// Copies then move 128-byte rows rather than 16-byte chunks, and eight rows of one chunk
// still fall in eight different banks.
constexpr bool SWIZZLED = PRODUCER_WARPS > 0;
constexpr int REGION_BYTES = BLOCK_N * 128;
static_assert(!SWIZZLED || DP % 64 == 0, "swizzled tiles are whole 64-feature regions");
// The byte offset of chunk `chunk` of row `row` in such a tile of ROWS-row regions.
template <int ROWS = BLOCK_N>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
    return (chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk ^ row) & 7) << 4);
}
// The forward's descriptors as a base per tile and a byte offset per k-step: the offset adds
// to the 14-bit start-address field alone (one integer add, no shift and mask per k-step).
// The sum never carries out of the field: it stays a shared-memory address below 228 KB, and
// the field holds addresses below 256 KB. (Each descriptor built whole per k-step cost ten
// instructions; hoisted out of the loop, the query ones took eight registers and spilled.)
struct Descriptor {
    unsigned lo, hi;  // start address and leading offset; stride and layout
    __device__ __forceinline__ unsigned long long at(unsigned offset) const {
        return static_cast<unsigned long long>(hi) << 32 | (lo + (offset >> 4));
    }
};
__device__ __forceinline__ Descriptor descriptor_base(unsigned address, unsigned leading,
                                                      unsigned stride, bool swizzled) {
    return {((address >> 4) & 0x3fffu) | ((leading >> 4) & 0x3fffu) << 16,
            ((stride >> 4) & 0x3fffu) | (swizzled ? 1u << 30 : 0u)};
}
// Keys: k-step kk (16 features) is 32 bytes on within a region (SWIZZLED) or two chunks on.
__device__ __forceinline__ Descriptor key_descriptor(unsigned tile) {
    return SWIZZLED ? descriptor_base(tile, 16, 1024, true)
                    : descriptor_base(tile, K_LEADING, K_STRIDE, false);
}
__device__ __forceinline__ constexpr unsigned key_offset(int kk) {
    return SWIZZLED ? (kk >> 2) * REGION_BYTES + (kk & 3) * 32 : kk * K_STEP;
}
// The query rows of a warpgroup (A of S = Q K^T, K-major) in the same layout as a 64-row key
// tile.
constexpr int QUERY_REGION_BYTES = 64 * 128;
constexpr int QUERY_GROUP_BYTES = 64 * DP * 2;  // one warpgroup's query rows
__device__ __forceinline__ Descriptor query_descriptor(unsigned group_tile) {
    return descriptor_base(group_tile, 16, 1024, true);
}
__device__ __forceinline__ constexpr unsigned query_offset(int kk) {
    return (kk >> 2) * QUERY_REGION_BYTES + (kk & 3) * 32;
}
// Values: k-step kk (16 keys) is 16 rows on.
__device__ __forceinline__ Descriptor value_descriptor(unsigned tile) {
    return SWIZZLED ? descriptor_base(tile, REGION_BYTES, 1024, true)
                    : descriptor_base(tile, V_LEADING, V_STRIDE, false);
}
__device__ __forceinline__ constexpr unsigned value_offset(int kk) {
    return SWIZZLED ? kk * 16 * 128 : kk * V_STEP;
}

// Who loads what of a streamed tile: the tile is cut into units of 8 rows x 4 items (rotation
// items, numbered as in rotate_rows: chunks of interleaved pairs or first-half chunks with their
// partners, then plain chunks; for values, chunks); warp w takes units w, w + WARPS, ... and in
// a unit lane l takes row l % 8 and item l / 8. Each quarter warp then stores 8 consecutive
// rows of one chunk (one 128-byte core matrix: no bank conflicts) and each row is read 64
// bytes at a time (whole 32-byte sectors). The thread that copies a key chunk also rotates
// it, so the rotation needs no barrier after the copies. Rotating items stage the table
// columns of their own pairs: ITEM_TABLE_BYTES per item and table.
constexpr int ROW_UNITS = BLOCK_N / 8;
constexpr int KEY_PASSES = (ROW_UNITS * ((ITEMS + 3) / 4) + WARPS - 1) / WARPS;
constexpr int VALUE_PASSES = (ROW_UNITS * ((CHUNKS + 3) / 4) + WARPS - 1) / WARPS;
constexpr int ITEM_PAIRS = INTERLEAVED ? 4 : 8;
constexpr int ITEM_TABLE_BYTES = ITEM_PAIRS * TABLE_STEP * TBYTES;
static_assert(!WGMMA || !ROTATE || !TABLE_ASYNC || ITEM_TABLE_BYTES % 8 == 0,
              "staged table pieces of 8 or 16 bytes");

// Row and item of this thread in pass `pass` over a tile of `items` items per row; false past
// the tile.
__device__ __forceinline__ bool unit_slot(int pass, int items, int* row, int* item) {
    const int unit = static_cast<int>(threadIdx.x >> 5) + WARPS * pass, lane = threadIdx.x & 31;
    *row = (unit % ROW_UNITS) * 8 + (lane & 7);
    *item = (unit / ROW_UNITS) * 4 + (lane >> 3);
    return unit < ROW_UNITS * ((items + 3) / 4) && *item < items;
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}

// Starts copying key rows [n0, n0 + BLOCK_N) into `tile` (chunk-major, zero past Sk and past
// head_dim), with the table columns of each rotating item.
template <int D = DTYPE>
__device__ __forceinline__ void copy_key_chunks(char* tile, char* cos_stage, char* sin_stage,
                                                const AttentionKernelParams& p, const T* k_head,
                                                long long n0) {
#pragma unroll
    for (int pass = 0; pass < KEY_PASSES; ++pass) {
        int row, k;
        if (!unit_slot(pass, ITEMS, &row, &k)) continue;
        const long long token = n0 + row;
        const bool ok = token < p.seqlen_k;
        const T* src = k_head + (ok ? token : 0) * p.k_stride[2];
        char* const dst = tile + row * 16;
        if (k < ROT_ITEMS) {
            cp_async16(dst + k * CHUNK_STRIDE, src + k * 8, ok);
            if constexpr (!INTERLEAVED)
                cp_async16(dst + (k + ROTARY_DIM / 16) * CHUNK_STRIDE,
                           src + (k + ROTARY_DIM / 16) * 8, ok);
            if constexpr (TABLE_ASYNC) {
                // The item's table columns start k * ITEM_TABLE_BYTES into the token's rows.
                const char* cos_src = static_cast<const char*>(p.cos) +
                                      (ok ? token : 0) * p.cos_stride[0] * TBYTES +
                                      k * ITEM_TABLE_BYTES;
                const char* sin_src = static_cast<const char*>(p.sin) +
                                      (ok ? token : 0) * p.sin_stride[0] * TBYTES +
                                      k * ITEM_TABLE_BYTES;
                char* cos_dst = cos_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
                char* sin_dst = sin_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
                if constexpr (ITEM_TABLE_BYTES == 8) {
                    cp_async8(cos_dst, cos_src, ok);
                    cp_async8(sin_dst, sin_src, ok);
                } else {
#pragma unroll
                    for (int piece = 0; piece < ITEM_TABLE_BYTES; piece += 16) {
                        cp_async16(cos_dst + piece, cos_src + piece, ok);
                        cp_async16(sin_dst + piece, sin_src + piece, ok);
                    }
                }
            }
        } else {
            const int ch = FIRST_PLAIN + (k - ROT_ITEMS);
            cp_async16(dst + ch * CHUNK_STRIDE, src + (ch < DCHUNKS ? ch : 0) * 8,
                       ok && ch < DCHUNKS);
        }
    }
}

// Rotates, in place, the key chunks this thread copied with copy_key_chunks, once its own
// copies completed (no other thread touches them).
template <int D = DTYPE>
__device__ __forceinline__ void rotate_key_chunks(char* tile, const char* cos_stage,
                                                  const char* sin_stage,
                                                  const AttentionKernelParams& p, long long n0) {
    if constexpr (ROTATE) {
#pragma unroll
        for (int pass = 0; pass < KEY_PASSES; ++pass) {
            int row, k;
            if (!unit_slot(pass, ITEMS, &row, &k) || k >= ROT_ITEMS) continue;
            const long long token = n0 + row;
            if (token >= p.seqlen_k) continue;  // zero rows; the tables may not reach them
            // Staged angles: this item's own columns (row 0 of its stage, pairs from 0).
            const char* cos_rows = cos_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
            const char* sin_rows = sin_stage + (k * BLOCK_N + row) * ITEM_TABLE_BYTES;
            const int pair0 = TABLE_ASYNC ? 0 : k * ITEM_PAIRS;
            U4* xa = reinterpret_cast<U4*>(tile + row * 16 + k * CHUNK_STRIDE);
            if constexpr (INTERLEAVED) {
                U4 x = *xa;
                rotate_pairs_chunk<TABLE_ASYNC>(x, p, cos_rows, sin_rows, 0, token, pair0);
                *xa = x;
            } else {
                U4* xb =
                    reinterpret_cast<U4*>(tile + row * 16 + (k + ROTARY_DIM / 16) * CHUNK_STRIDE);
                U4 a = *xa, bb = *xb;
                rotate_halves_chunks<TABLE_ASYNC>(a, bb, p, cos_rows, sin_rows, 0, token, pair0);
                *xa = a;
                *xb = bb;
            }
        }
    }
}

// Starts copying rows [n0, n0 + BLOCK_N) of a head's values (or of its keys rotated
// beforehand), `row_stride` elements apart, into `tile` (chunk-major), as they are.
template <int D = DTYPE>
__device__ __forceinline__ void copy_plain_chunks(char* tile, const AttentionKernelParams& p,
                                                  const T* head, long long row_stride,
                                                  long long n0) {
#pragma unroll
    for (int pass = 0; pass < VALUE_PASSES; ++pass) {
        int row, ch;
        if (!unit_slot(pass, CHUNKS, &row, &ch)) continue;
        const long long token = n0 + row;
        const bool ok = token < p.seqlen_k && ch < DCHUNKS;
        cp_async16(tile + row * 16 + ch * CHUNK_STRIDE,
                   head + (ok ? token * row_stride + ch * 8 : 0), ok);
    }
}

// Compiler-level fences on registers a wgmma reads or writes asynchronously: the empty asm
// "modifies" them, so no use of an accumulator moves above the wait before it, and no input
// register is reused before the wait after it.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(r[i][0]), "+f"(r[i][1]), "+f"(r[i][2]), "+f"(r[i][3])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

// Hooks around the issue of a tile's two products (S = Q K^T, O += P V), for consumer
// warpgroups that take turns (the producer forward's PINGPONG): none here.
struct NoTurns {
    __device__ __forceinline__ void before_scores() const {}
    __device__ __forceinline__ void after_scores() const {}
    __device__ __forceinline__ void before_values() const {}
    __device__ __forceinline__ void after_values() const {}
};

// The masks without attn_mask, applied to unscaled scores of a warp's 16 x 8*NT tile (rows
// from row_first + g (+8), columns from first_key + 2*(lane&3) (+1), as in scale_and_mask):
// -inf where the key is past the sequence, the query is past it, or (causal) the key comes
// after the query. Each row gets the last column offset it keeps (-1: none), so that every
// score costs one compare with its constant column offset and one select.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int row_first, int first_key,
                                            int seqlen_q, int seqlen_k, bool check_bounds,
                                            bool check_causal, int lane) {
    const int col0 = first_key + 2 * (lane & 3);
    int last[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row_first + (lane >> 2) + 8 * r;
        int keep = check_bounds ? seqlen_k - 1 - col0 : BLOCK_N;
        if (CAUSAL && check_causal) keep = min(keep, i - col0);
        last[r] = check_bounds && i >= seqlen_q ? -1 : keep;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (nt * 8 + (e & 1) > last[e >> 1]) s[nt][e] = neg_inf();
}

// S = Q K^T issued for a warpgroup whose swizzled query rows start at `q_group_tile` (the
// tensor cores read them and the key tile themselves): s zeroed, the products committed as
// one group. The caller waits for it before it reads s.
template <int NT, int D = DTYPE>
__device__ __forceinline__ void issue_scores(float (&s)[NT][4], unsigned q_group_tile,
                                             const char* key_tile) {
    zero(s);
    const Descriptor k_desc = key_descriptor(shared_address(key_tile));
    // The query descriptor from the loop-invariant address, per tile: `q_group_tile`
    // laundered so that the compiler keeps one register across the loop, not eight
    // descriptors.
    asm volatile("" : "+r"(q_group_tile));
    const Descriptor q_desc = query_descriptor(q_group_tile);
    fence_registers(s);
    __syncwarp();  // wgmma instructions are warp-aligned: every lane at the same one
    fence_operands();
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
        wgmma_ss<BLOCK_N>(s, q_desc.at(query_offset(kk)), k_desc.at(key_offset(kk)));
    commit();
}

// The masks and the softmax of a warp's 16 x BLOCK_N scores of the tile from key n0 (rows
// from row_first; the warpgroup's first row group_first): s becomes probabilities, the row
// maxima and sums move on, and alphas are the factors for the output accumulators
// (rescale_output), which are not touched here.
template <int NT, int D = DTYPE>
__device__ __forceinline__ void soften_tile(float (&s)[NT][4], float (&row_max)[2],
                                            float (&row_sum)[2], float (&alphas)[2],
                                            const AttentionKernelParams& p, long long b,
                                            long long row_first, long long group_first,
                                            long long n0, int lane) {
    // Tiles inside the sequence and below the diagonal need no mask. The choice is the same
    // for the whole warpgroup (its first row decides), whose warps must meet at the same wgmma.
    // Token indices fit 32 bits (the launcher refuses sequences of 2^31 tokens or more).
    const int first_key = static_cast<int>(n0);
    const bool check_bounds = first_key > static_cast<int>(p.seqlen_k) - BLOCK_N;
    const bool check_causal =
        CAUSAL && first_key > static_cast<int>(group_first) - (BLOCK_N - 1);
    const bool masked = check_bounds || check_causal;
    float scale = p.scale_log2;
    // Without attn_mask (and with a positive scale) the softmax applies the scale itself, in
    // the exponent's multiply-add, and a masked tile only gets its -inf; otherwise the scores
    // are scaled and masked first.
    if (MASK_KIND != 0 || !(scale > 0.f)) {
        scale_and_mask<NT, false>(s, p, b, row_first, n0, check_bounds, check_causal, lane);
        scale = 1.f;
    } else if (masked) {
        mask_scores<NT>(s, static_cast<int>(row_first), first_key, static_cast<int>(p.seqlen_q),
                        static_cast<int>(p.seqlen_k), check_bounds, check_causal, lane);
    }
    if (EXP2_FMA > 0 && MASK_KIND == 0 && scale > 0.f && !masked)  // no -inf: see exp2_fma
        softmax_probabilities<NT, EXP2_FMA, true>(s, row_max, row_sum, alphas, scale);
    else
        softmax_probabilities<NT, 0, true>(s, row_max, row_sum, alphas, scale);
}

// O += P V issued (P in `pa`, the values in value_tile), committed as one group. The caller
// waits for it before it reads `o` or lets go of `pa`.
template <int PSTEPS, int D = DTYPE>
__device__ __forceinline__ void issue_values(float (&o)[DTILES][4], unsigned (&pa)[PSTEPS][4],
                                             const char* value_tile) {
    fence_registers(o);
    fence_registers(pa);
    __syncwarp();
    fence_operands();
    const Descriptor v_desc = value_descriptor(shared_address(value_tile));
#pragma unroll
    for (int kk = 0; kk < PSTEPS; ++kk) wgmma<DP, 1>(o, pa[kk], v_desc.at(value_offset(kk)));
    commit();
}

// One key tile for a warp's 16 query rows (first row row_first) of a warpgroup whose first row
// is group_first: S = Q K^T on the tensor cores (`q_operand`: this lane's A fragments to reload
// from shared memory, or with SWIZZLED the warpgroup's swizzled query rows, which the tensor
// cores read themselves; the rotated keys in key_tile), the masks and the online softmax, then
// O += P V (values in value_tile) issued with P in `pa`. The caller waits for that product
// (wgmma wait) before it reads `o` or lets go of `pa`, so it may overlap other work with it.
// Both wgmma forwards run their tiles through here (but the producer forward's OVERLAP
// schedule); `turns` brackets the issue of each product (see NoTurns).
template <int PSTEPS, typename Turns = NoTurns, int D = DTYPE>
__device__ __forceinline__ void attend_tile(float (&o)[DTILES][4], unsigned (&pa)[PSTEPS][4],
                                            float (&row_max)[2], float (&row_sum)[2],
                                            unsigned q_operand, const char* key_tile,
                                            const char* value_tile, const AttentionKernelParams& p,
                                            long long b, long long row_first, long long group_first,
                                            long long n0, int lane, const Turns& turns = Turns{}) {
    constexpr int NT = BLOCK_N / 8;
    static_assert(PSTEPS == NT / 2, "P fragments: one per 16 keys of the tile");
    float s[NT][4];
    if constexpr (SWIZZLED) {
        turns.before_scores();
        issue_scores(s, q_operand, key_tile);
        turns.after_scores();
        wait_all();
        fence_registers(s);
    } else {
        zero(s);
        const Descriptor k_desc = key_descriptor(shared_address(key_tile));
        unsigned qa[KSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qa[kk], q_operand + kk * 32);
        fence_registers(s);
        __syncwarp();
        fence_operands();
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
            wgmma<BLOCK_N, 0>(s, qa[kk], k_desc.at(key_offset(kk)));
        commit();
        wait_all();
        fence_registers(s);
        fence_registers(qa);
    }
    float alphas[2];
    soften_tile(s, row_max, row_sum, alphas, p, b, row_first, group_first, n0, lane);
    rescale_output<true>(o, alphas);
    to_a_fragments<NT>(pa, s);

    turns.before_values();
    issue_values(o, pa, value_tile);
    turns.after_values();
}

template <int D = DTYPE>
__device__ void forward(const AttentionKernelParams& p, char* smem) {
    static_assert(WARPS % 4 == 0 && M_TILES == 1 && !HAS_POS_MASK,
                  "warpgroups of 16-row warps, no pos_mask");
    static_assert(STAGES == 2 || STAGES == 3, "two or three tiles in shared memory");
    const Buffers m = carve(smem);
    // Tile t lives in buffer t % STAGES; its table rows in stage t % (STAGES - 1).
    constexpr int TILE_BYTES = BLOCK_N * DP * 2, TABLE_STAGE_BYTES = BLOCK_N * TABLE_ROW_BYTES;
    auto key_tile = [&](int t) { return smem + SMEM.k + (t % STAGES) * TILE_BYTES; };
    auto value_tile = [&](int t) { return smem + SMEM.v0 + (t % STAGES) * TILE_BYTES; };
    auto cos_stage = [&](int t) {
        return smem + SMEM.cos_stage + (t % (STAGES - 1)) * TABLE_STAGE_BYTES;
    };
    auto sin_stage = [&](int t) {
        return smem + SMEM.sin_stage + (t % (STAGES - 1)) * TABLE_STAGE_BYTES;
    };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const auto [b, h, m0, q_head, k_head, v_head, tiles] = query_block(p);
    // With KEYS_BY_TMA the prepare kernel rotated the keys beforehand, into the workspace's
    // [B, Hk, seqlen_k_padded, DP] rows: they are copied as they are, like values, and no
    // tile is rotated here (at head_dim 256 a tile's rotation took the warps as long as a
    // good part of its products, reading the angles in place).
    const T* const k_rows =
        KEYS_BY_TMA ? static_cast<const T*>(p.k_rot) +
                          (b * p.heads_k + h / GQA_GROUP) * p.seqlen_k_padded * DP
                    : k_head;
    const T* const v_rows = v_head;  // (a structured binding cannot be captured)
    // Starts tile t's copies (keys with their table rows, values) as one copy group.
    auto issue_tile = [&](int t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        if constexpr (KEYS_BY_TMA)
            copy_plain_chunks(key_tile(t), p, k_rows, DP, n0);
        else
            copy_key_chunks(key_tile(t), cos_stage(t), sin_stage(t), p, k_rows, n0);
        copy_plain_chunks(value_tile(t), p, v_rows, p.v_stride[2], n0);
    };
    // Rotates tile t's keys, copied raw (without KEYS_BY_TMA).
    auto rotate_tile = [&](int t) {
        if constexpr (!KEYS_BY_TMA)
            rotate_key_chunks(key_tile(t), cos_stage(t), sin_stage(t), p,
                              static_cast<long long>(t) * BLOCK_N);
    };

    // Copy groups: the queries with tile 0, then one per tile (empty past the last), so that
    // "all but the newest STAGES - 2 groups" is always "up to the next tile".
    issue_rows<RESIDENT>(m.q, q_head, p.q_stride[2], m0, p.seqlen_q);
    if (tiles > 0) issue_tile(0);
    cp_async_commit();
#pragma unroll
    for (int t = 1; t < STAGES - 1; ++t) {
        if (t < tiles) issue_tile(t);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    if (tiles > 0) rotate_tile(0);
    __syncthreads();
    rotate_rows<RESIDENT, false>(m.q, m.q_plain, m.q, nullptr, nullptr, m.q_flags, p, b, m0,
                                 p.seqlen_q);
    fence_async_proxy();
    __syncthreads();

    // This warp's 16 rotated query rows stay in shared memory; each tile reloads them as A
    // fragments. (Held in registers across the loop, ptxas 13.0 gave the fragments' registers
    // to the P fragments of the same shape (head_dim == BLOCK_N), and the second tile
    // multiplied P by K.)
    const unsigned q_fragments = shared_address(m.q + warp * 16 * ROWE) + a_lane_offset(lane);
    const long long row_first = m0 + warp * 16;
    // The warpgroup's first row, broadcast from lane 0 (known the same in every lane: see
    // forward_specialized).
    const long long group_first = m0 + __shfl_sync(FULL_MASK, warp >> 2, 0) * 64;
    float o[DTILES][4];
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    zero(o);
    for (int t = 0; t < tiles; ++t) {
        const long long n0 = static_cast<long long>(t) * BLOCK_N;
        if (t + STAGES - 1 < tiles) issue_tile(t + STAGES - 1);
        cp_async_commit();

        unsigned pa[BLOCK_N / 16][4];
        attend_tile(o, pa, row_max, row_sum, q_fragments, key_tile(t), value_tile(t), p, b,
                    row_first, group_first, n0, lane);

        cp_async_wait<STAGES - 2>();  // tile t + 1
        if (t + 1 < tiles) rotate_tile(t + 1);
        __syncwarp();  // the rotation branches per lane; the wait is warp-aligned
        wait_all();
        fence_registers(o);
        fence_registers(pa);
        fence_async_proxy();
        __syncthreads();
    }
    finish_rows(o, row_max, row_sum, PaddedRows{m.q + warp * 16 * ROWE}, p, b, h, row_first,
                lane);
}

}  // namespace wg

}  // namespace tc

}  // namespace

#endif
