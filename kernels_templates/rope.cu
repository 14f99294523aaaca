// RoPE kernel template. The runtime prepends a block of constexpr specialization constants
// (src/ops/rope/kernel_spec.cpp, KernelSpec::preamble) and compiles this file with NVRTC, without any
// CUDA toolkit header. The constants:
//   DTYPE, TABLE_DTYPE, XPOS_DTYPE, INV_FREQ_DTYPE   0 = float32, 1 = float16, 2 = bfloat16
//   BACKWARD_PASS                                    rotate by -angle (gradients)
//   HEAD_DIM, ROTARY_DIM, ROTARY_OFFSET              features; [OFFSET, OFFSET+DIM) rotate
//   INTERLEAVED                                      pairs (2i, 2i+1), else (i, i + R/2)
//   PROPORTIONAL                                     half style with pairs (i, i + D/2)
//                                                    (an enumerator, as are later fields)
//   HAS_K, GQA_GROUP                                 k present; Hq = GQA_GROUP * Hk
//   POSITION_MODE                                    0 implicit, 1 per-token, 2 seqlen offsets
//   HAS_ROPE_INDICES                                 POSITION_MODE == 1
//   PACKED                                           sequences delimited by cu_seqlens
//   POSITIONS_INT64, SEQLEN_OFFSETS_INT64, CU_SEQLENS_INT64
//   ANGLES_FROM_INV_FREQ, TABLE_FULL                 angle source; table [P, R] vs [P, R/2]
//   HAS_XPOS, K_OWN_ANGLES                           k needs its own cos/sin (xPos, q offset)
//   IN_PLACE_Q, IN_PLACE_K                           outputs alias inputs (skip the copy)
//   VEC, VEC_LOADS                                   elements per access; aligned vector I/O
//   COPY_VEC                                         elements per access of the out-of-place
//                                                    copy of unrotated features (vector if > 1)
//   TABLE_VEC_LOADS                                  cos/sin spans read as aligned vectors
//   MROPE_AXES                                       position axes (M-RoPE); 0 = one position
//   FREQ_GRAD                                        also accumulate d(loss)/d(inv_freq)
//   BLOCK_THREADS                                    the most threads a block has (the
//                                                    launcher sizes each block to its work)
//   KV_CACHE                                         k into a KV cache (instead of k_out)
//                                                    at slots: 1 contiguous rows, 2 slot_mapping,
//                                                    3 block_tables; 0 none
//   KV_INDEX_INT64, KV_SEQLEN_OFFSETS                slot/block index dtype; cache positions
//                                                    from seqlen_offsets
//   KV_FP8, Q_FP8                                    the caches, q_out hold float8 e4m3fn
//   V_DIM, V_VEC                                     v's head_dim (0: no v), copied into its
//                                                    cache V_VEC elements per access
//   QK_NORM, NORM_WEIGHT_DTYPE, NORM_UNIT_OFFSET,     RMSNorm of each head first, weights w
//   NORM_WEIGHT_VEC_LOADS                            (or 1 + w): the forwards with a KV cache
//                                                    of RopePlan::norm_items, direct path only
//                                                    (the other QK-norm specs: rope_norm.cu)
//
// A block owns `tokens_per_block` consecutive tokens and first resolves, once per token,
// where its rows live and which table row it uses. With tables, every work item then reads
// its few cos/sin values itself: all heads of a token read the same ones, so after the first
// they come from L1, and the kernel streams q and k with no further barrier. Angles computed
// from inv_freq (or scaled by xPos) are computed once per token into shared memory instead.
// Blocks of one token of decode and KV cache calls skip that staging (rope_one_token): each
// thread resolves its own rows while its loads fly.

#include "device_numeric.h"
#include "rope_params.h"
#include "rope_norm_params.h"
#include "rope_device.h"
#include "bulk_copy.h"

namespace {

// The specialization as the launch plan reads it; the plan (rope_params.h) is the one the
// launcher sizes blocks and shared memory with.
ROPE_JIT_HOST_DEVICE constexpr RopeShape spec_shape() {
    RopeShape s{};
    s.head_dim = HEAD_DIM;
    s.rotary_dim = ROTARY_DIM;
    s.rotary_offset = ROTARY_OFFSET;
    s.vec = VEC;
    s.mrope_axes = MROPE_AXES;
    s.interleaved = INTERLEAVED;
    s.proportional = PROPORTIONAL;
    s.has_k = HAS_K;
    s.in_place_q = IN_PLACE_Q;
    s.in_place_k = IN_PLACE_K;
    s.k_own_angles = K_OWN_ANGLES;
    s.angles_from_inv_freq = ANGLES_FROM_INV_FREQ;
    s.has_xpos = HAS_XPOS;
    s.table_full = TABLE_FULL;
    s.freq_grad = FREQ_GRAD;
    s.v_dim = V_DIM;
    s.v_vec = V_VEC;
    s.qk_norm = QK_NORM;
    s.backward = BACKWARD_PASS;
    s.kv_cache = KV_CACHE != 0;
    s.q_fp8 = Q_FP8;
    s.dense_rows = DENSE_ROWS;
    return s;
}
// A function, not a constexpr variable: NVRTC emits each namespace-scope constant as a global
// of the module, and the plan is read only at compile time.
ROPE_JIT_HOST_DEVICE constexpr RopePlan plan() {
    return rope_plan(spec_shape());
}
static_assert(plan().problem == kRopePlanOk,
              "the vector width must hold whole pairs that tile the rotary range");
// The entries with a body in this module, from the preamble's ROPE_JIT_KERNEL_* (the others
// are empty and their source is left out: rope_params.h, rope_module_kernels, says why).
static_assert(ROPE_JIT_KERNEL_ROPE == rope_module_kernels(plan()).rope &&
                  ROPE_JIT_KERNEL_DIRECT == rope_module_kernels(plan()).direct &&
                  ROPE_JIT_KERNEL_BULK == rope_module_kernels(plan()).bulk &&
                  ROPE_JIT_KERNEL_FLAT == rope_module_kernels(plan()).flat,
              "the preamble's kernels are those of this spec's plan");

constexpr int PAIRS = plan().pairs;
constexpr int ROLES = plan().roles;  // angle sets per token (q, and k)
constexpr int PAIRS_PER_ITEM = plan().pairs_per_item;
// Work items per head. Interleaved: one VEC-wide chunk of features (PAIRS_PER_ITEM pairs).
// Half style: a chunk of first halves and the chunk of their partners R/2 later, rotated and
// stored together; or, when an out-of-place call also copies unrotated features (partial
// rotary), one output chunk, which reads its partner chunk but stores only itself
// (CHUNK_ITEMS). Measured on the H200 (bench/results/h200_kernel_tuning.json, "chunk_items"):
// chunk items took partial rotary out of place from 0.62 to 0.73-0.83 of copy bandwidth, and
// full rotary out of place from 0.90 down to 0.53-0.77. In place they would race: an item
// overwrites its partner's input.
constexpr bool OUT_OF_PLACE_PARTIAL = plan().out_of_place_partial;
constexpr bool CHUNK_ITEMS = plan().chunk_items;
static_assert(!CHUNK_ITEMS || OUT_OF_PLACE_PARTIAL, "chunk items race in place");
constexpr int ROT_ITEMS = plan().rot_items;
// Angles computed once per token into shared memory (else read per item from the tables).
constexpr bool SHARED_ANGLES = plan().shared_angles;
// Table rows resolved per token: one per position axis (M-RoPE), else one per role.
constexpr int ROW_SETS = plan().row_sets;
// Table columns one item reads: its pairs' columns, which in a full interleaved table sit at
// every other column (the span then covers both and the item uses the even ones).
constexpr int TABLE_STEP = plan().table_step;
constexpr int TABLE_SPAN = plan().table_span;

// Where a pair's partner lies: R/2 after its first feature (half style), or D/2 (proportional,
// whose unrotated features are the tail of each half). SECOND_SHIFT moves a chunk item of
// second halves from R/2 + chunk to D/2 + chunk; COPY_SPLIT and COPY_SHIFT map the copy's
// unrotated feature f to its place: f + COPY_SHIFT below COPY_SPLIT, else f + R. Enumerators,
// not constexpr variables, so that the modules of the other styles keep their globals.
enum : int {
    PARTNER_DISTANCE = PROPORTIONAL ? HEAD_DIM / 2 : PAIRS,
    SECOND_SHIFT = PROPORTIONAL ? HEAD_DIM / 2 - PAIRS : 0,
    COPY_SPLIT = PROPORTIONAL ? HEAD_DIM / 2 - PAIRS : ROTARY_OFFSET,
    COPY_SHIFT = PROPORTIONAL ? PAIRS : 0,
};
static_assert(!PROPORTIONAL || (!INTERLEAVED && ROTARY_OFFSET == 0 &&
                                (!VEC_LOADS || (HEAD_DIM / 2) % VEC == 0) &&
                                PAIRS % COPY_VEC == 0 && (HEAD_DIM / 2) % COPY_VEC == 0),
              "proportional pairs: half style from feature 0, vectors that tile both halves");

// ---- element types --------------------------------------------------------------------

// StorageOf, float_of_bits16, load_float and float_to_bf16_bits: device_numeric.h, shared with
// the attention templates; from_float and storage_to_float: rope_device.h.

using T = typename StorageOf<DTYPE>::type;

template <int N>
struct alignas(N * sizeof(T)) Pack {
    T v[N];
};

// q and k are written once and never read again by this kernel: their 16-byte stores are
// marked evict-first (st.global.cs), so that they do not push the table rows, which every head
// of a token reads, out of L2. Measured on the H200 (bench/results/h200_kernel_tuning.json,
// "hints_*"): 0.84 -> 0.89 of copy bandwidth on bf16 Llama shapes; load hints (evict-first,
// or no L1 allocation) changed nothing measurable and are not used.
// Kernels that write a KV cache store q (and non-FP8 caches) without the hint: there it cost
// 1.5% (Llama-3-8B prefill with a paged FP8 cache, 0.879-0.889 of copy with it, 0.898-0.907
// without, seven processes; session 12), where plain RoPE loses 3.5% without it. (A plain C++
// store instead of this asm reschedules the KV-cache decode kernels: not measured, not used.)
__device__ __forceinline__ void store_streaming16(void* y, const unsigned* w) {
    if constexpr (KV_CACHE != 0)
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(y), "r"(w[0]), "r"(w[1]),
                     "r"(w[2]), "r"(w[3])
                     : "memory");
    else
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(y), "r"(w[0]), "r"(w[1]),
                     "r"(w[2]), "r"(w[3])
                     : "memory");
}

