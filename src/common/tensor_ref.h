// A checked, internal view of a caller's DLTensor: its element type as one enum, the data
// pointer with byte_offset applied, and explicit strides (DLPack's NULL strides expanded).
// Built by make_tensor_ref, which rejects what no op can use (lanes != 1, > 4 dims unless the
// caller allows more, ...).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include <dlpack/dlpack.h>

#include "rope_jit/rope_jit.h"

namespace rope_jit {

// F8E4M3: float8 e4m3fn (DLPack 1.1 code 10, ROPE_JIT_DLPACK_FLOAT8_E4M3FN), an output dtype only.
enum class DType { F32, F16, BF16, I32, I64, U8, F8E4M3 };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);
inline bool is_float(DType dtype) {
    return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}
inline bool is_index(DType dtype) {
    return dtype == DType::I32 || dtype == DType::I64;
}

// The most dims a TensorRef holds: the memory queries' limit; the ops take at most 4
// (make_tensor_ref's max_ndim).
constexpr int kTensorRefMaxDims = ROPE_JIT_MEMORY_QUERY_MAX_DIMS;

struct TensorRef {
    const char* name = "";  // the argument's name, for messages
    DType dtype = DType::F32;
    char* data = nullptr;  // byte_offset applied
    DLDevice device{kDLCPU, 0};
    int ndim = 0;
    int64_t shape[kTensorRefMaxDims] = {};
    int64_t strides[kTensorRefMaxDims] = {};  // in elements

    bool present() const { return data != nullptr || ndim > 0; }
    int64_t numel() const;
    // Byte range [first, last] touched by the view; meaningless for empty tensors.
    void byte_extent(uintptr_t* first, uintptr_t* last) const;
    std::string shape_string() const;  // "[2, 4, 33, 64]"
};

// Copies t's first n strides (elements) into a kernel's parameter array.
inline void copy_strides(long long* out, const TensorRef& t, int n) {
    for (int i = 0; i < n; ++i) out[i] = t.strides[i];
}

// Validates and converts `tensor` (may be NULL: returns an absent ref). Throws
// INVALID_ARGUMENT naming `name` when the tensor is malformed or has more than max_ndim dims,
// when its device type is none of DLPack's (read as an integer: comparing another value in
// the enum field would be undefined behaviour), when its element count or byte extent
// overflows int64, when a non-empty tensor's data + byte_offset, or a byte its strides reach
// from there, is past either end of the address space, or when its data (with byte_offset)
// is not aligned to its element size. A max_ndim above kTensorRefMaxDims is taken as
// kTensorRefMaxDims.
TensorRef make_tensor_ref(const DLTensor* tensor, const char* name, int max_ndim = 4);
// make_tensor_ref for a tensor that should hold one element (a scale): a 0-dim tensor (as
// torch.tensor(1.0) exports) or one of any rank whose sizes are all 1 comes back as a 1-D
// view of that element; any other tensor as make_tensor_ref (max_ndim 4) takes it.
TensorRef make_one_element_ref(const DLTensor* tensor, const char* name);

// Whether a and b are exactly the same view (same data, dtype, shape and strides).
bool same_view(const TensorRef& a, const TensorRef& b);
// Whether the byte ranges of a and b intersect (a conservative test of sharing memory).
bool extents_overlap(const TensorRef& a, const TensorRef& b);
// Whether some byte of an element of a is a byte of an element of b. Exact for views that
// interleave in one buffer (q and k as slices of a fused qkv do not share memory), found by a
// bounded search over the two index lattices; a search past its bound answers true, the
// safe answer for a tensor about to be written.
bool shares_memory(const TensorRef& a, const TensorRef& b);
// Whether no two distinct indices of the view address the same element, by the sufficient
// test "sorted by stride, each stride exceeds the span of the smaller ones". Outputs must pass.
bool has_distinct_elements(const TensorRef& t);
// Throws INVALID_ARGUMENT naming `name` (the tensor to be written) when has_distinct_elements
// cannot show t's elements distinct.
void require_distinct_elements(const TensorRef& t, const char* name);

// When a written tensor meets another tensor of the call (check_written).
enum class MemoryRule {
    ByteRanges,  // their byte ranges intersect: views interleaved in one buffer meet
    Elements,    // they share a byte (shares_memory): interleaved views may coexist
};

// A tensor the call writes: its elements must be distinct, and it must meet none of `others`
// (absent ones, and `written` itself, are skipped), since outputs are written while inputs
// are still read. Throws INVALID_ARGUMENT naming `written` and the tensor it meets.
void check_written(const TensorRef& written, std::initializer_list<const TensorRef*> others,
                   MemoryRule rule);

// The name of a device type make_tensor_ref admits ("CPU", "CUDA", ...).
const char* device_name(DLDeviceType type);

}  // namespace rope_jit
