#include "ops/attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/half_float.h"
#include "common/tensor_element.h"

namespace rope_jit {

namespace {

constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

void write_float(const TensorRef& t, int64_t element, double value) {
    char* address = t.data + element * int64_t(dtype_size(t.dtype));
    switch (t.dtype) {
        case DType::F32: {
            const float v = float(value);
            std::memcpy(address, &v, 4);
            break;
        }
        case DType::F16: {
            const uint16_t v = double_to_fp16(value);
            std::memcpy(address, &v, 2);
            break;
        }
        case DType::BF16: {
            const uint16_t v = double_to_bf16(value);
            std::memcpy(address, &v, 2);
            break;
        }
        default: break;
    }
}

int64_t offset4(const TensorRef& t, int64_t b, int64_t h, int64_t s) {
    return b * t.strides[0] + h * t.strides[1] + s * t.strides[2];
}

// Head vector (b, h, s) of a [B, H, S, D] tensor as doubles.
void read_row(const TensorRef& t, int64_t b, int64_t h, int64_t s, double* out, int64_t D) {
    const int64_t base = offset4(t, b, h, s);
    for (int64_t d = 0; d < D; ++d) out[d] = read_element(t, base + d * t.strides[3]);
}

void write_row(const TensorRef& t, int64_t b, int64_t h, int64_t s, const double* values,
               int64_t D) {
    const int64_t base = offset4(t, b, h, s);
    for (int64_t d = 0; d < D; ++d) write_float(t, base + d * t.strides[3], values[d]);
}

double dot(const double* a, const double* b, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

void axpy(double alpha, const double* x, double* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// What every unit of work needs to know about tokens: positions, rotation and masks.
class Tokens {
public:
    explicit Tokens(const AttentionProblem& p) : p_(p) {}

    // Whether token s of batch b has a position (every token does without pos_mask).
    bool positioned(int64_t b, int64_t s) const {
        if (!p_.has_pos_mask) return true;
        return read_element(p_.pos_mask, b * p_.pos_mask.strides[0] + s * p_.pos_mask.strides[1]) !=
               0.0;
    }

    // Whether the pair (i, j) scores rotated vectors: both tokens have positions. Tokens that
    // both lack one also score their (unrotated) vectors, so "same positioned-ness" decides.
    bool rotated_pair(int64_t b, int64_t i, int64_t j) const {
        return !p_.has_pos_mask || positioned(b, i) == positioned(b, j);
    }

    // Rotates x (D features) in place by table row s; inverse = the transposed rotation.
    // Tokens without a position (or no tables at all) stay as they are.
    void rotate(double* x, int64_t b, int64_t s, bool inverse) const {
        if (!p_.rotate || !positioned(b, s)) return;
        const int64_t half = p_.rotary_dim / 2;
        for (int64_t i = 0; i < half; ++i) {
            const int64_t col = p_.table_column(i);
            const double c = read_element(p_.cos, s * p_.cos.strides[0] + col * p_.cos.strides[1]);
            double sn = read_element(p_.sin, s * p_.sin.strides[0] + col * p_.sin.strides[1]);
            if (inverse) sn = -sn;
            const int64_t i1 = p_.style == ROPE_JIT_STYLE_INTERLEAVED ? 2 * i : i;
            const int64_t i2 = p_.style == ROPE_JIT_STYLE_INTERLEAVED ? 2 * i + 1 : i + half;
            const double x1 = x[i1], x2 = x[i2];
            x[i1] = x1 * c - x2 * sn;
            x[i2] = x2 * c + x1 * sn;
        }
    }

    // The score's mask: -inf when (i, j) is masked out, the additive term otherwise.
    double mask(int64_t b, int64_t i, int64_t j) const {
        if (p_.causal && j > i) return kNegativeInfinity;
        if (p_.mask_kind == AttentionMaskKind::None) return 0.0;
        const TensorRef& m = p_.attn_mask;
        const double value =
            read_element(m, b * m.strides[0] + i * m.strides[1] + j * m.strides[2]);
        if (p_.mask_kind == AttentionMaskKind::Bool) return value != 0.0 ? 0.0 : kNegativeInfinity;
        return value;
    }

private:
    const AttentionProblem& p_;
};

// The keys and values of one (batch, kv head), as doubles: plain keys, keys rotated by their
// own rows (plain for tokens without a position), values.
struct KeyValues {
    int64_t D = 0;
    std::vector<double> plain, rotated, values;

    KeyValues(const AttentionProblem& p, const Tokens& tokens, int64_t b, int64_t hk)
        : D(p.head_dim) {
        const size_t n = size_t(p.seqlen_k * D);
        plain.resize(n);
        rotated.resize(n);
        values.resize(n);
        for (int64_t j = 0; j < p.seqlen_k; ++j) {
            read_row(p.k, b, hk, j, &plain[size_t(j * D)], D);
            std::copy_n(&plain[size_t(j * D)], D, &rotated[size_t(j * D)]);
            tokens.rotate(&rotated[size_t(j * D)], b, j, false);
            read_row(p.v, b, hk, j, &values[size_t(j * D)], D);
        }
    }
    const double* k_plain(int64_t j) const { return &plain[size_t(j * D)]; }
    const double* k_rotated(int64_t j) const { return &rotated[size_t(j * D)]; }
    const double* v(int64_t j) const { return &values[size_t(j * D)]; }
};

// Query row i's score of key j: scale * (q . k) + the mask's bias, on the rotated vectors where
// the pair is rotated; -inf where the mask hides the key.
double key_score(const AttentionProblem& p, const Tokens& tokens, const KeyValues& kv, int64_t b,
                 int64_t i, int64_t j, const double* q_plain, const double* q_rotated) {
    const double bias = tokens.mask(b, i, j);
    if (bias == kNegativeInfinity) return kNegativeInfinity;
    const int64_t D = p.head_dim;
    const double product = tokens.rotated_pair(b, i, j) ? dot(q_rotated, kv.k_rotated(j), D)
                                                        : dot(q_plain, kv.k_plain(j), D);
    return p.scale * product + bias;
}

// One query row's softmax: the probabilities p[j] (0 where masked) and the log-sum-exp, and
// which keys the row sees (seen[j]: not masked; a key whose probability underflows to 0 is
// still seen, and its v still counts, as in the GPU's P.V: a NaN there is the row's NaN).
// Returns false when every key is masked (p all 0, lse -inf). A NaN score makes the
// probabilities of every visible key and the lse NaN, also when no other key is visible: a
// NaN must not pass for "sees no key" (std::max drops NaN, so the maximum alone cannot tell).
bool row_softmax(const AttentionProblem& p, const Tokens& tokens, const KeyValues& kv, int64_t b,
                 int64_t i, const double* q_plain, const double* q_rotated,
                 std::vector<double>& prob, std::vector<char>& seen, double* lse) {
    double max_score = kNegativeInfinity;
    bool nan_score = false;
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
        const double score = key_score(p, tokens, kv, b, i, j, q_plain, q_rotated);
        prob[size_t(j)] = score;
        seen[size_t(j)] = score != kNegativeInfinity;
        max_score = std::max(max_score, score);
        nan_score = nan_score || std::isnan(score);
    }
    if (nan_score) {  // NaN for every key the row sees, 0 for masked ones (as the GPU kernels)
        for (double& x : prob)
            x = x == kNegativeInfinity ? 0.0 : std::numeric_limits<double>::quiet_NaN();
        *lse = std::numeric_limits<double>::quiet_NaN();
        return true;
    }
    if (max_score == kNegativeInfinity) {
        std::fill(prob.begin(), prob.end(), 0.0);
        *lse = kNegativeInfinity;
        return false;
    }
    double sum = 0;
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
        prob[size_t(j)] = std::exp(prob[size_t(j)] - max_score);
        sum += prob[size_t(j)];
    }
    for (int64_t j = 0; j < p.seqlen_k; ++j) prob[size_t(j)] /= sum;
    *lse = max_score + std::log(sum);
    return true;
}

// One query row's probabilities in the backward, from the forward's log-sum-exp as the caller
// passes it (as the GPU kernels take them): exp(score_j - lse) for the keys the row sees, 0 for
// masked ones and for every key of a row whose lse is -inf (it saw none); seen[j] as in
// row_softmax (none for such a row). The caller's lse, not one recomputed here, so that a
// stale or wrong lse gives the GPU's result, not a correct gradient the GPU would not give.
void row_probabilities(const AttentionProblem& p, const Tokens& tokens, const KeyValues& kv,
                       int64_t b, int64_t i, const double* q_plain, const double* q_rotated,
                       double lse, std::vector<double>& prob, std::vector<char>& seen) {
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
        const double score = key_score(p, tokens, kv, b, i, j, q_plain, q_rotated);
        seen[size_t(j)] = score != kNegativeInfinity && lse != kNegativeInfinity;
        prob[size_t(j)] = seen[size_t(j)] ? std::exp(score - lse) : 0.0;
    }
}

}  // namespace