// N consecutive features of one head starting at `x`; one vector access when the host
// proved alignment and unit stride (VEC_LOADS), else N scalar accesses at `stride`.
template <int N, bool VECTOR = VEC_LOADS>
__device__ __forceinline__ Pack<N> load_pack(const T* x, long long stride) {
    Pack<N> pack;
    if (VECTOR) {
        pack = *reinterpret_cast<const Pack<N>*>(x);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) pack.v[j] = x[j * stride];
    }
    return pack;
}

template <int N, bool VECTOR = VEC_LOADS>
__device__ __forceinline__ void store_pack(T* y, long long stride, const Pack<N>& pack) {
    if (VECTOR) {
        if constexpr (sizeof(Pack<N>) == 16)
            store_streaming16(y, reinterpret_cast<const unsigned*>(&pack));
        else
            *reinterpret_cast<Pack<N>*>(y) = pack;
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) y[j * stride] = pack.v[j];
    }
}

// ---- FP8 outputs --------------------------------------------------------------------------

// Where a result goes: an element of q's dtype, or (FP8) a float8 e4m3fn byte.
template <bool FP8>
struct OutOf {
    using type = T;
};
template <>
struct OutOf<true> {
    using type = unsigned char;
};

// An FP8 output's scale: one float32 in device memory, or NULL for 1.
__device__ __forceinline__ float fp8_scale_value(const float* scale) {
    return scale != nullptr ? *scale : 1.0f;
}

// N values quantized to float8 e4m3fn (value / scale), stored at y: one N-byte access when the
// host proved alignment and unit stride (VECTOR), else N byte stores at `stride`.
template <int N, bool VECTOR>
__device__ __forceinline__ void store_fp8(unsigned char* y, long long stride, const float* v,
                                          const Fp8Scale& scale) {
    unsigned short pairs[(N + 1) / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j)
        pairs[j] = e4m3x2_bits(fp8_quotient(v[2 * j], scale), fp8_quotient(v[2 * j + 1], scale));
    if (N % 2 != 0)
        pairs[N / 2] = static_cast<unsigned short>(e4m3_bits(fp8_quotient(v[N - 1], scale)));
    // Evict-first like q's 16-byte stores (store_streaming16): the cache rows and FP8 outputs
    // are written once and not read again by this kernel.
    if constexpr (VECTOR && N == 8) {
        asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(y),
                     "r"(pairs[0] | (unsigned(pairs[1]) << 16)),
                     "r"(pairs[2] | (unsigned(pairs[3]) << 16))
                     : "memory");
    } else if constexpr (VECTOR && N == 4) {
        asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(y),
                     "r"(pairs[0] | (unsigned(pairs[1]) << 16))
                     : "memory");
    } else if constexpr (VECTOR && N == 2) {
        *reinterpret_cast<unsigned short*>(y) = pairs[0];
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j)
            y[j * stride] = static_cast<unsigned char>(pairs[j / 2] >> (8 * (j % 2)));
    }
}

// A pack of N input elements stored as an output of kind FP8: bit for bit, or quantized.
template <bool FP8, int N, bool VECTOR>
__device__ __forceinline__ void store_out(typename OutOf<FP8>::type* y, long long stride,
                                          const Pack<N>& pack, float scale) {
    if constexpr (FP8) {
        float v[N];
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = storage_to_float<DTYPE>(pack.v[j]);
        store_fp8<N, VECTOR>(y, stride, v, fp8_scale(scale));
    } else {
        store_pack<N, VECTOR>(y, stride, pack);
    }
}

// ---- positions --------------------------------------------------------------------------

// load_index, table_row and pair_angle: rope_device.h, shared with rope_norm.cu.

using TableT = typename StorageOf<TABLE_DTYPE>::type;

template <int N>
struct alignas(N * sizeof(TableT)) TablePack {
    TableT v[N];
};

// The table columns of an item's pairs in one row, as stored: the item converts them when it
// computes, so that they occupy few registers while its loads are in flight.
__device__ __forceinline__ TablePack<TABLE_SPAN> load_table_span(const void* table,
                                                                 const long long* stride,
                                                                 long long row, int pair0) {
    const TableT* base = static_cast<const TableT*>(table) + row * stride[0];
    const long long col0 = static_cast<long long>(pair0) * TABLE_STEP;
    if constexpr (TABLE_VEC_LOADS) {
        return *reinterpret_cast<const TablePack<TABLE_SPAN>*>(base + col0);
    } else {
        TablePack<TABLE_SPAN> pack;
#pragma unroll
        for (int j = 0; j < TABLE_SPAN; ++j) pack.v[j] = base[(col0 + j) * stride[1]];
        return pack;
    }
}

// An item's angles: raw table spans, or (SHARED_ANGLES) a pointer to the token's cos/sin.
struct ItemAngles {
    TablePack<TABLE_SPAN> cos, sin;
    const float* shared_cos;
    const float* shared_sin;

    __device__ __forceinline__ float c(int j) const {
        return SHARED_ANGLES ? shared_cos[j] : storage_to_float<TABLE_DTYPE>(cos.v[j * TABLE_STEP]);
    }
    __device__ __forceinline__ float s(int j) const {
        if (SHARED_ANGLES) return shared_sin[j];  // backward sign and xPos already applied
        const float value = storage_to_float<TABLE_DTYPE>(sin.v[j * TABLE_STEP]);
        return BACKWARD_PASS ? -value : value;
    }
};

// ---- one work item of one head of one token -------------------------------------------

// Where item `item` (0 <= item < ROT_ITEMS) of a head lies: its first feature, its partner
// chunk's first feature (half style), its first pair, and (CHUNK_ITEMS) whether it is a chunk
// of second halves.
struct ItemSpan {
    int own, partner, pair0;
    bool second;
};

__device__ __forceinline__ ItemSpan item_span(int item) {
    ItemSpan span;
    span.second = CHUNK_ITEMS && item >= PAIRS / VEC;
    const int chunk = span.second ? item - PAIRS / VEC : item;
    span.own = ROTARY_OFFSET + item * VEC + (span.second ? SECOND_SHIFT : 0);
    span.partner = span.second ? span.own - PARTNER_DISTANCE : span.own + PARTNER_DISTANCE;
    span.pair0 = chunk * PAIRS_PER_ITEM;
    return span;
}

// An item's data: its chunk, and (half style) its partner chunk.
struct ItemData {
    Pack<VEC> own, partner;
};

__device__ __forceinline__ ItemData load_item(const T* x, long long xs, const ItemSpan& span) {
    ItemData data;
    data.own = load_pack<VEC>(x + span.own * xs, xs);
    if (!INTERLEAVED) data.partner = load_pack<VEC>(x + span.partner * xs, xs);
    return data;
}

// Rotates the item's pairs (x1, x2) to (x1 c - x2 s, x2 c + x1 s) and stores them: within
// the chunk (interleaved), or x1 from the chunk and x2 from the partner chunk (half style;
// a chunk item stores only its own chunk).
__device__ __forceinline__ void rotate_store_item(ItemData data, T* y, long long ys,
                                                  const ItemSpan& span, const ItemAngles& angles) {
    if (INTERLEAVED) {
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            const float x1 = storage_to_float<DTYPE>(data.own.v[2 * j]);
            const float x2 = storage_to_float<DTYPE>(data.own.v[2 * j + 1]);
            const float c = angles.c(j), s = angles.s(j);
            data.own.v[2 * j] = from_float<DTYPE>(x1 * c - x2 * s);
            data.own.v[2 * j + 1] = from_float<DTYPE>(x2 * c + x1 * s);
        }
    } else {
        // A chunk item of second halves holds x2 as its own features and x1 as its partner's.
        const float sign = span.second ? 1.0f : -1.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float x = storage_to_float<DTYPE>(data.own.v[j]);
            const float other = storage_to_float<DTYPE>(data.partner.v[j]);
            const float c = angles.c(j), s = angles.s(j);
            data.own.v[j] = from_float<DTYPE>(x * c + sign * other * s);
            data.partner.v[j] = from_float<DTYPE>(other * c - sign * x * s);
        }
        if (!CHUNK_ITEMS) store_pack<VEC>(y + span.partner * ys, ys, data.partner);
    }
    store_pack<VEC>(y + span.own * ys, ys, data.own);
}

// An item's features as float: its chunk and (half style) its partner chunk.
struct ItemFloats {
    float own[VEC], partner[VEC];
};

__device__ __forceinline__ ItemFloats item_floats(const ItemData& data) {
    ItemFloats x;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        x.own[j] = storage_to_float<DTYPE>(data.own.v[j]);
        if (!INTERLEAVED) x.partner[j] = storage_to_float<DTYPE>(data.partner.v[j]);
    }
    return x;
}

// rotate_store_item's rotation in float, for the outputs that are not stored as computed
// (FP8) or that were scaled first (QK-norm).
__device__ __forceinline__ ItemFloats rotate_floats(const ItemFloats& x, const ItemSpan& span,
                                                    const ItemAngles& angles) {
    ItemFloats y;
    if (INTERLEAVED) {
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            const float x1 = x.own[2 * j], x2 = x.own[2 * j + 1];
            const float c = angles.c(j), s = angles.s(j);
            y.own[2 * j] = x1 * c - x2 * s;
            y.own[2 * j + 1] = x2 * c + x1 * s;
        }
    } else {
        const float sign = span.second ? 1.0f : -1.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float c = angles.c(j), s = angles.s(j);
            y.own[j] = x.own[j] * c + sign * x.partner[j] * s;
            y.partner[j] = x.partner[j] * c - sign * x.own[j] * s;
        }
    }
    return y;
}

