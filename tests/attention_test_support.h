// Test support for attention: a configuration of one call, its tensors in host memory (any
// dtype, optionally stored [B, S, H, D] and passed as transposed views), the argument struct
// that points at them, and an independent float64 reference written straight from the golden
// README's formula (it shares no code with src/ops/attention/attention_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "rope_test_support.h"

namespace attention_test {

using rope_test::Dt;
using rope_test::HostTensor;

enum class Mask { None, BoolKeys, BoolFull, AddKeys, AddFull };

inline const char* mask_name(Mask m) {
    const char* names[] = {"none", "bool[B,Sk]", "bool[B,Sq,Sk]", "additive[B,Sk]",
                           "additive[B,Sq,Sk]"};
    return names[int(m)];
}

struct Config {
    Dt dt = Dt::F32, table_dt = Dt::F32, mask_dt = Dt::F32;
    int64_t B = 1, Hq = 2, Hk = 1, Sq = 5, Sk = 5, D = 8;
    int64_t R = 8;  // 0: no rotation (no tables)
    bool interleaved = false, table_full = false;
    bool causal = false;
    bool pos_mask = false, pos_mask_batched = false;
    Mask mask = Mask::None;
    bool mask_batch_broadcast = false;  // attn_mask with a leading 1
    double scale = 0;                   // 0: the default 1/sqrt(D)
    bool bshd = false;                  // q/k/v/out/grads stored [B, S, H, D]
    int64_t pad = 0;               // unused elements after each stored row (non-contiguous views)
    bool rotary_dim_zero = false;  // pass rotary_dim = 0 (R == D)
    bool deterministic = false;    // the backward's bitwise-reproducible kernels
};

inline std::string describe(const Config& c) {
    std::ostringstream s;
    s << "dt=" << rope_test::dt_name(c.dt) << " table_dt=" << rope_test::dt_name(c.table_dt)
      << " B=" << c.B << " Hq=" << c.Hq << " Hk=" << c.Hk << " Sq=" << c.Sq << " Sk=" << c.Sk
      << " D=" << c.D << " R=" << c.R << " style=" << (c.interleaved ? "interleaved" : "half")
      << " table=" << (c.table_full ? "full" : "half") << " causal=" << c.causal
      << " pos_mask=" << c.pos_mask << (c.pos_mask_batched ? "[B,N]" : "[N]")
      << " mask=" << mask_name(c.mask) << " mask_dt=" << rope_test::dt_name(c.mask_dt)
      << " mask_b1=" << c.mask_batch_broadcast << " scale=" << c.scale << " bshd=" << c.bshd
      << " pad=" << c.pad << " rotary_dim_zero=" << c.rotary_dim_zero
      << " deterministic=" << c.deterministic;
    return s.str();
}

// A one-byte tensor (bool/uint8) in host memory.
class ByteTensor {
public:
    ByteTensor() = default;
    explicit ByteTensor(std::vector<int64_t> shape, uint8_t dl_code = kDLUInt)
        : shape_(std::move(shape)) {
        int64_t n = 1;
        for (int64_t d : shape_) n *= d;
        bytes_.assign(size_t(std::max<int64_t>(n, 1)), 0);
        tensor_.data = bytes_.data();
        tensor_.device = {kDLCPU, 0};
        tensor_.ndim = int32_t(shape_.size());
        tensor_.dtype = {dl_code, 8, 1};
        tensor_.shape = shape_.data();
        tensor_.strides = nullptr;
    }
    ByteTensor(const ByteTensor&) = delete;
    ByteTensor& operator=(ByteTensor&& other) noexcept {
        shape_ = std::move(other.shape_);
        bytes_ = std::move(other.bytes_);
        tensor_ = other.tensor_;
        tensor_.data = bytes_.data();
        tensor_.shape = shape_.data();
        return *this;
    }
    const DLTensor* dl() const { return &tensor_; }
    DLTensor* dl() { return &tensor_; }
    std::vector<uint8_t>& bytes() { return bytes_; }
    const std::vector<uint8_t>& bytes() const { return bytes_; }
    bool present() const { return !shape_.empty(); }

private:
    std::vector<int64_t> shape_;
    std::vector<uint8_t> bytes_;
    DLTensor tensor_{};
};

// [B, H, S, D] logically; stored [B, S, H, D] when bshd, with `pad` after each stored row.
inline HostTensor head_tensor(const Config& c, Dt dt, int64_t heads, int64_t tokens) {
    return HostTensor(dt, {c.B, heads, tokens, c.D},
                      c.bshd ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{}, c.pad);
}

// Every tensor of one call. Masks and pos_mask are drawn so that some tokens lack positions
// and some scores are masked, but (except where a test wants it) every query sees a key.
struct Problem {
    Config c;
    HostTensor q, k, v, out, lse, cos, sin, mask_float, dout, dq, dk, dv;
    ByteTensor pos_mask, mask_bool;