void attention_forward_cpu(const AttentionProblem& p, ThreadPool& pool) {
    if (p.empty()) return;
    const Tokens tokens(p);
    const int64_t D = p.head_dim;
    constexpr int64_t kRowsPerUnit = 64;
    const int64_t row_blocks = (p.seqlen_q + kRowsPerUnit - 1) / kRowsPerUnit;
    const int64_t units = p.batch * p.heads_q * row_blocks;
    pool.parallel_for(units, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> q_plain(static_cast<size_t>(D)), q_rotated(static_cast<size_t>(D)),
            o(static_cast<size_t>(D)), prob(static_cast<size_t>(p.seqlen_k));
        std::vector<char> seen(static_cast<size_t>(p.seqlen_k));
        for (int64_t u = begin; u < end; ++u) {
            const int64_t block = u % row_blocks, h = (u / row_blocks) % p.heads_q,
                          b = u / (row_blocks * p.heads_q);
            const KeyValues kv(p, tokens, b, h / p.group());
            const int64_t last = std::min(p.seqlen_q, (block + 1) * kRowsPerUnit);
            for (int64_t i = block * kRowsPerUnit; i < last; ++i) {
                read_row(p.q, b, h, i, q_plain.data(), D);
                q_rotated = q_plain;
                tokens.rotate(q_rotated.data(), b, i, false);
                double lse = 0;
                std::fill(o.begin(), o.end(), 0.0);
                if (row_softmax(p, tokens, kv, b, i, q_plain.data(), q_rotated.data(), prob, seen,
                                &lse))
                    for (int64_t j = 0; j < p.seqlen_k; ++j)
                        if (seen[size_t(j)]) axpy(prob[size_t(j)], kv.v(j), o.data(), D);
                write_row(p.out, b, h, i, o.data(), D);
                if (p.has_lse)
                    write_float(p.lse,
                                b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2],
                                lse);
            }
        }
    });
}

