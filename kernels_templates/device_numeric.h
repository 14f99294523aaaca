// Element types of the kernel templates and their conversions to and from float: float32 as
// itself, float16 and bfloat16 as the bits of an unsigned short (the templates include no
// toolkit header). Template parameter DT: 0 float32, 1 float16, 2 bfloat16. Shared by the
// templates that include it; nothing here reads a specialization constant.
#ifndef ROPE_JIT_DEVICE_NUMERIC_H
#define ROPE_JIT_DEVICE_NUMERIC_H

namespace {

template <int DT>
struct StorageOf {
    using type = unsigned short;
};
template <>
struct StorageOf<0> {
    using type = float;
};

// The float value of the bits of a 16-bit element (DT 1 fp16, 2 bf16).
template <int DT>
__device__ __forceinline__ float float_of_bits16(unsigned short bits) {
    if constexpr (DT == 1) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
        return f;
    } else {
        return __uint_as_float(static_cast<unsigned>(bits) << 16);
    }
}

// The float values of a 32-bit word of two 16-bit elements, the lower-addressed one first: for
// bf16 a shift and a mask, where converting each half on its own also extracts it (2-3
// instructions an element in sm_90 SASS).
template <int DT>
__device__ __forceinline__ void floats_of_bits32(unsigned word, float* first, float* second) {
    if constexpr (DT == 1) {
        *first = float_of_bits16<1>(static_cast<unsigned short>(word & 0xffffu));
        *second = float_of_bits16<1>(static_cast<unsigned short>(word >> 16));
    } else {
        *first = __uint_as_float(word << 16);
        *second = __uint_as_float(word & 0xffff0000u);
    }
}

template <int DT>
__device__ __forceinline__ float load_float(const void* base, long long index) {
    if constexpr (DT == 0)
        return static_cast<const float*>(base)[index];
    else
        return float_of_bits16<DT>(static_cast<const unsigned short*>(base)[index]);
}

// Round to nearest even, NaN kept a (quiet) NaN; written out so it needs no sm_80.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float v) {
    unsigned bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return static_cast<unsigned short>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<unsigned short>(bits >> 16);
}

template <int DT>
__device__ __forceinline__ void store_float(void* base, long long index, float v) {
    if constexpr (DT == 0) {
        static_cast<float*>(base)[index] = v;
    } else if constexpr (DT == 1) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        static_cast<unsigned short*>(base)[index] = h;
    } else {
        static_cast<unsigned short*>(base)[index] = float_to_bf16_bits(v);
    }
}

}  // namespace

#endif