    Problem(const Config& config, std::mt19937& rng) : c(config) {
        q = head_tensor(c, c.dt, c.Hq, c.Sq);
        k = head_tensor(c, c.dt, c.Hk, c.Sk);
        v = head_tensor(c, c.dt, c.Hk, c.Sk);
        out = head_tensor(c, c.dt, c.Hq, c.Sq);
        dout = head_tensor(c, c.dt, c.Hq, c.Sq);
        dq = head_tensor(c, c.dt, c.Hq, c.Sq);
        dk = head_tensor(c, c.dt, c.Hk, c.Sk);
        dv = head_tensor(c, c.dt, c.Hk, c.Sk);
        lse = HostTensor(Dt::F32, {c.B, c.Hq, c.Sq});
        q.fill_uniform(rng, -1, 1);
        k.fill_uniform(rng, -1, 1);
        v.fill_uniform(rng, -1, 1);
        dout.fill_uniform(rng, -1, 1);
        const int64_t tokens = std::max(c.Sq, c.Sk);
        if (c.R > 0) {
            const int64_t columns = c.table_full ? c.R : c.R / 2;
            cos = HostTensor(c.table_dt, {tokens + 1, columns});
            sin = HostTensor(c.table_dt, {tokens + 1, columns});
            // Angles of a real RoPE table (position times a frequency), so cos^2 + sin^2 = 1.
            for (int64_t p = 0; p <= tokens; ++p)
                for (int64_t col = 0; col < columns; ++col) {
                    const int64_t pair = c.table_full && c.interleaved ? col / 2
                                         : c.table_full                ? col % (c.R / 2)
                                                                       : col;
                    const double angle =
                        double(p) * std::pow(10000.0, -2.0 * double(pair) / double(c.R));
                    cos.set({p, col}, std::cos(angle));
                    sin.set({p, col}, std::sin(angle));
                }
        }
        if (c.pos_mask) {
            pos_mask = ByteTensor(c.pos_mask_batched ? std::vector<int64_t>{c.B, tokens + 2}
                                                     : std::vector<int64_t>{tokens + 2});
            // Mostly positioned, with a few register/CLS tokens (the first one always unpositioned).
            for (size_t i = 0; i < pos_mask.bytes().size(); ++i)
                pos_mask.bytes()[i] = (i % (tokens + 2)) != 0 && rng() % 5 != 0;
        }
        const bool full = c.mask == Mask::BoolFull || c.mask == Mask::AddFull;
        const int64_t mask_batch = c.mask_batch_broadcast ? 1 : c.B;
        const std::vector<int64_t> mask_shape = full ? std::vector<int64_t>{mask_batch, c.Sq, c.Sk}
                                                     : std::vector<int64_t>{mask_batch, c.Sk};
        if (c.mask == Mask::BoolKeys || c.mask == Mask::BoolFull) {
            mask_bool = ByteTensor(mask_shape, rng() % 2 ? kDLUInt : 6 /* kDLBool */);
            // Key 0 always visible, so no row is entirely masked out by the mask itself.
            for (size_t i = 0; i < mask_bool.bytes().size(); ++i)
                mask_bool.bytes()[i] = (i % size_t(c.Sk)) == 0 || rng() % 4 != 0;
        } else if (c.mask == Mask::AddKeys || c.mask == Mask::AddFull) {
            mask_float = HostTensor(c.mask_dt, mask_shape);
            std::uniform_real_distribution<double> bias(-2.0, 1.0);
            mask_float.for_each([&](const std::vector<int64_t>& i) {
                const bool key0 = i.back() == 0;
                mask_float.set(i, !key0 && rng() % 6 == 0 ? -std::numeric_limits<double>::infinity()
                                                          : bias(rng));
            });
        }
    }
    Problem(const Problem&) = delete;
    Problem& operator=(const Problem&) = delete;

