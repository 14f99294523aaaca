#include "ops/attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
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

// Elements of a buffer of a rows of b: std::bad_alloc (out of host memory) where the count
// cannot be held (a zero-stride k may describe more keys than memory could hold as doubles).
size_t buffer_elements(int64_t a, int64_t b) {
    int64_t n = 0;
    if (__builtin_mul_overflow(a, b, &n) || uint64_t(n) > std::vector<double>().max_size())
        throw std::bad_alloc();
    return size_t(n);
}

// The keys and values of one (batch, kv head), as doubles: plain keys, keys rotated by their
// own rows (plain for tokens without a position), values. Sized once, loaded per unit.
struct KeyValues {
    int64_t D = 0;
    std::vector<double> plain, rotated, values;

    explicit KeyValues(const AttentionProblem& p)
        : D(p.head_dim),
          plain(buffer_elements(p.seqlen_k, D)),
          rotated(plain.size()),
          values(plain.size()) {}

    void load(const AttentionProblem& p, const Tokens& tokens, int64_t b, int64_t hk) {
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

// The working memory of one thread of a pass (ForwardScratch, BackwardScratch), all of it
// made before the pass writes anything: a call whose memory cannot be had fails with its
// outputs untouched, where threads allocating their own would fail after others had written
// rows. One set a thread that runs chunks at once (the pool's `before` says how many), taken
// per chunk.
template <class Scratch>
class ScratchSets {
public:
    explicit ScratchSets(const AttentionProblem& p) : p_(p) {}

    void make(int threads) {
        for (int n = 0; n < threads; ++n) {
            sets_.push_back(std::make_unique<Scratch>(p_));
            free_.push_back(sets_.back().get());
        }
    }

    // A set for the chunk that runs `use` on it.
    template <class Use>
    void with_one(Use&& use) {
        Scratch* set;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (free_.empty()) {  // more chunks at once than counted: never, but not a crash
                sets_.push_back(std::make_unique<Scratch>(p_));
                free_.push_back(sets_.back().get());
            }
            set = free_.back();
            free_.pop_back();
        }
        struct GiveBack {
            ScratchSets& sets;
            Scratch* set;
            ~GiveBack() {
                std::lock_guard<std::mutex> lock(sets.mutex_);
                sets.free_.push_back(set);
            }
        } give_back{*this, set};
        use(*set);
    }

private:
    const AttentionProblem& p_;
    std::vector<std::unique_ptr<Scratch>> sets_;
    std::vector<Scratch*> free_;
    std::mutex mutex_;
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

struct ForwardScratch {
    std::vector<double> q_plain, q_rotated, o, prob;
    std::vector<char> seen;
    KeyValues kv;

    explicit ForwardScratch(const AttentionProblem& p)
        : q_plain(size_t(p.head_dim)),
          q_rotated(size_t(p.head_dim)),
          o(size_t(p.head_dim)),
          prob(buffer_elements(p.seqlen_k, 1)),
          seen(prob.size()),
          kv(p) {}
};

struct BackwardScratch {
    std::vector<double> q_plain, q_rotated, dout, out, dq_rotated, dq_plain, prob;
    std::vector<char> seen;
    KeyValues kv;
    // Gradients with respect to the rotated keys (pairs that score rotated vectors) and the
    // plain keys (the others); dk is the first rotated back plus the second.
    std::vector<double> dk_rotated, dk_plain, dv;

    explicit BackwardScratch(const AttentionProblem& p)
        : q_plain(size_t(p.head_dim)),
          q_rotated(size_t(p.head_dim)),
          dout(size_t(p.head_dim)),
          out(size_t(p.head_dim)),
          dq_rotated(size_t(p.head_dim)),
          dq_plain(size_t(p.head_dim)),
          prob(buffer_elements(p.seqlen_k, 1)),
          seen(prob.size()),
          kv(p),
          dk_rotated(kv.plain.size()),
          dk_plain(kv.plain.size()),
          dv(kv.plain.size()) {}
};

// Query row i of head h (batch b): its dq row written, its terms added to the unit's dk and dv.
void backward_row(const AttentionProblem& p, const Tokens& tokens, BackwardScratch& w, int64_t b,
                  int64_t h, int64_t i) {
    const int64_t D = p.head_dim;
    read_row(p.q, b, h, i, w.q_plain.data(), D);
    w.q_rotated = w.q_plain;
    tokens.rotate(w.q_rotated.data(), b, i, false);
    read_row(p.dout, b, h, i, w.dout.data(), D);
    read_row(p.out, b, h, i, w.out.data(), D);
    std::fill(w.dq_rotated.begin(), w.dq_rotated.end(), 0.0);
    std::fill(w.dq_plain.begin(), w.dq_plain.end(), 0.0);
    const double lse =
        read_element(p.lse, b * p.lse.strides[0] + h * p.lse.strides[1] + i * p.lse.strides[2]);
    row_probabilities(p, tokens, w.kv, b, i, w.q_plain.data(), w.q_rotated.data(), lse, w.prob,
                      w.seen);
    // d(loss)/d(score_j) = p_j (dp_j - delta), dp_j = dout . v_j, and delta = dout . out
    // (= sum_k p_k dp_k for the forward's out), from the caller's out as the GPU kernels take it.
    const double delta = dot(w.dout.data(), w.out.data(), D);
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
        if (!w.seen[size_t(j)]) continue;
        const double pj = w.prob[size_t(j)];
        axpy(pj, w.dout.data(), &w.dv[size_t(j * D)], D);
        const double dpj = dot(w.dout.data(), w.kv.v(j), D);
        const double dproduct = pj * (dpj - delta) * p.scale;
        if (tokens.rotated_pair(b, i, j)) {
            axpy(dproduct, w.kv.k_rotated(j), w.dq_rotated.data(), D);
            axpy(dproduct, w.q_rotated.data(), &w.dk_rotated[size_t(j * D)], D);
        } else {
            axpy(dproduct, w.kv.k_plain(j), w.dq_plain.data(), D);
            axpy(dproduct, w.q_plain.data(), &w.dk_plain[size_t(j * D)], D);
        }
    }
    tokens.rotate(w.dq_rotated.data(), b, i, true);
    for (int64_t d = 0; d < D; ++d) w.dq_rotated[size_t(d)] += w.dq_plain[size_t(d)];
    write_row(p.dq, b, h, i, w.dq_rotated.data(), D);
}

}  // namespace

