// Reads elements of an int32/int64 tensor in host memory by logical index, whatever its
// strides. Used for positions, offsets and cu_seqlens on the CPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/tensor_ref.h"

namespace rope_jit {

class IndexReader {
public:
    explicit IndexReader(const TensorRef& t) : t_(t) {}
    int64_t operator[](int64_t i) const { return at(i * t_.strides[0]); }
    int64_t operator()(int64_t i, int64_t j) const {
        return at(i * t_.strides[0] + j * t_.strides[1]);
    }

private:
    int64_t at(int64_t element) const {
        if (t_.dtype == DType::I32) {
            int32_t value;
            std::memcpy(&value, t_.data + element * 4, 4);
            return value;
        }
        int64_t value;
        std::memcpy(&value, t_.data + element * 8, 8);
        return value;
    }
    TensorRef t_;
};

}  // namespace rope_jit
