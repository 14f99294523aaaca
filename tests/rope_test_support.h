// Test support: host tensors that hand out DLTensor views in any layout, random data, and an
// independent RoPE reference written straight from the golden README's formulas in float64
// (it shares no code with src/ops/rope/cpu_reference.cpp beyond the fp16/bf16 conversions).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "common/half_float.h"
#include "rope_jit/rope_jit.h"

namespace rope_test {

// F8: float8 e4m3fn (an output dtype of the KV cache and q_out), coded by e4m3_nearest below.
enum class Dt { F32, F16, BF16, I32, I64, F8 };

// float8 e4m3fn from its definition (test_rope_kv_cache.cpp's reference; independent of
// src/common/float8.h): sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals at
// exponent 0, 0x7f and 0xff NaN, no infinities.
inline double e4m3_value(uint8_t code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if ((code & 0x7f) == 0x7f) return NAN;
    const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    return (code & 0x80) ? -v : v;
}

// The e4m3fn code nearest to x among all codes (ties to the even code, whose mantissa ends in
// 0), after saturation to +-448; NaN gives 0x7f.
inline uint8_t e4m3_nearest(double x) {
    if (std::isnan(x)) return 0x7f;
    const double a = std::min(std::fabs(x), 448.0);
    int best = 0;
    for (int code = 1; code < 0x7f; ++code) {
        const double d = std::fabs(e4m3_value(uint8_t(code)) - a),
                     d_best = std::fabs(e4m3_value(uint8_t(best)) - a);
        if (d < d_best || (d == d_best && code % 2 == 0 && best % 2 != 0)) best = code;
    }
    return uint8_t(best | (std::signbit(x) ? 0x80 : 0));
}

inline const char* dt_name(Dt dt) {
    switch (dt) {
        case Dt::F32: return "float32";
        case Dt::F16: return "float16";
        case Dt::BF16: return "bfloat16";
        case Dt::I32: return "int32";
        case Dt::I64: return "int64";
        case Dt::F8: return "float8_e4m3fn";
    }
    return "?";
}

inline size_t dt_size(Dt dt) {
    return dt == Dt::F32 || dt == Dt::I32 ? 4 : dt == Dt::I64 ? 8 : dt == Dt::F8 ? 1 : 2;
}

inline DLDataType dl_type(Dt dt) {
    switch (dt) {
        case Dt::F32: return {kDLFloat, 32, 1};
        case Dt::F16: return {kDLFloat, 16, 1};
        case Dt::BF16: return {kDLBfloat, 16, 1};
        case Dt::I32: return {kDLInt, 32, 1};
        case Dt::I64: return {kDLInt, 64, 1};
        case Dt::F8: return {ROPE_JIT_DLPACK_FLOAT8_E4M3FN, 8, 1};
    }
    return {kDLFloat, 32, 1};
}

// Rounds a value to what dtype dt can hold (identity for float32 beyond fp32 rounding).
inline double quantize(double v, Dt dt) {
    switch (dt) {
        case Dt::F16: return rope_jit::fp16_to_float(rope_jit::float_to_fp16(float(v)));
        case Dt::BF16: return rope_jit::bf16_to_float(rope_jit::float_to_bf16(float(v)));
        default: return float(v);
    }
}

// A buffer in host memory and one strided view of it. `order` lists the logical dims from
// outermost to innermost in memory (e.g. {0, 2, 1, 3} stores [B,H,S,D] as [B,S,H,D]);
// `pad` adds unused elements after each innermost row, making the view non-contiguous.
class HostTensor {
public:
    HostTensor() = default;
    HostTensor(Dt dt, std::vector<int64_t> shape, std::vector<int> order = {}, int64_t pad = 0)
        : dt_(dt), shape_(std::move(shape)) {
        const int n = int(shape_.size());
        if (order.empty())
            for (int i = 0; i < n; ++i) order.push_back(i);
        strides_.assign(size_t(n), 0);
        int64_t stride = 1;
        for (int j = n - 1; j >= 0; --j) {
            strides_[size_t(order[size_t(j)])] = stride;
            stride *= shape_[size_t(order[size_t(j)])] + (j == n - 1 ? pad : 0);
        }
        bytes_.assign(size_t(std::max<int64_t>(stride, 1)) * dt_size(dt), 0xA5);  // poison padding
        tensor_.data = bytes_.data();
        tensor_.device = {kDLCPU, 0};
        tensor_.ndim = n;
        tensor_.dtype = dl_type(dt);
        tensor_.shape = shape_.data();
        tensor_.strides = strides_.data();
        tensor_.byte_offset = 0;
    }

