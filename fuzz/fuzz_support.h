// Shared pieces of the structured libFuzzer targets (attention, M-RoPE sections, frequency
// gradients; fuzz_rope_arguments takes the reader and the runtime): a reader of the input
// bytes, tensors that each own memory of exactly the bytes their view spans (so ASan reports
// any access past a view the library was given), and a CPU runtime. The targets build calls
// that are valid by default and let the input break one thing at a time (a dimension, a
// dtype, a device, an alias), which reaches far deeper into the checks and the CPU reference
// than independent random tensors do.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <dlpack/dlpack.h>

#include "rope_jit/rope_jit.h"

namespace fuzz {

class Input {
public:
    Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
    uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
    // In [0, n) (n >= 1).
    int64_t below(int64_t n) { return int64_t(byte()) % n; }
    // True once in n.
    bool chance(int n) { return byte() % n == 0; }
    template <size_t N, typename T>
    T pick(const T (&table)[N]) {
        return table[byte() % N];
    }
    int64_t i64() {
        uint64_t v = 0;
        for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
        return int64_t(v);
    }
    // A dimension: `value` most of the time, once in `odds` another small size (a mismatch
    // the library must reject, or accept consistently).
    int64_t dim(int64_t value, int odds = 24) { return chance(odds) ? below(10) : value; }
    bool empty() const { return at_ >= size_; }
    // The remaining input, cycled, as filler for tensor contents.
    uint8_t filler(size_t i) const { return size_ ? data_[(at_ + i) % size_] : 0; }

private:
    const uint8_t* data_;
    size_t size_;
    size_t at_ = 0;
};

constexpr DLDataType kF32{kDLFloat, 32, 1}, kF16{kDLFloat, 16, 1}, kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1}, kI64{kDLInt, 64, 1}, kU8{kDLUInt, 8, 1};

inline size_t element_bytes(const DLDataType& t) {
    return size_t(std::max(1, t.bits / 8));
}

