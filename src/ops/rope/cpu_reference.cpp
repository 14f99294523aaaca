#include "ops/rope/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/float8.h"
#include "common/half_float.h"
#include "common/index_reader.h"
#include "common/tensor_element.h"
#include "ops/rope/mrope_sections.h"

namespace rope_jit {

namespace {

// Storage types of the 16-bit formats; arithmetic always happens in fp32.
struct Bf16 {
    uint16_t bits;
};
struct Fp16 {
    uint16_t bits;
};

inline float to_float(float v) {
    return v;
}
inline float to_float(Bf16 v) {
    return bf16_to_float(v.bits);
}
inline float to_float(Fp16 v) {
    return fp16_to_float(v.bits);
}

template <typename T>
T from_float(float v);
template <>
inline float from_float<float>(float v) {
    return v;
}
template <>
inline Bf16 from_float<Bf16>(float v) {
    return Bf16{float_to_bf16(v)};
}
template <>
inline Fp16 from_float<Fp16>(float v) {
    return Fp16{float_to_fp16(v)};
}

// One element of a float tensor (tables are small: no need to specialize their reads).
float load_float(const TensorRef& t, int64_t element) {
    return float(read_element(t, element));
}

float load_2d(const TensorRef& t, int64_t row, int64_t col) {
    return load_float(t, row * t.strides[0] + col * t.strides[1]);
}

// The table row of pair i of a token whose position on each axis is rows[axis]: rows[0]
// unless M-RoPE sections send the pair to another axis.
inline int64_t pair_row(const RopeProblem& p, const int64_t* rows, int64_t i) {
    return p.pair_axis.empty() ? rows[0] : rows[p.pair_axis[size_t(i)]];
}

// The cosines and sines of one token's pairs, with the backward sign and xPos scale folded
// in, so that the row loop is a plain 2x2 rotation.
void token_angles(const RopeProblem& p, const int64_t* rows, bool is_k, float* cos_out,
                  float* sin_out) {
    const int64_t pairs = p.pairs();
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t row = pair_row(p, rows, i);
        float c, s;
        if (p.angles == AngleSource::Table) {
            const int64_t col = p.table_column(i);
            c = load_2d(p.cos, row, col);
            s = load_2d(p.sin, row, col);
        } else {
            // fp64 keeps the angle exact for the positions models use (up to ~2^40); the GPU
            // kernels are tested against this.
            const double angle =
                double(row) * double(load_float(p.inv_freq, i * p.inv_freq.strides[0]));
            c = float(std::cos(angle));
            s = float(std::sin(angle));
        }
        if (p.backward) s = -s;
        if (p.has_xpos) {
            const float scale = load_2d(p.xpos_scale, row, p.table_column(i));
            if (is_k) {
                c /= scale;
                s /= scale;
            } else {
                c *= scale;
                s *= scale;
            }
        }
        cos_out[i] = c;
        sin_out[i] = s;
    }
}

// Learned frequencies: where one token's contributions to d(loss)/d(inv_freq) go.
struct FreqGradSink {
    const TensorRef* saved;       // the forward outputs of this tensor (q_saved or k_saved)
    const double* pair_position;  // [R/2]: the position each pair of the token turned by
    double* sums;                 // [R/2]: this thread's running sums
};

// Adds, for every pair i of one head, p_i * (g2*y1 - g1*y2): the derivative of the loss with
// respect to the pair's angle (dy1/dt = -y2, dy2/dt = y1) times d(angle)/d(inv_freq[i]) = p_i.
// `grad` holds the rotated features' incoming gradient g.
template <typename T>
void accumulate_freq_grad(const RopeProblem& p, const FreqGradSink& sink, int64_t b, int64_t h,
                          int64_t s, const float* grad) {
    const TensorRef& saved = *sink.saved;
    const int64_t half = p.pairs(), ys = saved.strides[3];
    const bool interleaved = p.style == ROPE_JIT_STYLE_INTERLEAVED;
    const T* y = reinterpret_cast<const T*>(saved.data) + b * saved.strides[0] +
                 h * saved.strides[1] + s * saved.strides[2];
    for (int64_t i = 0; i < half; ++i) {
        // Elements of `grad` (the rotated range, gathered) and their features in the head.
        const int64_t e1 = interleaved ? 2 * i : i, e2 = interleaved ? 2 * i + 1 : i + half;
        const int64_t f1 = p.rotated_feature(e1), f2 = p.rotated_feature(e2);
        const double y1 = to_float(y[f1 * ys]), y2 = to_float(y[f2 * ys]);
        const double g1 = grad[e1], g2 = grad[e2];
        sink.sums[i] += sink.pair_position[i] * (g2 * y1 - g1 * y2);
    }
}

// Rotates heads [0, heads) of token (b, s) of `in` into `out`; with a sink, also accumulates
// the frequency gradient from the unrotated values of `in` (the incoming gradient).
template <typename T>
void rotate_token(const RopeProblem& p, const TensorRef& in, const TensorRef& out, bool in_place,
                  int64_t b, int64_t s, int64_t heads, const float* __restrict c,
                  const float* __restrict sn, float* __restrict buf,
                  const FreqGradSink* sink = nullptr) {
    const int64_t D = p.head_dim, o = p.rotary_offset, R = p.rotary_dim, half = R / 2;
    const int64_t xs = in.strides[3], ys = out.strides[3];
    for (int64_t h = 0; h < heads; ++h) {
        const T* x = reinterpret_cast<const T*>(in.data) + b * in.strides[0] + h * in.strides[1] +
                     s * in.strides[2];
        T* y = reinterpret_cast<T*>(out.data) + b * out.strides[0] + h * out.strides[1] +
               s * out.strides[2];
        const T* xr = x + o * xs;
        if (p.proportional()) {
            for (int64_t e = 0; e < R; ++e) buf[e] = to_float(x[p.rotated_feature(e) * xs]);
        } else if (xs == 1) {
            for (int64_t d = 0; d < R; ++d) buf[d] = to_float(xr[d]);
        } else {
            for (int64_t d = 0; d < R; ++d) buf[d] = to_float(xr[d * xs]);
        }
        if (sink != nullptr) accumulate_freq_grad<T>(p, *sink, b, h, s, buf);
        if (p.style != ROPE_JIT_STYLE_INTERLEAVED) {  // half and proportional
            float* __restrict lo = buf;
            float* __restrict hi = buf + half;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = lo[i], x2 = hi[i];
                lo[i] = x1 * c[i] - x2 * sn[i];
                hi[i] = x2 * c[i] + x1 * sn[i];
            }
        } else {
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = buf[2 * i], x2 = buf[2 * i + 1];
                buf[2 * i] = x1 * c[i] - x2 * sn[i];
                buf[2 * i + 1] = x2 * c[i] + x1 * sn[i];
            }
        }
        T* yr = y + o * ys;
        if (p.proportional()) {
            for (int64_t e = 0; e < R; ++e) y[p.rotated_feature(e) * ys] = from_float<T>(buf[e]);
        } else if (ys == 1) {
            for (int64_t d = 0; d < R; ++d) yr[d] = from_float<T>(buf[d]);
        } else {
            for (int64_t d = 0; d < R; ++d) yr[d * ys] = from_float<T>(buf[d]);
        }
        if (!in_place && p.proportional()) {
            // The unrotated tail of each half, bit for bit.
            for (int64_t d = half; d < D / 2; ++d) y[d * ys] = x[d * xs];
            for (int64_t d = D / 2 + half; d < D; ++d) y[d * ys] = x[d * xs];
        } else if (!in_place) {
            // Features outside the rotary range are copied bit for bit.
            for (int64_t d = 0; d < o; ++d) y[d * ys] = x[d * xs];
            for (int64_t d = o + R; d < D; ++d) y[d * ys] = x[d * xs];
        }
    }
}

