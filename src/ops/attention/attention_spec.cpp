#include "ops/attention/attention_spec.h"

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "attention_params.h"
#include "common/bounded_json.h"
#include "common/byte_hash.h"
#include "common/error.h"
#include "common/spec_fields.h"
#include "ops/attention/attention_kernel_choice.h"

namespace rope_jit {

namespace {

// ---- the field table, compiled: one row per ROPE_JIT_ATTENTION_SPEC_FIELDS line -----------

const char* const kFloatTypeNames[] = {"float32", "float16", "bfloat16"};
const char* const kKindNames[] = {"forward",          "backward-dq",    "backward-dkdv",
                                  "backward-prepare", "backward-wgmma", "backward-dq-finish"};
const char* const kMaskNames[] = {"none", "bool", "additive"};
const char* const kStyleNames[] = {"half", "interleaved"};

const SpecValues Integer{SpecValues::integer, nullptr, 0, false};
const SpecValues Boolean{SpecValues::boolean, nullptr, 0, true};
// Fields added after the PTX fingerprints were recorded: enumerators, which leave the PTX of
// the specs that keep their default unchanged (spec_fields.h).
const SpecValues BooleanEnumerator{SpecValues::boolean, nullptr, 0, true, true};
const SpecValues IntegerEnumerator{SpecValues::integer, nullptr, 0, false, true};
const SpecValues FloatTypes{SpecValues::named, kFloatTypeNames, 3, false};
const SpecValues KernelKinds{SpecValues::named, kKindNames, 6, false};
const SpecValues MaskKinds{SpecValues::named, kMaskNames, 3, false};
const SpecValues Styles{SpecValues::named, kStyleNames, 2, true};

constexpr SpecPresence PLAIN = SpecPresence::Plain, REQUIRED = SpecPresence::Required;

const SpecField<AttentionSpec> kFields[] = {
#define ROPE_JIT_ATTENTION_SPEC_ROW(member, init, key, values, min, max, constant, presence) \
    {&AttentionSpec::member, #member, key, &values, min, max, constant, presence},
    ROPE_JIT_ATTENTION_SPEC_FIELDS(ROPE_JIT_ATTENTION_SPEC_ROW)
#undef ROPE_JIT_ATTENTION_SPEC_ROW
};

int padded_head_dim(int head_dim) {
    return (head_dim + 15) / 16 * 16;
}

int table_columns(const AttentionSpec& s) {
    return ::table_columns(s.table_full != 0, s.interleaved != 0, s.rotary_dim / 2);
}

int table_element_bytes(const AttentionSpec& s) {
    return s.table_dtype == 0 ? 4 : 2;
}

}  // namespace

void AttentionSpec::validate() const {
    auto require = [](bool ok, const std::string& message) {
        if (!ok) fail_argument("attention kernel spec: " + message);
    };
    const std::string out_of_range = spec_range_problem(*this, kFields);
    require(out_of_range.empty(), out_of_range);
    require(kind >= 0 && kind <= 5, fmt::format("kind {} is not in [0, 5]", kind));
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
        require(
            head_dim % 8 == 0 && head_dim <= 256,
            fmt::format("tensor-core kernels need head_dim % 8 == 0 and <= 256, got {}", head_dim));
        require(block_n >= 16 && block_n % 16 == 0,
                fmt::format("block_n must be a multiple of 16, got {}", block_n));
        require(rotary_dim == 0 || rotary_dim % (interleaved ? 8 : 16) == 0,
                fmt::format("tensor-core rotation needs rotary_dim % {} == 0, got {}",
                            interleaved ? 8 : 16, rotary_dim));
        require(!table_async || rotary_dim == 0 ||
                    (table_columns(*this) * table_element_bytes(*this)) % 16 == 0,
                "staged table rows must be whole 16-byte chunks");
    }
    require(kind < int32_t(AttentionKernelKind::BackwardPrepare) || wgmma,
            "the sm_90 backward's kernels (kinds 3-5) are wgmma kernels");
    if (wgmma) {
        require(tensor_cores, "wgmma kernels are tensor-core kernels");
        switch (wgmma_broken_rule(*this)) {
            case WgmmaRule::None: break;
            case WgmmaRule::Forward:
                fail_argument(
                    "attention kernel spec: wgmma kernels are forwards or the sm_90 backward "
                    "(kinds 3-5)");
            case WgmmaRule::HeadDim:
                fail_argument(fmt::format(
                    "attention kernel spec: wgmma kernels take head_dim padded to 64, 128 or "
                    "256 (forwards at 256: 4 or 8 loading warps, or 8 consumer warps beside 4 "
                    "producer warps with setmaxnreg, two stages and keys by TMA, over 64-key "
                    "tiles), got {} (padded {})",
                    head_dim, padded_head_dim(head_dim)));
            case WgmmaRule::KeyTile:
                fail_argument(fmt::format(
                    "attention kernel spec: wgmma kernels take 64- or 128-key tiles, got {}",
                    block_n));
            case WgmmaRule::Warps:
                fail_argument(
                    fmt::format("attention kernel spec: wgmma kernels take 4, 8 or 12 warps of 16 "
                                "rows, got {} warps x {}",
                                warps, m_tiles));
            case WgmmaRule::PosMask:
                fail_argument("attention kernel spec: wgmma kernels do not take pos_mask");
            case WgmmaRule::Stages:
                fail_argument(fmt::format(
                    "attention kernel spec: wgmma kernels hold 2 or 3 tiles, got {}", stages));
            case WgmmaRule::Producer:
                fail_argument(fmt::format(
                    "attention kernel spec: wgmma kernels take 0 or 4 producer warps (with "
                    "tables read in 8- or 16-byte pieces and at most 8 other "
                    "warps; keys by TMA only with them), got {} beside {}",
                    producer_warps, warps));
            case WgmmaRule::Cluster:
                fail_argument(fmt::format(
                    "attention kernel spec: clusters of {} blocks need producer warps, 2 or 4 "
                    "blocks dividing the GQA group ({}) and 8-row shares of the {}-key tile",
                    cluster, gqa_group, block_n));
            case WgmmaRule::Schedule:
                fail_argument(fmt::format(
                    "attention kernel spec: pingpong ({}), setmaxnreg ({}), exp2_fma ({}) and "
                    "overlap ({}) are settings of the forward with 4 producer warps and 8 "
                    "consumer warps (setmaxnreg with keys by TMA; overlap with setmaxnreg, "
                    "without pingpong or clusters)",
                    pingpong, setmaxnreg, exp2_fma, overlap));
        }
    } else {
        require(stages == 2,
                fmt::format("stages is a wgmma setting (2 otherwise), got {}", stages));
        require(producer_warps == 0,
                fmt::format("producer warps are a wgmma setting (0 otherwise), got {}",
                            producer_warps));
        require(cluster == 1,
                fmt::format("clusters are a wgmma setting (1 otherwise), got {}", cluster));
        require(keys_by_tma == 0, "keys by TMA are a wgmma setting");
        require(pingpong == 0 && setmaxnreg == 0 && exp2_fma == 0 && overlap == 0,
                "pingpong, setmaxnreg, exp2_fma and overlap are wgmma settings");
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
    std::string why;
    const nlohmann::json j = parse_bounded_json(text, &why);
    if (j.is_discarded()) return fail(why);
    if (!j.is_object()) return fail("not a JSON object");
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
    std::string why;
    nlohmann::json j = parse_bounded_json(text, &why);
    if (j.is_discarded()) return fail(why);
    if (!j.is_object()) return fail("not a JSON object");
    if (!j.contains("op") || j["op"] != nlohmann::json("attention"))
        return fail("not an attention spec");
    static const char* const kTileKeys[] = {
        "kind",    "tensor_cores", "wgmma",       "stages", "producer_warps",
        "cluster", "keys_by_tma",  "table_async", "warps",  "m_tiles",
        "block_n", "compute_dk",   "compute_dv",  "pingpong", "setmaxnreg",
        "exp2_fma", "overlap"};
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
    const char* kinds[] = {"fwd", "bwd-dq", "bwd-dkdv", "bwd-prepare", "bwd", "bwd-dq-finish"};
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
                            m_tiles > 1            ? fmt::format("x{}", m_tiles)
                            : wgmma && stages != 2 ? fmt::format("x{}", stages)
                                                   : "",
                            producer_warps > 0
                                ? fmt::format(" +{} producer warps{}{}", producer_warps,
                                              cluster > 1 ? fmt::format(" cluster{}", cluster) : "",
                                              keys_by_tma ? " keys-by-tma" : "")
                                : "",
                            table_async ? " staged-tables" : "");
    else
        text += fmt::format(" simt {}w", warps);
    if (pingpong > 0) text += fmt::format(" pingpong{}", pingpong);
    if (setmaxnreg) text += " setmaxnreg";
    if (exp2_fma > 0) text += fmt::format(" exp2-fma{}/4", exp2_fma);
    if (overlap) text += " overlap";
    return text;
}

size_t AttentionSpecHash::operator()(const AttentionSpec& spec) const noexcept {
    static_assert(std::has_unique_object_representations_v<AttentionSpec>,
                  "hashed as plain bytes: no padding");
    return hash_bytes(&spec, sizeof spec);
}

}  // namespace rope_jit
