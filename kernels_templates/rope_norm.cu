// QK-norm + RoPE kernel template: RMSNorm over each head's HEAD_DIM features, then the rotation
// of rope.cu (any pair style, tables or inv_freq, positions, varlen, GQA, xPos, M-RoPE), and in
// the backward the gradients of both (rope_jit_rope_args, "QK-norm"). The forwards with a KV
// cache whose heads rope.cu's direct path can take (RopePlan::norm_items) are rope.cu's. The
// runtime prepends the same constants as for rope.cu (kernel_spec.cpp) plus QK_NORM,
// NORM_UNIT_OFFSET, NORM_WEIGHT_DTYPE, NORM_WEIGHT_GRAD and NORM_WEIGHT_VEC_LOADS.
//
// The norm needs a whole head row before any output, so a row lives in the registers of a group
// of LANES lanes (rope_norm_params.h): a lane owns whole pairs, VEC of them as one aligned vector
// of first features and one of partners (interleaved: VEC consecutive features), and COPY_VEC
// unrotated features at a time; each pair's angle is computed once. The sum of squares is a
// shuffle reduction inside the group. A warp holds 32 / LANES groups; each takes a run of up to
// rope_norm_max_run rows at a time (consecutive heads of one token and kind, sharing the place,
// table spans and weights resolved once), runs grid-stride (with many rows the launcher gives
// each group one run: a block per set of runs).
// Forward: y = rope(x * r * w'), r = 1/sqrt(mean(x^2) + eps). Backward (q and k hold dL/dy):
// g = the inverse rotation of dL/dy, xh = x * r, dL/dx = r (w' g - xh mean(w' g xh)), and dL/dw
// sums g xh, per block in shared memory, then once per block with atomics.
//
// At decode the time is a row's chain of dependent steps, not bandwidth, so each step starts as
// early as it can: a row's position (the head of the longest chain: position -> table row) is
// asked for first, then its data and weights; the norm (sums, shuffles, rsqrt) is computed
// while the table row is still on its way, and the table values are used only after it.
//
// Forward with a KV cache (KV_CACHE): k's rows go to their cache slots instead of k_out, and
// v's rows (V_DIM > 0) are copied into v's cache by groups of their own; FP8 outputs (KV_FP8,
// Q_FP8) store float8 e4m3fn of value / scale.

#include "device_numeric.h"
#include "rope_norm_params.h"
#include "rope_device.h"

static_assert(QK_NORM, "rope_norm.cu is the QK-norm kernel");

namespace {

using T = typename StorageOf<DTYPE>::type;

enum : int {
    PAIRS = ROTARY_DIM / 2,
    WARP = 32,
    LANES = rope_norm_lanes(HEAD_DIM, ROTARY_DIM, INTERLEAVED, VEC, COPY_VEC),
    ROWS_PER_WARP = WARP / LANES,
    // Rotated items (VEC pairs, or interleaved VEC features) and unrotated ones (COPY_VEC
    // features) of a row, and how many of each a lane holds (at least one slot, maybe unused).
    ROT_ITEMS = rope_norm_rot_items(ROTARY_DIM, INTERLEAVED, VEC),
    COPY_ITEMS = rope_norm_copy_items(HEAD_DIM, ROTARY_DIM, COPY_VEC),
    ROT_SLOTS = ROT_ITEMS > LANES ? (ROT_ITEMS + LANES - 1) / LANES : 1,
    COPY_SLOTS = COPY_ITEMS > LANES ? (COPY_ITEMS + LANES - 1) / LANES : 1,
    PAIRS_PER_ITEM = INTERLEAVED ? VEC / 2 : VEC,
    PARTNER_VEC = INTERLEAVED ? 1 : VEC,  // partner registers (none used when interleaved)
    // A pair's second feature in the half and proportional styles: R/2, or D/2, further on.
    PARTNER_SHIFT = PROPORTIONAL ? HEAD_DIM / 2 : PAIRS,
    V_ITEMS = V_DIM / V_VEC,
    V_SLOTS = V_ITEMS > LANES ? (V_ITEMS + LANES - 1) / LANES : 1,
};
static_assert(INTERLEAVED ? ROTARY_DIM % VEC == 0 && VEC % 2 == 0 : PAIRS % VEC == 0,
              "VEC tiles the pairs");
static_assert((HEAD_DIM - ROTARY_DIM) % COPY_VEC == 0 && V_DIM % V_VEC == 0,
              "COPY_VEC and V_VEC tile their features");

// Whether a lane reads its pairs' cos/sin as spans of a plain table.
enum : bool { TABLE_SPANS = rope_norm_table_spans(ANGLES_FROM_INV_FREQ, HAS_XPOS, MROPE_AXES) };

// Rows a run has at most (RopeNormParams::run is at most this).
enum : int {
    MAX_RUN = rope_norm_max_run(BACKWARD_PASS, Q_FP8 || KV_FP8 || KV_CACHE != 0, TABLE_SPANS,
                                ROTARY_DIM < HEAD_DIM, HEAD_DIM)
};
static_assert(MAX_RUN == 1 || (!BACKWARD_PASS && KV_CACHE == 0), "runs: plain forwards only");

template <int N>
struct alignas(N * sizeof(T)) Pack {
    T v[N];
};

// N consecutive features at x: one aligned vector access when the host proved alignment and
// unit stride (VECTOR), else N scalar accesses at `stride`.
template <int N, bool VECTOR>
__device__ __forceinline__ Pack<N> load_pack(const T* x, long long stride) {
    Pack<N> pack;
    if constexpr (VECTOR) {
        pack = *reinterpret_cast<const Pack<N>*>(x);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) pack.v[j] = x[j * stride];
    }
    return pack;
}