// Stores a rotated item: in q's dtype at y, or (fp8) as float8 e4m3fn of value / raw_scale at
// y8 (a chunk item stores only its own chunk).
__device__ __forceinline__ void store_item_floats(const ItemFloats& r, T* y, unsigned char* y8,
                                                  bool fp8, long long ys, const ItemSpan& span,
                                                  float raw_scale) {
    if ((Q_FP8 || KV_FP8) && fp8) {
        const Fp8Scale scale = fp8_scale(raw_scale);
        if (!INTERLEAVED && !CHUNK_ITEMS)
            store_fp8<VEC, VEC_LOADS>(y8 + span.partner * ys, ys, r.partner, scale);
        store_fp8<VEC, VEC_LOADS>(y8 + span.own * ys, ys, r.own, scale);
    } else {
        Pack<VEC> own, partner;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            own.v[j] = from_float<DTYPE>(r.own[j]);
            if (!INTERLEAVED) partner.v[j] = from_float<DTYPE>(r.partner[j]);
        }
        if (!INTERLEAVED && !CHUNK_ITEMS) store_pack<VEC>(y + span.partner * ys, ys, partner);
        store_pack<VEC>(y + span.own * ys, ys, own);
    }
}

// The same for an FP8 output (float8 e4m3fn): the fp32 results quantized by `scale`.
__device__ __forceinline__ void rotate_store_item_fp8(const ItemData& data, unsigned char* y,
                                                      long long ys, const ItemSpan& span,
                                                      const ItemAngles& angles, float raw_scale) {
    store_item_floats(rotate_floats(item_floats(data), span, angles), nullptr, y, true, ys, span,
                      raw_scale);
}

// The table row of one pair of a token (role 1 = k): per axis with M-RoPE, else k's own row
// when it has one (K_OWN_ANGLES), else the token's one row.
__device__ __forceinline__ long long pair_row(const long long* s_row, const RopeKernelParams& p,
                                              int token, int role, int pair) {
    if (MROPE_AXES > 0) return s_row[token * ROW_SETS + p.pair_axis[pair]];
    return s_row[token * ROW_SETS + (ROLES == 2 ? role : 0)];
}

// Learned frequencies: adds, for each of the item's pairs, position * (g2*y1 - g1*y2) to
// `sums` (the derivative of the loss by the pair's angle, dy1/dt = -y2 and dy2/dt = y1, times
// d(angle)/d(inv_freq) = position). g is the incoming gradient, y the forward output.
__device__ __forceinline__ void accumulate_freq_grad(const ItemData& g, const ItemData& y,
                                                     const long long* s_row,
                                                     const RopeKernelParams& p, int token, int role,
                                                     const ItemSpan& span, float* sums) {
    if (span.second) return;  // a chunk item's pairs are counted by their first-half item
#pragma unroll
    for (int j = 0; j < PAIRS_PER_ITEM; ++j) {
        float g1, g2, y1, y2;
        if (INTERLEAVED) {
            g1 = storage_to_float<DTYPE>(g.own.v[2 * j]);
            g2 = storage_to_float<DTYPE>(g.own.v[2 * j + 1]);
            y1 = storage_to_float<DTYPE>(y.own.v[2 * j]);
            y2 = storage_to_float<DTYPE>(y.own.v[2 * j + 1]);
        } else {
            g1 = storage_to_float<DTYPE>(g.own.v[j]);
            g2 = storage_to_float<DTYPE>(g.partner.v[j]);
            y1 = storage_to_float<DTYPE>(y.own.v[j]);
            y2 = storage_to_float<DTYPE>(y.partner.v[j]);
        }
        const float position = static_cast<float>(pair_row(s_row, p, token, role, span.pair0 + j));
        atomicAdd(&sums[span.pair0 + j], position * (g2 * y1 - g1 * y2));
    }
}

// Where token (b, s)'s rows start in q, q_out, k, k_out (and the saved outputs).
__device__ __forceinline__ RopeTokenBases token_bases(const RopeKernelParams& p, long long b,
                                                      long long s) {
    RopeTokenBases base{-1, -1, -1, -1, 0, 0};
    if (s < p.seqlen_q) {
        base.q_in = b * p.q_stride[0] + s * p.q_stride[2];
        base.q_out = b * p.q_out_stride[0] + s * p.q_out_stride[2];
        if (FREQ_GRAD) base.q_saved = b * p.q_saved_stride[0] + s * p.q_saved_stride[2];
    }
    if (HAS_K && s < p.seqlen_k) {
        base.k_in = b * p.k_stride[0] + s * p.k_stride[2];
        base.k_out = b * p.k_out_stride[0] + s * p.k_out_stride[2];
        if (FREQ_GRAD) base.k_saved = b * p.k_saved_stride[0] + s * p.k_saved_stride[2];
    }
    return base;
}

// The blocks per multiprocessor the register budget must allow: plan().threads_per_sm threads
// (1536, 75% of an SM, at most 40 registers a thread; 1024 with batches of two items).
// Measured on the H200 (bench/results/h200_kernel_tuning.json): one item in flight per thread
// at that occupancy beat two or four at lower occupancy, except where a head's items are not a
// power of two (RopePlan::item_batch).
constexpr int MIN_BLOCKS_PER_SM =
    BLOCK_THREADS < plan().threads_per_sm ? plan().threads_per_sm / BLOCK_THREADS : 1;
constexpr int ITEM_BATCH = plan().item_batch;

// The unrotated features an out-of-place call copies, COPY_VEC per access (the host proved
// vectors of COPY_VEC aligned with unit stride when it is above 1).
constexpr int COPY_UNITS = HEAD_DIM > ROTARY_DIM ? (HEAD_DIM - ROTARY_DIM) / COPY_VEC : 1;
constexpr bool COPY_VECTORS = COPY_VEC > 1;
// Copies a thread loads before it stores any: a thread usually has several (a token's
// unrotated features outnumber its rotation items), and one load at a time in flight leaves
// the copy latency-bound. Four spilled registers at the 40-register budget (ncu, GPT-NeoX).
constexpr int COPY_BATCH = 2;
// Copies a thread loads before its rotation items (and stores after them, 4. in the kernel).
// Two where a head of fewer than 128 features has at most two copies per rotation item, which
// puts most of a thread's copies in the rotation's window; one where copies outnumber rotation
// items more (the copy loop's batches then carry them), and at 128 features and more. H200 run
// CG (session 20), fractions of copy, one ahead -> two: GPT-NeoX 24/96 out of place (9 copies,
// 6 items a head) 0.767 -> 0.816, Phi-2 32/80 (6, 4) 0.852 -> 0.861, GPT-J 64/256 (24, 8)
// 0.925 -> 0.931, Gemma-4 proportional 128/512 (48, 16) 0.909 -> 0.891; carrying a copy into
// each later rotation round as well lost 2-6% on Phi-2 and Gemma-4, a third copy a batch moved
// nothing. At 128 features two ahead lost (runs DI-DK, session 26, two -> one): ChatGLM2-6B's
// interleaved 64/128 (8 copies, 8 items) 0.825 -> 0.840, the same with 32 kv heads 0.849 ->
// 0.873, half style 64/128 (8, 8) 0.660 -> 0.815.
constexpr int COPIES_AHEAD =
    plan().copies_unrotated && COPY_UNITS <= 2 * ROT_ITEMS && HEAD_DIM < 128 ? 2 : 1;

// Everything one item needs, located from its index in the block: token, head, span.
struct ItemPlace {
    const T* x;
    T* y;
    unsigned char* y8;  // the output when it is FP8 (fp8; then y is unused)
    float scale;        // its scale
    bool fp8;
    const T* saved;  // the forward output (FREQ_GRAD only)
    long long xs, ys, saved_stride;
    ItemSpan span;
    int token, role;
    int set;  // angle set: token * ROLES + role
    bool valid;
};

__device__ __forceinline__ ItemPlace place_item(const RopeKernelParams& p,
                                                const RopeTokenBases* bases, int item,
                                                int items_per_token, int heads_q, int block_items,
                                                float q_scale = 1.0f, float k_scale = 1.0f) {
    ItemPlace place;
    place.valid = false;
    place.fp8 = false;
    if (item >= block_items) return place;
    int token, h;
    if (p.items_by_head) {  // (head, token, chunk): one head's rows of the block's tokens
        const int head_items = block_items / items_per_token * ROT_ITEMS;
        h = item / head_items;
        const int rest = item - h * head_items;
        token = rest / ROT_ITEMS;
        place.span = item_span(rest - token * ROT_ITEMS);
    } else {  // (token, head, chunk)
        token = item / items_per_token;
        const int rest = item - token * items_per_token;
        h = rest / ROT_ITEMS;
        place.span = item_span(rest - h * ROT_ITEMS);
    }
    const bool is_k = HAS_K && h >= heads_q;
    const RopeTokenBases base = bases[token];
    if (is_k) {
        h -= heads_q;
        const long long in = base.k_in;
        if (in < 0) return place;
        place.x = static_cast<const T*>(p.k) + in + h * p.k_stride[1];
        if (KV_FP8) {
            place.y8 = static_cast<unsigned char*>(p.k_out) + base.k_out + h * p.k_out_stride[1];
            place.scale = k_scale;
            place.fp8 = true;
        } else {
            place.y = static_cast<T*>(p.k_out) + base.k_out + h * p.k_out_stride[1];
        }
        place.xs = VEC_LOADS ? 1 : p.k_stride[3];
        place.ys = VEC_LOADS ? 1 : p.k_out_stride[3];
        if (FREQ_GRAD) {
            place.saved = static_cast<const T*>(p.k_saved) + base.k_saved + h * p.k_saved_stride[1];
            place.saved_stride = VEC_LOADS ? 1 : p.k_saved_stride[3];
        }
    } else {
        const long long in = base.q_in;
        if (in < 0) return place;
        place.x = static_cast<const T*>(p.q) + in + h * p.q_stride[1];
        if (Q_FP8) {
            place.y8 = static_cast<unsigned char*>(p.q_out) + base.q_out + h * p.q_out_stride[1];
            place.scale = q_scale;
            place.fp8 = true;
        } else {
            place.y = static_cast<T*>(p.q_out) + base.q_out + h * p.q_out_stride[1];
        }
        place.xs = VEC_LOADS ? 1 : p.q_stride[3];
        place.ys = VEC_LOADS ? 1 : p.q_out_stride[3];
        if (FREQ_GRAD) {
            place.saved = static_cast<const T*>(p.q_saved) + base.q_saved + h * p.q_saved_stride[1];
            place.saved_stride = VEC_LOADS ? 1 : p.q_saved_stride[3];
        }
    }
    place.token = token;
    place.role = is_k ? 1 : 0;
    place.set = token * ROLES + (ROLES == 2 && is_k ? 1 : 0);
    place.valid = true;
    return place;
}

