#include "api/prewarm_specs.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/error.h"
#include "jit/nvrtc_loader.h"
#include "ops/attention/cuda_attention.h"

namespace rope_jit {

namespace {

using nlohmann::json;

// Dynamic shared memory a block may opt in to (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_
// OPTIN), by compute capability, from the CUDA programming guide's table of technical
// specifications. An architecture not listed takes the nearest older entry.
struct SharedMemoryRow {
    int compute_capability;
    int bytes;
};
constexpr SharedMemoryRow kOptInSharedMemory[] = {
    {70, 98304},   {72, 98304},   {75, 65536},   {80, 166912},  {86, 101376},
    {87, 166912},  {89, 101376},  {90, 232448},  {100, 232448}, {101, 232448},
    {103, 232448}, {110, 232448}, {120, 101376}, {121, 101376},
};

// A fake, 256-byte-aligned address for the views of a call that has no tensors: the kernel
// choice reads only shapes, strides and alignment, never data.
char* fake_data() {
    return reinterpret_cast<char*>(uintptr_t(1) << 20);
}

// A contiguous view of `shape` (ndim entries).
TensorRef contiguous(const char* name, DType dtype, int ndim, const int64_t* shape) {
    TensorRef t;
    t.name = name;
    t.dtype = dtype;
    t.data = fake_data();
    t.device = DLDevice{kDLCUDA, 0};
    t.ndim = ndim;
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
        t.shape[d] = shape[d];
        t.strides[d] = stride;
        stride *= shape[d];
    }
    return t;
}

DType float_type(int32_t code) {
    return code == 1 ? DType::F16 : code == 2 ? DType::BF16 : DType::F32;
}

// The problem of an attention call with contiguous, aligned tensors: one sequence of
// seqlen_k queries and keys, gqa_group q heads over one k head.
AttentionProblem attention_problem(const AttentionCall& call) {
    const AttentionSpec& f = call.fields;
    AttentionProblem p;
    p.backward = call.backward;
    p.batch = 1;
    p.heads_q = f.gqa_group;
    p.heads_k = 1;
    p.seqlen_q = p.seqlen_k = call.seqlen_k;
    p.head_dim = f.head_dim;
    p.dtype = float_type(f.dtype);
    const int64_t q_shape[4] = {1, p.heads_q, p.seqlen_q, p.head_dim};
    const int64_t k_shape[4] = {1, p.heads_k, p.seqlen_k, p.head_dim};
    p.q = contiguous("q", p.dtype, 4, q_shape);
    p.k = contiguous("k", p.dtype, 4, k_shape);
    p.v = contiguous("v", p.dtype, 4, k_shape);
    p.out = contiguous("out", p.dtype, 4, q_shape);
    const int64_t lse_shape[3] = {1, p.heads_q, p.seqlen_q};
    p.has_lse = f.write_lse || call.backward;
    if (p.has_lse) p.lse = contiguous("lse", DType::F32, 3, lse_shape);
    p.rotate = f.rotary_dim > 0;
    if (p.rotate) {
        p.rotary_dim = f.rotary_dim;
        p.style = f.interleaved ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
        p.table_full = f.table_full;
        const int64_t table_shape[2] = {p.seqlen_k, f.table_full ? f.rotary_dim : f.rotary_dim / 2};
        p.cos = contiguous("cos", float_type(f.table_dtype), 2, table_shape);
        p.sin = contiguous("sin", float_type(f.table_dtype), 2, table_shape);
        p.has_pos_mask = f.pos_mask;
        const int64_t mask_shape[2] = {1, p.seqlen_k};
        if (p.has_pos_mask) p.pos_mask = contiguous("pos_mask", DType::U8, 2, mask_shape);
    }
    if (f.mask_kind != 0) {
        p.mask_kind = f.mask_kind == 1 ? AttentionMaskKind::Bool : AttentionMaskKind::Additive;
        const int64_t mask_shape[3] = {1, p.seqlen_q, p.seqlen_k};
        p.attn_mask = contiguous(
            "attn_mask", f.mask_kind == 1 ? DType::U8 : float_type(f.mask_dtype), 3, mask_shape);
    }
    p.causal = f.causal;
    p.scale = 1.0;
    if (call.backward) {
        p.dout = contiguous("dout", p.dtype, 4, q_shape);
        p.dq = contiguous("dq", p.dtype, 4, q_shape);
        p.dk = contiguous("dk", p.dtype, 4, k_shape);
        p.dv = contiguous("dv", p.dtype, 4, k_shape);
    }
    p.device = DLDevice{kDLCUDA, 0};
    return p;
}

}  // namespace