template <int N>
__device__ __forceinline__ void unpack(const Pack<N>& pack, float* v) {
    if constexpr (DTYPE != 0 && N % 2 == 0) {
        // 16-bit elements two a 32-bit word (a Pack is aligned to its size).
        const unsigned* words = reinterpret_cast<const unsigned*>(&pack);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) floats_of_bits32<DTYPE>(words[j], &v[2 * j], &v[2 * j + 1]);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = storage_to_float<DTYPE>(pack.v[j]);
    }
}

// 16-byte stores of results are marked evict-first (st.global.cs), as in rope.cu: they are never
// read again here and should not push the table rows, which every head reads, out of L2.
__device__ __forceinline__ void store_streaming16(void* y, const unsigned* w) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(y), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
}

// N results at y (q's dtype) or, FP8, N float8 e4m3fn bytes of value / scale at y8 (the IEEE
// quotient's byte, as the CPU reference divides, from a reciprocal prepared once: fp8_quotient
// in rope_device.h): one aligned vector store when VECTOR, else N scalar stores at `stride`.
template <int N, bool VECTOR>
__device__ __forceinline__ void store_values(T* y, unsigned char* y8, bool fp8, long long stride,
                                             const float* v, const Fp8Scale& scale) {
    if ((KV_FP8 || Q_FP8) && fp8) {
        unsigned short pairs[(N + 1) / 2];
#pragma unroll
        for (int j = 0; j < N / 2; ++j)
            pairs[j] = e4m3x2_bits(fp8_quotient(v[2 * j], scale),
                                   fp8_quotient(v[2 * j + 1], scale));
        if (N % 2 != 0)
            pairs[N / 2] = static_cast<unsigned short>(e4m3_bits(fp8_quotient(v[N - 1], scale)));
        if constexpr (VECTOR && N == 8) {
            struct alignas(8) Words {
                unsigned lo, hi;
            };
            *reinterpret_cast<Words*>(y8) = Words{pairs[0] | (unsigned(pairs[1]) << 16),
                                                  pairs[2] | (unsigned(pairs[3]) << 16)};
        } else if constexpr (VECTOR && N == 4) {
            *reinterpret_cast<unsigned*>(y8) = pairs[0] | (unsigned(pairs[1]) << 16);
        } else if constexpr (VECTOR && N == 2) {
            *reinterpret_cast<unsigned short*>(y8) = pairs[0];
        } else {
#pragma unroll
            for (int j = 0; j < N; ++j)
                y8[j * stride] = static_cast<unsigned char>(pairs[j / 2] >> (8 * (j % 2)));
        }
        return;
    }
    Pack<N> pack;
#pragma unroll
    for (int j = 0; j < N; ++j) pack.v[j] = from_float<DTYPE>(v[j]);
    if constexpr (VECTOR && sizeof(Pack<N>) == 16) {
        store_streaming16(y, reinterpret_cast<const unsigned*>(&pack));
    } else if constexpr (VECTOR) {
        *reinterpret_cast<Pack<N>*>(y) = pack;
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) y[j * stride] = pack.v[j];
    }
}

// Sum over the LANES lanes of a group (xor offsets below LANES stay inside it); every lane of
// the warp calls it.
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The first feature of rotated item j, and of unrotated item j: [0, o) then [o + R, D), or,
// proportional, [R/2, D/2) then [D/2 + R/2, D).
__device__ __forceinline__ int rot_feature(int j) {
    return ROTARY_OFFSET + j * VEC;
}
__device__ __forceinline__ int copy_feature(int j) {
    const int f = j * COPY_VEC;
    if (PROPORTIONAL) {
        const int first = HEAD_DIM / 2 - PAIRS;
        return f < first ? PAIRS + f : HEAD_DIM / 2 + PAIRS + (f - first);
    }
    return f < ROTARY_OFFSET ? f : f + ROTARY_DIM;
}

// A row's features as the lane holds them: rotated items (first features, partners) and
// unrotated ones, raw as loaded, so that they occupy few registers while loads are in flight.
struct RawRow {
    Pack<VEC> own[ROT_SLOTS];
    Pack<PARTNER_VEC> partner[ROT_SLOTS];
    Pack<COPY_VEC> tail[COPY_SLOTS];
};

// The same as float (values, weights, or results).
struct Row {
    float own[ROT_SLOTS][VEC];
    float partner[ROT_SLOTS][PARTNER_VEC];
    float tail[COPY_SLOTS][COPY_VEC];
};

// Whether slot k of lane `sub` holds an item; known at compile time where the items fill every
// lane's slots, or there are none.
__device__ __forceinline__ bool rot_valid(int sub, int k) {
    if constexpr (ROT_ITEMS % LANES == 0) return true;
    return sub + k * LANES < ROT_ITEMS;
}
__device__ __forceinline__ bool copy_valid(int sub, int k) {
    if constexpr (COPY_ITEMS == 0) return false;
    if constexpr (COPY_ITEMS % LANES == 0) return true;
    return sub + k * LANES < COPY_ITEMS;
}

// Loads the lane's items of the row at x (feature stride xs); nothing for an inactive row.
__device__ __forceinline__ void load_row(const T* x, long long xs, bool active, int sub,
                                         RawRow* raw) {
    if (VEC_LOADS) xs = 1;  // the host proved unit feature strides (as rope.cu assumes)
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        if (!active || !rot_valid(sub, k)) continue;
        const T* at = x + rot_feature(sub + k * LANES) * xs;
        raw->own[k] = load_pack<VEC, VEC_LOADS>(at, xs);
        if (!INTERLEAVED)
            raw->partner[k] = load_pack<PARTNER_VEC, VEC_LOADS>(at + PARTNER_SHIFT * xs, xs);
    }
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k) {
        if (!active || !copy_valid(sub, k)) continue;
        const T* at = x + copy_feature(sub + k * LANES) * xs;
        raw->tail[k] = load_pack<COPY_VEC, (COPY_VEC > 1)>(at, xs);
    }
}

