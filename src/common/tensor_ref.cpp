#include "common/tensor_ref.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "common/raw_enum.h"
#include "rope_jit/rope_jit.h"

namespace rope_jit {

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::F32: return "float32";
        case DType::F16: return "float16";
        case DType::BF16: return "bfloat16";
        case DType::I32: return "int32";
        case DType::I64: return "int64";
        case DType::U8: return "uint8/bool";
        case DType::F8E4M3: return "float8_e4m3fn";
    }
    return "unknown";
}

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::F32:
        case DType::I32: return 4;
        case DType::F16:
        case DType::BF16: return 2;
        case DType::I64: return 8;
        case DType::U8:
        case DType::F8E4M3: return 1;
    }
    return 0;
}

namespace {

// DLPack's device types (dlpack.h 0.6). A caller may store any integer in the enum field;
// only these are compared as DLDeviceType.
struct DeviceTypeName {
    int type;
    const char* name;
};
constexpr DeviceTypeName kDeviceTypes[] = {
    {kDLCPU, "CPU"},
    {kDLCUDA, "CUDA"},
    {kDLCUDAHost, "CUDA host (pinned)"},
    {kDLOpenCL, "OpenCL"},
    {kDLVulkan, "Vulkan"},
    {kDLMetal, "Metal"},
    {kDLVPI, "VPI"},
    {kDLROCM, "ROCm"},
    {kDLROCMHost, "ROCm host"},
    {kDLExtDev, "ExtDev"},
    {kDLCUDAManaged, "CUDA managed"},
};

const char* find_device_name(int type) {
    for (const DeviceTypeName& known : kDeviceTypes)
        if (known.type == type) return known.name;
    return nullptr;
}

}  // namespace

const char* device_name(DLDeviceType type) {
    const char* name = find_device_name(raw_enum(type));
    return name ? name : "an unknown device";
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
        if (reach < 0)
            low += reach;
        else
            high += reach;
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
        fail_argument(
            fmt::format("{}: vector dtypes (lanes = {}) are not supported", name, type.lanes));
    if (type.code == kDLFloat && type.bits == 32) return DType::F32;
    if (type.code == kDLFloat && type.bits == 16) return DType::F16;
    if (type.code == kDLBfloat && type.bits == 16) return DType::BF16;
    if (type.code == kDLInt && type.bits == 32) return DType::I32;
    if (type.code == kDLInt && type.bits == 64) return DType::I64;
    if (type.code == kDLUInt && type.bits == 8) return DType::U8;
    // Read as a mask, int8 would be boolean where -1 may have meant "add -1": refused.
    if (type.code == kDLInt && type.bits == 8)
        fail_argument(fmt::format(
            "{}: int8 is not supported (masks are bool or uint8, indices int32 or int64)", name));
    // DLPack >= 0.8 encodes bool as code 6 with 8 bits.
    if (type.code == 6 && type.bits == 8) return DType::U8;
    if (type.code == ROPE_JIT_DLPACK_FLOAT8_E4M3FN && type.bits == 8) return DType::F8E4M3;
    fail_argument(
        fmt::format("{}: unsupported dtype (code {}, {} bits)", name, type.code, type.bits));
}

// The elements a non-empty view reaches, as offsets from its data in elements: [low, high],
// low <= 0 <= high (negative strides reach below data).
struct ElementSpan {
    int64_t low = 0, high = 0;
};

// The view's span, or nothing when its element count or byte extent does not fit in int64
// (an empty view always fits; its span, [0, 0], is never used).
std::optional<ElementSpan> element_span(const TensorRef& ref) {
    for (int i = 0; i < ref.ndim; ++i)
        if (ref.shape[i] == 0) return ElementSpan{};
    int64_t count = 1, span = 0, bytes = 0;
    ElementSpan reached;
    bool overflow = false;
    for (int i = 0; i < ref.ndim; ++i) {
        int64_t reach = 0;
        overflow |= __builtin_mul_overflow(count, ref.shape[i], &count);
        overflow |= __builtin_mul_overflow(ref.strides[i], ref.shape[i] - 1, &reach);
        overflow |= reach < 0 ? __builtin_add_overflow(reached.low, reach, &reached.low)
                              : __builtin_add_overflow(reached.high, reach, &reached.high);
    }
    overflow |= __builtin_sub_overflow(reached.high, reached.low, &span);
    overflow |= __builtin_add_overflow(span, 1, &span);
    overflow |= __builtin_mul_overflow(span, int64_t(dtype_size(ref.dtype)), &bytes);
    if (overflow) return std::nullopt;
    return reached;
}

