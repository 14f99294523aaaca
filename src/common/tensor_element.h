// One element of a tensor, read as a number whatever its dtype: what the CPU references use for
// tables, masks and other small operands (their hot rows have typed readers of their own).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/half_float.h"
#include "common/tensor_ref.h"

namespace rope_jit {

// Element `element` (an offset in elements) of a float32, float16, bfloat16 or uint8 tensor;
// 0 for any other dtype (the argument checks admit none where this is called).
inline double read_element(const TensorRef& t, int64_t element) {
    const char* address = t.data + element * int64_t(dtype_size(t.dtype));
    switch (t.dtype) {
        case DType::F32: {
            float v;
            std::memcpy(&v, address, 4);
            return v;
        }
        case DType::F16: {
            uint16_t v;
            std::memcpy(&v, address, 2);
            return fp16_to_float(v);
        }
        case DType::BF16: {
            uint16_t v;
            std::memcpy(&v, address, 2);
            return bf16_to_float(v);
        }
        case DType::U8: return double(*reinterpret_cast<const uint8_t*>(address));
        default: return 0.0;
    }
}

}  // namespace rope_jit