void attention_backward_cpu(const AttentionProblem& p, ThreadPool& pool) {
    if (p.batch == 0 || p.heads_k == 0) return;
    const Tokens tokens(p);
    const int64_t D = p.head_dim, group = p.group();
    // One unit per (batch, kv head): it owns dk and dv of that head and dq of its query heads,
    // so units write disjoint memory and the sums run in one fixed order (deterministic).
    pool.parallel_for(p.batch * p.heads_k, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> q_plain(static_cast<size_t>(D)), q_rotated(static_cast<size_t>(D)),
            dout(static_cast<size_t>(D)), out(static_cast<size_t>(D)),
            prob(static_cast<size_t>(p.seqlen_k)), dq_rotated(static_cast<size_t>(D)),
            dq_plain(static_cast<size_t>(D));
        std::vector<char> seen(static_cast<size_t>(p.seqlen_k));
        for (int64_t u = begin; u < end; ++u) {
            const int64_t b = u / p.heads_k, hk = u % p.heads_k;
            const KeyValues kv(p, tokens, b, hk);
            const size_t n = size_t(p.seqlen_k * D);
            // Gradients with respect to the rotated keys (pairs that score rotated vectors) and
            // the plain keys (the others); dk is the first rotated back plus the second.
            std::vector<double> dk_rotated(n, 0.0), dk_plain(n, 0.0), dv(n, 0.0);
            for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
                for (int64_t i = 0; i < p.seqlen_q; ++i) {
                    read_row(p.q, b, h, i, q_plain.data(), D);
                    q_rotated = q_plain;
                    tokens.rotate(q_rotated.data(), b, i, false);
                    read_row(p.dout, b, h, i, dout.data(), D);
                    read_row(p.out, b, h, i, out.data(), D);
                    std::fill(dq_rotated.begin(), dq_rotated.end(), 0.0);
                    std::fill(dq_plain.begin(), dq_plain.end(), 0.0);
                    const double lse = read_element(
                        p.lse, b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2]);
                    row_probabilities(p, tokens, kv, b, i, q_plain.data(), q_rotated.data(), lse,
                                      prob, seen);
                    // d(loss)/d(score_j) = p_j (dp_j - delta), dp_j = dout . v_j, and delta =
                    // dout . out (= sum_k p_k dp_k for the forward's out), from the caller's
                    // out as the GPU kernels take it.
                    const double delta = dot(dout.data(), out.data(), D);
                    for (int64_t j = 0; j < p.seqlen_k; ++j) {
                        if (!seen[size_t(j)]) continue;
                        const double pj = prob[size_t(j)];
                        axpy(pj, dout.data(), &dv[size_t(j * D)], D);
                        const double dpj = dot(dout.data(), kv.v(j), D);
                        const double dproduct = pj * (dpj - delta) * p.scale;
                        if (tokens.rotated_pair(b, i, j)) {
                            axpy(dproduct, kv.k_rotated(j), dq_rotated.data(), D);
                            axpy(dproduct, q_rotated.data(), &dk_rotated[size_t(j * D)], D);
                        } else {
                            axpy(dproduct, kv.k_plain(j), dq_plain.data(), D);
                            axpy(dproduct, q_plain.data(), &dk_plain[size_t(j * D)], D);
                        }
                    }
                    tokens.rotate(dq_rotated.data(), b, i, true);
                    for (int64_t d = 0; d < D; ++d) dq_rotated[size_t(d)] += dq_plain[size_t(d)];
                    write_row(p.dq, b, h, i, dq_rotated.data(), D);
                }
            }
            for (int64_t j = 0; j < p.seqlen_k; ++j) {
                double* dk = &dk_rotated[size_t(j * D)];
                tokens.rotate(dk, b, j, true);
                for (int64_t d = 0; d < D; ++d) dk[d] += dk_plain[size_t(j * D + d)];
                write_row(p.dk, b, hk, j, dk, D);
                write_row(p.dv, b, hk, j, &dv[size_t(j * D)], D);
            }
        }
    });
}

}  // namespace rope_jit