// Whether data + byte_offset and every byte the span reaches from there are addresses: none
// wraps past 2^64 - 1 or below 0. (A byte_offset of 2^64 - 64 reached the 64 bytes before
// data: the sum wraps, and the view was read and written there; adversarial pass, session 49.)
// The span's bytes fit in int64 (element_span), so neither product below overflows.
bool addresses_fit(const void* data, uint64_t byte_offset, const ElementSpan& span,
                   size_t element_bytes) {
    uint64_t base = 0;
    if (__builtin_add_overflow(uint64_t(reinterpret_cast<uintptr_t>(data)), byte_offset, &base))
        return false;
    const uint64_t below = uint64_t(-span.low) * element_bytes;
    const uint64_t above = (uint64_t(span.high) + 1) * element_bytes - 1;
    return below <= base && above <= UINT64_MAX - base;
}

}  // namespace

TensorRef make_tensor_ref(const DLTensor* tensor, const char* name, int max_ndim) {
    TensorRef ref;
    ref.name = name;
    if (tensor == nullptr) return ref;
    max_ndim = std::min(max_ndim, kTensorRefMaxDims);
    if (tensor->ndim < 1 || tensor->ndim > max_ndim)
        fail_argument(fmt::format(
            "{}: expected {} dimensions, got {}", name,
            tensor->ndim < 1 ? std::string("at least 1") : fmt::format("at most {}", max_ndim),
            tensor->ndim));
    if (tensor->shape == nullptr) fail_argument(fmt::format("{}: shape is NULL", name));
    ref.dtype = dtype_of(tensor->dtype, name);
    const int device_type = raw_enum(tensor->device.device_type);
    if (find_device_name(device_type) == nullptr)
        fail_argument(fmt::format(
            "{}: device type {} is not a DLPack device type (CPU = {}, CUDA = {}, "
            "CUDA host = {}, CUDA managed = {} are the ones rope-jit reaches)",
            name, device_type, int(kDLCPU), int(kDLCUDA), int(kDLCUDAHost), int(kDLCUDAManaged)));
    ref.device = tensor->device;
    ref.ndim = tensor->ndim;
    int64_t contiguous_stride = 1;
    bool overflow = false;
    for (int i = ref.ndim - 1; i >= 0; --i) {
        ref.shape[i] = tensor->shape[i];
        if (ref.shape[i] < 0)
            fail_argument(fmt::format("{}: dimension {} is negative ({})", name, i, ref.shape[i]));
        ref.strides[i] = tensor->strides ? tensor->strides[i] : contiguous_stride;
        overflow |= __builtin_mul_overflow(contiguous_stride, std::max<int64_t>(ref.shape[i], 1),
                                           &contiguous_stride);
    }
    // Every offset the ops compute stays inside the byte extent; when that extent does not
    // fit in int64, no memory can hold the view and the offsets would overflow.
    const std::optional<ElementSpan> span = overflow ? std::nullopt : element_span(ref);
    if (!span)
        fail_argument(
            fmt::format("{}: shape {} with its strides spans more bytes than memory can hold", name,
                        ref.shape_string()));
    if (ref.numel() > 0 && tensor->data == nullptr)
        fail_argument(
            fmt::format("{}: data is NULL for a tensor of shape {}", name, ref.shape_string()));
    if (ref.numel() > 0 &&
        !addresses_fit(tensor->data, tensor->byte_offset, *span, dtype_size(ref.dtype)))
        fail_argument(fmt::format(
            "{}: data + byte_offset ({} + {}), or a byte of shape {} with its strides from "
            "there, wraps around the address space",
            name, tensor->data, tensor->byte_offset, ref.shape_string()));
    // An empty tensor may have NULL data (kept), or a byte_offset that wraps (no element is
    // there to read: the sum is computed unsigned, where wrapping is defined, and never used).
    ref.data = tensor->data ? reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(tensor->data) +
                                                      uintptr_t(tensor->byte_offset))
                            : nullptr;
    // The ops read elements through typed pointers, which must be aligned to the element.
    if (ref.numel() > 0 && reinterpret_cast<uintptr_t>(ref.data) % dtype_size(ref.dtype) != 0)
        fail_argument(
            fmt::format("{}: data + byte_offset is not aligned to its {}-byte {} elements", name,
                        dtype_size(ref.dtype), dtype_name(ref.dtype)));
    return ref;
}