    rope_jit_attention_args args() {
        rope_jit_attention_args a;
        rope_jit_attention_args_init(&a);
        a.q = q.dl();
        a.k = k.dl();
        a.v = v.dl();
        a.out = out.dl();
        a.lse = lse.dl();
        if (c.R > 0) {
            a.cos = cos.dl();
            a.sin = sin.dl();
            a.rotary_dim = c.rotary_dim_zero ? 0 : int32_t(c.R);
        }
        if (c.pos_mask) a.pos_mask = pos_mask.dl();
        if (mask_bool.present()) a.attn_mask = mask_bool.dl();
        if (c.mask == Mask::AddKeys || c.mask == Mask::AddFull) a.attn_mask = mask_float.dl();
        a.causal = c.causal;
        a.deterministic = c.deterministic;
        a.scale = c.scale;
        a.style = c.interleaved ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
        a.dout = dout.dl();
        a.dq = dq.dl();
        a.dk = dk.dl();
        a.dv = dv.dl();
        return a;
    }
};

// ------------------------------------------------------------------------------------------
// The independent float64 reference, on plain row-major arrays so finite differences can
// perturb them: q [B][Hq][Sq][D], k and v [B][Hk][Sk][D].
// ------------------------------------------------------------------------------------------

struct Arrays {
    std::vector<double> q, k, v;
};

inline Arrays arrays_of(const Problem& p) {
    return Arrays{p.q.values(), p.k.values(), p.v.values()};
}

struct Result {
    std::vector<double> out;  // [B][Hq][Sq][D]
    std::vector<double> lse;  // [B][Hq][Sq]
};

class Reference {
public:
    explicit Reference(const Problem& p) : c_(p.c) {
        scale_ = c_.scale != 0 ? c_.scale : 1.0 / std::sqrt(double(c_.D));
        if (c_.R > 0) {
            cos_ = p.cos.values();
            sin_ = p.sin.values();
            columns_ = c_.table_full ? c_.R : c_.R / 2;
        }
        tokens_ = std::max(c_.Sq, c_.Sk) + 2;
        if (c_.pos_mask) positioned_.assign(p.pos_mask.bytes().begin(), p.pos_mask.bytes().end());
        if (p.mask_bool.present())
            bool_mask_.assign(p.mask_bool.bytes().begin(), p.mask_bool.bytes().end());
        if (c_.mask == Mask::AddKeys || c_.mask == Mask::AddFull) add_mask_ = p.mask_float.values();
    }