// An item's cos/sin: the token's, computed once into shared memory (inv_freq, xPos, M-RoPE),
// or spans of its table row.
__device__ __forceinline__ ItemAngles item_angles(const RopeKernelParams& p,
                                                  const ItemPlace& place, const float* s_cos,
                                                  const float* s_sin, const long long* s_row) {
    ItemAngles angles;
    const int pair0 = place.span.pair0;
    if (SHARED_ANGLES) {
        angles.shared_cos = s_cos + place.set * PAIRS + pair0;
        angles.shared_sin = s_sin + place.set * PAIRS + pair0;
    } else {
        const long long row = pair_row(s_row, p, place.token, place.role, pair0);
        angles.cos = load_table_span(p.cos, p.cos_stride, row, pair0);
        angles.sin = load_table_span(p.sin, p.sin_stride, row, pair0);
    }
    return angles;
}

// An item once loaded: its share of the frequency gradient (FREQ_GRAD), its rotation and its
// stores.
__device__ __forceinline__ void finish_item(const RopeKernelParams& p, const ItemPlace& place,
                                            const ItemData& data, const ItemAngles& angles,
                                            const long long* s_row, float* s_grad) {
    if (FREQ_GRAD)
        accumulate_freq_grad(data, load_item(place.saved, place.saved_stride, place.span), s_row,
                             p, place.token, place.role, place.span, s_grad);
    if ((Q_FP8 || KV_FP8) && place.fp8)
        rotate_store_item_fp8(data, place.y8, place.ys, place.span, angles, place.scale);
    else
        rotate_store_item(data, place.y, place.ys, place.span, angles);
}

// ---- QK-norm on the direct path (QK_NORM, RopePlan::norm_items) ---------------------------

// A QK-norm kernel takes rope_norm.cu's arguments (RopeNormParams: the rope ones, the norm
// weights, eps), the plain kernel RopeKernelParams.
template <bool NORM>
struct OwnParamsOf {
    using type = RopeKernelParams;
};
template <>
struct OwnParamsOf<true> {
    using type = RopeNormParams;
};
using OwnParams = typename OwnParamsOf<QK_NORM>::type;
__device__ __forceinline__ const RopeKernelParams& rope_part(const RopeKernelParams& a) {
    return a;
}
__device__ __forceinline__ const RopeKernelParams& rope_part(const RopeNormParams& a) {
    return a.rope;
}
__device__ __forceinline__ const RopeNormParams* norm_part(const RopeKernelParams&) {
    return nullptr;
}
__device__ __forceinline__ const RopeNormParams* norm_part(const RopeNormParams& a) {
    return &a;
}
static_assert(!QK_NORM || plan().norm_items,
              "rope.cu takes the QK-norm forwards of RopePlan::norm_items only");

using W = NormWeight;  // rope_device.h

// An item's norm weights, raw as stored, at its own features and its partner's.
struct ItemWeights {
    WeightPack<VEC> own, partner;
};

__device__ __forceinline__ ItemWeights load_item_weights(const RopeNormParams& np, bool is_k,
                                                         const ItemSpan& span) {
    const W* w = static_cast<const W*>(is_k ? np.k_weight : np.q_weight);
    const long long ws = is_k ? np.k_weight_stride : np.q_weight_stride;
    ItemWeights weights;
    load_weight_pack<VEC, NORM_WEIGHT_VEC_LOADS>(w, ws, span.own, &weights.own);
    if (!INTERLEAVED)
        load_weight_pack<VEC, NORM_WEIGHT_VEC_LOADS>(w, ws, span.partner, &weights.partner);
    return weights;
}

// 1 / sqrt(mean(x^2) + eps) over the item's head: each item's sum of squares, added across the
// head's ROT_ITEMS lanes (consecutive lanes of one warp: the launcher's blocks are whole warps,
// a thread's items a block's width apart, and RopePlan::norm_items makes ROT_ITEMS a power of
// two up to 32, so a head's items meet in one round). A butterfly: every lane ends with the
// same sum.
__device__ __forceinline__ float head_norm_scale(const ItemData& data, float eps) {
    const ItemFloats x = item_floats(data);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        sum += x.own[j] * x.own[j];
        if (!INTERLEAVED) sum += x.partner[j] * x.partner[j];
    }
    const unsigned lane = threadIdx.x % 32;
    const unsigned group = ROT_ITEMS >= 32 ? 0xffffffffu
                                           : ((1u << (ROT_ITEMS % 32)) - 1u)
                                                 << (lane & ~(static_cast<unsigned>(ROT_ITEMS) - 1u));
#pragma unroll
    for (int offset = ROT_ITEMS / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(group, sum, offset);
    return rsqrtf(sum * (1.0f / HEAD_DIM) + eps);
}

// The item normalized and rotated, rope(x r w'), then stored as store_item_floats stores.
__device__ __forceinline__ void norm_rotate_store_item(const ItemData& data,
                                                       const ItemWeights& weights, float r, T* y,
                                                       unsigned char* y8, bool fp8, long long ys,
                                                       const ItemSpan& span,
                                                       const ItemAngles& angles, float raw_scale) {
    ItemFloats x = item_floats(data);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        x.own[j] = x.own[j] * r * weight_value(weights.own.v[j]);
        if (!INTERLEAVED) x.partner[j] = x.partner[j] * r * weight_value(weights.partner.v[j]);
    }
    store_item_floats(rotate_floats(x, span, angles), y, y8, fp8, ys, span, raw_scale);
}

// ---- one token a block, resolved by each thread (RopeKernelParams::direct) ------------------

// The direct path loads q, k and v with plain ld.global (load_item, load_pack). Volatile loads,
// which ptxas keeps in program order ahead of the position load, were slower in every case
// measured (H200, session 12, run AY): decode B=64 in a graph 2.01 -> 1.91 us, B=1 1.81 ->
// 1.72 us, D64 prefill 0.866 -> 0.881 of copy, the rest unchanged.

// The table row of the direct path: the token's position, or table_row. Plain loads here too:
// volatile ones (kept in program order after the item's loads) cost decode 0.03 us with
// positions and 0.11 us with a paged FP8 cache (H200, session 12, run BA: B=64 1.90 -> 1.87
// us, paged KV FP8 2.32 -> 2.21 us in a graph).
__device__ __forceinline__ long long direct_table_row(const RopeKernelParams& p, int b, int s,
                                                      bool is_k) {
    if constexpr (HAS_ROPE_INDICES) {
        const long long at = b * p.positions_stride[0] + s * p.positions_stride[1];
        if (POSITIONS_INT64) return static_cast<const long long*>(p.positions)[at];
        return static_cast<const int*>(p.positions)[at];
    } else {
        return table_row(p, b, s, is_k);
    }
}