// A tensor with memory of its own: the logical shape laid out in an order the input picks
// (dims permuted, the innermost padded, one dim walked backwards), in a heap block of exactly
// the bytes the view spans.
class Tensor {
public:
    Tensor() = default;
    Tensor(Input& in, DLDataType dtype, std::vector<int64_t> shape) : shape_(std::move(shape)) {
        const int n = int(shape_.size());
        strides_.assign(size_t(n), 0);
        std::vector<int> order(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        if (n > 1 && in.chance(4))
            std::swap(order[size_t(in.below(n))], order[size_t(in.below(n))]);
        const int64_t pad = in.chance(4) ? in.below(3) : 0;
        int64_t stride = 1;
        for (int j = n - 1; j >= 0; --j) {
            const int d = order[size_t(j)];
            strides_[size_t(d)] = stride;
            stride *= std::max<int64_t>(shape_[size_t(d)], 1) + (j == n - 1 ? pad : 0);
        }
        int64_t low = 0, high = 0, count = 1;
        if (n > 0 && in.chance(6)) strides_[size_t(in.below(n))] *= -1;
        for (int d = 0; d < n; ++d) {
            count *= shape_[size_t(d)];
            const int64_t reach =
                strides_[size_t(d)] * (std::max<int64_t>(shape_[size_t(d)], 1) - 1);
            (reach < 0 ? low : high) += reach;
        }
        const size_t size = element_bytes(dtype);
        bytes_.assign(count == 0 ? 0 : size_t(high - low + 1) * size, 0);
        for (size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = in.byte();
        first_ = -low;
        // An empty view may have NULL data, or any pointer (never read).
        static unsigned char nothing[8];
        if (count == 0)
            tensor_.data = in.chance(2) ? nullptr : nothing;
        else
            tensor_.data = bytes_.data() + first_ * int64_t(size);
        tensor_.device = {kDLCPU, 0};
        tensor_.ndim = n;
        tensor_.dtype = dtype;
        tensor_.shape = shape_.data();
        tensor_.strides = strides_.data();
        present_ = true;
    }
    Tensor(const Tensor&) = delete;
    Tensor& operator=(const Tensor&) = delete;
    Tensor(Tensor&&) = default;
    Tensor& operator=(Tensor&&) = default;

    const DLTensor* dl() const { return present_ ? &tensor_ : nullptr; }
    DLTensor* dl() { return present_ ? &tensor_ : nullptr; }
    bool present() const { return present_; }
    int64_t numel() const {
        int64_t n = 1;
        for (int64_t d : shape_) n *= d;
        return n;
    }

    // Writes `value` at flat logical index i (row-major) of an integer tensor (positions,
    // offsets, cu_seqlens: int32 entries take the low 32 bits, bytes the low 8).
    void set(int64_t i, int64_t value) {
        int64_t offset = 0;
        for (int d = int(shape_.size()) - 1; d >= 0; --d) {
            offset += (i % shape_[size_t(d)]) * strides_[size_t(d)];
            i /= shape_[size_t(d)];
        }
        unsigned char* p =
            bytes_.data() + (first_ + offset) * int64_t(element_bytes(tensor_.dtype));
        if (tensor_.dtype.bits == 64) {
            std::memcpy(p, &value, 8);
        } else if (tensor_.dtype.bits == 32) {
            const int32_t low = int32_t(uint32_t(uint64_t(value)));
            std::memcpy(p, &low, 4);
        } else if (tensor_.dtype.bits == 8) {
            *p = (unsigned char)(uint64_t(value) & 0xff);
        }
    }

    // Breaks one property the input picks, always staying inside the tensor's memory: the
    // dtype (to one no wider), the device, one dimension (smaller), the rank (a leading dim
    // dropped), the data pointer (NULL) or the order of two dims.
    void perturb(Input& in) {
        if (!present_) return;
        switch (in.below(6)) {
            case 0: {
                const DLDataType narrower[] = {
                    kU8, {kDLFloat, 8, 1}, {kDLInt, 16, 1}, {kDLFloat, 32, 2}};
                const DLDataType t = in.pick(narrower);
                if (element_bytes(t) * size_t(t.lanes) <= element_bytes(tensor_.dtype))
                    tensor_.dtype = t;
                break;
            }
            case 1: {
                // Any integer, as a C caller may store: 16 and -1 lie outside DLPack's enum.
                const int types[] = {kDLCUDA, kDLCUDAHost, kDLROCM, 16, -1, 0, 6};
                const int type = in.pick(types);
                std::memcpy(&tensor_.device.device_type, &type, sizeof type);
                tensor_.device.device_id = int32_t(in.below(3));
                break;
            }
            case 2:
                if (!shape_.empty()) {
                    int64_t& d = shape_[size_t(in.below(int64_t(shape_.size())))];
                    d = d > 0 ? in.below(d) : 0;
                }
                break;
            case 3:
                // Not past an empty leading dim: the rest would be a non-empty view over bytes
                // this tensor never had (its data may be `nothing`).
                if (tensor_.ndim > 1 && tensor_.shape[0] != 0) {
                    tensor_.ndim -= 1;
                    tensor_.shape += 1;
                    tensor_.strides += 1;
                }
                break;
            case 4: tensor_.data = nullptr; break;
            default:
                // Two dims swapped with their strides: the same elements, another order.
                if (tensor_.ndim > 1) {
                    const int64_t a = in.below(tensor_.ndim), b = in.below(tensor_.ndim);
                    std::swap(shape_[size_t(a)], shape_[size_t(b)]);
                    std::swap(strides_[size_t(a)], strides_[size_t(b)]);
                }
                break;
        }
    }

    // A view with `shape` over this tensor's memory, C-contiguous from an element the input
    // picks, when it fits (else the tensor itself): partial overlaps for the alias checks.
    DLTensor alias(Input& in, std::vector<int64_t>& shape) const {
        DLTensor view = tensor_;
        int64_t count = 1;
        for (int64_t d : shape) count *= d;
        const int64_t elements = int64_t(bytes_.size() / element_bytes(tensor_.dtype));
        if (!present_ || count > elements || shape.empty()) return view;
        const int64_t start = in.below(elements - count + 1);
        view.data = const_cast<unsigned char*>(bytes_.data()) +
                    start * int64_t(element_bytes(tensor_.dtype));
        view.byte_offset = 0;
        view.ndim = int(shape.size());
        view.shape = shape.data();
        view.strides = nullptr;
        return view;
    }

private:
    std::vector<int64_t> shape_, strides_;
    std::vector<unsigned char> bytes_;
    int64_t first_ = 0;  // element index of logical element 0 in bytes_
    DLTensor tensor_{};
    bool present_ = false;
};

// Stores any int in a C enum field, as a C caller may (C++ forbids such enum values).
template <typename Enum>
void set_raw_enum(Enum& field, int value) {
    static_assert(sizeof(Enum) == sizeof(int), "C enums of this API are int-sized");
    std::memcpy(&field, &value, sizeof value);
}

inline rope_jit_runtime* cpu_runtime() {
    static rope_jit_runtime* runtime = [] {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.disk_cache = 0;
        config.cpu_threads = 1;
        rope_jit_runtime* created = nullptr;
        if (rope_jit_runtime_create(&config, &created) != ROPE_JIT_OK) __builtin_trap();
        return created;
    }();
    return runtime;
}

// A failure must come with a message naming what was wrong; only argument errors (and
// UNSUPPORTED for what the backend does not do) may come back from a CPU call.
inline void check_status(rope_jit_status status) {
    if (status == ROPE_JIT_OK) return;
    if (rope_jit_last_error()[0] == '\0') __builtin_trap();
    if (status != ROPE_JIT_ERROR_INVALID_ARGUMENT && status != ROPE_JIT_ERROR_UNSUPPORTED)
        __builtin_trap();
}

}  // namespace fuzz