// The row as float, and the lane's part of its sum of squares (0 for unused slots). An inactive
// row's registers hold whatever they held (load_row loaded nothing): its group computes on them
// and stores nothing, and its sums stay inside the group, so masking them would only cost
// instructions.
__device__ __forceinline__ float unpack_row(const RawRow& raw, int sub, Row* row) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        const bool valid = rot_valid(sub, k);
        unpack<VEC>(raw.own[k], row->own[k]);
        if (!INTERLEAVED) unpack<PARTNER_VEC>(raw.partner[k], row->partner[k]);
#pragma unroll
        for (int t = 0; t < VEC; ++t) {
            if (!valid) row->own[k][t] = 0.0f;
            sum += row->own[k][t] * row->own[k][t];
            if (!INTERLEAVED) {
                if (!valid) row->partner[k][t] = 0.0f;
                sum += row->partner[k][t] * row->partner[k][t];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k) {
        const bool valid = copy_valid(sub, k);
        unpack<COPY_VEC>(raw.tail[k], row->tail[k]);
#pragma unroll
        for (int t = 0; t < COPY_VEC; ++t) {
            if (!valid) row->tail[k][t] = 0.0f;
            sum += row->tail[k][t] * row->tail[k][t];
        }
    }
    return sum;
}

// The weights at the lane's features, raw as stored (w' = w, or 1 + w, when used): loaded with
// the row, so that their latency overlaps its. Unit-stride, 16-byte-aligned weights (the
// usual [D] parameter) are read as vectors of up to 16 bytes, else one element at a time;
// unused slots hold zeros (the backward's sums multiply them).
using W = NormWeight;  // rope_device.h

struct WeightRow {
    WeightPack<VEC> own[ROT_SLOTS];
    WeightPack<PARTNER_VEC> partner[ROT_SLOTS];
    WeightPack<COPY_VEC> tail[COPY_SLOTS];
};

// Whether an inactive row's registers are left as they are rather than zeroed: in forwards
// without runs (decode, KV cache, FP8), where the zeros merged into the loaded halves made the
// warp wait for the loads right there (H200 run BE, exp-s13); an inactive row stores nothing.
// Elsewhere zeros: the backward's sums multiply the weights, and the forwards with runs took 10
// more registers without them.
enum : bool { KEEP_INACTIVE = !BACKWARD_PASS && MAX_RUN == 1 };

template <int N, bool VECTOR>
__device__ __forceinline__ void load_weight_run(const W* w, long long ws, bool valid, int d,
                                                WeightPack<N>* out) {
    if (valid) {
        load_weight_pack<N, VECTOR>(w, ws, d, out);
    } else if (!KEEP_INACTIVE) {
#pragma unroll
        for (int j = 0; j < N; ++j) out->v[j] = W{};
    }
}

__device__ __forceinline__ void load_weights(const void* weights, long long ws, bool active,
                                             int sub, WeightRow* wr) {
    const W* w = static_cast<const W*>(weights);
    // Vectors where every run starts at a multiple of its length (unrotated runs always do;
    // rotated ones when the offset and the partner distance are multiples of VEC, which
    // VEC_LOADS guarantees), so that the 16-byte-aligned, contiguous weights the host proved
    // (NORM_WEIGHT_VEC_LOADS) align every vector. Decided at compile time: a run-time choice
    // between the two paths merged their registers, and a decode row waited there for its
    // weights (H200, session 14: QK-norm decode 2.87 -> 2.62 us, fused with a paged FP8 cache
    // 2.99 -> 2.84 us in a graph, without the check).
    constexpr bool runs_tile =
        ROTARY_OFFSET % VEC == 0 && (INTERLEAVED || PARTNER_SHIFT % VEC == 0);
    constexpr bool vector = runs_tile && NORM_WEIGHT_VEC_LOADS;
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        const bool valid = active && rot_valid(sub, k);
        const int d = rot_feature(sub + k * LANES);
        load_weight_run<VEC, vector>(w, ws, valid, d, &wr->own[k]);
        if (!INTERLEAVED)
            load_weight_run<PARTNER_VEC, vector>(w, ws, valid, d + PARTNER_SHIFT, &wr->partner[k]);
    }
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k) {
        const bool valid = active && copy_valid(sub, k);
        load_weight_run<COPY_VEC, vector>(w, ws, valid, copy_feature(sub + k * LANES),
                                          &wr->tail[k]);
    }
}

// cos and sin of the lane's pairs. Plain tables: each item's span of columns, raw as stored
// (converted when used: few registers while the loads are in flight), one vector each when the
// host proved it aligned (TABLE_VEC_LOADS), as rope.cu reads them. inv_freq, xPos or M-RoPE:
// pair_angle per pair (backward sign and xPos folded in). Unused slots rotate zeros.
using TableT = typename StorageOf<TABLE_DTYPE>::type;

enum : int {
    TABLE_STEP = table_column(TABLE_FULL, INTERLEAVED, 1),  // columns from a pair to the next
    TABLE_SPAN = table_columns(TABLE_FULL, INTERLEAVED, PAIRS_PER_ITEM),  // an item's columns
};
enum : int { SPAN = TABLE_SPANS ? TABLE_SPAN : 1 };  // columns the Angles hold per item