// The head features of rotated pair i: (first, second).
inline void pair_features(const RopeProblem& p, int64_t i, int64_t* f1, int64_t* f2) {
    if (p.style == ROPE_JIT_STYLE_INTERLEAVED) {
        *f1 = p.rotary_offset + 2 * i;
        *f2 = *f1 + 1;
    } else {
        *f1 = p.rotated_feature(i);
        *f2 = p.rotated_feature(i + p.pairs());
    }
}

// Where the rows of one token go when they are not plain outputs of q's dtype (a KV cache, or
// an FP8 output): head h's feature d is element base + h * head_stride + d * feature_stride,
// of q's dtype or (fp8) float8 e4m3fn holding value / scale.
struct RowSink {
    char* base;
    int64_t head_stride, feature_stride;
    bool fp8;
    float scale;
};

// The sink of token (b, s) of an output view [B, H, S, D] (or a cache view at (block, slot)).
RowSink row_sink(const TensorRef& out, int64_t b, int64_t s, bool fp8, float scale) {
    const int64_t element = b * out.strides[0] + s * out.strides[2];
    return RowSink{out.data + element * int64_t(dtype_size(out.dtype)), out.strides[1],
                   out.strides[3], fp8, scale};
}

// Stores feature d of head h: a computed value (quantized when FP8), or (copy) the input
// element x bit for bit when the sink has x's dtype.
template <typename T>
void sink_store(const RowSink& sink, int64_t h, int64_t d, float value, const T* copy) {
    const int64_t element = h * sink.head_stride + d * sink.feature_stride;
    if (sink.fp8) {
        const float v = copy != nullptr ? to_float(*copy) : value;
        reinterpret_cast<uint8_t*>(sink.base)[element] = float_to_e4m3(v / sink.scale);
    } else {
        reinterpret_cast<T*>(sink.base)[element] = copy != nullptr ? *copy : from_float<T>(value);
    }
}