    // A 1-D view of n elements `step` apart (the elements between are poison).
    static HostTensor spaced(Dt dt, int64_t n, int64_t step) {
        HostTensor t(dt, {n, step});
        t.shape_ = {n};
        t.strides_ = {step};
        t.tensor_.ndim = 1;
        t.repoint();
        return t;
    }

    // Copies own their bytes and shape: the DLTensor is re-pointed at the copy's storage.
    HostTensor(const HostTensor& other)
        : dt_(other.dt_),
          shape_(other.shape_),
          strides_(other.strides_),
          bytes_(other.bytes_),
          tensor_(other.tensor_) {
        repoint();
    }
    HostTensor& operator=(const HostTensor& other) {
        dt_ = other.dt_;
        shape_ = other.shape_;
        strides_ = other.strides_;
        bytes_ = other.bytes_;
        tensor_ = other.tensor_;
        repoint();
        return *this;
    }

    const DLTensor* dl() const { return &tensor_; }
    DLTensor* dl() { return &tensor_; }
    Dt dtype() const { return dt_; }
    const std::vector<int64_t>& shape() const { return shape_; }
    const std::vector<int64_t>& strides() const { return strides_; }
    int64_t numel() const {
        int64_t n = 1;
        for (int64_t d : shape_) n *= d;
        return n;
    }
    std::vector<uint8_t>& bytes() { return bytes_; }

    int64_t offset(const std::vector<int64_t>& index) const {
        int64_t o = 0;
        for (size_t i = 0; i < index.size(); ++i) o += index[i] * strides_[i];
        return o;
    }
    double get(const std::vector<int64_t>& index) const { return get_at(offset(index)); }
    void set(const std::vector<int64_t>& index, double v) { set_at(offset(index), v); }

    double get_at(int64_t o) const {
        const uint8_t* p = bytes_.data() + o * int64_t(dt_size(dt_));
        switch (dt_) {
            case Dt::F32: {
                float v;
                std::memcpy(&v, p, 4);
                return v;
            }
            case Dt::F16: {
                uint16_t v;
                std::memcpy(&v, p, 2);
                return rope_jit::fp16_to_float(v);
            }
            case Dt::BF16: {
                uint16_t v;
                std::memcpy(&v, p, 2);
                return rope_jit::bf16_to_float(v);
            }
            case Dt::I32: {
                int32_t v;
                std::memcpy(&v, p, 4);
                return v;
            }
            case Dt::I64: {
                int64_t v;
                std::memcpy(&v, p, 8);
                return double(v);
            }
            case Dt::F8: return e4m3_value(*p);
        }
        return 0;
    }
    void set_at(int64_t o, double v) {
        uint8_t* p = bytes_.data() + o * int64_t(dt_size(dt_));
        switch (dt_) {
            case Dt::F32: {
                float f = float(v);
                std::memcpy(p, &f, 4);
                break;
            }
            case Dt::F16: {
                uint16_t h = rope_jit::float_to_fp16(float(v));
                std::memcpy(p, &h, 2);
                break;
            }
            case Dt::BF16: {
                uint16_t h = rope_jit::float_to_bf16(float(v));
                std::memcpy(p, &h, 2);
                break;
            }
            case Dt::I32: {
                int32_t i = int32_t(v);
                std::memcpy(p, &i, 4);
                break;
            }
            case Dt::I64: {
                int64_t i = int64_t(v);
                std::memcpy(p, &i, 8);
                break;
            }
            case Dt::F8: *p = e4m3_nearest(v); break;
        }
    }

    // Calls f(index) for every logical index, in row-major logical order.
    template <typename F>
    void for_each(F&& f) const {
        std::vector<int64_t> index(shape_.size(), 0);
        if (numel() == 0) return;
        for (;;) {
            f(index);
            int d = int(shape_.size()) - 1;
            while (d >= 0 && ++index[size_t(d)] == shape_[size_t(d)]) index[size_t(d--)] = 0;
            if (d < 0) return;
        }
    }

    void fill_uniform(std::mt19937& rng, double lo, double hi) {
        std::uniform_real_distribution<double> dist(lo, hi);
        for_each([&](const std::vector<int64_t>& i) { set(i, dist(rng)); });
    }