template <int N>
struct alignas(N * sizeof(TableT)) TablePack {
    TableT v[N];
};

__device__ __forceinline__ TablePack<SPAN> load_table_span(const void* table,
                                                           const long long* stride,
                                                           long long row, int pair0) {
    const TableT* base = static_cast<const TableT*>(table) + row * stride[0];
    const long long col0 = static_cast<long long>(pair0) * TABLE_STEP;
    if constexpr (TABLE_VEC_LOADS) {
        return *reinterpret_cast<const TablePack<SPAN>*>(base + col0);
    } else {
        TablePack<SPAN> pack;
#pragma unroll
        for (int j = 0; j < SPAN; ++j) pack.v[j] = base[(col0 + j) * stride[1]];
        return pack;
    }
}

struct Angles {
    TablePack<SPAN> cos[TABLE_SPANS ? ROT_SLOTS : 1];
    TablePack<SPAN> sin[TABLE_SPANS ? ROT_SLOTS : 1];
    float c[TABLE_SPANS ? 1 : ROT_SLOTS][PAIRS_PER_ITEM];
    float s[TABLE_SPANS ? 1 : ROT_SLOTS][PAIRS_PER_ITEM];

    __device__ __forceinline__ float cos_of(int k, int t) const {
        if constexpr (TABLE_SPANS)
            return storage_to_float<TABLE_DTYPE>(cos[k].v[t * TABLE_STEP]);
        else
            return c[k][t];
    }
    __device__ __forceinline__ float sin_of(int k, int t) const {
        if constexpr (TABLE_SPANS) {
            const float value = storage_to_float<TABLE_DTYPE>(sin[k].v[t * TABLE_STEP]);
            return BACKWARD_PASS ? -value : value;
        } else {
            return s[k][t];
        }
    }
};

__device__ __forceinline__ void load_angles(const RopeKernelParams& p, const long long* rows,
                                            bool is_k, bool active, int sub, Angles* a) {
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        const bool valid = active && rot_valid(sub, k);
        const int pair0 = (sub + k * LANES) * PAIRS_PER_ITEM;
        if constexpr (TABLE_SPANS) {
            if (valid) {
                a->cos[k] = load_table_span(p.cos, p.cos_stride, rows[0], pair0);
                a->sin[k] = load_table_span(p.sin, p.sin_stride, rows[0], pair0);
            } else if (!KEEP_INACTIVE) {
#pragma unroll
                for (int j = 0; j < SPAN; ++j) a->cos[k].v[j] = a->sin[k].v[j] = TableT{};
            }
        } else {
#pragma unroll
            for (int t = 0; t < PAIRS_PER_ITEM; ++t) {
                a->c[k][t] = 0.0f;
                a->s[k][t] = 0.0f;
                if (!valid) continue;
                const int pair = pair0 + t;
                const long long row = rows[MROPE_AXES > 0 ? p.pair_axis[pair] : 0];
                pair_angle(p, row, pair, is_k, &a->c[k][t], &a->s[k][t]);
            }
        }
    }
}

// The first and the second feature of the lane's pair t in rotated slot k of a Row or a
// WeightRow: own[t] and partner[t] in the half and proportional styles, own[2t] and own[2t+1]
// interleaved.
template <typename R>
__device__ __forceinline__ auto& pair_first(R& r, int k, int t) {
    return INTERLEAVED ? r.own[k][2 * t] : r.own[k][t];
}
template <typename R>
__device__ __forceinline__ auto& pair_second(R& r, int k, int t) {
    return INTERLEAVED ? r.own[k][2 * t + 1] : r.partner[k][INTERLEAVED ? 0 : t];
}

// Calls f(k, t) for every pair the lane holds of a row (unused slots included).
template <typename F>
__device__ __forceinline__ void for_each_pair(F f) {
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k)
#pragma unroll
        for (int t = 0; t < PAIRS_PER_ITEM; ++t) f(k, t);
}

// Rotates the row's pairs in place: (x1 c - x2 s, x2 c + x1 s).
__device__ __forceinline__ void rotate_row(const Angles& a, Row* row) {
    for_each_pair([&](int k, int t) {
        float& x1 = pair_first(*row, k, t);
        float& x2 = pair_second(*row, k, t);
        const float c = a.cos_of(k, t), s = a.sin_of(k, t);
        const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        x1 = y1;
        x2 = y2;
    });
}

// The forward's factors of the lane's pairs with the norm weights folded into the angles, once
// a run: y1 = r (x1 w1' c - x2 w2' s), y2 = r (x2 w2' c + x1 w1' s), 6 instructions a pair and
// row instead of 8 (x1 w1', x2 w2' scaled first).
struct PairFactors {
    float w1c[ROT_SLOTS][PAIRS_PER_ITEM], w2s[ROT_SLOTS][PAIRS_PER_ITEM];
    float w2c[ROT_SLOTS][PAIRS_PER_ITEM], w1s[ROT_SLOTS][PAIRS_PER_ITEM];
};

__device__ __forceinline__ void fold_weights(const Angles& a, const WeightRow& w, PairFactors* f) {
    for_each_pair([&](int k, int t) {
        const float w1 = weight_value(pair_first(w, k, t));
        const float w2 = weight_value(pair_second(w, k, t));
        const float c = a.cos_of(k, t), s = a.sin_of(k, t);
        f->w1c[k][t] = w1 * c;
        f->w2s[k][t] = w2 * s;
        f->w2c[k][t] = w2 * c;
        f->w1s[k][t] = w1 * s;
    });
}