// Rotates heads [0, heads) of token (b, s) of `in` into a sink (every feature: the unrotated
// ones copied). The same fp32 expressions as rotate_token, so the values agree bit for bit.
template <typename T>
void rotate_token_to_sink(const RopeProblem& p, const TensorRef& in, int64_t b, int64_t s,
                          int64_t heads, const float* c, const float* sn, std::vector<float>& row,
                          std::vector<char>& rotated, const RowSink& sink) {
    const int64_t D = p.head_dim, pairs = p.pairs();
    const bool interleaved = p.style == ROPE_JIT_STYLE_INTERLEAVED;
    std::fill(rotated.begin(), rotated.end(), 0);
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t f1 = interleaved ? p.rotary_offset + 2 * i : p.rotated_feature(i);
        const int64_t f2 = interleaved ? f1 + 1 : p.rotated_feature(i + pairs);
        rotated[size_t(f1)] = rotated[size_t(f2)] = 1;
    }
    for (int64_t h = 0; h < heads; ++h) {
        const T* x = reinterpret_cast<const T*>(in.data) + b * in.strides[0] + h * in.strides[1] +
                     s * in.strides[2];
        for (int64_t d = 0; d < D; ++d) row[size_t(d)] = to_float(x[d * in.strides[3]]);
        for (int64_t i = 0; i < pairs; ++i) {
            const int64_t f1 = interleaved ? p.rotary_offset + 2 * i : p.rotated_feature(i);
            const int64_t f2 = interleaved ? f1 + 1 : p.rotated_feature(i + pairs);
            const float x1 = row[size_t(f1)], x2 = row[size_t(f2)];
            row[size_t(f1)] = x1 * c[i] - x2 * sn[i];
            row[size_t(f2)] = x2 * c[i] + x1 * sn[i];
        }
        for (int64_t d = 0; d < D; ++d)
            sink_store<T>(sink, h, d, row[size_t(d)],
                          rotated[size_t(d)] ? nullptr : x + d * in.strides[3]);
    }
}

