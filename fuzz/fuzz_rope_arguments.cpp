// libFuzzer target: rope_jit_rope's argument checks on the CPU backend. The input decides
// which tensors are present and each one's dtype, device, rank, shape, strides, byte offset,
// place in one shared arena (so views overlap) and contents (so positions and cu_seqlens hold
// anything), plus every scalar argument. Whatever it decides, the call must return a status,
// never crash, and never touch memory outside the views it was given: every view lies inside
// the arena, which ASan guards, unless its extent cannot even be represented, which the
// library must reject without reading.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <dlpack/dlpack.h>

#include "fuzz_support.h"
#include "rope_jit/rope_jit.h"

namespace {

// Bigger than any view the harness accepts, so every valid view fits somewhere.
constexpr size_t kArenaBytes = size_t(1) << 20;
// Views with more elements than this are skipped: the CPU backend would take too long.
constexpr int64_t kMaxElements = int64_t(1) << 15;

using fuzz::Input;

const DLDataType kDtypes[] = {{kDLFloat, 32, 1},  {kDLFloat, 16, 1}, {kDLBfloat, 16, 1},
                              {kDLInt, 32, 1},    {kDLInt, 64, 1},   {kDLFloat, 32, 1},
                              {kDLBfloat, 16, 1}, {kDLUInt, 8, 1},   {kDLFloat, 64, 1},
                              {kDLFloat, 32, 2},  {kDLInt, 16, 1},   {200, 32, 1},
                              {6, 8, 1},          {kDLFloat, 0, 1},  {kDLFloat, 32, 0}};
const DLDeviceType kDevices[] = {kDLCPU, kDLCPU,      kDLCPU,  kDLCPU,
                                 kDLCPU, kDLCUDAHost, kDLCUDA, kDLROCM};
const int64_t kDims[] = {1,
                         2,
                         3,
                         4,
                         8,
                         16,
                         5,
                         2,
                         1,
                         0,
                         32,
                         64,
                         7,
                         -1,
                         int64_t(1) << 31,
                         std::numeric_limits<int64_t>::max()};
const int64_t kStrides[] = {
    1, 0, -1, 2, 64, -64, 3, 4096, int64_t(1) << 40, std::numeric_limits<int64_t>::min()};

size_t element_bytes(const DLDataType& dtype) {
    return dtype.bits >= 8 ? size_t(dtype.bits / 8) * dtype.lanes : 1;
}

struct Built {
    DLTensor tensor{};
    int64_t shape[6]{};
    int64_t strides[6]{};
    bool present = false;
};

// Element offsets [low, high] a view reaches. False when they, the element count or the byte
// extent overflow int64 (no memory can back such a view); *oversized when it has more than
// kMaxElements elements.
bool reach(const Built& b, int64_t* low, int64_t* high, bool* oversized) {
    *low = *high = 0;
    *oversized = false;
    int64_t lo = 0, hi = 0, count = 1;
    bool overflow = false;
    for (int i = 0; i < b.tensor.ndim; ++i)
        if (b.shape[i] <= 0)
            return true;  // no elements (or a negative dim the library must reject)
    for (int i = 0; i < b.tensor.ndim; ++i) {
        const int64_t dim = b.shape[i];
        overflow |= __builtin_mul_overflow(count, dim, &count);
        int64_t step = 0;
        overflow |= __builtin_mul_overflow(b.tensor.strides ? b.strides[i] : 0, dim - 1, &step);
        overflow |= __builtin_add_overflow(step < 0 ? lo : hi, step, step < 0 ? &lo : &hi);
    }
    if (overflow) return false;
    if (!b.tensor.strides) hi = count - 1;  // C-contiguous
    int64_t elements = 0, bytes = 0;
    overflow |= __builtin_sub_overflow(hi, lo, &elements);
    overflow |= __builtin_add_overflow(elements, 1, &elements);
    overflow |= __builtin_mul_overflow(elements, int64_t(element_bytes(b.tensor.dtype)), &bytes);
    if (overflow) return false;
    *oversized = count > kMaxElements;
    *low = lo;
    *high = hi;
    return true;
}

// Builds one tensor from the input inside the arena. Returns false when the input describes
// a view the harness cannot back with memory (the whole input is then skipped).
bool build(Input& in, Built& b, char* arena) {
    b.present = in.byte() % 3 != 0;
    if (!b.present) return true;
    DLTensor& t = b.tensor;
    t.dtype = in.pick(kDtypes);
    t.device = {in.pick(kDevices), in.byte() % 4 == 0 ? 1 : 0};
    if (in.byte() % 32 == 0) {
        // A device type outside DLPack's enum, stored bytewise as a C caller may.
        const int raw_types[] = {16, -1, 0, 1000};
        const int raw = in.pick(raw_types);
        std::memcpy(&t.device.device_type, &raw, sizeof raw);
    }
    t.ndim = in.byte() % 7 - (in.byte() % 9 == 0 ? 1 : 0);  // -1 .. 6
    const int dims = t.ndim > 0 ? (t.ndim < 6 ? t.ndim : 6) : 0;
    for (int i = 0; i < dims; ++i) b.shape[i] = in.pick(kDims);
    const bool strided = in.byte() % 2 == 0;
    for (int i = 0; i < dims; ++i) b.strides[i] = in.pick(kStrides);
    t.shape = in.byte() % 16 == 0 ? nullptr : b.shape;
    t.strides = strided ? b.strides : nullptr;

    int64_t low = 0, high = 0;
    bool oversized = false;
    const bool representable = t.shape == nullptr || reach(b, &low, &high, &oversized);
    if (oversized) return false;
    const size_t size = element_bytes(t.dtype);
    const int64_t span = (high - low + 1) * int64_t(size);
    if (!representable) {
        // No memory could back this view: the library must reject it before reading.
        t.data = arena + kArenaBytes / 2;
        return true;
    }
    if (span > int64_t(kArenaBytes) / 2) return false;  // valid, but too big for the arena
    // Place the view's lowest element at a chosen spot, sometimes misaligned by byte_offset.
    const size_t slot = (size_t(in.byte()) * 4096 + size_t(in.byte()) * 16) % (kArenaBytes / 2);
    t.byte_offset = in.byte() % 8 == 0 ? in.byte() % 8 : 0;
    t.data = in.byte() % 32 == 0 ? nullptr : arena + slot - low * int64_t(size);
    // Contents: raw input bytes, or small non-negative integers that make valid positions.
    const bool small = in.byte() % 2 == 0;
    char* first = arena + slot + t.byte_offset;
    for (size_t i = 0; i < size_t(span); ++i)
        first[i] = char(small ? ((i % size) == 0 ? in.filler(i) % 16 : 0) : in.filler(i));
    return true;
}

// With ROPE_JIT_FUZZ_VERBOSE set, prints each call's arguments (to reproduce a finding).
void describe(const char* name, const DLTensor* t) {
    if (t == nullptr) return;
    int device_type;  // read bytewise: the field may hold a value outside the enum
    std::memcpy(&device_type, &t->device.device_type, sizeof device_type);
    std::fprintf(stderr, "  %s: dtype %d/%d/%d device %d ndim %d byte_offset %llu data %p shape",
                 name, t->dtype.code, t->dtype.bits, t->dtype.lanes, device_type, t->ndim,
                 static_cast<unsigned long long>(t->byte_offset), t->data);
    for (int i = 0; t->shape && i < t->ndim && i < 6; ++i)
        std::fprintf(stderr, " %lld", static_cast<long long>(t->shape[i]));
    std::fprintf(stderr, " strides");
    for (int i = 0; t->strides && i < t->ndim && i < 6; ++i)
        std::fprintf(stderr, " %lld", static_cast<long long>(t->strides[i]));
    std::fprintf(stderr, "\n");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static std::vector<char> arena(kArenaBytes + 64);
    char* base = arena.data() + (64 - reinterpret_cast<uintptr_t>(arena.data()) % 64) % 64;
    Input in(data, size);

    enum {
        Q,
        K,
        Q_OUT,
        K_OUT,
        COS,
        SIN,
        INV_FREQ,
        POSITIONS,
        SEQLEN_OFFSETS,
        CU_SEQLENS,
        XPOS,
        COUNT
    };
    Built tensors[COUNT];
    for (Built& b : tensors)
        if (!build(in, b, base)) return 0;

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    auto view = [&](int slot) -> const DLTensor* {
        return tensors[slot].present ? &tensors[slot].tensor : nullptr;
    };
    args.q = view(Q);
    args.k = view(K);
    // Outputs: absent (in place), their own view, or the very input view.
    const uint8_t aliasing = in.byte();
    args.q_out = aliasing % 3 == 0 ? args.q : view(Q_OUT);
    args.k_out = aliasing / 3 % 3 == 0 ? args.k : view(K_OUT);
    args.cos = view(COS);
    args.sin = in.byte() % 4 == 0 ? args.cos : view(SIN);
    args.inv_freq = view(INV_FREQ);
    args.positions = view(POSITIONS);
    args.seqlen_offsets = view(SEQLEN_OFFSETS);
    args.cu_seqlens = view(CU_SEQLENS);
    args.xpos_scale = view(XPOS);
    args.position_offset = in.byte() % 4 == 0 ? in.i64() : in.byte() % 8;
    args.q_position_offset = in.byte() % 4 == 0 ? in.i64() : in.byte() % 8;
    args.rotary_dim = int32_t(in.byte() % 4 == 0 ? in.i64() : in.byte() % 70);
    args.rotary_offset = int32_t(in.byte() % 8 == 0 ? in.i64() : in.byte() % 8);
    // Any int, as a C caller may pass (0-2: the three pair styles); stored bytewise since C++
    // forbids such enum values.
    const int style = in.byte() % 8 == 0 ? int(in.byte()) : in.byte() % 3;
    std::memcpy(&args.style, &style, sizeof style);
    args.backward = in.byte() % 2;
    if (in.byte() % 64 == 0) args.struct_size = size_t(in.byte());
    // QK-norm, decoded after everything else so that older inputs keep their meaning (an
    // exhausted input leaves every norm tensor absent).
    enum {
        Q_NORM_WEIGHT,
        K_NORM_WEIGHT,
        Q_NORM_INPUT,
        K_NORM_INPUT,
        Q_NORM_GRAD,
        K_NORM_GRAD,
        NORM_COUNT
    };
    Built norm[NORM_COUNT];
    for (Built& b : norm)
        if (!build(in, b, base)) return 0;
    auto norm_view = [&](int slot) -> const DLTensor* {
        return norm[slot].present ? &norm[slot].tensor : nullptr;
    };
    const uint8_t norm_aliasing = in.byte();
    args.q_norm_weight = norm_view(Q_NORM_WEIGHT);
    args.k_norm_weight = norm_aliasing % 4 == 0 ? args.q_norm_weight : norm_view(K_NORM_WEIGHT);
    args.q_norm_input = norm_aliasing / 4 % 4 == 0 ? args.q : norm_view(Q_NORM_INPUT);
    args.k_norm_input = norm_aliasing / 16 % 4 == 0 ? args.k : norm_view(K_NORM_INPUT);
    args.q_norm_weight_grad = norm_view(Q_NORM_GRAD);
    args.k_norm_weight_grad = norm_view(K_NORM_GRAD);
    if (in.byte() % 4 == 0) {
        const int64_t bits = in.i64();  // any double, NaN and infinities included
        std::memcpy(&args.norm_eps, &bits, sizeof bits);
    }
    args.norm_unit_offset = in.byte() % 2;
    // KV cache write and FP8 outputs, decoded last likewise. Caches and q_out may become
    // float8 e4m3fn: one byte an element, so the view stays inside the bytes built for it.
    enum { V, K_CACHE, V_CACHE, SLOT_MAPPING, BLOCK_TABLES, K_SCALE, V_SCALE, Q_SCALE, KV_COUNT };
    Built kv[KV_COUNT];
    for (Built& b : kv)
        if (!build(in, b, base)) return 0;
    const DLDataType fp8{ROPE_JIT_DLPACK_FLOAT8_E4M3FN, 8, 1};
    for (Built* b : {&kv[K_CACHE], &kv[V_CACHE], &tensors[Q_OUT]})
        if (in.byte() % 3 == 0) b->tensor.dtype = fp8;
    auto kv_view = [&](int slot) -> const DLTensor* {
        return kv[slot].present ? &kv[slot].tensor : nullptr;
    };
    const int kv_layout = in.byte() % 8 == 0 ? int(in.byte()) - 64 : in.byte() % 4;
    std::memcpy(&args.kv_layout, &kv_layout, sizeof kv_layout);
    args.v = kv_view(V);
    args.k_cache = kv_view(K_CACHE);
    args.v_cache = in.byte() % 8 == 0 ? args.k_cache : kv_view(V_CACHE);
    args.slot_mapping = kv_view(SLOT_MAPPING);
    args.block_tables = kv_view(BLOCK_TABLES);
    args.k_scale = kv_view(K_SCALE);
    args.v_scale = kv_view(V_SCALE);
    args.q_scale = kv_view(Q_SCALE);

    static const bool verbose = std::getenv("ROPE_JIT_FUZZ_VERBOSE") != nullptr;
    if (verbose) {
        std::fprintf(
            stderr,
            "rope_jit_rope: position_offset %lld q_position_offset %lld rotary_dim %d offset %d "
            "style %d backward %d struct_size %zu\n",
            static_cast<long long>(args.position_offset),
            static_cast<long long>(args.q_position_offset), args.rotary_dim, args.rotary_offset,
            style, args.backward, args.struct_size);
        const char* names[] = {"q",         "k",        "q_out",     "k_out",          "cos",
                               "sin",       "inv_freq", "positions", "seqlen_offsets", "cu_seqlens",
                               "xpos_scale"};
        const DLTensor* views[] = {args.q,          args.k,         args.q_out,
                                   args.k_out,      args.cos,       args.sin,
                                   args.inv_freq,   args.positions, args.seqlen_offsets,
                                   args.cu_seqlens, args.xpos_scale};
        for (int i = 0; i < COUNT; ++i) describe(names[i], views[i]);
    }
    rope_jit_status status = rope_jit_rope(fuzz::cpu_runtime(), &args);
    if (verbose)
        std::fprintf(stderr, "-> %s: %s\n", rope_jit_status_name(status), rope_jit_last_error());
    // A failure must come with a message naming what was wrong.
    if (status != ROPE_JIT_OK && rope_jit_last_error()[0] == '\0') __builtin_trap();
    return 0;
}