TensorRef make_one_element_ref(const DLTensor* tensor, const char* name) {
    if (tensor == nullptr || (tensor->ndim >= 1 && tensor->ndim <= 4))
        return make_tensor_ref(tensor, name);
    if (tensor->ndim < 0)
        fail_argument(fmt::format("{}: ndim is negative ({})", name, tensor->ndim));
    if (tensor->ndim > 0 && tensor->shape == nullptr)
        fail_argument(fmt::format("{}: shape is NULL", name));
    for (int i = 0; i < tensor->ndim; ++i)
        if (tensor->shape[i] != 1)
            fail_argument(fmt::format("{}: expected one element, but dimension {} has size {}",
                                      name, i, tensor->shape[i]));
    DLTensor element = *tensor;
    int64_t shape = 1, stride = 1;
    element.ndim = 1;
    element.shape = &shape;
    element.strides = &stride;
    return make_tensor_ref(&element, name);
}

bool same_view(const TensorRef& a, const TensorRef& b) {
    if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
    for (int i = 0; i < a.ndim; ++i)
        if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i]))
            return false;
    return true;
}

bool extents_overlap(const TensorRef& a, const TensorRef& b) {
    if (a.numel() == 0 || b.numel() == 0) return false;
    uintptr_t a_first, a_last, b_first, b_last;
    a.byte_extent(&a_first, &a_last);
    b.byte_extent(&b_first, &b_last);
    return a_first <= b_last && b_first <= a_last;
}

namespace {

// Whether sum(step_i * x_i) = target has a solution with 0 <= x_i < count_i: a depth-first
// search over the steps in a given order, pruned by the reach of the later steps and their
// gcd. At each step it tries only the x_i that leave a remainder the later steps' gcd divides
// (one residue class), so a node never scans values the next one would reject at once (1-byte
// views with large odd strides scanned billions: hours for one call). The views a call passes
// have a few steps each, most much larger than the span below them, so from the largest step
// down a search visits a handful of nodes; one that exceeds its budget of candidates answers
// "unknown".
class LatticeSearch {
public:
    using Wide = __int128;  // a step times a count spans up to two int64 extents
    struct Term {
        Wide step, count;
    };
    enum class Answer { yes, no, unknown };

    // Equal steps are one variable: x + y, x in [0, c1) and y in [0, c2), takes every value of
    // [0, c1 + c2 - 1). Returns the steps from the largest down.
    static std::vector<Term> merged(std::vector<Term> terms) {
        std::sort(terms.begin(), terms.end(),
                  [](const Term& a, const Term& b) { return a.step > b.step; });
        std::vector<Term> out;
        for (const Term& t : terms) {
            if (!out.empty() && out.back().step == t.step)
                out.back().count += t.count - 1;
            else
                out.push_back(t);
        }
        return out;
    }

    // The same steps, each next one the step whose removal leaves the remaining steps the
    // largest gcd (ties: the larger step): the order that constrains each choice most, for
    // views whose largest steps share no divisor with the rest (strides 2^33 and 2^32 + 1
    // against 2^32: from the largest down, every multiple of 2^33 is a candidate; taken
    // first, 2^32 + 1 has one candidate modulo 2^32).
    static std::vector<Term> by_divisors(std::vector<Term> rest) {
        std::vector<Term> order;
        while (!rest.empty()) {
            size_t best = 0;
            Wide best_gcd = -1;
            for (size_t i = 0; i < rest.size(); ++i) {
                Wide g = 0;
                for (size_t j = 0; j < rest.size(); ++j)
                    if (j != i) g = gcd(rest[j].step, g);
                if (g > best_gcd || (g == best_gcd && rest[i].step > rest[best].step)) {
                    best = i;
                    best_gcd = g;
                }
            }
            order.push_back(rest[best]);
            rest.erase(rest.begin() + std::ptrdiff_t(best));
        }
        return order;
    }

