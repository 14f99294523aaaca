#include "ops/rope/rope_frequencies.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "common/error.h"
#include "common/half_float.h"
#include "ops/rope/mrope_sections.h"
#include "common/raw_enum.h"
#include "ops/rope/rope_problem.h"  // host_accessible
#include "common/tensor_ref.h"

namespace rope_jit {

namespace {

constexpr double kPi = 3.14159265358979323846;

// The recipe's name, or nullptr for a value outside the enum.
const char* rope_type_name(int type) {
    switch (type) {
        case ROPE_JIT_ROPE_TYPE_DEFAULT: return "default";
        case ROPE_JIT_ROPE_TYPE_LINEAR: return "linear";
        case ROPE_JIT_ROPE_TYPE_DYNAMIC: return "dynamic";
        case ROPE_JIT_ROPE_TYPE_YARN: return "yarn";
        case ROPE_JIT_ROPE_TYPE_LLAMA3: return "llama3";
        case ROPE_JIT_ROPE_TYPE_LONGROPE: return "longrope";
        case ROPE_JIT_ROPE_TYPE_LANG: return "lang";
        case ROPE_JIT_ROPE_TYPE_PIXEL: return "pixel";
        case ROPE_JIT_ROPE_TYPE_CONSTANT: return "constant";
        case ROPE_JIT_ROPE_TYPE_PROPORTIONAL: return "proportional";
    }
    return nullptr;
}

// ---- checks on config fields; each names the field and the rope type that needs it ---------

struct FieldChecker {
    const char* type;