std::vector<size_t> prewarm_start_order(const std::vector<PrewarmKernel>& kernels) {
    // Measured (NVRTC 13, sm_90, bench/results/cold_start_notes.md): the wgmma backward 430 ms,
    // a forward 280 ms, prepare / dq finish 70-110 ms, RoPE 85-95 ms on the 2-core machine.
    const auto rank = [](const PrewarmKernel& kernel) {
        if (!kernel.attention) return 2;
        switch (AttentionKernelKind(kernel.attention_spec.kind)) {
            case AttentionKernelKind::Backward:
            case AttentionKernelKind::BackwardDkDv:
            case AttentionKernelKind::BackwardDq: return 0;
            case AttentionKernelKind::Forward: return 1;
            default: return 2;
        }
    };
    std::vector<size_t> order(kernels.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rank(kernels[a]) < rank(kernels[b]); });
    return order;
}

int target_compute_capability(const std::string& target) {
    const auto bad = [&] {
        fail_argument(fmt::format(
            "target: '{}' is not an architecture like sm_90, sm_90a or compute_90", target));
    };
    size_t start = target.rfind("sm_", 0) == 0 ? 3 : target.rfind("compute_", 0) == 0 ? 8 : 0;
    if (start == 0) bad();
    size_t end = start;
    while (end < target.size() && std::isdigit(static_cast<unsigned char>(target[end]))) ++end;
    const size_t digits = end - start;
    const std::string suffix = target.substr(end);
    if (digits < 2 || digits > 4 || target[start] == '0' ||
        !(suffix.empty() || suffix == "a" || suffix == "f"))
        bad();
    return std::stoi(target.substr(start, digits));
}

AttentionDevice attention_device_for_target(const std::string& target) {
    AttentionDevice device;
    device.compute_capability = target_compute_capability(target);
    device.max_shared_bytes = 48 * 1024;  // every architecture's default
    for (const SharedMemoryRow& row : kOptInSharedMemory)
        if (row.compute_capability <= device.compute_capability)
            device.max_shared_bytes = row.bytes;
    // The wgmma forward is built for sm_90a: a PTX target (compute_90) cannot hold it.
    device.wgmma = device.compute_capability == 90 && target.rfind("sm_", 0) == 0 &&
                   nvrtc_runs_wgmma_forward(nvrtc_version_string());
    // TMA descriptors are encoded at launch by the driver of the GPU that runs them (sm_90).
    device.tma = device.wgmma;
    return device;
}

std::vector<PrewarmKernel> expand_prewarm_json(const std::string& json_text,
                                               const std::string& target) {
    target_compute_capability(target);  // a malformed target fails before any entry
    std::string why;
    const json document = parse_bounded_json(json_text, &why);
    if (document.is_discarded()) fail_argument("json: " + why);
    if (!document.is_object() && !document.is_array())
        fail_argument("json: expected a spec object or an array of them");
    const bool many = document.is_array();
    std::vector<PrewarmKernel> kernels;
    std::unordered_set<std::string> seen;
    auto add = [&](PrewarmKernel kernel) {
        if (seen.insert(kernel.spec_json).second) kernels.push_back(std::move(kernel));
    };
    std::optional<AttentionDevice> device;  // read once, for the first attention call
    for (size_t i = 0; i < (many ? document.size() : 1); ++i) {
        const json& entry = many ? document[i] : document;
        const std::string where = many ? fmt::format("json[{}]", i) : std::string("json");
        if (!entry.is_object())
            fail_argument(fmt::format("{}: expected a spec object, got {}", where, entry.dump()));
        if (entry.contains("op") && !entry["op"].is_string())
            fail_argument(fmt::format("{}: op: expected \"rope\" or \"attention\"", where));
        const std::string op = entry.value("op", std::string("rope"));
        const std::string text = entry.dump();
        std::string error;
        if (op == "rope") {
            const std::optional<KernelSpec> spec = KernelSpec::from_json(text, &error);
            if (!spec) fail_argument(fmt::format("{}: {}", where, error));
            PrewarmKernel kernel;
            kernel.rope = *spec;
            kernel.spec_json = spec->to_json();
            kernel.description = spec->describe();
            add(std::move(kernel));
        } else if (op == "attention" && entry.contains("kind")) {
            const std::optional<AttentionSpec> spec = AttentionSpec::from_json(text, &error);
            if (!spec) fail_argument(fmt::format("{}: {}", where, error));
            PrewarmKernel kernel;
            kernel.attention = true;
            kernel.attention_spec = *spec;
            kernel.spec_json = spec->to_json();
            kernel.description = spec->describe();
            add(std::move(kernel));
        } else if (op == "attention") {
            const std::optional<AttentionCall> call = attention_call_from_json(text, &error);
            if (!call) fail_argument(fmt::format("{}: {}", where, error));
            if (!device) device = attention_device_for_target(target);
            for (const AttentionSpec& spec :
                 choose_attention_specs(attention_problem(*call), *device)) {
                PrewarmKernel kernel;
                kernel.attention = true;
                kernel.attention_spec = spec;
                kernel.spec_json = spec.to_json();
                kernel.description = spec.describe();
                add(std::move(kernel));
            }
        } else {
            fail_argument(
                fmt::format("{}: op: expected \"rope\" or \"attention\", got \"{}\"", where, op));
        }
    }
    return kernels;
}

}  // namespace rope_jit