// The forward of a row in place: normalized (r = 1/rms), weighted and rotated.
__device__ __forceinline__ void norm_rotate_row(const PairFactors& f, const WeightRow& w, float r,
                                                Row* row) {
    for_each_pair([&](int k, int t) {
        float& x1 = pair_first(*row, k, t);
        float& x2 = pair_second(*row, k, t);
        const float y1 = r * (x1 * f.w1c[k][t] - x2 * f.w2s[k][t]);
        const float y2 = r * (x2 * f.w2c[k][t] + x1 * f.w1s[k][t]);
        x1 = y1;
        x2 = y2;
    });
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k)
#pragma unroll
        for (int t = 0; t < COPY_VEC; ++t) row->tail[k][t] *= r * weight_value(w.tail[k][t]);
}

// Stores the lane's items of the row (results) at y / y8 (feature stride ys).
__device__ __forceinline__ void store_row(T* y, unsigned char* y8, bool fp8, long long ys,
                                          bool active, int sub, const Row& row,
                                          const Fp8Scale& scale) {
    if (VEC_LOADS) ys = 1;  // the host proved unit feature strides (q_out, k_out, k's cache)
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        if (!active || !rot_valid(sub, k)) continue;
        const int d = rot_feature(sub + k * LANES);
        store_values<VEC, VEC_LOADS>(y + d * ys, y8 + d * ys, fp8, ys, row.own[k], scale);
        if (!INTERLEAVED)
            store_values<PARTNER_VEC, VEC_LOADS>(y + (d + PARTNER_SHIFT) * ys,
                                                 y8 + (d + PARTNER_SHIFT) * ys, fp8, ys,
                                                 row.partner[k], scale);
    }
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k) {
        if (!active || !copy_valid(sub, k)) continue;
        const int d = copy_feature(sub + k * LANES);
        store_values<COPY_VEC, (COPY_VEC > 1)>(y + d * ys, y8 + d * ys, fp8, ys, row.tail[k],
                                               scale);
    }
}

// Calls f(part, k, t, feature) for every value the lane holds of a row (Row and WeightRow
// share the layout: at() and weight() read element (part, k, t)); unused slots included
// (they hold zeros).
template <typename F>
__device__ __forceinline__ void for_each_feature(int sub, F f) {
#pragma unroll
    for (int k = 0; k < ROT_SLOTS; ++k) {
        const int d = rot_feature(sub + k * LANES);
#pragma unroll
        for (int t = 0; t < VEC; ++t) {
            f(0, k, t, d + t);
            if (!INTERLEAVED) f(1, k, t, d + PARTNER_SHIFT + t);
        }
    }
#pragma unroll
    for (int k = 0; k < COPY_SLOTS; ++k) {
        const int d = copy_feature(sub + k * LANES);
#pragma unroll
        for (int t = 0; t < COPY_VEC; ++t) f(2, k, t, d + t);
    }
}

// Element (part, k, t) of a Row: part 0 own, 1 partner, 2 tail.
__device__ __forceinline__ float& at(Row& row, int part, int k, int t) {
    return part == 0 ? row.own[k][t] : part == 1 ? row.partner[k][INTERLEAVED ? 0 : t]
                                                 : row.tail[k][t];
}

__device__ __forceinline__ W weight(const WeightRow& w, int part, int k, int t) {
    return part == 0 ? w.own[k][t] : part == 1 ? w.partner[k][INTERLEAVED ? 0 : t] : w.tail[k][t];
}

// The FP8 scales are loaded once, at the kernel's entry, but their reciprocals are computed where
// a row is stored: hoisted to the entry (as the compiler did), the first row waited there for the
// scale's load before issuing any of its own (QK-norm + paged KV + FP8 decode, sm_90 SASS).
__device__ __forceinline__ float opaque(float value) {
    asm volatile("" : "+f"(value));
    return value;
}

// A v row (KV cache with v): its V_DIM features copied, or quantized, into v's cache. The loads
// go out before the slot lookup; `active` turns false for a token that writes nothing.
__device__ __forceinline__ void copy_v_row(const RopeKernelParams& p, const RopeCacheParams& c,
                                           long long b, long long s, int h, bool active, int sub,
                                           float v_scale) {
    if (s >= p.seqlen_k) active = false;
    const T* v = static_cast<const T*>(c.v) + b * c.v_stride[0] + h * c.v_stride[1] +
                 s * c.v_stride[2];
    const long long vs = c.v_stride[3];
    Pack<V_VEC> raw[V_SLOTS];
#pragma unroll
    for (int k = 0; k < V_SLOTS; ++k)
        if (active && sub + k * LANES < V_ITEMS)
            raw[k] = load_pack<V_VEC, (V_VEC > 1)>(v + (sub + k * LANES) * V_VEC * vs, vs);
    long long block = 0, slot = 0;
    if (active && !cache_slot(p, c, b, s, &block, &slot)) active = false;
    if (!active) return;
    // The scale's reciprocal only now: it waits for the scale's load, which must not hold back
    // the row's loads above.
    const Fp8Scale scale = fp8_scale(opaque(v_scale));
    const long long cs = c.v_cache_stride[3];
    const long long out =
        block * c.v_cache_stride[0] + h * c.v_cache_stride[1] + slot * c.v_cache_stride[2];
#pragma unroll
    for (int k = 0; k < V_SLOTS; ++k) {
        if (sub + k * LANES >= V_ITEMS) continue;
        const long long d = out + (sub + k * LANES) * V_VEC * cs;
        if constexpr (KV_FP8) {
            float values[V_VEC];
            unpack<V_VEC>(raw[k], values);
            store_values<V_VEC, (V_VEC > 1)>(nullptr, static_cast<unsigned char*>(c.v_cache) + d,
                                             true, cs, values, scale);
        } else {
            T* y = static_cast<T*>(c.v_cache) + d;
            if constexpr (V_VEC > 1)
                *reinterpret_cast<Pack<V_VEC>*>(y) = raw[k];
            else
                *y = raw[k].v[0];
        }
    }
}