#if ROPE_JIT_KERNEL_ROPE || ROPE_JIT_KERNEL_DIRECT
// Decode (a token per sequence, fewer tokens than multiprocessors) and KV cache calls of one
// token a block: a thread resolves its own item's rows instead of reading them from shared
// memory behind a barrier, so that its chain is as short as the data allows. Its q, k or v
// loads depend on nothing loaded: they are issued first, and the position (then the table
// row), the cache slot and the FP8 scale are read while they fly; then one store. Items:
// the token's rotation items, then (KV cache) its v copies, one or more a thread.
__device__ __forceinline__ void rope_one_token(const RopeKernelParams& p,
                                               const RopeCacheParams* cache,
                                               const RopeNormParams* norm) {
    // Few values live across the items (the budget is 40 registers): the token's (b, s), in
    // 32 bits (a grid of one token a block has under 2^31 of them); rows are recomputed.
    // Decode has one token a row: no division then (it heads every load's address chain).
    const unsigned per_row = static_cast<unsigned>(p.seqlen_max);  // <= the grid's tokens
    unsigned row = blockIdx.x, index = 0;
    if (per_row != 1) {
        row = blockIdx.x / per_row;
        index = blockIdx.x - row * per_row;
    }
    const int b = static_cast<int>(row), s = static_cast<int>(index);
    const bool has_q = s < p.seqlen_q, has_k = HAS_K && s < p.seqlen_k;
    const int heads_k = HAS_K ? static_cast<int>(p.heads_k) : 0;
    const int heads_q = HAS_K ? heads_k * GQA_GROUP : static_cast<int>(p.heads_q);
    const int rot_items = (heads_q + heads_k) * ROT_ITEMS;
    // v items per head: V_PAIR vectors each (two where they pair up, plan().v_direct_items).
    constexpr int V_ITEMS = V_DIM > 0 ? plan().v_direct_items : 1;
    constexpr int V_PAIR = V_DIM > 0 ? V_DIM / V_VEC / V_ITEMS : 1;
    static_assert(V_DIM == 0 || V_ITEMS * V_PAIR * V_VEC == V_DIM, "v items tile v's row");
    const int items = rot_items + (KV_CACHE != 0 && V_DIM > 0 ? heads_k * V_ITEMS : 0);
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        if (KV_CACHE != 0 && V_DIM > 0 && item >= rot_items) {
            // v's copy: V_VEC features of one head into v's cache.
            if constexpr (KV_CACHE != 0 && V_DIM > 0) {
                if (!has_k) continue;  // no k at this token: no v either
                const int h = (item - rot_items) / V_ITEMS;
                const int f = (item - rot_items - h * V_ITEMS) * (V_PAIR * V_VEC);
                constexpr bool V_VECTORS = V_VEC > 1;
                const long long* vs = cache->v_stride;
                const long long xs = V_VECTORS ? 1 : vs[3];
                const T* const x =
                    static_cast<const T*>(cache->v) + b * vs[0] + s * vs[2] + h * vs[1] + f * xs;
                Pack<V_VEC> value[V_PAIR];
#pragma unroll
                for (int u = 0; u < V_PAIR; ++u)
                    value[u] = load_pack<V_VEC, V_VECTORS>(x + u * V_VEC * xs, xs);
                const float scale = KV_FP8 ? fp8_scale_value(cache->v_scale) : 1.0f;
                long long block, slot;
                if (!cache_slot(p, *cache, b, s, &block, &slot)) continue;
                const long long* cs = cache->v_cache_stride;
                const long long ys = V_VECTORS ? 1 : cs[3];
                typename OutOf<KV_FP8>::type* const y =
                    static_cast<typename OutOf<KV_FP8>::type*>(cache->v_cache) + block * cs[0] +
                    slot * cs[2] + h * cs[1] + f * ys;
#pragma unroll
                for (int u = 0; u < V_PAIR; ++u)
                    store_out<KV_FP8, V_VEC, V_VECTORS>(y + u * V_VEC * ys, ys, value[u], scale);
            }
            continue;
        }
        int h = item / ROT_ITEMS;
        const ItemSpan span = item_span(item - h * ROT_ITEMS);
        const bool is_k = HAS_K && h >= heads_q;
        if (!(is_k ? has_k : has_q)) continue;
        if (is_k) h -= heads_q;
        const long long* in_stride = is_k ? p.k_stride : p.q_stride;
        const long long xs = VEC_LOADS ? 1 : in_stride[3];
        const ItemData data = load_item(static_cast<const T*>(is_k ? p.k : p.q) + b * in_stride[0] +
                                            s * in_stride[2] + h * in_stride[1],
                                        xs, span);
        // QK-norm: the weights are read with the item's loads (every head of the token reads
        // the same ones: after the first, from L1).
        ItemWeights weights;
        if constexpr (QK_NORM) weights = load_item_weights(*norm, is_k, span);
        // The FP8 scale is read with the item's loads: read after the table, its latency would
        // come before the store.
        float scale = 1.0f;
        if constexpr (Q_FP8 || KV_FP8)
            if (is_k ? KV_FP8 : Q_FP8)
                scale = fp8_scale_value(is_k ? cache->k_scale : cache->q_scale);
        const long long row = direct_table_row(p, b, s, ROLES == 2 && is_k);
        ItemAngles angles;
        angles.cos = load_table_span(p.cos, p.cos_stride, row, span.pair0);
        angles.sin = load_table_span(p.sin, p.sin_stride, row, span.pair0);
        // QK-norm: the head's norm, from its lanes' sums, while the table spans are on their
        // way (every lane of the head's group comes here: its items share the head).
        float r = 1.0f;
        if constexpr (QK_NORM) r = head_norm_scale(data, norm->eps);
        // Where the head's row goes: k_out (or k's cache at the token's slot), or q_out.
        const long long* out_stride = is_k ? p.k_out_stride : p.q_out_stride;
        long long block = b, slot = s;
        if (KV_CACHE != 0 && is_k && !cache_slot(p, *cache, b, s, &block, &slot)) continue;
        const long long out = block * out_stride[0] + slot * out_stride[2] + h * out_stride[1];
        const long long ys = VEC_LOADS ? 1 : out_stride[3];
        if constexpr (QK_NORM)
            norm_rotate_store_item(data, weights, r, static_cast<T*>(is_k ? p.k_out : p.q_out) + out,
                                   static_cast<unsigned char*>(is_k ? p.k_out : p.q_out) + out,
                                   (Q_FP8 || KV_FP8) && (is_k ? KV_FP8 : Q_FP8), ys, span,
                                   angles, scale);
        else if ((Q_FP8 || KV_FP8) && (is_k ? KV_FP8 : Q_FP8))
            rotate_store_item_fp8(data, static_cast<unsigned char*>(is_k ? p.k_out : p.q_out) + out,
                                  ys, span, angles, scale);
        else
            rotate_store_item(data, static_cast<T*>(is_k ? p.k_out : p.q_out) + out, ys, span,
                              angles);
    }
}
#endif  // ROPE_JIT_KERNEL_ROPE || ROPE_JIT_KERNEL_DIRECT

// ---- rows through shared memory (rope_bulk_kernel, RopePlan::bulk_rows) -------------------
#if ROPE_JIT_KERNEL_BULK

// A tile's work items: every pair of a row once, each item rotating a chunk of pairs in place
// in the tile. Half style: a chunk of first halves and its partner chunk, both stored (the
// staged path's chunk items, which store only their own chunk, would race in place);
// interleaved: a chunk of whole pairs.
constexpr int PAIR_ITEMS = plan().bulk_items;
// Items a thread loads before it rotates any. One at a time left the threads waiting on each
// item's table spans where items are many and small: H200 run DM (session 26), fractions of
// copy, one -> two: StableLM-3B 20/80 (5 items of 2 pairs a row, 510 a tile) 0.838 -> 0.884;
// Phi-2, GPT-NeoX, Persimmon-8B, 128-feature heads within 0.004, GPT-NeoX in f32 0.933 ->
// 0.930. Each row's table row read once into shared memory as well took StableLM to 0.888 but
// cost GPT-NeoX f32 0.007 (an extra barrier a tile).
constexpr int BULK_ITEMS_IN_FLIGHT = 2;

__device__ __forceinline__ ItemSpan pair_item_span(int item) {
    ItemSpan span;
    span.second = false;
    span.own = ROTARY_OFFSET + item * VEC;
    span.partner = span.own + PARTNER_DISTANCE;
    span.pair0 = item * PAIRS_PER_ITEM;
    return span;
}

// A tile row's item is rotated where it lies: its chunks read from shared memory
// (load_in_tile), rotated and written back (store_rotated_in_tile); vector accesses where the
// host proved global vectors aligned (a tile row starts 16-byte aligned like the row it holds).
__device__ __forceinline__ ItemData load_in_tile(const T* row, const ItemSpan& span) {
    ItemData data;
    data.own = load_pack<VEC>(row + span.own, 1);
    if (!INTERLEAVED) data.partner = load_pack<VEC>(row + span.partner, 1);
    return data;
}
__device__ __forceinline__ void store_rotated_in_tile(T* row, const ItemSpan& span,
                                                      const ItemData& data,
                                                      const ItemAngles& angles) {
    const ItemFloats r = rotate_floats(item_floats(data), span, angles);
    Pack<VEC> own, partner;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        own.v[j] = from_float<DTYPE>(r.own[j]);
        if (!INTERLEAVED) partner.v[j] = from_float<DTYPE>(r.partner[j]);
    }
    auto store = [](T* y, const Pack<VEC>& pack) {
        if (VEC_LOADS) {
            *reinterpret_cast<Pack<VEC>*>(y) = pack;
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) y[j] = pack.v[j];
        }
    };
    store(row + span.own, own);
    if (!INTERLEAVED) store(row + span.partner, partner);
}
#endif  // ROPE_JIT_KERNEL_BULK

}  // namespace