    void positive(double value, const char* field) const {
        if (!(std::isfinite(value) && value > 0))
            fail_argument(fmt::format("{}: must be finite and > 0 for rope_type {}, got {}", field,
                                      type, value));
    }
    void finite(double value, const char* field) const {
        if (!std::isfinite(value))
            fail_argument(
                fmt::format("{}: must be finite for rope_type {}, got {}", field, type, value));
    }
    void at_least_zero(double value, const char* field, const char* zero_means) const {
        if (!(std::isfinite(value) && value >= 0))
            fail_argument(
                fmt::format("{}: must be finite and >= 0 (0 = {}) for rope_type {}, got {}", field,
                            zero_means, type, value));
    }
    void positive_count(int64_t value, const char* field) const {
        if (value <= 0)
            fail_argument(
                fmt::format("{}: required (> 0) for rope_type {}, got {}", field, type, value));
    }
};

// theta^(-2i/R), i in [0, R/2): HF's `1 / base ** (arange(0, dim, 2) / dim)`.
std::vector<double> default_inv_freq(double theta, int64_t rotary_dim) {
    std::vector<double> inv(size_t(rotary_dim / 2));
    for (size_t i = 0; i < inv.size(); ++i)
        inv[i] = std::pow(theta, -double(2 * i) / double(rotary_dim));
    return inv;
}

// HF's YaRN get_mscale.
double yarn_mscale(double scale, double mscale) {
    return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The context length a scaled rope type was trained at: original_max_position_embeddings, or
// max_position_embeddings standing in for it (HF's fallback). Both are >= 0 (0 = unset).
int64_t original_max_positions(const rope_jit_freq_config& c, const char* rope_type) {
    if (c.max_position_embeddings < 0 || c.original_max_position_embeddings < 0)
        fail_argument(
            "max_position_embeddings / original_max_position_embeddings: must be >= 0 (0 = unset)");
    const int64_t original = c.original_max_position_embeddings > 0
                                 ? c.original_max_position_embeddings
                                 : c.max_position_embeddings;
    if (original <= 0)
        fail_argument(
            fmt::format("original_max_position_embeddings: required for rope_type {} (or "
                        "max_position_embeddings, which stands in for it)",
                        rope_type));
    return original;
}

Frequencies yarn(const rope_jit_freq_config& c, const FieldChecker& check) {
    const int64_t R = c.rotary_dim;
    if (c.theta == 1.0) fail_argument("theta: yarn divides by ln(theta), so theta must not be 1");
    const int64_t original = original_max_positions(c, "yarn");
    double factor = c.factor;
    if (factor == 0) {
        // HF (DeepSeek-V3 configs): factor = max_position_embeddings / original when unset.
        if (c.max_position_embeddings <= 0 || c.original_max_position_embeddings <= 0)
            fail_argument(
                "factor: required for rope_type yarn, unless both max_position_embeddings and "
                "original_max_position_embeddings are given (factor is then their ratio)");
        factor = double(c.max_position_embeddings) / double(c.original_max_position_embeddings);
    }
    check.positive(factor, "factor");
    check.at_least_zero(c.attention_factor, "attention_factor", "derive it");
    check.at_least_zero(c.beta_fast, "beta_fast", "32");
    check.at_least_zero(c.beta_slow, "beta_slow", "1");
    check.finite(c.mscale, "mscale");
    check.finite(c.mscale_all_dim, "mscale_all_dim");

    Frequencies out;
    if (c.attention_factor > 0) {
        out.attention_factor = c.attention_factor;
    } else if (c.mscale != 0 && c.mscale_all_dim != 0) {
        out.attention_factor =
            yarn_mscale(factor, c.mscale) / yarn_mscale(factor, c.mscale_all_dim);
    } else {
        out.attention_factor = yarn_mscale(factor, 1.0);
    }

    // HF's `beta_fast or 32`: zero means the default.
    const double beta_fast = c.beta_fast > 0 ? c.beta_fast : 32.0;
    const double beta_slow = c.beta_slow > 0 ? c.beta_slow : 1.0;
    // The pair index whose wavelength makes `rotations` turns over the original context.
    auto correction_dim = [&](double rotations) {
        return double(R) * std::log(double(original) / (rotations * 2 * kPi)) /
               (2 * std::log(c.theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (c.truncate != 0) {
        low = std::floor(low);
        high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(R - 1));
    if (low == high) high += 0.001;  // HF: prevents a division by zero

    const std::vector<double> extrapolation = default_inv_freq(c.theta, R);
    out.inv_freq.resize(extrapolation.size());
    for (size_t i = 0; i < extrapolation.size(); ++i) {
        const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
        // ramp 0: extrapolate (keep the frequency); ramp 1: interpolate (divide by factor).
        out.inv_freq[i] = extrapolation[i] / factor * ramp + extrapolation[i] * (1 - ramp);
    }
    return out;
}

Frequencies llama3(const rope_jit_freq_config& c, const FieldChecker& check) {
    check.positive(c.factor, "factor");
    const int64_t original = original_max_positions(c, "llama3");
    check.positive(c.low_freq_factor, "low_freq_factor");
    check.positive(c.high_freq_factor, "high_freq_factor");
    if (!(c.high_freq_factor > c.low_freq_factor))
        fail_argument(fmt::format(
            "high_freq_factor: must exceed low_freq_factor ({}) for rope_type llama3, got {}",
            c.low_freq_factor, c.high_freq_factor));
    const double old_context = double(original);
    const double low_freq_wavelength = old_context / c.low_freq_factor;
    const double high_freq_wavelength = old_context / c.high_freq_factor;

    Frequencies out;
    out.inv_freq = default_inv_freq(c.theta, c.rotary_dim);
    for (double& inv : out.inv_freq) {
        const double wavelength = 2 * kPi / inv;
        if (wavelength > low_freq_wavelength) {
            inv /= c.factor;  // low frequencies: interpolated fully
        } else if (!(wavelength < high_freq_wavelength)) {
            // Between the two: blend smoothly from interpolated to unchanged.
            const double smooth = (old_context / wavelength - c.low_freq_factor) /
                                  (c.high_freq_factor - c.low_freq_factor);
            inv = (1 - smooth) * inv / c.factor + smooth * inv;
        }  // high frequencies: unchanged
    }
    return out;
}

Frequencies longrope(const rope_jit_freq_config& c, size_t n, const FieldChecker& check) {
    const int64_t original = original_max_positions(c, "longrope");
    double factor = c.factor;
    if (factor == 0) {
        // HF (Phi-3 configs): the ratio of the extended to the original context when unset.
        if (c.max_position_embeddings <= 0)
            fail_argument(
                "factor: required for rope_type longrope, unless max_position_embeddings is given "
                "(factor is then max_position_embeddings / original_max_position_embeddings)");
        factor = double(c.max_position_embeddings) / double(original);
    }
    check.positive(factor, "factor");
    check.at_least_zero(c.attention_factor, "attention_factor", "derive it");
    if (c.seq_len < 0)
        fail_argument(fmt::format("seq_len: must be >= 0 (0 = none), got {}", c.seq_len));
    if (c.short_factor == nullptr)
        fail_argument("short_factor: required for rope_type longrope, got NULL");
    if (c.long_factor == nullptr)
        fail_argument("long_factor: required for rope_type longrope, got NULL");
    // A caller that states its lists' lengths gets them checked before anything is read.
    for (const auto& [stated, name] : {std::pair{c.num_short_factor, "short_factor"},
                                       std::pair{c.num_long_factor, "long_factor"}})
        if (stated != 0 && stated != n)
            fail_argument(fmt::format(
                "{}: num_{} is {}, but rope_type longrope reads rotary_dim / 2 = {} factors", name,
                name, stated, n));
    const bool long_context = c.seq_len > original;
    const float* ext = long_context ? c.long_factor : c.short_factor;
    for (size_t i = 0; i < n; ++i)
        if (!(std::isfinite(ext[i]) && ext[i] > 0))
            fail_argument(fmt::format("{}: element {} must be finite and > 0, got {}",
                                      long_context ? "long_factor" : "short_factor", i, ext[i]));

    Frequencies out;
    if (c.attention_factor > 0) {
        out.attention_factor = c.attention_factor;
    } else if (factor <= 1) {
        out.attention_factor = 1.0;
    } else {
        if (original <= 1)
            fail_argument(
                "original_max_position_embeddings: must be > 1 to derive longrope's attention "
                "factor "
                "(it divides by its logarithm)");
        out.attention_factor = std::sqrt(1 + std::log(factor) / std::log(double(original)));
    }
    out.inv_freq = default_inv_freq(c.theta, c.rotary_dim);
    for (size_t i = 0; i < n; ++i) out.inv_freq[i] /= double(ext[i]);
    return out;
}

Frequencies frequencies_of_type(const rope_jit_freq_config& c, size_t n, const char* type) {
    const FieldChecker check{type};

    if (c.rope_type == ROPE_JIT_ROPE_TYPE_CONSTANT) {
        if (c.num_freqs <= 0 || c.num_freqs > ROPE_JIT_MAX_FREQUENCIES)
            fail_argument(fmt::format(
                "num_freqs: must be in [1, 2^24] (ROPE_JIT_MAX_FREQUENCIES) for rope_type "
                "constant, got {}",
                c.num_freqs));
        if (n != size_t(c.num_freqs))
            fail_argument(
                fmt::format("n: rope_type constant has num_freqs = {} frequencies, got n = {}",
                            c.num_freqs, n));
        Frequencies out;
        out.inv_freq.assign(n, 1.0);
        return out;
    }

    if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0)
        fail_argument(fmt::format("rotary_dim: must be even and > 0, got {}", c.rotary_dim));
    if (c.rotary_dim / 2 > ROPE_JIT_MAX_FREQUENCIES)
        fail_argument(fmt::format(
            "rotary_dim: at most 2^25 (ROPE_JIT_MAX_FREQUENCIES pairs), got {}", c.rotary_dim));
    if (n != size_t(c.rotary_dim / 2))
        fail_argument(fmt::format("n: expected rotary_dim / 2 = {} inverse frequencies, got {}",
                                  c.rotary_dim / 2, n));
    if (c.rope_type != ROPE_JIT_ROPE_TYPE_PIXEL) check.positive(c.theta, "theta");

    Frequencies out;
    switch (c.rope_type) {
        case ROPE_JIT_ROPE_TYPE_DEFAULT:
            out.inv_freq = default_inv_freq(c.theta, c.rotary_dim);
            return out;
        case ROPE_JIT_ROPE_TYPE_LINEAR:
            // Dividing the frequencies is dividing the positions (position interpolation).
            check.positive(c.factor, "factor");
            out.inv_freq = default_inv_freq(c.theta, c.rotary_dim);
            for (double& inv : out.inv_freq) inv /= c.factor;
            return out;
        case ROPE_JIT_ROPE_TYPE_DYNAMIC: {
            check.positive(c.factor, "factor");
            check.positive_count(c.max_position_embeddings, "max_position_embeddings");
            if (c.seq_len < 0)
                fail_argument(fmt::format("seq_len: must be >= 0 (0 = none), got {}", c.seq_len));
            if (c.rotary_dim <= 2)
                fail_argument(
                    fmt::format("rotary_dim: dynamic NTK raises theta to R / (R - 2), so it needs "
                                "rotary_dim > 2, got {}",
                                c.rotary_dim));
            // HF clamps the length from below: the scaling starts past the trained context.
            const double length = double(std::max(c.seq_len, c.max_position_embeddings));
            const double R = c.rotary_dim;
            const double stretch =
                c.factor * length / double(c.max_position_embeddings) - (c.factor - 1);
            out.inv_freq = default_inv_freq(c.theta * std::pow(stretch, R / (R - 2)), c.rotary_dim);
            return out;
        }
        case ROPE_JIT_ROPE_TYPE_YARN: return yarn(c, check);
        case ROPE_JIT_ROPE_TYPE_LLAMA3: return llama3(c, check);
        case ROPE_JIT_ROPE_TYPE_LONGROPE: return longrope(c, n, check);
        case ROPE_JIT_ROPE_TYPE_LANG: {
            check.positive(c.theta_rescale_factor, "theta_rescale_factor");
            double theta = c.theta;
            if (c.theta_rescale_factor != 1.0) {
                if (c.rotary_dim <= 2)
                    fail_argument(fmt::format(
                        "rotary_dim: theta_rescale_factor raises it to R / (R - 2), so it "
                        "needs rotary_dim > 2, got {}",
                        c.rotary_dim));
                const double R = c.rotary_dim;
                theta *= std::pow(c.theta_rescale_factor, R / (R - 2));
            }
            out.inv_freq = default_inv_freq(theta, c.rotary_dim);
            return out;
        }
        case ROPE_JIT_ROPE_TYPE_PIXEL: {
            check.finite(c.max_freq, "max_freq");
            // pi * torch.linspace(1, max_freq / 2, n).
            const double last = c.max_freq / 2;
            out.inv_freq.resize(n);
            for (size_t i = 0; i < n; ++i)
                out.inv_freq[i] =
                    kPi * (n == 1 ? 1.0 : 1.0 + double(i) * (last - 1.0) / double(n - 1));
            return out;
        }
        case ROPE_JIT_ROPE_TYPE_PROPORTIONAL: {
            // HF's exponents run over the whole head: the rotated pairs turn as the first
            // R/2 pairs of a full rotary head of head_dim features would.
            const int64_t head_dim = c.head_dim == 0 ? c.rotary_dim : c.head_dim;
            if (head_dim < c.rotary_dim || head_dim % 2 != 0)
                fail_argument(fmt::format(
                    "head_dim: must be even and >= rotary_dim ({}) for rope_type proportional "
                    "(0 = rotary_dim), got {}",
                    c.rotary_dim, c.head_dim));
            if (c.factor != 0) check.positive(c.factor, "factor");
            const double factor = c.factor == 0 ? 1.0 : c.factor;
            out.inv_freq.resize(n);
            for (size_t i = 0; i < n; ++i)
                out.inv_freq[i] = std::pow(c.theta, -double(2 * i) / double(head_dim)) / factor;
            return out;
        }
        case ROPE_JIT_ROPE_TYPE_CONSTANT: break;  // handled above
    }
    fail_argument(fmt::format("rope_type: unknown value {}", raw_enum(c.rope_type)));
}

}  // namespace

Frequencies compute_frequencies(const rope_jit_freq_config& c, size_t n) {
    const char* type = rope_type_name(raw_enum(c.rope_type));
    if (type == nullptr)
        fail_argument(fmt::format("rope_type: unknown value {}", raw_enum(c.rope_type)));
    Frequencies out = frequencies_of_type(c, n, type);
    // Fields each valid alone may still combine into an overflow (a factor of 1e-40, a
    // beta_fast of 1e-310, mscale_all_dim making YaRN's divisor 0): refused, never returned.
    // Judged as the float32 values the caller gets.
    for (size_t i = 0; i < out.inv_freq.size(); ++i) {
        const float inv = float(out.inv_freq[i]);
        const bool ok = c.rope_type == ROPE_JIT_ROPE_TYPE_PIXEL ? std::isfinite(inv)
                                                                : std::isfinite(inv) && inv > 0;
        if (!ok)
            fail_argument(fmt::format(
                "rope_type {}: the config's fields give inverse frequency {} = {}, not finite "
                "and > 0 (check factor, beta_fast, beta_slow and theta)",
                type, i, inv));
    }
    if (!(std::isfinite(float(out.attention_factor)) && float(out.attention_factor) > 0))
        fail_argument(fmt::format(
            "rope_type {}: the config's fields give attention factor {}, not finite and > 0 "
            "(check mscale, mscale_all_dim and factor)",
            type, out.attention_factor));
    return out;
}

// ============================================================================================
// Tables
// ============================================================================================

namespace {

void store(const TensorRef& t, int64_t row, int64_t col, double value) {
    char* address =
        t.data + (row * t.strides[0] + col * t.strides[1]) * int64_t(dtype_size(t.dtype));
    const float v = float(value);
    switch (t.dtype) {
        case DType::F32: std::memcpy(address, &v, 4); break;
        case DType::F16: {
            const uint16_t h = float_to_fp16(v);
            std::memcpy(address, &h, 2);
            break;
        }
        case DType::BF16: {
            const uint16_t h = float_to_bf16(v);
            std::memcpy(address, &h, 2);
            break;
        }
        default: break;  // check_output_table admits float dtypes only
    }
}

// cos and sin of the exact angle position / factor * inv_freq. The double quotient and
// product round to half an ulp of the angle, which at angles of 1e12 is already 1,500 float32
// ulps of its cosine: the rounding errors (the quotient's remainder, the product's low part
// by fma) are carried as a second angle `lo` and added by the angle-sum rule.
void angle_cos_sin(double position, double factor, double inv_freq, double* cos_value,
                   double* sin_value) {
    const double t = position / factor;
    const double t_low = std::fma(-t, factor, position) / factor;
    const double hi = t * inv_freq;
    const double lo = std::fma(t, inv_freq, -hi) + t_low * inv_freq;
    const double cos_hi = std::cos(hi), sin_hi = std::sin(hi);
    if (std::fabs(lo) < 0x1p-30) {  // (lo^2 / 2 below 2^-61: first order is exact enough)
        *cos_value = cos_hi - sin_hi * lo;
        *sin_value = sin_hi + cos_hi * lo;
        return;
    }
    const double cos_lo = std::cos(lo), sin_lo = std::sin(lo);
    *cos_value = cos_hi * cos_lo - sin_hi * sin_lo;
    *sin_value = sin_hi * cos_lo + cos_hi * sin_lo;
}

TensorRef check_output_table(const DLTensor* tensor, const char* name, int64_t pairs) {
    TensorRef t = make_tensor_ref(tensor, name, 2);
    if (!t.present()) return t;
    if (t.ndim != 2 || (t.shape[1] != pairs && t.shape[1] != 2 * pairs))
        fail_argument(fmt::format(
            "{}: expected [P, {}] (half table) or [P, {}] (full table) for num_freqs {}, got {}",
            name, pairs, 2 * pairs, pairs, t.shape_string()));
    if (!is_float(t.dtype))
        fail_argument(fmt::format("{}: dtype must be float32, float16 or bfloat16, got {}", name,
                                  dtype_name(t.dtype)));
    if (!host_accessible(t.device))
        fail_argument(fmt::format(
            "{}: lives on {}; tables are built in host memory (CPU, CUDA host or managed); "
            "copy them to the device afterwards",
            name, device_name(t.device.device_type)));
    require_distinct_elements(t, name);
    return t;
}

// Whether the host arrays [a, a + a_bytes) and [b, b + b_bytes) meet (NULL or no bytes meets
// nothing).
bool arrays_meet(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
    if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
    const auto a_first = reinterpret_cast<uintptr_t>(a);
    const auto b_first = reinterpret_cast<uintptr_t>(b);
    return a_first < b_first + b_bytes && b_first < a_first + a_bytes;
}

// Whether table t's bytes reach into [begin, begin + bytes): an input array the call reads
// while it writes the tables. A conservative test (the byte extents), as for outputs.
bool table_overlaps(const TensorRef& t, const void* begin, size_t bytes) {
    if (!t.present() || t.numel() == 0) return false;
    uintptr_t first = 0, last = 0;
    t.byte_extent(&first, &last);
    return arrays_meet(reinterpret_cast<const void*>(first), last - first + 1, begin, bytes);
}

}  // namespace

void check_inv_freq_outputs(const rope_jit_freq_config& config, const float* inv_freq, size_t n,
                            const float* attention_factor) {
    // The outputs may not land on each other or on the caller's factor lists, which are read
    // before anything is written: an attention factor inside inv_freq replaced a frequency,
    // an inv_freq over a factor list overwrote it, each returning OK (overlap audit, session
    // 40).
    const size_t list_bytes = n * sizeof(float);
    if (arrays_meet(attention_factor, sizeof(float), inv_freq, list_bytes))
        fail_argument("attention_factor: points into inv_freq, which the call writes");
    if (config.rope_type != ROPE_JIT_ROPE_TYPE_LONGROPE) return;
    for (const auto& [list, name] : {std::pair{config.short_factor, "short_factor"},
                                     std::pair{config.long_factor, "long_factor"}}) {
        if (arrays_meet(inv_freq, list_bytes, list, list_bytes))
            fail_argument(fmt::format("inv_freq: shares memory with {}, the caller's input", name));
        if (arrays_meet(attention_factor, sizeof(float), list, list_bytes))
            fail_argument(
                fmt::format("attention_factor: points into {}, the caller's input", name));
    }
}

void fill_rope_tables(const rope_jit_table_config& c, const DLTensor* cos_tensor,
                      const DLTensor* sin_tensor, const DLTensor* xpos_tensor) {
    if (c.inv_freq == nullptr) fail_argument("inv_freq: required, got NULL");
    if (c.num_freqs == 0 || c.num_freqs > size_t(ROPE_JIT_MAX_FREQUENCIES))
        fail_argument(fmt::format(
            "num_freqs: must be in [1, 2^24] (ROPE_JIT_MAX_FREQUENCIES), got {}", c.num_freqs));
    const int64_t pairs = int64_t(c.num_freqs);
    if (!(std::isfinite(c.interpolate_factor) && c.interpolate_factor > 0))
        fail_argument(fmt::format("interpolate_factor: must be finite and > 0, got {}",
                                  c.interpolate_factor));
    if (!std::isfinite(c.attention_factor))
        fail_argument(fmt::format("attention_factor: must be finite, got {}", c.attention_factor));
    if (!std::isfinite(c.position_start))
        fail_argument(fmt::format("position_start: must be finite, got {}", c.position_start));
    const int style = raw_enum(c.style);  // proportional tables are laid out as half ones
    if (style != ROPE_JIT_STYLE_HALF && style != ROPE_JIT_STYLE_INTERLEAVED &&
        style != ROPE_JIT_STYLE_PROPORTIONAL)
        fail_argument(
            fmt::format("style: must be ROPE_JIT_STYLE_HALF, ROPE_JIT_STYLE_INTERLEAVED "
                        "or ROPE_JIT_STYLE_PROPORTIONAL, got {}",
                        style));
    if (c.num_mrope_sections < 0)
        fail_argument(
            fmt::format("num_mrope_sections: must be >= 0, got {}", c.num_mrope_sections));
    const std::vector<int32_t> axes =
        c.num_mrope_sections > 0
            ? pair_axes_from_sections(c.mrope_sections, c.num_mrope_sections,
                                      c.mrope_interleaved != 0, pairs, "mrope_sections")
            : std::vector<int32_t>();
    const int64_t num_axes = c.num_mrope_sections > 0 ? c.num_mrope_sections : 1;

    const TensorRef cos = check_output_table(cos_tensor, "cos", pairs);
    const TensorRef sin = check_output_table(sin_tensor, "sin", pairs);
    const TensorRef xpos = check_output_table(xpos_tensor, "xpos_scale", pairs);
    if (!cos.present() && !sin.present() && !xpos.present())
        fail_argument("cos/sin/xpos_scale: all NULL; pass at least one table to fill");
    int64_t rows = -1;
    const TensorRef* first = nullptr;
    const TensorRef* tables[] = {&cos, &sin, &xpos};
    for (const TensorRef* t : tables) {
        if (!t->present()) continue;
        if (first == nullptr) {
            first = t;
            rows = t->shape[0];
        } else if (t->shape[0] != rows) {
            fail_argument(fmt::format("{}: has {} rows but {} has {}", t->name, t->shape[0],
                                      first->name, rows));
        }
        for (const TensorRef* other : tables)
            if (other != t && other->present() && shares_memory(*t, *other))
                fail_argument(fmt::format("{}: shares memory with {}; each table needs elements "
                                          "of its own",
                                          t->name, other->name));
    }
    // The inputs are read while the tables are written: a table over them (a sin table on
    // the caller's inv_freq) filled its later rows from its own first one, and returned OK
    // (adversarial pass, session 38).
    for (const TensorRef* t : tables) {
        if (table_overlaps(*t, c.inv_freq, c.num_freqs * sizeof(float)))
            fail_argument(fmt::format("{}: shares memory with inv_freq, which the call reads "
                                      "while it writes the tables",
                                      t->name));
        // (Read before any table is written, so the tables came out right, but the caller's
        // sections were lost; overlap audit, session 40.)
        if (c.num_mrope_sections > 0 &&
            table_overlaps(*t, c.mrope_sections, size_t(c.num_mrope_sections) * sizeof(int32_t)))
            fail_argument(fmt::format("{}: shares memory with mrope_sections, the caller's "
                                      "input",
                                      t->name));
    }
    if (xpos.present() && !(std::isfinite(c.xpos_scale_base) && c.xpos_scale_base > 0))
        fail_argument(
            fmt::format("xpos_scale_base: must be finite and > 0, got {}", c.xpos_scale_base));
    if (xpos.present() && !std::isfinite(c.xpos_center))
        fail_argument(fmt::format("xpos_center: must be finite, got {}", c.xpos_center));
    if (c.positions != nullptr && c.num_positions != 0) {
        // A caller that states how many positions it holds gets that checked before any is read.
        const unsigned __int128 needed =
            (unsigned __int128)num_axes * (unsigned __int128)std::max<int64_t>(rows, 0);
        if (c.num_positions < needed)
            fail_argument(
                fmt::format("positions: num_positions is {}, but the tables' {} rows need {}{}",
                            c.num_positions, rows, uint64_t(needed),
                            num_axes > 1 ? fmt::format(" ({} sections x {} rows)", num_axes, rows)
                                         : std::string()));
    }
    // (After the count check: the positions read are num_axes x rows, which a stated
    // num_positions has just been found to hold.)
    if (c.positions != nullptr && rows > 0)
        for (const TensorRef* t : tables)
            if (table_overlaps(*t, c.positions, size_t(num_axes * rows) * sizeof(double)))
                fail_argument(fmt::format("{}: shares memory with positions, which the call "
                                          "reads while it writes the tables",
                                          t->name));
    // The largest |position| and |inverse frequency|: their product must stay finite.
    double largest_position = 0;
    if (c.positions != nullptr) {
        for (int64_t e = 0; e < num_axes * rows; ++e) {
            if (!std::isfinite(c.positions[e]))
                fail_argument(fmt::format("positions: entry [{}, {}] is not finite ({})",
                                          e / std::max<int64_t>(rows, 1),
                                          e % std::max<int64_t>(rows, 1), c.positions[e]));
            largest_position = std::max(largest_position, std::fabs(c.positions[e]));
        }
    } else if (rows > 0) {
        largest_position = std::max(std::fabs(c.position_start),
                                    std::fabs(c.position_start + double(rows - 1)));
    }
    double largest_inv_freq = 0;
    for (int64_t i = 0; i < pairs; ++i) {
        if (!std::isfinite(c.inv_freq[i]))
            fail_argument(fmt::format("inv_freq: element {} is not finite ({})", i, c.inv_freq[i]));
        largest_inv_freq = std::max(largest_inv_freq, std::fabs(double(c.inv_freq[i])));
    }
    // float32_angles divides and multiplies in float32 (the factor itself may round to 0).
    const bool overflows =
        c.float32_angles != 0
            ? !(float(c.interpolate_factor) > 0 &&
                std::isfinite(float(largest_position) / float(c.interpolate_factor) *
                              float(largest_inv_freq)))
            : !std::isfinite(largest_position / c.interpolate_factor * largest_inv_freq);
    if (overflows)
        fail_argument(fmt::format(
            "interpolate_factor: positions up to {} divided by {} and multiplied by inverse "
            "frequencies up to {} overflow{}",
            largest_position, c.interpolate_factor, largest_inv_freq,
            c.float32_angles != 0 ? " in float32 (float32_angles)" : ""));

    // Every check passed: from here on nothing fails.
    const bool float32_angles = c.float32_angles != 0;
    const double rotated_features = 2.0 * double(pairs);
    auto columns = [&](const TensorRef& t, int64_t i, int64_t* first_col) -> int {
        if (t.shape[1] == pairs) {
            *first_col = i;
            return 1;
        }
        *first_col = c.style == ROPE_JIT_STYLE_INTERLEAVED ? 2 * i : i;
        return 2;
    };
    auto put = [&](const TensorRef& t, int64_t r, int64_t i, double value) {
        if (!t.present()) return;
        int64_t col = 0;
        const int count = columns(t, i, &col);
        store(t, r, col, value);
        if (count == 2)
            store(t, r, c.style == ROPE_JIT_STYLE_INTERLEAVED ? col + 1 : col + pairs, value);
    };

    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < pairs; ++i) {
            const int64_t axis = axes.empty() ? 0 : axes[size_t(i)];
            const double position =
                c.positions ? c.positions[axis * rows + r] : c.position_start + double(r);
            double t = position / c.interpolate_factor;
            double cos_value, sin_value;
            if (float32_angles) {
                // PyTorch: positions in float32, divided in float32, one float32 product
                // (the double product of two floats is exact, so rounding it once is fp32's).
                t = double(float(double(float(position)) / double(float(c.interpolate_factor))));
                const double angle = double(float(t * double(c.inv_freq[i])));
                cos_value = std::cos(angle);
                sin_value = std::sin(angle);
            } else {
                angle_cos_sin(position, c.interpolate_factor, double(c.inv_freq[i]), &cos_value,
                              &sin_value);
            }
            put(cos, r, i, c.attention_factor * cos_value);
            put(sin, r, i, c.attention_factor * sin_value);
            if (xpos.present()) {
                const double base =
                    (2.0 * double(i) + 0.4 * rotated_features) / (1.4 * rotated_features);
                put(xpos, r, i, std::pow(base, (t - c.xpos_center) / c.xpos_scale_base));
            }
        }
    }
}

}  // namespace rope_jit