// How the grid's work is cut: runs of RopeNormParams::run consecutive heads of one token and
// kind (q's runs, then k's, then v's rows, one a run), token-major.
struct Runs {
    long long total;  // runs in the grid
    int q, k, all;    // runs a token has: of q, of k, in all (v's rows included)
    int run;          // rows a run has
};

// Run r of the grid: its token (b, s), kind (0 q, 1 k, 2 v) and first head within the kind;
// inactive past the last run or past its sequence.
struct RowPlace {
    long long b, s;
    int h, kind;
    bool active;
};

__device__ __forceinline__ RowPlace place_run(const RopeNormParams& np, const Runs& runs,
                                              long long r) {
    const RopeKernelParams& p = np.rope;
    RowPlace place{0, 0, 0, 0, r < runs.total};
    long long u = 0;
    // A multiply and a shift where the host prepared the divisors and the sizes fit 31 bits
    // (the common case: row_divide), else plain divisions.
    const bool fast = runs.total <= 0x7fffffffLL && np.heads_div.divisor == runs.all &&
                      np.seqlen_div.divisor == p.seqlen_max;
    if (place.active) {
        if (fast) {
            u = row_divide(static_cast<unsigned>(r), np.heads_div);
            const unsigned row = row_divide(static_cast<unsigned>(u), np.seqlen_div);
            place.b = row;
            place.s = u - static_cast<long long>(row) * p.seqlen_max;
        } else {
            u = r / runs.all;
            split_token(p, u, &place.b, &place.s);
        }
    }
    // (Past the last run r - u * runs.all need not fit an int: such a group places nothing.)
    int unit = place.active ? static_cast<int>(r - u * runs.all) : 0;
    place.kind = unit < runs.q ? 0 : unit < runs.q + runs.k ? 1 : 2;
    unit -= place.kind == 0 ? 0 : place.kind == 1 ? runs.q : runs.q + runs.k;
    place.h = place.kind == 2 ? unit : unit * runs.run;
    if (place.s >= (place.kind == 0 ? p.seqlen_q : p.seqlen_k)) place.active = false;
    return place;
}

// The first element of a q or k row's input: x (forward; backward dL/dy), or (forward_input)
// the backward's x before the norm.
__device__ __forceinline__ const T* row_input(const RopeNormParams& np, const RowPlace& at,
                                              bool forward_input) {
    const RopeKernelParams& p = np.rope;
    const bool is_k = at.kind == 1;
    const void* base = forward_input ? (is_k ? np.k_input : np.q_input) : (is_k ? p.k : p.q);
    const long long* stride = forward_input ? (is_k ? np.k_input_stride : np.q_input_stride)
                                            : (is_k ? p.k_stride : p.q_stride);
    return static_cast<const T*>(base) + at.b * stride[0] + at.h * stride[1] + at.s * stride[2];
}

__device__ __forceinline__ void prefetch_l2(const void* x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(x));
}

// Asks L2 for what the lane will load of a later row (its vectors of x, and backward of the
// forward's input): the loads of the rows a thread takes one after another then overlap,
// without holding registers. Unit-stride rows only (VEC_LOADS); v's rows are not prefetched.
__device__ __forceinline__ void prefetch_row(const RopeNormParams& np, const RowPlace& at,
                                             int sub) {
    if (!VEC_LOADS || !at.active || at.kind == 2) return;
#pragma unroll
    for (int pass = 0; pass < (BACKWARD_PASS ? 2 : 1); ++pass) {
        const T* x = row_input(np, at, pass == 1);
#pragma unroll
        for (int k = 0; k < ROT_SLOTS; ++k) {
            if (!rot_valid(sub, k)) continue;
            const T* own = x + rot_feature(sub + k * LANES);
            prefetch_l2(own);
            if (!INTERLEAVED) prefetch_l2(own + PARTNER_SHIFT);
        }
#pragma unroll
        for (int k = 0; k < COPY_SLOTS; ++k)
            if (copy_valid(sub, k)) prefetch_l2(x + copy_feature(sub + k * LANES));
    }
}


__device__ __forceinline__ void prefetch_l1(const void* x) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(x));
}

// What the kernel's scalars and sizes are, shared by every run a thread takes.
struct Launch {
    const RopeNormParams& np;
    const RopeCacheParams* cache;  // KV cache and FP8 scales, or NULL
    Runs runs;
    int sub;
    float q_scale, k_scale, v_scale;
};

// One run of q or k rows between its loads and its stores: where it is and goes, and what the
// lane holds of its rows (raw, as loaded). A run is taken in three steps, so that its
// independent loads are all issued before any waits: start_row (every load that depends on no
// other: the rows, the weights, positions), aim_row (those that wait for positions: the table
// rows; and k's cache slot), finish_row (for each row the norm, the rotation, the stores).
struct RowJob {
    RowPlace place;
    bool active, is_k;
    long long rows[MROPE_AXES > 0 ? MROPE_AXES : 1];
    RawRow raw[MAX_RUN], raw0;
    WeightRow wr;
    Angles angles;
    long long out;  // the first row's first output element in q_out, k_out or k's cache
};