    // Logical contents as doubles, row-major.
    std::vector<double> values() const {
        std::vector<double> out;
        for_each([&](const std::vector<int64_t>& i) { out.push_back(get(i)); });
        return out;
    }

private:
    void repoint() {
        tensor_.data = bytes_.data();
        tensor_.shape = shape_.data();
        tensor_.strides = strides_.data();
    }

    Dt dt_ = Dt::F32;
    std::vector<int64_t> shape_, strides_;
    std::vector<uint8_t> bytes_;
    DLTensor tensor_{};
};

// What the independent reference needs to know about a call, in plain values.
struct Case {
    int64_t B = 1, Hq = 1, Hk = 0, S = 1, Sk = 0, D = 8, R = 0, offset = 0;
    bool interleaved = false, backward = false;
    // Table rows per token: row_q[b*S + s], row_k[b*Sk + s] (already resolved by the test from
    // the position mode it exercises, written independently of the library's rules).
    std::vector<int64_t> row_q, row_k;
    // Angles: either tables cos/sin [P][R/2] (pair-indexed) or inv_freq [R/2].
    std::vector<std::vector<double>> cos, sin, xpos;
    std::vector<double> inv_freq;
};

// y for one head vector x at table row p, straight from the README's formulas.
inline std::vector<double> reference_rotate(const Case& c, const std::vector<double>& x, int64_t p,
                                            bool is_k) {
    std::vector<double> y = x;
    const int64_t R = c.R, half = R / 2;
    for (int64_t i = 0; i < half; ++i) {
        double co, si;
        if (!c.inv_freq.empty()) {
            co = std::cos(double(p) * c.inv_freq[size_t(i)]);
            si = std::sin(double(p) * c.inv_freq[size_t(i)]);
        } else {
            co = c.cos[size_t(p)][size_t(i)];
            si = c.sin[size_t(p)][size_t(i)];
        }
        if (c.backward) si = -si;
        const int64_t i1 = c.interleaved ? c.offset + 2 * i : c.offset + i;
        const int64_t i2 = c.interleaved ? c.offset + 2 * i + 1 : c.offset + i + half;
        double y1 = x[size_t(i1)] * co - x[size_t(i2)] * si;
        double y2 = x[size_t(i2)] * co + x[size_t(i1)] * si;
        if (!c.xpos.empty()) {
            const double scale = c.xpos[size_t(p)][size_t(i)];
            y1 = is_k ? y1 / scale : y1 * scale;
            y2 = is_k ? y2 / scale : y2 * scale;
        }
        y[size_t(i1)] = y1;
        y[size_t(i2)] = y2;
    }
    return y;
}

// Element-wise check |got - expected| <= atol + rtol * |expected|; returns the worst ratio
// of error to allowance (<= 1 passes).
inline double worst_ratio(const std::vector<double>& got, const std::vector<double>& expected,
                          double atol, double rtol) {
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double allowed = atol + rtol * std::fabs(expected[i]);
        const double err = std::fabs(got[i] - expected[i]);
        if (!(err <= allowed))
            worst = std::max(worst, std::isfinite(err) ? err / allowed : 1e30);
        else
            worst = std::max(worst, err / allowed);
    }
    return worst;
}

// A CPU-backend runtime for one test: `threads` workers (more than the cores exercises the
// pool's hand-off), with or without the disk cache. Throws when it cannot be created (doctest
// reports the exception).
class CpuRuntime {
public:
    explicit CpuRuntime(int threads = 3, bool disk_cache = true) {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.cpu_threads = threads;
        config.disk_cache = disk_cache ? 1 : 0;
        if (rope_jit_runtime_create(&config, &handle) != ROPE_JIT_OK)
            throw std::runtime_error(std::string("rope_jit_runtime_create: ") +
                                     rope_jit_last_error());
    }
    ~CpuRuntime() { rope_jit_runtime_free(handle); }
    CpuRuntime(const CpuRuntime&) = delete;
    CpuRuntime& operator=(const CpuRuntime&) = delete;
    rope_jit_runtime* handle = nullptr;
};

inline double tolerance_for(Dt dt) {
    return dt == Dt::F32 ? 1e-5 : dt == Dt::F16 ? 2e-3 : 1.6e-2;
}

}  // namespace rope_test