    // `terms` searched in this order, trying at most `budget` candidates.
    LatticeSearch(std::vector<Term> terms, int64_t budget)
        : terms_(std::move(terms)), budget_(budget) {
        reach_.assign(terms_.size() + 1, 0);
        gcd_.assign(terms_.size() + 1, 0);
        for (size_t i = terms_.size(); i-- > 0;) {
            reach_[i] = reach_[i + 1] + terms_[i].step * (terms_[i].count - 1);
            gcd_[i] = gcd(terms_[i].step, gcd_[i + 1]);
        }
    }

    Answer solvable(Wide target) {
        const bool found = solve(0, target);
        return budget_ < 0 ? Answer::unknown : found ? Answer::yes : Answer::no;
    }

private:
    static Wide gcd(Wide a, Wide b) {
        while (b != 0) {
            const Wide r = a % b;
            a = b;
            b = r;
        }
        return a;
    }

    // a * b mod m for 0 <= a, b < m, by doubling: m is below 2^68 (steps are int64 strides
    // times an element size of at most 8, sums of them), so a product would overflow 128 bits
    // but a sum of two residues does not.
    static Wide mul_mod(Wide a, Wide b, Wide m) {
        Wide result = 0;
        while (b > 0) {
            if (b & 1) result = (result + a) % m;
            a = (a + a) % m;
            b >>= 1;
        }
        return result;
    }

    // The inverse of a modulo m, for gcd(a, m) = 1 and m >= 1 (extended Euclid).
    static Wide inverse_mod(Wide a, Wide m) {
        Wide old_r = a % m, r = m, old_s = 1, s = 0;
        while (r != 0) {
            const Wide q = old_r / r;
            Wide next = old_r - q * r;
            old_r = r;
            r = next;
            next = old_s - q * s;
            old_s = s;
            s = next;
        }
        const Wide inverse = old_s % m;
        return inverse < 0 ? inverse + m : inverse;
    }

    bool solve(size_t i, Wide target) {
        if (target < 0 || target > reach_[i]) return false;
        if (i == terms_.size()) return target == 0;
        if (target % gcd_[i] != 0) return false;
        const Term& t = terms_[i];
        // x_i such that the rest can still reach target - x_i * step.
        const Wide rest = reach_[i + 1];
        const Wide lowest = target > rest ? (target - rest + t.step - 1) / t.step : 0;
        const Wide highest = std::min(t.count - 1, target / t.step);
        if (highest < lowest) return false;
        // The x_i whose remainder target - x_i * step the smaller steps' gcd g divides:
        // x_i * (step / d) = target / d (mod g / d), d = gcd(step, g), which divides target
        // (checked above). The last step (g = 0) must take all of target.
        const Wide g = gcd_[i + 1];
        Wide x = highest, stride = 1;
        if (g == 0) {
            x = target / t.step;
            if (x > highest || x < lowest) return false;
        } else {
            const Wide d = gcd_[i];
            const Wide modulus = g / d;
            if (modulus > 1) {
                const Wide residue = mul_mod((target / d) % modulus,
                                             inverse_mod((t.step / d) % modulus, modulus),
                                             modulus);
                // The largest x <= highest in the class.
                x = highest - ((highest - residue) % modulus + modulus) % modulus;
                stride = modulus;
            }
        }
        for (; x >= lowest; x -= stride) {
            if (--budget_ < 0) return true;
            if (solve(i + 1, target - x * t.step)) return true;
            if (budget_ < 0) return true;
        }
        return false;
    }

    std::vector<Term> terms_;
    std::vector<Wide> reach_, gcd_;  // suffix sums of step * (count - 1), suffix gcds
    int64_t budget_;                 // candidates left to try, over the whole search
};

}  // namespace