// The first loads of a row: its position (a load with per-token positions), whose wait heads
// the row's longest chain (position -> table row), and with slot_mapping k's slot entry, asked
// into L1 now so that cache_slot finds it there once the table rows have been issued.
__device__ __forceinline__ void start_positions(const Launch& l, RowJob* job) {
    const RopeKernelParams& p = l.np.rope;
    const RowPlace& at = job->place;
    const bool is_k = job->is_k, active = job->active;
#pragma unroll
    for (int axis = 0; axis < (MROPE_AXES > 0 ? MROPE_AXES : 1); ++axis)
        job->rows[axis] = 0;
    if (active) {
        if (MROPE_AXES > 0) {
            for (int axis = 0; axis < MROPE_AXES; ++axis)
                job->rows[axis] = table_row(p, at.b, at.s, false, axis);
        } else {
            job->rows[0] = table_row(p, at.b, at.s, is_k);
        }
    }
    if constexpr (KV_CACHE == 2) {
        if (active && is_k) {
            const int bytes = KV_INDEX_INT64 ? 8 : 4;
            prefetch_l1(static_cast<const char*>(l.cache->slot_mapping) +
                        (at.b * p.seqlen_k + at.s) * l.cache->slot_mapping_stride * bytes);
        }
    }
}

__device__ __forceinline__ void start_row(const Launch& l, long long r, RowJob* job) {
    const RopeKernelParams& p = l.np.rope;
    job->place = place_run(l.np, l.runs, r);
    const RowPlace& at = job->place;
    job->active = at.active;
    if constexpr (KV_CACHE != 0 && V_DIM > 0) {
        if (at.kind == 2) {  // a row of v, copied here; its group is inactive from here on
            copy_v_row(p, *l.cache, at.b, at.s, at.h, job->active, l.sub, l.v_scale);
            job->active = false;  // its group computes on stale registers and stores nothing
        }
    }
    job->is_k = at.kind != 0;
    const bool is_k = job->is_k, active = job->active;
    start_positions(l, job);
    const T* x = row_input(l.np, at, false);
    const long long head_stride = is_k ? p.k_stride[1] : p.q_stride[1];
#pragma unroll
    for (int j = 0; j < MAX_RUN; ++j)
        if (j == 0 || j < l.runs.run)  // the same for the whole warp
            load_row(x + j * head_stride, is_k ? p.k_stride[3] : p.q_stride[3], active, l.sub,
                     &job->raw[j]);
    if (BACKWARD_PASS)
        load_row(row_input(l.np, at, true), is_k ? l.np.k_input_stride[3] : l.np.q_input_stride[3],
                 active, l.sub, &job->raw0);
    load_weights(is_k ? l.np.k_weight : l.np.q_weight,
                 is_k ? l.np.k_weight_stride : l.np.q_weight_stride, active, l.sub, &job->wr);
}

__device__ __forceinline__ void aim_row(const Launch& l, RowJob* job) {
    const RopeKernelParams& p = l.np.rope;
    const RowPlace& at = job->place;
    // The table rows first: with positions they waited for a load, and the slot's index math
    // below then overlaps their latency.
    load_angles(p, job->rows, job->is_k, job->active, l.sub, &job->angles);
    if (job->is_k) {
        job->out = at.b * p.k_out_stride[0] + at.h * p.k_out_stride[1] + at.s * p.k_out_stride[2];
        if constexpr (KV_CACHE != 0) {
            long long block = 0, slot = 0;
            if (job->active && !cache_slot(p, *l.cache, at.b, at.s, &block, &slot))
                job->active = false;
            job->out =
                block * p.k_out_stride[0] + at.h * p.k_out_stride[1] + slot * p.k_out_stride[2];
        }
    } else {
        job->out = at.b * p.q_out_stride[0] + at.h * p.q_out_stride[1] + at.s * p.q_out_stride[2];
    }
}

__device__ __forceinline__ void finish_row(const Launch& l, RowJob& job, float* dw) {
    const RopeKernelParams& p = l.np.rope;
    const bool is_k = job.is_k, active = job.active;
    const int sub = l.sub;
    T* y = static_cast<T*>(is_k ? p.k_out : p.q_out) + job.out;
    unsigned char* y8 = static_cast<unsigned char*>(is_k ? p.k_out : p.q_out) + job.out;
    const long long ys = is_k ? p.k_out_stride[3] : p.q_out_stride[3];
    const float inv_d = 1.0f / HEAD_DIM;
    Row row;
    if (!BACKWARD_PASS) {
        const long long head_stride = is_k ? p.k_out_stride[1] : p.q_out_stride[1];
        // The norms first: they need only the rows, so that their sums and shuffles run while
        // the table rows (which waited for positions) are still on their way (decode B=64,
        // QK-norm: 3.0 -> 2.88 us with the positions asked first, H200 run BE).
        float norms[MAX_RUN];
#pragma unroll
        for (int j = 0; j < MAX_RUN; ++j) {
            if (j > 0 && j >= l.runs.run) break;  // the same for the whole warp
            norms[j] = rsqrtf(group_sum(unpack_row(job.raw[j], sub, &row)) * inv_d + l.np.eps);
        }
        PairFactors factors;
        fold_weights(job.angles, job.wr, &factors);
#pragma unroll
        for (int j = 0; j < MAX_RUN; ++j) {
            if (j > 0 && j >= l.runs.run) break;  // the same for the whole warp
            unpack_row(job.raw[j], sub, &row);
            norm_rotate_row(factors, job.wr, norms[j], &row);
            const bool fp8 = is_k ? KV_FP8 : Q_FP8;
            store_row(y + j * head_stride, y8 + j * head_stride, fp8, ys, active, sub, row,
                      fp8_scale(opaque(is_k ? l.k_scale : l.q_scale)));
        }
    } else {
        const float sum = unpack_row(job.raw[0], sub, &row);
        // row holds dL/dy; g, its inverse rotation (pair_angle negated the sines).
        rotate_row(job.angles, &row);
        Row x0r;
        const float rms =
            rsqrtf(group_sum(unpack_row(job.raw0, sub, &x0r)) * inv_d + l.np.eps);
        float dot = 0.0f;
        for_each_feature(sub, [&](int part, int k, int t, int d) {
            const float xh = at(x0r, part, k, t) * rms;
            const float g = at(row, part, k, t);
            dot += weight_value(weight(job.wr, part, k, t)) * g * xh;
            const bool valid = part == 2 ? copy_valid(sub, k) : rot_valid(sub, k);
            if (NORM_WEIGHT_GRAD && active && valid)
                atomicAdd(&dw[(is_k ? HEAD_DIM : 0) + d], g * xh);
        });
        const float mean = group_sum(dot) * inv_d;
        for_each_feature(sub, [&](int part, int k, int t, int) {
            const float xh = at(x0r, part, k, t) * rms;
            float& g = at(row, part, k, t);
            g = rms * (weight_value(weight(job.wr, part, k, t)) * g - xh * mean);
        });
        store_row(y, y8, false, ys, active, sub, row, fp8_scale(1.0f));
    }
}

}  // namespace