// Copies (or quantizes) v's rows of token (b, s) into a sink.
template <typename T>
void copy_token_to_sink(const RopeProblem& p, int64_t b, int64_t s, const RowSink& sink) {
    const TensorRef& v = p.v;
    for (int64_t h = 0; h < p.heads_k; ++h) {
        const T* x = reinterpret_cast<const T*>(v.data) + b * v.strides[0] + h * v.strides[1] +
                     s * v.strides[2];
        for (int64_t d = 0; d < p.v_head_dim; ++d)
            sink_store<T>(sink, h, d, 0.0f, x + d * v.strides[3]);
    }
}

// A float32 scale of one element in host memory, or 1 when absent.
float scale_value(const TensorRef& scale) {
    if (!scale.present()) return 1.0f;
    float value;
    std::memcpy(&value, scale.data, 4);
    return value;
}

// QK-norm: one head row of each of heads [0, heads) of token (b, s), with the norm weights
// `weight`. Forward: in holds x, out gets rope(x / rms * w'). Backward: in holds dL/dy, `input`
// the forward's x, out gets dL/dx, and dw (when not NULL) gathers dL/dw in float64.
template <typename T>
void norm_rotate_token(const RopeProblem& p, const TensorRef& in, const TensorRef& out,
                       const TensorRef& input, const TensorRef& weight, int64_t b, int64_t s,
                       int64_t heads, const float* c, const float* sn, std::vector<float>& row,
                       std::vector<float>& x, double* dw, const RowSink* sink = nullptr) {
    const int64_t D = p.head_dim, pairs = p.pairs();
    const float offset = p.norm_unit_offset ? 1.0f : 0.0f;
    auto rotate = [&](float* v) {
        for (int64_t i = 0; i < pairs; ++i) {
            int64_t f1, f2;
            pair_features(p, i, &f1, &f2);
            const float x1 = v[f1], x2 = v[f2];
            v[f1] = x1 * c[i] - x2 * sn[i];
            v[f2] = x2 * c[i] + x1 * sn[i];
        }
    };
    auto load_row = [&](const TensorRef& t, int64_t h, float* v) {
        const T* src = reinterpret_cast<const T*>(t.data) + b * t.strides[0] + h * t.strides[1] +
                       s * t.strides[2];
        for (int64_t d = 0; d < D; ++d) v[d] = to_float(src[d * t.strides[3]]);
    };
    // 1 / sqrt(mean(v^2) + eps), the sum in float64.
    auto inverse_rms = [&](const float* v) {
        double sum = 0;
        for (int64_t d = 0; d < D; ++d) sum += double(v[d]) * double(v[d]);
        return float(1.0 / std::sqrt(sum / double(D) + p.norm_eps));
    };
    for (int64_t h = 0; h < heads; ++h) {
        load_row(in, h, row.data());
        if (!p.backward) {
            const float r = inverse_rms(row.data());
            for (int64_t d = 0; d < D; ++d)
                row[size_t(d)] =
                    row[size_t(d)] * r * (load_float(weight, d * weight.strides[0]) + offset);
            rotate(row.data());
        } else {
            rotate(row.data());  // g: the inverse rotation (the angles carry the backward sign)
            load_row(input, h, x.data());
            const float r = inverse_rms(x.data());
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) {
                const float w = load_float(weight, d * weight.strides[0]) + offset;
                x[size_t(d)] *= r;  // x hat
                dot += double(w) * double(row[size_t(d)]) * double(x[size_t(d)]);
                if (dw != nullptr) dw[d] += double(row[size_t(d)]) * double(x[size_t(d)]);
            }
            const float mean = float(dot / double(D));
            for (int64_t d = 0; d < D; ++d) {
                const float w = load_float(weight, d * weight.strides[0]) + offset;
                row[size_t(d)] = r * (w * row[size_t(d)] - x[size_t(d)] * mean);
            }
        }
        if (sink != nullptr) {  // a KV cache row or an FP8 output
            for (int64_t d = 0; d < D; ++d) sink_store<T>(*sink, h, d, row[size_t(d)], nullptr);
            continue;
        }
        T* dst = reinterpret_cast<T*>(out.data) + b * out.strides[0] + h * out.strides[1] +
                 s * out.strides[2];
        for (int64_t d = 0; d < D; ++d) dst[d * out.strides[3]] = from_float<T>(row[size_t(d)]);
    }
}