void attention_forward_cpu(const AttentionProblem& p, ThreadPool& pool) {
    if (p.empty()) return;
    const Tokens tokens(p);
    const int64_t D = p.head_dim;
    constexpr int64_t kRowsPerUnit = 64;
    const int64_t row_blocks = (p.seqlen_q + kRowsPerUnit - 1) / kRowsPerUnit;
    const int64_t units = p.batch * p.heads_q * row_blocks;
    ScratchSets<ForwardScratch> scratch(p);
    pool.parallel_for(units, 1, [&](int64_t begin, int64_t end) {
        scratch.with_one([&](ForwardScratch& w) {
            for (int64_t u = begin; u < end; ++u) {
                const int64_t block = u % row_blocks, h = (u / row_blocks) % p.heads_q,
                              b = u / (row_blocks * p.heads_q);
                w.kv.load(p, tokens, b, h / p.group());
                const int64_t last = std::min(p.seqlen_q, (block + 1) * kRowsPerUnit);
                for (int64_t i = block * kRowsPerUnit; i < last; ++i) {
                    read_row(p.q, b, h, i, w.q_plain.data(), D);
                    w.q_rotated = w.q_plain;
                    tokens.rotate(w.q_rotated.data(), b, i, false);
                    double lse = 0;
                    std::fill(w.o.begin(), w.o.end(), 0.0);
                    if (row_softmax(p, tokens, w.kv, b, i, w.q_plain.data(), w.q_rotated.data(),
                                    w.prob, w.seen, &lse))
                        for (int64_t j = 0; j < p.seqlen_k; ++j)
                            if (w.seen[size_t(j)])
                                axpy(w.prob[size_t(j)], w.kv.v(j), w.o.data(), D);
                    write_row(p.out, b, h, i, w.o.data(), D);
                    if (p.has_lse)
                        write_float(p.lse,
                                    b * p.lse.strides[0] + h * p.lse.strides[1] +
                                        i * p.lse.strides[2],
                                    lse);
                }
            }
        });
    }, [&](int threads) { scratch.make(threads); });
}

void attention_backward_cpu(const AttentionProblem& p, ThreadPool& pool) {
    // Units run only where they write something: dq rows (a query head of the unit's group with
    // tokens) or dk and dv rows (keys). Without either, a call of 2^60 empty units would run
    // them all; with one, its outputs' own elements bound the units.
    const bool dq_rows = p.heads_q > 0 && p.seqlen_q > 0;
    if (p.batch == 0 || p.heads_k == 0 || (!dq_rows && p.seqlen_k == 0)) return;
    const Tokens tokens(p);
    const int64_t D = p.head_dim, group = p.group();
    const int64_t units = p.batch * p.heads_k;
    ScratchSets<BackwardScratch> scratch(p);
    // One unit per (batch, kv head): it owns dk and dv of that head and dq of its query heads,
    // so units write disjoint memory and the sums run in one fixed order (deterministic).
    pool.parallel_for(units, 1, [&](int64_t begin, int64_t end) {
        scratch.with_one([&](BackwardScratch& w) {
            for (int64_t u = begin; u < end; ++u) {
                const int64_t b = u / p.heads_k, hk = u % p.heads_k;
                w.kv.load(p, tokens, b, hk);
                std::fill(w.dk_rotated.begin(), w.dk_rotated.end(), 0.0);
                std::fill(w.dk_plain.begin(), w.dk_plain.end(), 0.0);
                std::fill(w.dv.begin(), w.dv.end(), 0.0);
                for (int64_t h = hk * group; dq_rows && h < (hk + 1) * group; ++h)
                    for (int64_t i = 0; i < p.seqlen_q; ++i) backward_row(p, tokens, w, b, h, i);
                for (int64_t j = 0; j < p.seqlen_k; ++j) {
                    double* dk = &w.dk_rotated[size_t(j * D)];
                    tokens.rotate(dk, b, j, true);
                    for (int64_t d = 0; d < D; ++d) dk[d] += w.dk_plain[size_t(j * D + d)];
                    write_row(p.dk, b, hk, j, dk, D);
                    write_row(p.dv, b, hk, j, &w.dv[size_t(j * D)], D);
                }
            }
        });
    }, [&](int threads) { scratch.make(threads); });
}

}  // namespace rope_jit
