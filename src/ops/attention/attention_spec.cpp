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
#include "ops/attention/attention_kernel_choice.h"

namespace rope_jit {

namespace {

const char* const kDtypeNames[] = {"float32", "float16", "bfloat16"};
const char* const kKindNames[] = {"forward", "backward_dq", "backward_dkdv"};
const char* const kMaskNames[] = {"none", "bool", "additive"};

int padded_head_dim(int head_dim) { return (head_dim + 15) / 16 * 16; }

int table_columns(const AttentionSpec& s) {
    return ::table_columns(s.table_full != 0, s.interleaved != 0, s.rotary_dim / 2);
}

int table_element_bytes(const AttentionSpec& s) { return s.table_dtype == 0 ? 4 : 2; }

}  // namespace

void AttentionSpec::validate() const {
    auto require = [](bool ok, const std::string& message) {
        if (!ok) fail_argument("attention kernel spec: " + message);
    };
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
    auto define = [&](const char* name, long long value) { text += fmt::format("constexpr int {} = {};\n", name, value); };
    auto flag = [&](const char* name, int32_t value) {
        text += fmt::format("constexpr bool {} = {};\n", name, value ? "true" : "false");
    };
    define("KIND", kind);
    define("DTYPE", dtype);
    define("TABLE_DTYPE", table_dtype);
    define("MASK_DTYPE", mask_dtype);
    define("HEAD_DIM", head_dim);
    define("ROTARY_DIM", rotary_dim);
    flag("INTERLEAVED", interleaved);
    flag("TABLE_FULL", table_full);
    flag("HAS_POS_MASK", pos_mask);
    define("MASK_KIND", mask_kind);
    flag("CAUSAL", causal);
    define("GQA_GROUP", gqa_group);
    flag("WRITE_LSE", write_lse);
    flag("TENSOR_CORES", tensor_cores);
    flag("WGMMA", wgmma);
    define("STAGES", stages);
    define("PRODUCER_WARPS", producer_warps);
    define("CLUSTER", cluster);
    if (cluster > 1) text += fmt::format("#define ROPE_JIT_CLUSTER_DIMS __cluster_dims__({}, 1, 1)\n", cluster);
    flag("TABLE_ASYNC", table_async);
    define("WARPS", warps);
    define("M_TILES", m_tiles);
    define("BLOCK_N", block_n);
    flag("COMPUTE_DK", compute_dk);
    flag("COMPUTE_DV", compute_dv);
    return text;
}

std::string AttentionSpec::to_json() const {
    nlohmann::json j;  // keys are sorted on output, so the text is canonical
    j["op"] = "attention";
    j["kind"] = kKindNames[kind];
    j["dtype"] = kDtypeNames[dtype];
    j["table_dtype"] = kDtypeNames[table_dtype];
    j["mask_dtype"] = kDtypeNames[mask_dtype];
    j["head_dim"] = head_dim;
    j["rotary_dim"] = rotary_dim;
    j["style"] = interleaved ? "interleaved" : "half";
    j["table_full"] = bool(table_full);
    j["pos_mask"] = bool(pos_mask);
    j["mask"] = kMaskNames[mask_kind];
    j["causal"] = bool(causal);
    j["gqa_group"] = gqa_group;
    j["write_lse"] = bool(write_lse);
    j["tensor_cores"] = bool(tensor_cores);
    j["wgmma"] = bool(wgmma);
    j["stages"] = stages;
    j["producer_warps"] = producer_warps;
    j["cluster"] = cluster;
    j["table_async"] = bool(table_async);
    j["warps"] = warps;
    j["m_tiles"] = m_tiles;
    j["block_n"] = block_n;
    j["compute_dk"] = bool(compute_dk);
    j["compute_dv"] = bool(compute_dv);
    return j.dump();
}

std::optional<AttentionSpec> AttentionSpec::from_json(const std::string& text, std::string* error) {
    auto fail = [&](const std::string& why) -> std::optional<AttentionSpec> {
        if (error != nullptr) *error = why;
        return std::nullopt;
    };
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
    if (!j.contains("op") || !j["op"].is_string() || j["op"].get<std::string>() != "attention")
        return fail("not an attention spec");
    // A name among `names`, as its index.
    auto index_of = [&](const char* key, const char* const* names, int count, int32_t* out) {
        if (!j.contains(key) || !j[key].is_string()) return false;
        for (int i = 0; i < count; ++i)
            if (j[key].get<std::string>() == names[i]) {
                *out = i;
                return true;
            }
        return false;
    };
    auto integer = [&](const char* key, int32_t* out) {
        if (!j.contains(key) || !j[key].is_number_integer()) return false;
        const int64_t value = j[key].get<int64_t>();
        if (value < INT32_MIN || value > INT32_MAX) return false;
        *out = int32_t(value);
        return true;
    };
    auto flag = [&](const char* key, int32_t* out) {
        if (!j.contains(key) || !j[key].is_boolean()) return false;
        *out = j[key].get<bool>() ? 1 : 0;
        return true;
    };
    AttentionSpec s;
    int32_t interleaved = 0;
    static const char* const kStyles[] = {"half", "interleaved"};
    const bool ok = index_of("kind", kKindNames, 3, &s.kind) && index_of("dtype", kDtypeNames, 3, &s.dtype) &&
                    index_of("table_dtype", kDtypeNames, 3, &s.table_dtype) &&
                    index_of("mask_dtype", kDtypeNames, 3, &s.mask_dtype) && integer("head_dim", &s.head_dim) &&
                    integer("rotary_dim", &s.rotary_dim) && index_of("style", kStyles, 2, &interleaved) &&
                    flag("table_full", &s.table_full) && flag("pos_mask", &s.pos_mask) &&
                    index_of("mask", kMaskNames, 3, &s.mask_kind) && flag("causal", &s.causal) &&
                    integer("gqa_group", &s.gqa_group) && flag("write_lse", &s.write_lse) &&
                    flag("tensor_cores", &s.tensor_cores) && flag("wgmma", &s.wgmma) && integer("stages", &s.stages) &&
                    integer("producer_warps", &s.producer_warps) && integer("cluster", &s.cluster) &&
                    flag("table_async", &s.table_async) && integer("warps", &s.warps) &&
                    integer("m_tiles", &s.m_tiles) && integer("block_n", &s.block_n) &&
                    flag("compute_dk", &s.compute_dk) && flag("compute_dv", &s.compute_dv);
    if (!ok) return fail("a field is missing or of the wrong type");
    s.interleaved = interleaved;
    if (s.to_json() != j.dump()) return fail("fields or values this build's attention spec does not write");
    return s;
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

}  // namespace rope_jit