bool shares_memory(const TensorRef& a, const TensorRef& b) {
    if (!extents_overlap(a, b)) return false;  // also: either one empty
    // A byte of both: a.data + sum(a_i x_i) + e == b.data + sum(b_j y_j) + f, with e and f the
    // byte within an element. Every term moves to the left with a positive step (a variable
    // x in [0, n) with step -s becomes n - 1 - x with step s, shifting the target).
    using Wide = LatticeSearch::Wide;
    std::vector<LatticeSearch::Term> terms;
    Wide target =
        Wide(reinterpret_cast<uintptr_t>(b.data)) - Wide(reinterpret_cast<uintptr_t>(a.data));
    auto add = [&](Wide step, Wide count) {
        if (step == 0 || count <= 1) return;
        if (step < 0) {
            target -= step * (count - 1);
            step = -step;
        }
        terms.push_back({step, count});
    };
    for (const TensorRef* t : {&a, &b}) {
        const Wide sign = t == &a ? 1 : -1;
        const Wide size = Wide(dtype_size(t->dtype));
        for (int i = 0; i < t->ndim; ++i) add(sign * size * t->strides[i], t->shape[i]);
        add(sign, size);  // the byte within the element
    }
    // From the largest step down first (a handful of nodes for the views calls pass), then,
    // if that ran out of candidates, in the order of divisors; an answer either gives is
    // exact, and a pair neither settles may share.
    using Answer = LatticeSearch::Answer;
    const std::vector<LatticeSearch::Term> largest_first = LatticeSearch::merged(std::move(terms));
    constexpr int64_t kBudget = int64_t(1) << 15;  // candidates, each order
    Answer answer = LatticeSearch(largest_first, kBudget).solvable(target);
    if (answer == Answer::unknown)
        answer = LatticeSearch(LatticeSearch::by_divisors(largest_first), kBudget).solvable(target);
    return answer != Answer::no;
}

void require_distinct_elements(const TensorRef& t, const char* name) {
    if (!has_distinct_elements(t))
        fail_argument(fmt::format(
            "{}: its strides may make several indices address the same element (a written "
            "tensor's strides, in increasing order, must each exceed the span of the dimensions "
            "below), so it cannot be written",
            name));
}

void check_written(const TensorRef& written, std::initializer_list<const TensorRef*> others,
                   MemoryRule rule) {
    require_distinct_elements(written, written.name);
    for (const TensorRef* other : others) {
        if (!other->present() || other == &written) continue;
        // An empty tensor has no element to share, whatever its data pointer (empty torch
        // tensors all have data NULL).
        if (written.numel() == 0 || other->numel() == 0) continue;
        if (rule == MemoryRule::ByteRanges) {
            if (extents_overlap(written, *other))
                fail_argument(fmt::format(
                    "{}: overlaps {} (their memory ranges meet); outputs need memory of "
                    "their own (interleaved outputs in one buffer, as a packed dqkv, are "
                    "not supported)",
                    written.name, other->name));
        } else if (same_view(written, *other)) {
            fail_argument(fmt::format(
                "{}: is the same memory as {}; a tensor the call writes needs memory no "
                "other tensor of the call uses",
                written.name, other->name));
        } else if (shares_memory(written, *other)) {
            fail_argument(fmt::format(
                "{}: shares memory with {}; a tensor the call writes needs elements no "
                "other tensor of the call uses (views of one buffer may interleave, but "
                "not touch the same elements)",
                written.name, other->name));
        }
    }
}

bool has_distinct_elements(const TensorRef& t) {
    struct Dim {
        int64_t stride, size;
    };
    Dim dims[kTensorRefMaxDims];
    int n = 0;
    for (int i = 0; i < t.ndim; ++i) {
        if (t.shape[i] == 0) return true;  // empty: nothing aliases
        if (t.shape[i] > 1) dims[n++] = {std::llabs(t.strides[i]), t.shape[i]};
    }
    for (int i = 1; i < n; ++i)  // insertion sort by stride: a few dims
        for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j)
            std::swap(dims[j], dims[j - 1]);
    int64_t span = 0;  // largest offset reachable with the smaller-stride dims
    for (int i = 0; i < n; ++i) {
        if (dims[i].stride <= span) return false;
        span += dims[i].stride * (dims[i].size - 1);
    }
    return true;
}

}  // namespace rope_jit