    // README: score = scale * (both positioned ? rot(q_i).rot(k_j) : q_i.k_j) + mask; causal
    // masks j > i; softmax over j; out = sum_j p v_j.
    Result forward(const Arrays& a) const {
        const int64_t D = c_.D, group = c_.Hq / c_.Hk;
        Result r;
        r.out.assign(size_t(c_.B * c_.Hq * c_.Sq * D), 0.0);
        r.lse.assign(size_t(c_.B * c_.Hq * c_.Sq), -std::numeric_limits<double>::infinity());
        std::vector<double> scores(size_t(c_.Sk));
        for (int64_t b = 0; b < c_.B; ++b)
            for (int64_t h = 0; h < c_.Hq; ++h)
                for (int64_t i = 0; i < c_.Sq; ++i) {
                    const double* qi = &a.q[size_t(((b * c_.Hq + h) * c_.Sq + i) * D)];
                    double best = -std::numeric_limits<double>::infinity();
                    for (int64_t j = 0; j < c_.Sk; ++j) {
                        const double* kj = &a.k[size_t(((b * c_.Hk + h / group) * c_.Sk + j) * D)];
                        double s = -std::numeric_limits<double>::infinity();
                        if (visible(b, i, j)) {
                            double product = 0;
                            if (c_.R > 0 && has_position(b, i) && has_position(b, j)) {
                                const std::vector<double> qr = rotate(qi, i), kr = rotate(kj, j);
                                for (int64_t d = 0; d < D; ++d)
                                    product += qr[size_t(d)] * kr[size_t(d)];
                            } else {
                                for (int64_t d = 0; d < D; ++d) product += qi[d] * kj[d];
                            }
                            s = scale_ * product + additive(b, i, j);
                        }
                        scores[size_t(j)] = s;
                        best = std::max(best, s);
                    }
                    if (best == -std::numeric_limits<double>::infinity()) continue;
                    double sum = 0;
                    for (double& s : scores) sum += (s = std::exp(s - best));
                    double* o = &r.out[size_t(((b * c_.Hq + h) * c_.Sq + i) * D)];
                    for (int64_t j = 0; j < c_.Sk; ++j) {
                        const double* vj = &a.v[size_t(((b * c_.Hk + h / group) * c_.Sk + j) * D)];
                        for (int64_t d = 0; d < D; ++d) o[d] += scores[size_t(j)] / sum * vj[d];
                    }
                    r.lse[size_t((b * c_.Hq + h) * c_.Sq + i)] = best + std::log(sum);
                }
        return r;
    }

private:
    bool has_position(int64_t b, int64_t s) const {
        if (!c_.pos_mask) return true;
        return positioned_[size_t((c_.pos_mask_batched ? b * tokens_ : 0) + s)] != 0;
    }
    double mask_value(const std::vector<double>& values, int64_t b, int64_t i, int64_t j) const {
        const bool full = c_.mask == Mask::BoolFull || c_.mask == Mask::AddFull;
        const int64_t mb = c_.mask_batch_broadcast ? 0 : b;
        return values[size_t(full ? (mb * c_.Sq + i) * c_.Sk + j : mb * c_.Sk + j)];
    }
    bool visible(int64_t b, int64_t i, int64_t j) const {
        if (c_.causal && j > i) return false;
        if (c_.mask == Mask::BoolKeys || c_.mask == Mask::BoolFull)
            return mask_value(bool_mask_, b, i, j) != 0;
        if ((c_.mask == Mask::AddKeys || c_.mask == Mask::AddFull) &&
            std::isinf(mask_value(add_mask_, b, i, j)))
            return false;
        return true;
    }
    double additive(int64_t b, int64_t i, int64_t j) const {
        return c_.mask == Mask::AddKeys || c_.mask == Mask::AddFull ? mask_value(add_mask_, b, i, j)
                                                                    : 0.0;
    }
    std::vector<double> rotate(const double* x, int64_t s) const {
        std::vector<double> y(x, x + c_.D);
        for (int64_t i = 0; i < c_.R / 2; ++i) {
            const int64_t col = c_.table_full && c_.interleaved ? 2 * i : i;
            const double co = cos_[size_t(s * columns_ + col)],
                         si = sin_[size_t(s * columns_ + col)];
            const int64_t i1 = c_.interleaved ? 2 * i : i,
                          i2 = c_.interleaved ? 2 * i + 1 : i + c_.R / 2;
            y[size_t(i1)] = x[i1] * co - x[i2] * si;
            y[size_t(i2)] = x[i2] * co + x[i1] * si;
        }
        return y;
    }

    Config c_;
    double scale_ = 0;
    std::vector<double> cos_, sin_, add_mask_, bool_mask_;
    std::vector<uint8_t> positioned_;
    int64_t columns_ = 0, tokens_ = 0;
};

// max |got - expected| / max(max |expected|, floor): an error normalized by the output's scale.
inline double normalized_error(const std::vector<double>& got, const std::vector<double>& expected,
                               double floor = 1e-3) {
    double worst = 0, scale = floor;
    for (double e : expected)
        if (std::isfinite(e)) scale = std::max(scale, std::fabs(e));
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(expected[i]) && got[i] == expected[i]) continue;
        const double err = std::fabs(got[i] - expected[i]);
        worst = std::max(worst, std::isfinite(err) ? err : std::numeric_limits<double>::infinity());
    }
    return worst / scale;
}

}  // namespace attention_test
