#include "common/tensor_ref.h"

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::F32: return "float32";
        case DType::F16: return "float16";
        case DType::BF16: return "bfloat16";
        case DType::I32: return "int32";
        case DType::I64: return "int64";
        case DType::U8: return "uint8/bool";
    }
    return "unknown";
}

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::F32: case DType::I32: return 4;
        case DType::F16: case DType::BF16: return 2;
        case DType::I64: return 8;
        case DType::U8: return 1;
    }
    return 0;
}

const char* device_name(DLDeviceType type) {
    switch (type) {
        case kDLCPU: return "CPU";
        case kDLCUDA: return "CUDA";
        case kDLCUDAHost: return "CUDA host (pinned)";
        case kDLCUDAManaged: return "CUDA managed";
        case kDLROCM: return "ROCm";
        default: return "an unsupported device";
    }
}

int64_t TensorRef::numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
}

void TensorRef::byte_extent(uintptr_t* first, uintptr_t* last) const {
    int64_t low = 0, high = 0;
    for (int i = 0; i < ndim; ++i) {
        int64_t reach = strides[i] * (shape[i] - 1);
        if (reach < 0) low += reach; else high += reach;
    }
    const int64_t size = int64_t(dtype_size(dtype));
    *first = reinterpret_cast<uintptr_t>(data) + uintptr_t(low * size);
    *last = reinterpret_cast<uintptr_t>(data) + uintptr_t(high * size + size - 1);
}

std::string TensorRef::shape_string() const {
    std::string text = "[";
    for (int i = 0; i < ndim; ++i) text += fmt::format("{}{}", i ? ", " : "", shape[i]);
    return text + "]";
}

namespace {

DType dtype_of(const DLDataType& type, const char* name) {
    if (type.lanes != 1)
        fail_argument(fmt::format("{}: vector dtypes (lanes = {}) are not supported", name, type.lanes));
    if (type.code == kDLFloat && type.bits == 32) return DType::F32;
    if (type.code == kDLFloat && type.bits == 16) return DType::F16;
    if (type.code == kDLBfloat && type.bits == 16) return DType::BF16;
    if (type.code == kDLInt && type.bits == 32) return DType::I32;
    if (type.code == kDLInt && type.bits == 64) return DType::I64;
    if ((type.code == kDLUInt || type.code == kDLInt) && type.bits == 8) return DType::U8;
    // DLPack >= 0.8 encodes bool as code 6 with 8 bits.
    if (type.code == 6 && type.bits == 8) return DType::U8;
    fail_argument(fmt::format("{}: unsupported dtype (code {}, {} bits)", name, type.code, type.bits));
}

// Whether the element count and the byte extent of the view fit in int64 (an empty view
// always does).
bool extent_fits(const TensorRef& ref) {
    for (int i = 0; i < ref.ndim; ++i)
        if (ref.shape[i] == 0) return true;
    int64_t count = 1, low = 0, high = 0, span = 0, bytes = 0;
    bool overflow = false;
    for (int i = 0; i < ref.ndim; ++i) {
        int64_t reach = 0;
        overflow |= __builtin_mul_overflow(count, ref.shape[i], &count);
        overflow |= __builtin_mul_overflow(ref.strides[i], ref.shape[i] - 1, &reach);
        overflow |= reach < 0 ? __builtin_add_overflow(low, reach, &low) : __builtin_add_overflow(high, reach, &high);
    }
    overflow |= __builtin_sub_overflow(high, low, &span);
    overflow |= __builtin_add_overflow(span, 1, &span);
    overflow |= __builtin_mul_overflow(span, int64_t(dtype_size(ref.dtype)), &bytes);
    return !overflow;
}

}  // namespace

TensorRef make_tensor_ref(const DLTensor* tensor, const char* name, int max_ndim) {
    TensorRef ref;
    ref.name = name;
    if (tensor == nullptr) return ref;
    if (tensor->ndim < 1 || tensor->ndim > max_ndim)
        fail_argument(fmt::format("{}: expected 1 to {} dimensions, got {}", name, max_ndim, tensor->ndim));
    if (tensor->shape == nullptr) fail_argument(fmt::format("{}: shape is NULL", name));
    ref.dtype = dtype_of(tensor->dtype, name);
    ref.device = tensor->device;
    ref.ndim = tensor->ndim;
    int64_t contiguous_stride = 1;
    bool overflow = false;
    for (int i = ref.ndim - 1; i >= 0; --i) {
        ref.shape[i] = tensor->shape[i];
        if (ref.shape[i] < 0)
            fail_argument(fmt::format("{}: dimension {} is negative ({})", name, i, ref.shape[i]));
        ref.strides[i] = tensor->strides ? tensor->strides[i] : contiguous_stride;
        overflow |= __builtin_mul_overflow(contiguous_stride, std::max<int64_t>(ref.shape[i], 1), &contiguous_stride);
    }
    // Every offset the ops compute stays inside the byte extent; when that extent does not
    // fit in int64, no memory can hold the view and the offsets would overflow.
    if (overflow || !extent_fits(ref))
        fail_argument(fmt::format("{}: shape {} with its strides spans more bytes than memory can hold", name,
                                  ref.shape_string()));
    if (ref.numel() > 0 && tensor->data == nullptr)
        fail_argument(fmt::format("{}: data is NULL for a tensor of shape {}", name, ref.shape_string()));
    // An empty tensor may have NULL data; offsetting NULL would be undefined.
    ref.data = tensor->data ? static_cast<char*>(tensor->data) + tensor->byte_offset : nullptr;
    // The ops read elements through typed pointers, which must be aligned to the element.
    if (ref.numel() > 0 && reinterpret_cast<uintptr_t>(ref.data) % dtype_size(ref.dtype) != 0)
        fail_argument(fmt::format("{}: data + byte_offset is not aligned to its {}-byte {} elements", name,
                                  dtype_size(ref.dtype), dtype_name(ref.dtype)));
    return ref;
}

bool same_view(const TensorRef& a, const TensorRef& b) {
    if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
    for (int i = 0; i < a.ndim; ++i)
        if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
    return true;
}

bool extents_overlap(const TensorRef& a, const TensorRef& b) {
    if (a.numel() == 0 || b.numel() == 0) return false;
    uintptr_t a_first, a_last, b_first, b_last;
    a.byte_extent(&a_first, &a_last);
    b.byte_extent(&b_first, &b_last);
    return a_first <= b_last && b_first <= a_last;
}

bool has_distinct_elements(const TensorRef& t) {
    struct Dim { int64_t stride, size; };
    Dim dims[4];
    int n = 0;
    for (int i = 0; i < t.ndim; ++i) {
        if (t.shape[i] == 0) return true;  // empty: nothing aliases
        if (t.shape[i] > 1) dims[n++] = {std::llabs(t.strides[i]), t.shape[i]};
    }
    for (int i = 1; i < n; ++i)  // insertion sort by stride: at most four dims
        for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
    int64_t span = 0;  // largest offset reachable with the smaller-stride dims
    for (int i = 0; i < n; ++i) {
        if (dims[i].stride <= span) return false;
        span += dims[i].stride * (dims[i].size - 1);
    }
    return true;
}

}  // namespace rope_jit