// Writes float64 sums into a [D] float32 output (when present).
void store_sums(const TensorRef& out, const std::vector<double>& sums) {
    if (!out.present()) return;
    for (size_t i = 0; i < sums.size(); ++i) {
        const float value = float(sums[i]);
        std::memcpy(out.data + int64_t(i) * out.strides[0] * 4, &value, 4);
    }
}

template <typename T>
void rope_cpu_typed(const RopeProblem& p, ThreadPool& pool) {
    const int64_t seqlen = p.rotated_seqlen();
    const int64_t units = p.batch * seqlen;

    std::vector<int64_t> cu;  // sequence starts of a packed batch
    if (p.cu_seqlens.present()) {
        IndexReader reader(p.cu_seqlens);
        for (int64_t i = 0; i <= p.num_sequences; ++i) cu.push_back(reader[i]);
    }

    // One view per position axis (one without M-RoPE sections).
    const int64_t axes = p.multi_section() ? p.num_position_axes : 1;
    std::vector<TensorRef> axis_positions;
    if (p.position_mode == PositionMode::Indices)
        for (int64_t a = 0; a < axes; ++a) axis_positions.push_back(p.position_axis(a));

    // The table rows of token (b, s) of q or k on every axis, by the rules of
    // rope_jit_rope_args.
    auto table_rows = [&](int64_t b, int64_t s, bool is_k, int64_t* rows) {
        int64_t sequence = b, index = s;
        if (!cu.empty()) {
            sequence = int64_t(std::upper_bound(cu.begin(), cu.end(), s) - cu.begin()) - 1;
            index = s - cu[size_t(sequence)];
        }
        switch (p.position_mode) {
            case PositionMode::Indices:
                for (int64_t a = 0; a < axes; ++a) {
                    const TensorRef& view = axis_positions[size_t(a)];
                    IndexReader positions(view);
                    rows[a] = view.ndim == 2 ? positions(b, s) : positions[s];
                }
                return;
            case PositionMode::SeqlenOffsets:
                rows[0] = index + IndexReader(p.seqlen_offsets)[sequence];
                return;
            case PositionMode::Implicit: break;
        }
        rows[0] = index + p.position_offset + (is_k ? 0 : p.q_position_offset);
    };

    const int64_t pairs = p.pairs();

    // KV cache and FP8 outputs.
    const float q_scale = scale_value(p.q_scale), k_scale = scale_value(p.k_scale),
                v_scale = scale_value(p.v_scale);
    auto cache_slot = [&](int64_t b, int64_t s, CacheSlot* slot) {
        int64_t sequence = b, index = s;
        if (!cu.empty()) {
            sequence = int64_t(std::upper_bound(cu.begin(), cu.end(), s) - cu.begin()) - 1;
            index = s - cu[size_t(sequence)];
        }
        return cache_slot_on_host(p, b, s, sequence, index, slot);
    };

    // The pool takes whole blocks of units, at least `grain` each (enough work to be worth a
    // chunk) and at most kSumBlocks in all. The gradients are summed in float64 per block,
    // then the blocks' sums in block order: the result depends only on the shape, neither on
    // which thread finished first nor on how the pool chunked the work (a busy pool runs it
    // all in one chunk; the chunks also follow cpu_threads).
    const int64_t elements_per_unit = std::max<int64_t>(1, (p.heads_q + p.heads_k) * p.head_dim);
    const int64_t grain = std::max<int64_t>(1, 32768 / elements_per_unit);
    constexpr int64_t kSumBlocks = 256;
    const int64_t block_units = std::max(grain, (units + kSumBlocks - 1) / kSumBlocks);
    const int64_t blocks = (units + block_units - 1) / block_units;
    // Learned frequencies' sums a block (pairs), and the QK-norm weights' (q's D, then k's).
    std::vector<double> grad_partials(p.has_freq_grad ? size_t(blocks * pairs) : 0);
    const size_t norm_width = p.has_norm_weight_grad ? size_t(2 * p.head_dim) : 0;
    std::vector<double> norm_partials(size_t(blocks) * norm_width);
    pool.parallel_for(blocks, 1, [&](int64_t first_block, int64_t end_block) {
        const int64_t begin = first_block * block_units;
        const int64_t end = std::min(units, end_block * block_units);
        std::vector<float> scratch(size_t(p.rotary_dim + 2 * pairs));
        float* buf = scratch.data();
        float* c = buf + p.rotary_dim;
        float* sn = c + pairs;
        int64_t q_rows[kMaxMropeSections], k_rows[kMaxMropeSections];
        std::vector<float> norm_row, norm_x;
        std::vector<double> norm_sums;
        double* q_dw = nullptr;
        double* k_dw = nullptr;
        if (p.has_norm) {
            norm_row.resize(size_t(p.head_dim));
            norm_x.resize(size_t(p.head_dim));
            if (p.has_norm_weight_grad) {
                norm_sums.assign(size_t(2 * p.head_dim), 0.0);
                q_dw = norm_sums.data();
                k_dw = q_dw + p.head_dim;
            }
        }
        std::vector<double> pair_position, grad_sums;
        if (p.has_freq_grad) {
            pair_position.resize(size_t(pairs));
            grad_sums.assign(size_t(pairs), 0.0);
        }
        // The positions each pair of a token turns by (the angle's factor besides inv_freq).
        auto set_pair_positions = [&](const int64_t* rows) {
            for (int64_t i = 0; i < pairs; ++i)
                pair_position[size_t(i)] = double(pair_row(p, rows, i));
        };
        std::vector<float> sink_row(size_t(p.head_dim));
        std::vector<char> sink_rotated(size_t(p.head_dim));
        // Hands the sums of block `block` over (its own slots: no lock) and starts the next
        // block's from zero.
        auto end_of_block = [&](int64_t block) {
            if (p.has_freq_grad) {
                std::copy(grad_sums.begin(), grad_sums.end(),
                          grad_partials.begin() + block * pairs);
                std::fill(grad_sums.begin(), grad_sums.end(), 0.0);
            }
            if (p.has_norm_weight_grad) {
                std::copy(norm_sums.begin(), norm_sums.end(),
                          norm_partials.begin() + block * int64_t(norm_width));
                std::fill(norm_sums.begin(), norm_sums.end(), 0.0);
            }
        };
        for (int64_t u = begin; u < end; ++u) {
            const int64_t b = u / seqlen, s = u % seqlen;
            bool have_q_angles = false;
            if (s < p.seqlen_q) {
                table_rows(b, s, false, q_rows);
                token_angles(p, q_rows, false, c, sn);
                have_q_angles = true;
                FreqGradSink sink{&p.q_saved, pair_position.data(), grad_sums.data()};
                if (p.has_freq_grad) set_pair_positions(q_rows);
                if (p.has_norm) {
                    const RowSink q_sink = row_sink(p.q_out, b, s, true, q_scale);
                    norm_rotate_token<T>(p, p.q, p.q_out, p.q_norm_input, p.q_norm_weight, b, s,
                                         p.heads_q, c, sn, norm_row, norm_x, q_dw,
                                         p.q_fp8 ? &q_sink : nullptr);
                } else if (p.q_fp8)
                    rotate_token_to_sink<T>(p, p.q, b, s, p.heads_q, c, sn, sink_row, sink_rotated,
                                            row_sink(p.q_out, b, s, true, q_scale));
                else
                    rotate_token<T>(p, p.q, p.q_out, p.q_in_place, b, s, p.heads_q, c, sn, buf,
                                    p.has_freq_grad ? &sink : nullptr);
            }
            if (p.has_k && s < p.seqlen_k) {
                // k usually sits at q's rows: its angles are then q's, unless xPos scales differ.
                table_rows(b, s, true, k_rows);
                const bool same_rows = have_q_angles && std::equal(k_rows, k_rows + axes, q_rows);
                if (!same_rows || p.has_xpos) token_angles(p, k_rows, true, c, sn);
                FreqGradSink sink{&p.k_saved, pair_position.data(), grad_sums.data()};
                if (p.has_freq_grad) set_pair_positions(k_rows);
                CacheSlot slot{};
                if (p.has_kv_cache) {
                    if (cache_slot(b, s, &slot)) {
                        const RowSink k_sink =
                            row_sink(p.k_out, slot.block, slot.slot, p.kv_fp8, k_scale);
                        if (p.has_norm)
                            norm_rotate_token<T>(p, p.k, p.k_out, p.k_norm_input, p.k_norm_weight,
                                                 b, s, p.heads_k, c, sn, norm_row, norm_x, k_dw,
                                                 &k_sink);
                        else
                            rotate_token_to_sink<T>(p, p.k, b, s, p.heads_k, c, sn, sink_row,
                                                    sink_rotated, k_sink);
                        if (p.has_v)
                            copy_token_to_sink<T>(
                                p, b, s,
                                row_sink(p.v_cache, slot.block, slot.slot, p.kv_fp8, v_scale));
                    }
                } else if (p.has_norm) {
                    norm_rotate_token<T>(p, p.k, p.k_out, p.k_norm_input, p.k_norm_weight, b, s,
                                         p.heads_k, c, sn, norm_row, norm_x, k_dw);
                } else
                    rotate_token<T>(p, p.k, p.k_out, p.k_in_place, b, s, p.heads_k, c, sn, buf,
                                    p.has_freq_grad ? &sink : nullptr);
            }
            if ((u + 1) % block_units == 0 || u + 1 == end) end_of_block(u / block_units);
        }
    });

    if (p.has_norm_weight_grad) {
        const size_t D = size_t(p.head_dim);
        std::vector<double> q_total(D, 0.0), k_total(D, 0.0);
        for (int64_t block = 0; block < blocks; ++block)
            for (size_t d = 0; d < D; ++d) {
                q_total[d] += norm_partials[size_t(block) * norm_width + d];
                k_total[d] += norm_partials[size_t(block) * norm_width + D + d];
            }
        store_sums(p.q_norm_weight_grad, q_total);
        store_sums(p.k_norm_weight_grad, k_total);
    }

    if (p.has_freq_grad) {
        std::vector<double> total(size_t(pairs), 0.0);
        for (int64_t block = 0; block < blocks; ++block)
            for (int64_t i = 0; i < pairs; ++i)
                total[size_t(i)] += grad_partials[size_t(block * pairs + i)];
        for (int64_t i = 0; i < pairs; ++i) {
            const float value = float(total[size_t(i)]);
            std::memcpy(p.inv_freq_grad.data + i * p.inv_freq_grad.strides[0] * 4, &value, 4);
        }
    }
}

}  // namespace

void rope_cpu(const RopeProblem& problem, ThreadPool& pool) {
    if (problem.empty()) {
        // No token contributes: the frequency gradient is zero, and it is still an output.
        if (problem.has_freq_grad)
            for (int64_t i = 0; i < problem.pairs(); ++i)
                std::memset(problem.inv_freq_grad.data + i * problem.inv_freq_grad.strides[0] * 4,
                            0, 4);
        const std::vector<double> zeros(size_t(problem.head_dim), 0.0);
        store_sums(problem.q_norm_weight_grad, zeros);
        store_sums(problem.k_norm_weight_grad, zeros);
        return;
    }
    switch (problem.dtype) {
        case DType::F32: rope_cpu_typed<float>(problem, pool); break;
        case DType::F16: rope_cpu_typed<Fp16>(problem, pool); break;
        case DType::BF16: rope_cpu_typed<Bf16>(problem, pool); break;
        default: break;  // make_rope_problem admits float dtypes only
    }
}

}  // namespace rope_jit