// The direct path's own entry, where the plan has direct_entry (rope_params.h says why); empty
// for the other specs, whose recipe does not name it: rope_kernel takes both paths there.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
    rope_direct_kernel(const typename LaunchArgs<OwnParams>::type args) {
#if ROPE_JIT_KERNEL_DIRECT
    const OwnParams& own = own_args(args);
    const RopeKernelParams& p = rope_part(own);
    if (p.programmatic) fetch_argument_lines(args);  // as rope_kernel's direct path does
    wait_for_preceding_grid();
    rope_one_token(p, cache_args(args), norm_part(own));
#endif
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
    rope_kernel(const typename LaunchArgs<OwnParams>::type args) {
    // Empty for QK-norm specs, which take rope_direct_kernel alone, and for specs with the flat
    // path (KernelSpec::dense_rows), which launch rope_flat_kernel for every call
    // (rope_dense_rows.h: flat_rows_call derives the field only for calls flat_rows_of takes):
    // their NVRTC time drops by half or more (Llama bf16: 250 -> 110 ms on a 2-core machine),
    // which a prefill's first call and the presets' prewarm pay.
#if ROPE_JIT_KERNEL_ROPE
    // The direct path here, or (direct_entry) in rope_direct_kernel.
    constexpr bool DIRECT_HERE = plan().one_token_direct && !plan().direct_entry;
    const OwnParams& own = own_args(args);
    const RopeKernelParams& p = rope_part(own);
    const RopeCacheParams* cache = cache_args(args);  // KV cache and FP8 scales, or NULL
    // Only kernels that may take the direct path (decode, one token a block) fetch their
    // argument lines early: where the wait's window is most of a call. The others compile
    // without it (GPT-NeoX's out-of-place partial rotary ran 0.718 -> 0.679 of copy with it,
    // run CB, one process).
    if constexpr (DIRECT_HERE) {
        if (p.programmatic) fetch_argument_lines(args);
    }
    wait_for_preceding_grid();
    extern __shared__ __align__(16) char shared[];
    const int tpb = p.tokens_per_block;
    const int threads = static_cast<int>(blockDim.x);  // at most BLOCK_THREADS
    // The layout the launcher sized the block's dynamic shared memory with.
    const RopeSmemLayout layout = rope_block_smem(plan(), tpb);
    // [tpb][ROLES][PAIRS] angles if SHARED_ANGLES, [tpb][ROW_SETS] table rows, [tpb] row bases,
    // [PAIRS] gradient sums if FREQ_GRAD.
    float* s_cos = reinterpret_cast<float*>(shared + layout.cos);
    float* s_sin = reinterpret_cast<float*>(shared + layout.sin);
    long long* s_row = reinterpret_cast<long long*>(shared + layout.rows);
    RopeTokenBases* s_bases = reinterpret_cast<RopeTokenBases*>(shared + layout.bases);
    float* s_grad = reinterpret_cast<float*>(shared + layout.grad);
    RopeValueBases* s_value = reinterpret_cast<RopeValueBases*>(shared + layout.value_bases);
    if constexpr (DIRECT_HERE) {
        if (p.direct) {
            rope_one_token(p, cache, norm_part(own));
            return;
        }
    }
    // The FP8 scales, read once (NULL: 1).
    float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
    if constexpr (CACHE_PARAMS) {
        if (Q_FP8) q_scale = fp8_scale_value(cache->q_scale);
        if (KV_FP8) k_scale = fp8_scale_value(cache->k_scale);
        if (KV_FP8 && V_DIM > 0) v_scale = fp8_scale_value(cache->v_scale);
    }
    const long long first = static_cast<long long>(blockIdx.x) * tpb;
    const int heads_k = HAS_K ? static_cast<int>(p.heads_k) : 0;
    const int heads_q = HAS_K ? heads_k * GQA_GROUP : static_cast<int>(p.heads_q);
    const int items_per_token = (heads_q + heads_k) * ROT_ITEMS;
    const int tokens_here = static_cast<int>(min(static_cast<long long>(tpb), p.units - first));
    const int block_items = tokens_here * items_per_token;

    // 1. Per token: where its rows are, and its table rows (for q, and for k when k has its
    //    own angles), once per token: the split of a token into (batch row, position) is the
    //    kernel's only 64-bit division (32-bit while the grid has under 2^31 tokens).
    for (int i = threadIdx.x; i < tpb; i += threads) {
        RopeTokenBases base{-1, -1, -1, -1, 0, 0};
        if (i < tokens_here) {
            long long b, s;
            split_token(p, first + i, &b, &s);
            base = token_bases(p, b, s);
            if constexpr (KV_CACHE != 0) {
                // k goes to its cache slot (k_out is the cache), v to v's; a token without a
                // slot writes neither.
                RopeValueBases value{-1, -1};
                long long block, slot;
                if (base.k_in >= 0 && cache_slot(p, *cache, b, s, &block, &slot)) {
                    base.k_out = block * p.k_out_stride[0] + slot * p.k_out_stride[2];
                    value.v_in = b * cache->v_stride[0] + s * cache->v_stride[2];
                    value.v_out =
                        block * cache->v_cache_stride[0] + slot * cache->v_cache_stride[2];
                } else {
                    base.k_in = -1;
                }
                if (V_DIM > 0) s_value[i] = value;
            }
            if (MROPE_AXES > 0) {
                for (int axis = 0; axis < MROPE_AXES; ++axis)
                    s_row[i * ROW_SETS + axis] = table_row(p, b, s, false, axis);
            } else {
                for (int role = 0; role < ROLES; ++role)
                    s_row[i * ROW_SETS + role] = table_row(p, b, s, role == 1);
            }
        }
        s_bases[i] = base;
        if (KV_CACHE != 0 && V_DIM > 0 && i >= tokens_here) s_value[i] = RopeValueBases{-1, -1};
    }
    if (FREQ_GRAD)
        for (int i = threadIdx.x; i < PAIRS; i += threads) s_grad[i] = 0.0f;
    __syncthreads();

    // 2. With inv_freq or xPos: the block's cos/sin, once per token, shared by all its heads.
    if (SHARED_ANGLES) {
        for (int i = threadIdx.x; i < tokens_here * ROLES * PAIRS; i += threads) {
            const int set = i / PAIRS;  // token * ROLES + role
            const int pair = i - set * PAIRS;
            pair_angle(p, pair_row(s_row, p, set / ROLES, set % ROLES, pair), pair,
                       set % ROLES == 1, &s_cos[i], &s_sin[i]);
        }
        __syncthreads();
    }

    // Out of place, the features outside the rotary range are copied unchanged (4. below),
    // COPY_VEC at a time: copy `item` (consecutive items take consecutive vectors of a head
    // row) loaded into *value, its destination in *dst (and *dst8 for an FP8 output), *dst
    // NULL where there is nothing to copy.
    auto load_copy = [&](int item, int copies, Pack<COPY_VEC>* value, T** dst, unsigned char** dst8,
                         bool* is_k) {
        *dst = nullptr;
        if (item >= copies) return;
        const int rest = item / COPY_UNITS;
        const int f = (item - rest * COPY_UNITS) * COPY_VEC;
        const int token = rest / (heads_q + heads_k);
        int h = rest - token * (heads_q + heads_k);
        const long long d = f < COPY_SPLIT ? f + COPY_SHIFT : f + ROTARY_DIM;
        const RopeTokenBases base = s_bases[token];
        *is_k = HAS_K && h >= heads_q;
        if (*is_k ? (IN_PLACE_K || base.k_in < 0) : (IN_PLACE_Q || base.q_in < 0)) return;
        if (*is_k) {
            h -= heads_q;
            const long long xs = COPY_VECTORS ? 1 : p.k_stride[3],
                            ys = COPY_VECTORS ? 1 : p.k_out_stride[3];
            *value = load_pack<COPY_VEC, COPY_VECTORS>(
                static_cast<const T*>(p.k) + base.k_in + h * p.k_stride[1] + d * xs, xs);
            *dst = static_cast<T*>(p.k_out) + base.k_out + h * p.k_out_stride[1] + d * ys;
            if (KV_FP8)
                *dst8 = static_cast<unsigned char*>(p.k_out) + base.k_out + h * p.k_out_stride[1] +
                        d * ys;
        } else {
            const long long xs = COPY_VECTORS ? 1 : p.q_stride[3],
                            ys = COPY_VECTORS ? 1 : p.q_out_stride[3];
            *value = load_pack<COPY_VEC, COPY_VECTORS>(
                static_cast<const T*>(p.q) + base.q_in + h * p.q_stride[1] + d * xs, xs);
            *dst = static_cast<T*>(p.q_out) + base.q_out + h * p.q_out_stride[1] + d * ys;
            if (Q_FP8)
                *dst8 = static_cast<unsigned char*>(p.q_out) + base.q_out + h * p.q_out_stride[1] +
                        d * ys;
        }
    };
    // A thread's first copies (COPIES_AHEAD) are loaded before its rotation items, so that the
    // copies' latency overlaps theirs instead of following it (they are stored after them, in
    // 4.). One ahead against none, H200 run CF (session 19), fractions of copy: GPT-NeoX 24/96
    // out of place 0.705 -> 0.768, Phi-2 32/80 0.81 -> 0.85, GPT-J 64/256 0.89 -> 0.925, Gemma-4
    // proportional 128/512 0.863 -> 0.91.
    // The rotation writes only rotated features of the outputs and the copy reads only
    // unrotated ones of the inputs (outputs out of place do not overlap their inputs), so the
    // load may pass the rotation's stores.
    const int copies = plan().copies_unrotated ? tokens_here * (heads_q + heads_k) * COPY_UNITS : 0;
    Pack<COPY_VEC> ahead_value[COPIES_AHEAD];
    T* ahead_dst[COPIES_AHEAD];
    unsigned char* ahead_dst8[COPIES_AHEAD];
    bool ahead_is_k[COPIES_AHEAD];
#pragma unroll
    for (int j = 0; j < COPIES_AHEAD; ++j) {
        ahead_dst[j] = nullptr;
        ahead_dst8[j] = nullptr;
        ahead_is_k[j] = false;
        if constexpr (plan().copies_unrotated)
            load_copy(threadIdx.x + j * threads, copies, &ahead_value[j], &ahead_dst[j],
                      &ahead_dst8[j], &ahead_is_k[j]);
    }

    // 3. Rotate. Consecutive threads hold consecutive items of one head, so every access
    //    coalesces. One item a thread at a time, or (ITEM_BATCH) a batch: its loads and table
    //    spans first, in program order before any store, so that none waits on a store it
    //    might alias. (One item keeps its own loop: the batched form with one item spilled 8
    //    bytes at D64.)
    if constexpr (ITEM_BATCH == 1) {
        for (int item = threadIdx.x; item < block_items; item += threads) {
            const ItemPlace place = place_item(p, s_bases, item, items_per_token, heads_q,
                                               block_items, q_scale, k_scale);
            if (!place.valid) continue;
            const ItemData data = load_item(place.x, place.xs, place.span);
            const ItemAngles angles = item_angles(p, place, s_cos, s_sin, s_row);
            finish_item(p, place, data, angles, s_row, s_grad);
        }
    } else {
        for (int first_item = threadIdx.x; first_item < block_items;
             first_item += ITEM_BATCH * threads) {
            ItemPlace place[ITEM_BATCH];
            ItemData data[ITEM_BATCH];
            ItemAngles angles[ITEM_BATCH];
#pragma unroll
            for (int j = 0; j < ITEM_BATCH; ++j) {
                place[j] = place_item(p, s_bases, first_item + j * threads, items_per_token,
                                      heads_q, block_items, q_scale, k_scale);
                if (place[j].valid) data[j] = load_item(place[j].x, place[j].xs, place[j].span);
            }
#pragma unroll
            for (int j = 0; j < ITEM_BATCH; ++j)
                if (place[j].valid) angles[j] = item_angles(p, place[j], s_cos, s_sin, s_row);
#pragma unroll
            for (int j = 0; j < ITEM_BATCH; ++j)
                if (place[j].valid) finish_item(p, place[j], data[j], angles[j], s_row, s_grad);
        }
    }
    if (FREQ_GRAD) {
        // One global add per pair and block: the block's sums were gathered in shared memory.
        __syncthreads();
        for (int i = threadIdx.x; i < PAIRS; i += threads)
            atomicAdd(p.inv_freq_grad + i * p.inv_freq_grad_stride, s_grad[i]);
    }

    // 4. The copies: the thread's first COPIES_AHEAD (loaded before 3.), then the rest,
    //    COPY_BATCH loads in flight before their stores.
    if constexpr (plan().copies_unrotated) {
        auto store_copy = [&](const Pack<COPY_VEC>& value, T* dst, unsigned char* dst8,
                              bool is_k) {
            const long long ys = COPY_VECTORS ? 1 : is_k ? p.k_out_stride[3] : p.q_out_stride[3];
            if ((Q_FP8 || KV_FP8) && (is_k ? KV_FP8 : Q_FP8))
                store_out<true, COPY_VEC, COPY_VECTORS>(dst8, ys, value, is_k ? k_scale : q_scale);
            else
                store_pack<COPY_VEC, COPY_VECTORS>(dst, ys, value);
        };
#pragma unroll
        for (int j = 0; j < COPIES_AHEAD; ++j)
            if (ahead_dst[j] != nullptr)
                store_copy(ahead_value[j], ahead_dst[j], ahead_dst8[j], ahead_is_k[j]);
        for (int first_copy = threadIdx.x + COPIES_AHEAD * threads; first_copy < copies;
             first_copy += COPY_BATCH * threads) {
            T* dst[COPY_BATCH];
            unsigned char* dst8[COPY_BATCH];  // FP8 outputs (KV_FP8 for k, Q_FP8 for q)
            bool dst_is_k[COPY_BATCH];
            Pack<COPY_VEC> value[COPY_BATCH];
#pragma unroll
            for (int j = 0; j < COPY_BATCH; ++j)
                load_copy(first_copy + j * threads, copies, &value[j], &dst[j], &dst8[j], &dst_is_k[j]);
#pragma unroll
            for (int j = 0; j < COPY_BATCH; ++j)
                if (dst[j] != nullptr) store_copy(value[j], dst[j], dst8[j], dst_is_k[j]);
        }
    }

    // 5. KV cache: v's rows of the block's tokens copied (or quantized) into v's cache,
    //    V_VEC at a time, consecutive threads on consecutive vectors of a head row.
    if constexpr (KV_CACHE != 0 && V_DIM > 0) {
        constexpr int V_UNITS = V_DIM / V_VEC;
        constexpr bool V_VECTORS = V_VEC > 1;
        const int copies = tokens_here * heads_k * V_UNITS;
        for (int first_copy = threadIdx.x; first_copy < copies;
             first_copy += COPY_BATCH * threads) {
            typename OutOf<KV_FP8>::type* dst[COPY_BATCH];
            Pack<V_VEC> value[COPY_BATCH];
#pragma unroll
            for (int j = 0; j < COPY_BATCH; ++j) {
                dst[j] = nullptr;
                const int item = first_copy + j * threads;
                if (item >= copies) continue;
                const int rest = item / V_UNITS;
                const int f = (item - rest * V_UNITS) * V_VEC;
                const int token = rest / heads_k;
                const int h = rest - token * heads_k;
                const RopeValueBases base = s_value[token];
                if (base.v_in < 0) continue;
                const long long xs = V_VECTORS ? 1 : cache->v_stride[3];
                const long long ys = V_VECTORS ? 1 : cache->v_cache_stride[3];
                value[j] = load_pack<V_VEC, V_VECTORS>(
                    static_cast<const T*>(cache->v) + base.v_in + h * cache->v_stride[1] + f * xs,
                    xs);
                dst[j] = static_cast<typename OutOf<KV_FP8>::type*>(cache->v_cache) + base.v_out +
                         h * cache->v_cache_stride[1] + f * ys;
            }
#pragma unroll
            for (int j = 0; j < COPY_BATCH; ++j) {
                if (dst[j] == nullptr) continue;
                const long long ys = V_VECTORS ? 1 : cache->v_cache_stride[3];
                store_out<KV_FP8, V_VEC, V_VECTORS>(dst[j], ys, value[j], v_scale);
            }
        }
    }
#endif  // ROPE_JIT_KERNEL_ROPE
}

// The bulk path (RopePlan::bulk_rows; the launcher's choice, rope_dense_rows.h): a persistent
// grid whose blocks take tiles of consecutive rows grid-stride. Thread 0 loads each tile into
// one of the block's kRopeBulkStages stages with the bulk copy engine; the block rotates its
// pairs in place there, then thread 0 stores the whole tile, rotated and unrotated features
// alike, to the output with one bulk store, and reloads the stage the previous tile used once
// that tile's store has read it. Empty for the other specs and before sm_90, where the recipe
// does not name it.
extern "C" __global__ void __launch_bounds__(kRopeBulkThreads, kRopeBulkBlocksPerSm)
    rope_bulk_kernel(const RopeBulkKernelParams args) {
#if ROPE_JIT_KERNEL_BULK && __CUDA_ARCH__ >= 900
    const RopeKernelParams& p = args.own;
    const RopeBulkParams& bulk = args.bulk;
    // [kRopeBulkStages] mbarriers, then the stages' tiles from byte 128.
    extern __shared__ __align__(128) char shared[];
    const unsigned barriers = shared_address(shared);
    char* const tiles = shared + 128;
    const long long grid = gridDim.x;
    auto tile_rows = [&](long long tile, bool* is_k, long long* row0) {
        *is_k = tile >= bulk.q_tiles;
        *row0 = (*is_k ? tile - bulk.q_tiles : tile) * bulk.tile_rows;
        const long long left = (*is_k ? bulk.k_rows : bulk.q_rows) - *row0;
        return static_cast<int>(left < bulk.tile_rows ? left : bulk.tile_rows);
    };
    auto load_tile = [&](long long tile, int stage) {
        bool is_k;
        long long row0;
        const int rows = tile_rows(tile, &is_k, &row0);
        const T* x = static_cast<const T*>(is_k ? p.k : p.q) + row0 * HEAD_DIM;
        bulk_load(shared_address(tiles + stage * kRopeBulkStageBytes), x,
                  static_cast<unsigned>(rows * HEAD_DIM * sizeof(T)), barriers + 8 * stage);
    };
    if (threadIdx.x == 0) {
        for (int stage = 0; stage < kRopeBulkStages; ++stage)
            bulk_barrier_init(barriers + 8 * stage);
        bulk_barriers_ready();
    }
    __syncthreads();
    // The next grid launches only once this one's blocks have left their loops (below), not
    // here: allowed at the start, StableLM's 20/80 out of place ran 91.5 us in a graph
    // against 86.4 us launched plainly, GPT-NeoX's 24/96 202.8 against 201.3 (H200, run GK);
    // allowed after the loop, 86.2 and 201.0, ahead of plain launches at every bulk case
    // (run GM). Our reading: this grid is persistent, one wave whose blocks each take a fixed
    // share of the tiles, and at 43 registers a multiprocessor holds a fifth block beside its
    // four; the next grid's blocks took those places at once and the places of the first
    // blocks to finish, so it started unevenly spread (five blocks on some multiprocessors,
    // three on others) and its most loaded multiprocessors ended late.
    await_preceding_grid();
    if (threadIdx.x == 0)
        for (int stage = 0; stage < kRopeBulkStages; ++stage)
            if (blockIdx.x + stage * grid < bulk.tiles)
                load_tile(blockIdx.x + stage * grid, stage);

    long long it = 0;
    for (long long tile = blockIdx.x; tile < bulk.tiles; tile += grid, ++it) {
        const int stage = static_cast<int>(it % kRopeBulkStages);
        bool is_k;
        long long row0;
        const int rows = tile_rows(tile, &is_k, &row0);
        T* const rows_here = reinterpret_cast<T*>(tiles + stage * kRopeBulkStageBytes);
        // (b, s) of a row: the launcher keeps rows under 2^31, so 32-bit multiply-shift
        // divisions by the host's divisors.
        const RowDivisor heads = is_k ? bulk.k_heads : bulk.q_heads;
        const RowDivisor seqlen = is_k ? bulk.k_seqlen : bulk.q_seqlen;
        auto table_row_of = [&](int r) -> long long {  // r: the row's place in the tile
            const unsigned row = static_cast<unsigned>(row0) + static_cast<unsigned>(r);
            unsigned b, s;
            if (bulk.heads_fastest) {
                const unsigned token = row_divide(row, heads);
                b = row_divide(token, seqlen);
                s = token - b * static_cast<unsigned>(seqlen.divisor);
            } else {
                const unsigned plane = row_divide(row, seqlen);  // (b, h)
                s = row - plane * static_cast<unsigned>(seqlen.divisor);
                b = row_divide(plane, heads);
            }
            return direct_table_row(p, static_cast<int>(b), static_cast<int>(s), false);
        };
        bulk_wait(barriers + 8 * stage, static_cast<unsigned>(it / kRopeBulkStages) & 1u);
        // BULK_ITEMS_IN_FLIGHT items a round: all loaded (table spans and tile chunks), then
        // all rotated and stored back.
        const int items = rows * PAIR_ITEMS;
        for (int i0 = threadIdx.x; i0 < items; i0 += BULK_ITEMS_IN_FLIGHT * kRopeBulkThreads) {
            ItemSpan spans[BULK_ITEMS_IN_FLIGHT];
            ItemAngles angles[BULK_ITEMS_IN_FLIGHT];
            ItemData data[BULK_ITEMS_IN_FLIGHT];
            T* where[BULK_ITEMS_IN_FLIGHT];
#pragma unroll
            for (int u = 0; u < BULK_ITEMS_IN_FLIGHT; ++u) {
                const int i = i0 + u * kRopeBulkThreads;
                if (i >= items) break;
                const int r = i / PAIR_ITEMS;
                spans[u] = pair_item_span(i - r * PAIR_ITEMS);
                const long long table = table_row_of(r);
                angles[u].cos = load_table_span(p.cos, p.cos_stride, table, spans[u].pair0);
                angles[u].sin = load_table_span(p.sin, p.sin_stride, table, spans[u].pair0);
                where[u] = rows_here + r * HEAD_DIM;
                data[u] = load_in_tile(where[u], spans[u]);
            }
#pragma unroll
            for (int u = 0; u < BULK_ITEMS_IN_FLIGHT; ++u) {
                if (i0 + u * kRopeBulkThreads >= items) break;
                store_rotated_in_tile(where[u], spans[u], data[u], angles[u]);
            }
        }
        bulk_fence_shared_writes();
        __syncthreads();
        if (threadIdx.x == 0) {
            T* const y = static_cast<T*>(is_k ? p.k_out : p.q_out) + row0 * HEAD_DIM;
            bulk_store(y, shared_address(rows_here),
                       static_cast<unsigned>(rows * HEAD_DIM * sizeof(T)));
            // The previous tile's stage takes the tile kRopeBulkStages - 1 rounds on, once
            // that tile's store has read it (this tile's store may still be reading).
            const long long next = tile + (kRopeBulkStages - 1) * grid;
            if (it > 0 && next < bulk.tiles) {
                bulk_wait_stores_read_but_newest();
                load_tile(next, static_cast<int>((it - 1) % kRopeBulkStages));
            }
        }
    }
    allow_next_grid();
    // The stores read the block's shared memory until they complete.
    if (threadIdx.x == 0) bulk_wait_stores();
#endif
}

// The flat path (RopePlan::flat_rows; the launcher's choice, rope_dense_rows.h): q's dense rows,
// then k's, walked as one array of items, a block's items consecutive in memory, so that it
// reads and writes one run of memory as a copy does. Its item is the direct path's rotation
// item (load, table spans, rotation, store) or, with flat_copies (out-of-place partial rotary
// of interleaved pairs), one vector of the output row, rotated or copied.
// A row's (b, s): a multiply-shift division or two of the row index (under 2^31, as the item
// index under 2^32: the launcher's bounds). ITEMS a thread, all loaded before any is stored:
// one; two ran D64 [B,H,S,D] interleaved at 0.84-0.85 of copy against 0.895 and spilled
// Llama-3-8B's half-style items (run DU). Empty for the other specs, whose recipe does not
// name it.
#if ROPE_JIT_KERNEL_FLAT
constexpr int FLAT_ITEMS = plan().flat_items;
constexpr bool FLAT_COPIES = plan().flat_copies;
enum : int { FLAT_SHUFFLES = plan().flat_shuffles };  // no global, unlike a constexpr (above)
static_assert(!FLAT_SHUFFLES || 32 % FLAT_ITEMS == 0, "a row's vectors in one warp");
static_assert(kRopeFlatThreads % 32 == 0, "blocks of whole warps: a lane is threadIdx.x % 32");
static_assert(!FLAT_COPIES || INTERLEAVED || (FLAT_SHUFFLES && CHUNK_ITEMS && !PROPORTIONAL),
              "a copied row's rotated vectors hold whole pairs, or take their partners by "
              "shuffles");

// `pack` as held by lane `source` of the warp; every lane of the warp calls it.
template <int N>
__device__ __forceinline__ Pack<N> shuffle_pack(const Pack<N>& pack, int source) {
    static_assert(sizeof(Pack<N>) % sizeof(unsigned) == 0, "a pack of whole 32-bit words");
    constexpr int WORDS = sizeof(Pack<N>) / sizeof(unsigned);
    unsigned words[WORDS];
    memcpy(words, &pack, sizeof(pack));
#pragma unroll
    for (int w = 0; w < WORDS; ++w) words[w] = __shfl_sync(0xffffffffu, words[w], source);
    Pack<N> out;
    memcpy(&out, words, sizeof(out));
    return out;
}

// With flat_copies: the rotation item of vector `v` of the row, or -1 where it is copied.
__device__ __forceinline__ int row_vector_item(int v) {
    const int f = v * VEC;
    return f >= ROTARY_OFFSET && f < ROTARY_OFFSET + ROTARY_DIM ? (f - ROTARY_OFFSET) / VEC : -1;
}
#endif  // ROPE_JIT_KERNEL_FLAT

#if ROPE_JIT_KERNEL_FLAT
// flat_shuffles: vector `i` of the rows, rotated or copied, every lane of the warp on one path
// up to the shuffle that hands each rotated vector its partner (divergent paths there waited
// for their loads one after the other: run ET), lanes past the last item too (they store
// nothing).
__device__ __forceinline__ void flat_shuffled_vector(const RopeKernelParams& p,
                                                     const RopeBulkParams& rows, long long i,
                                                     long long items, long long q_items) {
    const bool valid = i < items;
    const long long v = valid ? i : 0;
    const bool is_k = HAS_K && v >= q_items;
    const unsigned local = static_cast<unsigned>(is_k ? v - q_items : v);
    const unsigned row = local / FLAT_ITEMS;
    const int in_row = static_cast<int>(local - row * FLAT_ITEMS);
    const long long at = static_cast<long long>(row) * HEAD_DIM;
    const int item = row_vector_item(in_row);
    const bool copied = item < 0;
    const ItemSpan span = item_span(copied ? 0 : item);
    ItemData data;
    data.own = load_pack<VEC>(static_cast<const T*>(is_k ? p.k : p.q) + at + in_row * VEC, 1);
    // The row's (b, s), written out as in the item loop: a helper that both call changed the
    // PTX of all three flat kernels (codegen fingerprint, session 33), as one shared with the
    // bulk kernel did (run DU).
    const RowDivisor heads = is_k ? rows.k_heads : rows.q_heads;
    const RowDivisor seqlen = is_k ? rows.k_seqlen : rows.q_seqlen;
    unsigned b, s;
    if (rows.heads_fastest) {
        const unsigned token = row_divide(row, heads);
        b = row_divide(token, seqlen);
        s = token - b * static_cast<unsigned>(seqlen.divisor);
    } else {
        const unsigned plane = row_divide(row, seqlen);  // (b, h)
        s = row - plane * static_cast<unsigned>(seqlen.divisor);
        b = row_divide(plane, heads);
    }
    const long long table =
        direct_table_row(p, static_cast<int>(b), static_cast<int>(s), ROLES == 2 && is_k);
    ItemAngles angles;
    angles.cos = load_table_span(p.cos, p.cos_stride, table, span.pair0);
    angles.sin = load_table_span(p.sin, p.sin_stride, table, span.pair0);
    const int lane = static_cast<int>(threadIdx.x % 32);
    data.partner = shuffle_pack(
        data.own, copied ? lane : span.second ? lane - PAIRS / VEC : lane + PAIRS / VEC);
    if (!valid) return;
    T* const y = static_cast<T*>(is_k ? p.k_out : p.q_out) + at;
    if (copied)
        store_pack<VEC>(y + in_row * VEC, 1, data.own);
    else
        rotate_store_item(data, y, 1, span, angles);
}
#endif  // ROPE_JIT_KERNEL_FLAT

// The flat kernel's bound of blocks a multiprocessor (rope_params.h says why):
// kRopeFlatBlocksPerSm for the item loop; for shuffled vectors 8 with 16-bit tables (31
// registers, no spills) and 4 with float32 tables (50; spills at 5 and 6).
ROPE_JIT_HOST_DEVICE constexpr int flat_min_blocks() {
    if (!plan().flat_shuffles) return kRopeFlatBlocksPerSm;
    return sizeof(TableT) == 2 ? 8 : 4;
}

extern "C" __global__ void __launch_bounds__(kRopeFlatThreads, flat_min_blocks())
    rope_flat_kernel(const RopeBulkKernelParams args) {
#if ROPE_JIT_KERNEL_FLAT
    constexpr int ITEMS = 1;
    const RopeKernelParams& p = args.own;
    const RopeBulkParams& rows = args.bulk;
    wait_for_preceding_grid();
    const long long q_items = rows.q_rows * FLAT_ITEMS;
    const long long items = q_items + rows.k_rows * FLAT_ITEMS;
    const long long first =
        static_cast<long long>(blockIdx.x) * (blockDim.x * ITEMS) + threadIdx.x;
    if constexpr (FLAT_SHUFFLES) {
        flat_shuffled_vector(p, rows, first, items, q_items);
        return;
    }
    ItemData data[ITEMS];
    ItemAngles angles[ITEMS];
    ItemSpan spans[ITEMS];
    long long at[ITEMS];
    bool in_k[ITEMS], copies[ITEMS];
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
        const long long i = first + u * static_cast<long long>(blockDim.x);
        if (i >= items) break;
        const bool is_k = HAS_K && i >= q_items;
        const unsigned local = static_cast<unsigned>(is_k ? i - q_items : i);
        const unsigned row = local / FLAT_ITEMS;
        const int in_row = static_cast<int>(local - row * FLAT_ITEMS);
        const T* const x = static_cast<const T*>(is_k ? p.k : p.q);
        at[u] = static_cast<long long>(row) * HEAD_DIM;
        in_k[u] = is_k;
        copies[u] = false;
        if constexpr (FLAT_COPIES) {
            const int item = row_vector_item(in_row);
            copies[u] = item < 0;
            if (copies[u]) {
                at[u] += in_row * VEC;
                data[u].own = load_pack<VEC>(x + at[u], 1);
                continue;
            }
            spans[u] = item_span(item);
        } else {
            spans[u] = item_span(in_row);
        }
        data[u] = load_item(x + at[u], 1, spans[u]);
        // The row's (b, s) as the bulk kernel splits its rows; written out here too, since
        // a helper shared by both changed this kernel's code from the one measured (run DU).
        const RowDivisor heads = is_k ? rows.k_heads : rows.q_heads;
        const RowDivisor seqlen = is_k ? rows.k_seqlen : rows.q_seqlen;
        unsigned b, s;
        if (rows.heads_fastest) {
            const unsigned token = row_divide(row, heads);
            b = row_divide(token, seqlen);
            s = token - b * static_cast<unsigned>(seqlen.divisor);
        } else {
            const unsigned plane = row_divide(row, seqlen);  // (b, h)
            s = row - plane * static_cast<unsigned>(seqlen.divisor);
            b = row_divide(plane, heads);
        }
        const long long table =
            direct_table_row(p, static_cast<int>(b), static_cast<int>(s), ROLES == 2 && is_k);
        angles[u].cos = load_table_span(p.cos, p.cos_stride, table, spans[u].pair0);
        angles[u].sin = load_table_span(p.sin, p.sin_stride, table, spans[u].pair0);
    }
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
        if (first + u * static_cast<long long>(blockDim.x) >= items) break;
        T* const y = static_cast<T*>(in_k[u] ? p.k_out : p.q_out) + at[u];
        if (FLAT_COPIES && copies[u])
            store_pack<VEC>(y, 1, data[u].own);
        else
            rotate_store_item(data[u], y, 1, spans[u], angles[u]);
    }
#endif
}