// The forward's launch bound holds kRopeNormForwardBlocks blocks a multiprocessor (the
// launcher's grid for many rows); the backward's one.
extern "C" __global__ void __launch_bounds__(WARP* kRopeNormMaxWarps,
                                             BACKWARD_PASS ? 1 : kRopeNormForwardBlocks)
    rope_norm_kernel(const typename LaunchArgs<RopeNormParams>::type args) {
    extern __shared__ __align__(16) float dw[];  // weight gradients: [2][HEAD_DIM], q's then k's
    const RopeNormParams& np = own_args(args);
    const RopeCacheParams* cache = cache_args(args);
    const RopeKernelParams& p = np.rope;
    if (p.programmatic) fetch_argument_lines(args);
    wait_for_preceding_grid();
    // The scales are loaded once; their latency overlaps the first row's loads.
    float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
    if constexpr (CACHE_PARAMS) {
        if (Q_FP8 && cache->q_scale != nullptr) q_scale = *cache->q_scale;
        if (KV_FP8 && cache->k_scale != nullptr) k_scale = *cache->k_scale;
        if (KV_FP8 && V_DIM > 0 && cache->v_scale != nullptr) v_scale = *cache->v_scale;
    }
    const int warp = static_cast<int>(threadIdx.x) / WARP;
    const int lane = static_cast<int>(threadIdx.x) % WARP;
    if (NORM_WEIGHT_GRAD) {
        for (int d = threadIdx.x; d < 2 * HEAD_DIM; d += blockDim.x) dw[d] = 0.0f;
        __syncthreads();
    }

    const int heads_k = HAS_K ? static_cast<int>(p.heads_k) : 0;
    const int heads_q = HAS_K ? heads_k * GQA_GROUP : static_cast<int>(p.heads_q);
    // Rows of a token: q's heads, k's, and (KV cache with v) v's, copied by groups of their own.
    const int heads_v = KV_CACHE != 0 && V_DIM > 0 ? heads_k : 0;
    // Runs of np.run heads (the host chose a run dividing heads_q and heads_k, and 1 with v).
    const int run = MAX_RUN > 1 ? np.run : 1;
    const int runs_q = MAX_RUN > 1 ? heads_q / run : heads_q;
    const int runs_k = MAX_RUN > 1 ? heads_k / run : heads_k;
    const int runs_all = runs_q + runs_k + heads_v;
    const Launch l{np,           cache,   Runs{p.units * runs_all, runs_q, runs_k, runs_all, run},
                   lane % LANES, q_scale, k_scale,
                   v_scale};
    const long long step = static_cast<long long>(gridDim.x) * np.warps * ROWS_PER_WARP;
    // The whole warp runs every iteration (the group sums shuffle across it); a group past the
    // last run, or whose run writes nothing, is inactive: it loads and stores nothing. A group
    // takes one run at a time. Two unrelated rows at once needed 156 registers and measured
    // slower than one (H200 run AF); copying later rows into shared memory by cp.async was
    // slower still (run AH: its instructions made the kernel issue-bound). A run's rows share
    // everything but their data, which cut the instructions a row by about 3x (run AR: Qwen3-8B
    // prefill 107 -> 91 us).
    long long first = (static_cast<long long>(blockIdx.x) * np.warps + warp) * ROWS_PER_WARP;
    for (; first < l.runs.total; first += step) {
        const long long r = first + lane / LANES;
        RowJob job;
        start_row(l, r, &job);
        aim_row(l, &job);
        // The group's next row, if the grid has one (the backward: one row at a time): its
        // loads start while this one computes (its place recomputed there: carrying it costs
        // more registers than the divisions).
        if (BACKWARD_PASS && first + step < l.runs.total)
            prefetch_row(np, place_run(np, l.runs, r + step), l.sub);
        finish_row(l, job, dw);
    }

    if (NORM_WEIGHT_GRAD) {
        // One global add per feature and block: the block's sums were gathered in shared memory.
        __syncthreads();
        for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
            if (np.q_weight_grad != nullptr)
                atomicAdd(np.q_weight_grad + d * np.q_weight_grad_stride, dw[d]);
            if (HAS_K && np.k_weight_grad != nullptr)
                atomicAdd(np.k_weight_grad + d * np.k_weight_grad_stride, dw[HEAD_DIM + d]);
        }
    }
}
