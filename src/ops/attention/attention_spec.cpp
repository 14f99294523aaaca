#include "ops/attention/attention_spec.h"

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "attention_params.h"
#include "common/byte_hash.h"
#include "common/error.h"
#include "common/spec_fields.h"

namespace rope_jit {

namespace {

// ---- the field table, compiled: one row per ROPE_JIT_ATTENTION_SPEC_FIELDS line -----------

const char* const kFloatTypeNames[] = {"float32", "float16", "bfloat16"};
const char* const kKindNames[] = {"forward", "backward-dq", "backward-dkdv"};
const char* const kMaskNames[] = {"none", "bool", "additive"};
const char* const kStyleNames[] = {"half", "interleaved"};

const SpecValues Integer{SpecValues::integer, nullptr, 0, false};
const SpecValues Boolean{SpecValues::boolean, nullptr, 0, true};
const SpecValues FloatTypes{SpecValues::named, kFloatTypeNames, 3, false};
const SpecValues KernelKinds{SpecValues::named, kKindNames, 3, false};
const SpecValues MaskKinds{SpecValues::named, kMaskNames, 3, false};
const SpecValues Styles{SpecValues::named, kStyleNames, 2, true};

constexpr SpecPresence PLAIN = SpecPresence::plain, REQUIRED = SpecPresence::required;

const SpecField<AttentionSpec> kFields[] = {
#define ROPE_JIT_ATTENTION_SPEC_ROW(member, init, key, values, min, max, constant, presence) \
    {&AttentionSpec::member, #member, key, &values, min, max, constant, presence},
    ROPE_JIT_ATTENTION_SPEC_FIELDS(ROPE_JIT_ATTENTION_SPEC_ROW)
#undef ROPE_JIT_ATTENTION_SPEC_ROW
};

int32_t dtype_code(DType dtype) {
    switch (dtype) {
        case DType::F16: return 1;
        case DType::BF16: return 2;
        default: return 0;
    }
}

int padded_head_dim(int head_dim) { return (head_dim + 15) / 16 * 16; }

int table_columns(const AttentionSpec& s) {
    if (s.rotary_dim == 0) return 0;
    return s.table_full && s.interleaved ? s.rotary_dim : s.rotary_dim / 2;
}

int table_element_bytes(const AttentionSpec& s) { return s.table_dtype == 0 ? 4 : 2; }

// Whether the tensor-core kernels can read a [B, H, S, D] view 16 bytes at a time: unit
// feature stride, every other stride a multiple of 8 elements, 16-byte-aligned data.
bool vector_friendly(const TensorRef& t) {
    if (t.shape[3] > 1 && t.strides[3] != 1) return false;
    for (int d = 0; d < 3; ++d)
        if (t.shape[d] > 1 && t.strides[d] % 8 != 0) return false;
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

// Whether TMA can copy boxes of a [B, H, S, D] view that vector_friendly() accepts: data there
// and tokens in it, and every stride of a dimension longer than one positive and below the
// 2^40 bytes a tensor map takes (a negative or zero stride, as of an expanded or flipped
// view, is not).
bool tma_friendly(const TensorRef& t) {
    if (t.data == nullptr || t.shape[2] == 0) return false;
    for (int d = 0; d < 3; ++d)
        if (t.shape[d] > 1 && (t.strides[d] <= 0 || t.strides[d] >= (int64_t(1) << 39))) return false;
    return true;
}

// Whether a table's rows can be staged with 16-byte cp.async copies of `columns` columns.
bool table_stageable(const TensorRef& t, int columns) {
    const int64_t bytes = int64_t(dtype_size(t.dtype));
    if (t.shape[1] > 1 && t.strides[1] != 1) return false;
    if (t.shape[0] > 1 && (t.strides[0] * bytes) % 16 != 0) return false;
    if ((columns * bytes) % 16 != 0) return false;
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

struct TileShape {
    int32_t warps, block_n, m_tiles = 1;
    bool wgmma = false;
    int32_t stages = 2;          // wgmma only
    int32_t producer_warps = 0;  // wgmma only: 0 or 4
    int32_t cluster = 1;         // with producer warps: 1, 2 or 4
};

// The rules of the wgmma forward: a forward with head_dim padded to 64 or 128 (56-64,
// 120-128), 64- or 128-key tiles, one to three warpgroups of 16-row warps (four or more
// spill), no pos_mask, 2 or 3 tiles in shared memory, no producer warps or one warpgroup of
// them (with tables read in 8- or 16-byte pieces, three warpgroups in all at most); clusters
// of 2 or 4 blocks only with producer warps, within a GQA group, over shares of whole 8-row
// units. The first one broken, or none. No text here: the kernel choice asks on every launch.
enum class WgmmaRule { none, forward, head_dim, key_tile, warps, pos_mask, stages, producer, cluster };

WgmmaRule wgmma_broken_rule(const AttentionSpec& s) {
    const int dp = padded_head_dim(s.head_dim);
    if (s.kind != 0) return WgmmaRule::forward;
    if (dp != 64 && dp != 128) return WgmmaRule::head_dim;
    if (s.block_n != 64 && s.block_n != 128) return WgmmaRule::key_tile;
    if ((s.warps != 4 && s.warps != 8 && s.warps != 12) || s.m_tiles != 1) return WgmmaRule::warps;
    if (s.pos_mask) return WgmmaRule::pos_mask;
    if (s.stages != 2 && s.stages != 3) return WgmmaRule::stages;
    // Producers read table columns in 8- or 16-byte pieces, so the tables must allow it (as
    // for staging them); the block takes at most three warpgroups (a fourth leaves everyone
    // too few registers: measured, it spills and runs at half speed). A head_dim that pads
    // (56, 120) works: the producers write zeros into the key chunks past head_dim.
    if ((s.producer_warps != 0 && s.producer_warps != 4) ||
        (s.producer_warps > 0 && ((s.rotary_dim > 0 && !s.table_async) || s.warps + s.producer_warps > 12)))
        return WgmmaRule::producer;
    if (s.cluster != 1 && (s.producer_warps == 0 || (s.cluster != 2 && s.cluster != 4) ||
                           s.gqa_group % s.cluster != 0 || (s.block_n / s.cluster) % 8 != 0))
        return WgmmaRule::cluster;
    return WgmmaRule::none;
}

// The ROPE_JIT_ATTENTION_KERNELS override (see attention_spec.h).
struct Override {
    bool force_simt = false;
    std::optional<TileShape> shape[3];
};

// One "kind=shape" item: WxN[xM] (mma.sync), wWxN[xS], pWxN[xS] or cCxWxN[xS] (wgmma); nullopt
// for anything else.
std::optional<TileShape> parse_shape(std::string text, int kind) {
    char family = 0;
    if (!text.empty() && (text[0] == 'w' || text[0] == 'p' || text[0] == 'c')) {
        family = text[0];
        text = text.substr(1);
    }
    std::vector<int> numbers;
    size_t start = 0;
    while (start <= text.size()) {
        size_t end = text.find('x', start);
        if (end == std::string::npos) end = text.size();
        const std::string number = text.substr(start, end - start);
        if (number.empty() || number.size() > 4 || number.find_first_not_of("0123456789") != std::string::npos)
            return std::nullopt;
        numbers.push_back(std::atoi(number.c_str()));
        start = end + 1;
    }
    const size_t first = family == 'c' ? 1 : 0;  // the cluster size comes first
    if (numbers.size() < first + 2 || numbers.size() > first + 3) return std::nullopt;
    for (int n : numbers)
        if (n <= 0) return std::nullopt;
    TileShape shape{numbers[first], numbers[first + 1]};
    const int third = numbers.size() == first + 3 ? numbers[first + 2] : 0;
    if (family == 0) {
        shape.m_tiles = third > 0 ? third : 1;
        return shape;
    }
    if (kind != 0) return std::nullopt;  // wgmma kernels are forwards
    shape.wgmma = true;
    shape.stages = third > 0 ? third : 2;
    shape.producer_warps = family == 'w' ? 0 : 4;
    shape.cluster = family == 'c' ? numbers[0] : 1;
    return shape;
}

Override read_override() {
    Override o;
    const char* text = std::getenv("ROPE_JIT_ATTENTION_KERNELS");
    if (text == nullptr || *text == '\0') return o;
    const std::string value = text;
    if (value == "simt") {
        o.force_simt = true;
        return o;
    }
    size_t start = 0;
    while (start < value.size()) {
        size_t end = value.find(',', start);
        if (end == std::string::npos) end = value.size();
        const std::string item = value.substr(start, end - start);
        const size_t eq = item.find('=');
        if (eq != std::string::npos) {
            const std::string name = item.substr(0, eq);
            const int kind = name == "fwd" ? 0 : name == "dq" ? 1 : name == "dkdv" ? 2 : -1;
            if (kind >= 0)
                if (std::optional<TileShape> shape = parse_shape(item.substr(eq + 1), kind)) o.shape[kind] = shape;
        }
        start = end + 1;
    }
    return o;
}

}  // namespace

int AttentionSpec::shared_bytes() const {
    if (!tensor_cores) return 0;
    const int table_row_bytes = rotary_dim > 0 && table_async ? table_columns(*this) * table_element_bytes(*this) : 0;
    return attention_smem_layout(kind, padded_head_dim(head_dim), warps, m_tiles, block_n, pos_mask != 0,
                                 table_row_bytes, wgmma != 0, stages, producer_warps > 0)
        .bytes;
}

void AttentionSpec::validate() const {
    auto require = [](bool ok, const std::string& message) {
        if (!ok) fail_argument("attention kernel spec: " + message);
    };
    const std::string out_of_range = spec_range_problem(*this, kFields);
    require(out_of_range.empty(), out_of_range);
    require(kind >= 0 && kind <= 2, fmt::format("kind {} is not 0, 1 or 2", kind));
    for (int32_t code : {dtype, table_dtype, mask_dtype})
        require(code >= 0 && code <= 2, fmt::format("dtype code {} is not 0, 1 or 2", code));
    require(head_dim > 0 && head_dim <= kAttentionMaxHeadDim,
            fmt::format("head_dim must be in [1, {}], got {}", kAttentionMaxHeadDim, head_dim));
    require(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
            fmt::format("rotary_dim must be even and <= head_dim, got {}", rotary_dim));
    require(!pos_mask || rotary_dim > 0, "pos_mask needs rotation");
    require(mask_kind >= 0 && mask_kind <= 2, fmt::format("mask_kind {} unknown", mask_kind));
    require(gqa_group >= 1, fmt::format("gqa_group must be >= 1, got {}", gqa_group));
    require(warps >= 1 && warps <= 16, fmt::format("warps must be in [1, 16], got {}", warps));
    require(m_tiles == 1 || (m_tiles == 2 && kind == 0 && tensor_cores),
            fmt::format("m_tiles must be 1 (or 2 for a tensor-core forward), got {}", m_tiles));
    require(compute_dk || compute_dv, "a dk/dv kernel must compute dk or dv");
    if (tensor_cores) {
        require(dtype != 0, "tensor-core kernels take float16 or bfloat16");
        require(head_dim % 8 == 0 && head_dim <= 256,
                fmt::format("tensor-core kernels need head_dim % 8 == 0 and <= 256, got {}", head_dim));
        require(block_n >= 16 && block_n % 16 == 0, fmt::format("block_n must be a multiple of 16, got {}", block_n));
        require(rotary_dim == 0 || rotary_dim % (interleaved ? 8 : 16) == 0,
                fmt::format("tensor-core rotation needs rotary_dim % {} == 0, got {}", interleaved ? 8 : 16, rotary_dim));
        require(!table_async || rotary_dim == 0 || (table_columns(*this) * table_element_bytes(*this)) % 16 == 0,
                "staged table rows must be whole 16-byte chunks");
    }
    if (wgmma) {
        require(tensor_cores, "wgmma kernels are tensor-core kernels");
        switch (wgmma_broken_rule(*this)) {
            case WgmmaRule::none: break;
            case WgmmaRule::forward: fail_argument("attention kernel spec: wgmma kernels are forwards");
            case WgmmaRule::head_dim:
                fail_argument(fmt::format("attention kernel spec: wgmma kernels take head_dim padded to 64 or 128, "
                                          "got {} (padded {})",
                                          head_dim, padded_head_dim(head_dim)));
            case WgmmaRule::key_tile:
                fail_argument(fmt::format("attention kernel spec: wgmma kernels take 64- or 128-key tiles, got {}",
                                          block_n));
            case WgmmaRule::warps:
                fail_argument(fmt::format(
                    "attention kernel spec: wgmma kernels take 4, 8 or 12 warps of 16 rows, got {} warps x {}", warps,
                    m_tiles));
            case WgmmaRule::pos_mask: fail_argument("attention kernel spec: wgmma kernels do not take pos_mask");
            case WgmmaRule::stages:
                fail_argument(fmt::format("attention kernel spec: wgmma kernels hold 2 or 3 tiles, got {}", stages));
            case WgmmaRule::producer:
                fail_argument(fmt::format("attention kernel spec: wgmma kernels take 0 or 4 producer warps (with "
                                          "tables read in 8- or 16-byte pieces and at most 8 other "
                                          "warps), got {} beside {}",
                                          producer_warps, warps));
            case WgmmaRule::cluster:
                fail_argument(fmt::format("attention kernel spec: clusters of {} blocks need producer warps, 2 or 4 "
                                          "blocks dividing the GQA group ({}) and 8-row shares of the {}-key tile",
                                          cluster, gqa_group, block_n));
        }
    } else {
        require(stages == 2, fmt::format("stages is a wgmma setting (2 otherwise), got {}", stages));
        require(producer_warps == 0,
                fmt::format("producer warps are a wgmma setting (0 otherwise), got {}", producer_warps));
        require(cluster == 1, fmt::format("clusters are a wgmma setting (1 otherwise), got {}", cluster));
    }
}

std::string AttentionSpec::preamble() const {
    std::string text = "// Specialization of attention.cu: " + describe() + "\n";
    text += spec_constants(*this, kFields);
    if (cluster > 1)
        text += fmt::format("#define ROPE_JIT_CLUSTER_DIMS __cluster_dims__({}, 1, 1)\n", cluster);
    return text;
}

std::string AttentionSpec::to_json() const {
    nlohmann::json j;  // keys are sorted on output, so the text is canonical
    j["op"] = "attention";
    spec_write_fields(*this, kFields, j);
    return j.dump();
}

std::optional<AttentionSpec> AttentionSpec::from_json(const std::string& text, std::string* error) {
    auto fail = [&](const std::string& why) -> std::optional<AttentionSpec> {
        if (error != nullptr) *error = why;
        return std::nullopt;
    };
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
    if (!j.contains("op") || j["op"] != nlohmann::json("attention"))
        return fail("not an attention spec");
    AttentionSpec s;
    try {
        spec_read_fields(s, kFields, j, {"op"});
        s.validate();
    } catch (const std::exception& e) {
        return fail(e.what());
    }
    return s;
}

std::optional<AttentionCall> attention_call_from_json(const std::string& text, std::string* error) {
    auto fail = [&](const std::string& why) -> std::optional<AttentionCall> {
        if (error != nullptr) *error = why;
        return std::nullopt;
    };
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
    if (!j.contains("op") || j["op"] != nlohmann::json("attention"))
        return fail("not an attention spec");
    static const char* const kTileKeys[] = {
        "kind",        "tensor_cores", "wgmma",   "stages",  "producer_warps", "cluster",
        "table_async", "warps",        "m_tiles", "block_n", "compute_dk",     "compute_dv"};
    AttentionCall call;
    try {
        for (const char* key : kTileKeys)
            if (j.contains(key))
                throw std::runtime_error(fmt::format(
                    "{}: the kernel choice sets it; give \"kind\" too for one exact kernel", key));
        if (j.contains("direction")) {
            static const char* const kDirections[] = {"forward", "backward"};
            static const SpecValues directions{SpecValues::named, kDirections, 2, false};
            call.backward = spec_parse_value("direction", directions, 0, 1, j["direction"]) == 1;
        }
        if (j.contains("seqlen_k")) {
            call.seqlen_k = spec_parse_value("seqlen_k", Integer, 1, INT32_MAX, j["seqlen_k"]);
        }
        j["kind"] = kKindNames[0];  // read as a forward kernel's fields
        spec_read_fields(call.fields, kFields, j, {"op", "direction", "seqlen_k"});
        if (!j.contains("rotary_dim")) call.fields.rotary_dim = call.fields.head_dim;
        call.fields.validate();
    } catch (const std::exception& e) {
        return fail(e.what());
    }
    return call;
}

std::string AttentionSpec::describe() const {
    const char* kinds[] = {"fwd", "bwd-dq", "bwd-dkdv"};
    const char* dtypes[] = {"f32", "f16", "bf16"};
    std::string text = fmt::format("attention {} {} D{}", kinds[kind], dtypes[dtype], head_dim);
    if (rotary_dim > 0)
        text += fmt::format(" R{} {} table/{}{}", rotary_dim, interleaved ? "interleaved" : "half",
                            table_full ? "full" : "half", pos_mask ? " pos_mask" : "");
    else
        text += " unrotated";
    if (mask_kind != 0) text += fmt::format(" {}-mask", kMaskNames[mask_kind]);
    if (causal) text += " causal";
    text += fmt::format(" gqa{}", gqa_group);
    if (write_lse) text += " lse";
    if (kind == 2 && !(compute_dk && compute_dv)) text += compute_dk ? " dk-only" : " dv-only";
    if (tensor_cores)
        text += fmt::format(" {} {}x{}{}{}{}", wgmma ? "wgmma" : "tc", warps, block_n,
                            m_tiles > 1 ? fmt::format("x{}", m_tiles) : wgmma && stages != 2 ? fmt::format("x{}", stages) : "",
                            producer_warps > 0 ? fmt::format(" +{} producer warps{}", producer_warps,
                                                             cluster > 1 ? fmt::format(" cluster{}", cluster) : "")
                                               : "",
                            table_async ? " staged-tables" : "");
    else text += fmt::format(" simt {}w", warps);
    return text;
}

size_t AttentionSpecHash::operator()(const AttentionSpec& spec) const noexcept {
    static_assert(std::has_unique_object_representations_v<AttentionSpec>, "hashed as plain bytes: no padding");
    return hash_bytes(&spec, sizeof spec);
}

std::vector<AttentionSpec> choose_attention_specs(const AttentionProblem& p, const AttentionDevice& device) {
    if (p.head_dim > kAttentionMaxHeadDim)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("q: head_dim {} exceeds the {} the CUDA attention kernels support", p.head_dim,
                                kAttentionMaxHeadDim));
    const Override override = read_override();

    AttentionSpec base;
    base.dtype = dtype_code(p.dtype);
    base.head_dim = int32_t(p.head_dim);
    if (p.rotate) {
        base.rotary_dim = int32_t(p.rotary_dim);
        base.table_dtype = dtype_code(p.cos.dtype);
        base.interleaved = p.style == ROPE_JIT_STYLE_INTERLEAVED;
        base.table_full = p.table_full;
        base.pos_mask = p.has_pos_mask;
    }
    base.mask_kind = p.mask_kind == AttentionMaskKind::None ? 0 : p.mask_kind == AttentionMaskKind::Bool ? 1 : 2;
    base.mask_dtype = base.mask_kind == 2 ? dtype_code(p.attn_mask.dtype) : 0;
    base.causal = p.causal;
    base.gqa_group = int32_t(p.group());
    if (p.rotate) base.table_async = table_stageable(p.cos, table_columns(base)) && table_stageable(p.sin, table_columns(base));

    bool tensor_cores = !override.force_simt && p.dtype != DType::F32 && device.compute_capability >= 80 &&
                        p.head_dim % 8 == 0 && p.head_dim <= 256 &&
                        (!p.rotate || p.rotary_dim % (base.interleaved ? 8 : 16) == 0);
    for (const TensorRef* t : {&p.q, &p.k, &p.v, &p.out}) tensor_cores = tensor_cores && vector_friendly(*t);
    if (p.backward)
        for (const TensorRef* t : {&p.dout, &p.dq, &p.dk, &p.dv}) tensor_cores = tensor_cores && vector_friendly(*t);

    const int dp = padded_head_dim(int(p.head_dim));
    auto simt = [&](AttentionKernelKind kind) {
        AttentionSpec spec = base;
        spec.kind = int32_t(kind);
        spec.write_lse = kind == AttentionKernelKind::Forward && p.has_lse;
        spec.table_async = 0;
        spec.warps = 4;
        return spec;
    };
    // The first shape (the override's, then the defaults) whose shared memory fits; none: CUDA cores.
    auto tiled = [&](AttentionKernelKind kind, std::vector<TileShape> shapes, bool dk, bool dv) -> std::optional<AttentionSpec> {
        if (override.shape[int(kind)]) shapes.insert(shapes.begin(), *override.shape[int(kind)]);
        for (const TileShape& shape : shapes) {
            AttentionSpec spec = simt(kind);
            spec.tensor_cores = 1;
            spec.table_async = base.table_async;
            spec.warps = shape.warps;
            spec.block_n = shape.block_n;
            spec.m_tiles = shape.m_tiles;
            spec.wgmma = shape.wgmma;
            spec.stages = shape.stages;
            spec.producer_warps = shape.producer_warps;
            spec.cluster = shape.cluster;
            spec.compute_dk = dk;
            spec.compute_dv = dv;
            if (shape.block_n % 16 != 0 || shape.warps > 16 || (shape.m_tiles != 1 && !(shape.m_tiles == 2 && kind == AttentionKernelKind::Forward)))
                continue;
            if (shape.wgmma && (!device.wgmma || wgmma_broken_rule(spec) != WgmmaRule::none)) continue;
            if (shape.producer_warps > 0 && !(device.tma && tma_friendly(p.k) && tma_friendly(p.v))) continue;
            if (spec.shared_bytes() <= device.max_shared_bytes) return spec;
        }
        return std::nullopt;
    };
    const std::vector<TileShape> query_side =
        dp <= 128 ? std::vector<TileShape>{{8, 64}, {4, 64}, {4, 32}} : std::vector<TileShape>{{8, 32}, {4, 32}, {4, 16}};
    // The forward: two 16-row tiles per warp share every K and V fragment (FlashAttention-2's
    // layout) where the accumulators fit in registers; with pos_mask the second score tile
    // does not.
    std::vector<TileShape> forward_shapes = query_side;
    if (dp <= 128 && !base.pos_mask)
        forward_shapes.insert(forward_shapes.begin(), {TileShape{8, 64, 2}, TileShape{4, 64, 2}});
    // head_dim 256 without pos_mask: 64-key tiles where they fit (H200, S 4096: 8% faster than
    // 32-key tiles; bench/results/attention_h200_tile_variants_d256.json).
    if (dp > 128 && !base.pos_mask) forward_shapes.insert(forward_shapes.begin(), TileShape{8, 64});
    // On sm_90 the forward runs on warpgroup matrix products. First two warpgroups of 64 query
    // rows fed by a producer warpgroup (keys through its registers, rotated there; values by
    // TMA; see bench/results/attention_h200.json), three 64-key tiles in shared memory; where
    // TMA or loadable tables are not there, three warpgroups that load their own tiles (each
    // key tile, its rotation and its table rows serve 192 queries); then smaller blocks.
    if (device.wgmma)
        forward_shapes.insert(forward_shapes.begin(),
                              {TileShape{8, 64, 1, true, 3, 4}, TileShape{12, 64, 1, true, 3},
                               TileShape{12, 64, 1, true, 2}, TileShape{8, 128, 1, true, 2}, TileShape{8, 64, 1, true, 2}});
    // head_dim 64 over long key sequences: 128-key producer tiles halve the pipeline's round
    // trips per key (H200, S 4096: 10% faster; at S 1024 5% slower, so only from 4096 keys).
    if (device.wgmma && dp == 64 && p.seqlen_k >= 4096)
        forward_shapes.insert(forward_shapes.begin(), TileShape{8, 128, 1, true, 2, 4});
    const std::vector<TileShape> key_side = dp <= 64    ? std::vector<TileShape>{{8, 64}, {4, 64}, {4, 32}}
                                            : dp <= 128 ? std::vector<TileShape>{{8, 64}, {8, 32}, {4, 32}, {4, 16}}
                                                        : std::vector<TileShape>{{4, 32}, {4, 16}};

    std::vector<AttentionSpec> specs;
    if (!p.backward) {
        std::optional<AttentionSpec> spec = tensor_cores ? tiled(AttentionKernelKind::Forward, forward_shapes, true, true)
                                                         : std::nullopt;
        specs.push_back(spec ? *spec : simt(AttentionKernelKind::Forward));
        return specs;
    }
    // Accumulator registers per thread: dq (and its plain part), dk (and its plain part), dv.
    const int accumulators = dp / 2, rotated_parts = base.pos_mask ? 2 : 1;
    std::optional<AttentionSpec> dq;
    if (tensor_cores && accumulators * rotated_parts <= 128) dq = tiled(AttentionKernelKind::BackwardDq, query_side, true, true);
    specs.push_back(dq ? *dq : simt(AttentionKernelKind::BackwardDq));

    std::vector<AttentionSpec> passes;
    if (tensor_cores && accumulators * (rotated_parts + 1) <= 128) {
        if (std::optional<AttentionSpec> both = tiled(AttentionKernelKind::BackwardDkDv, key_side, true, true))
            passes.push_back(*both);
    } else if (tensor_cores && accumulators * rotated_parts <= 128) {
        std::optional<AttentionSpec> dk = tiled(AttentionKernelKind::BackwardDkDv, key_side, true, false);
        std::optional<AttentionSpec> dv = tiled(AttentionKernelKind::BackwardDkDv, key_side, false, true);
        if (dk && dv) passes = {*dk, *dv};
    }
    if (passes.empty()) passes.push_back(simt(AttentionKernelKind::BackwardDkDv));
    specs.insert(specs.end(), passes.begin(), passes.end());
    return specs;
}

}  // namespace rope_jit
