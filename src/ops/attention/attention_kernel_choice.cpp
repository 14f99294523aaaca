#include "ops/attention/attention_kernel_choice.h"

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "common/error.h"

namespace rope_jit {

namespace {

using Kind = AttentionKernelKind;

// One row of the tile tables: `shape` is a candidate for kernels of `kind` whose head_dim pads
// into [dp_min, dp_max], where the row's conditions hold. Rows are tried in order (after an
// override's shape), and the first whose shape the kernel takes and whose shared memory fits
// wins; wgmma rows count only where the device runs the wgmma forward and the spec keeps its
// rules (wgmma_broken_rule), producer rows only where TMA can copy k and v.
struct TileRow {
    Kind kind;
    int dp_min, dp_max;
    bool without_pos_mask;  // only without pos_mask
    int64_t min_keys;       // only from this many keys (0: any)
    AttentionTileShape shape;
};

// clang-format off
const TileRow kTileTable[] = {
    // Forward. head_dim 256 on sm_90: two consumer warpgroups with the producer warps' registers
    // (setmaxnreg; each thread holds 128 output accumulators), 64-key tiles by TMA (keys rotated
    // beforehand: a workspace), two in shared memory; without a workspace, two warpgroups that
    // load their own tiles (see wgmma_broken_rule).
    {Kind::Forward, 256, 256, false, 0, {8, 64, 1, true, 2, 4, 1, true, 0, true}},
    {Kind::Forward, 256, 256, false, 0, {8, 64, 1, true, 2}},
    // head_dim 64 over long key sequences: 128-key producer tiles halve the pipeline's
    // round trips per key (H200, S 4096: 10% faster; at S 1024 5% slower, so only from 4096
    // keys), three of them, each consumer warpgroup's softmax beside its previous O += P V
    // (overlap, with setmaxnreg's registers; H200, 4x4096 16/16 heads causal: 0.443 ms against
    // 0.465 ms for two tiles without it).
    {Kind::Forward,  64,  64, false, 4096, {8, 128, 1, true, 3, 4, 1, true, 0, true, 0, true}},
    // head_dim 128 likewise, with keys by TMA (H200, 4x4096 32/8 heads causal: 1.166 ms against
    // 1.218 ms for two 128-key tiles without the overlap, 1.37 ms and 1.51 ms with three 64-key
    // tiles before that; bench/results/attention_wgmma_tuning.json). Over 64-key tiles the
    // overlap loses (two stages: the next tile's copy waits for the product it overlaps).
    {Kind::Forward, 128, 128, false, 4096, {8, 128, 1, true, 3, 4, 1, true, 0, true, 0, true}},
    // On sm_90 the forward runs on warpgroup matrix products. First two warpgroups of 64 query
    // rows fed by a producer warpgroup (keys and values by TMA, the keys rotated beforehand by
    // the prepare kernel; without a workspace, keys through the producers' registers, rotated
    // there; bench/results/attention_h200_issue19.json), three 64-key tiles in shared memory; where
    // TMA or loadable tables are not there, three warpgroups that load their own tiles (each
    // key tile, its rotation and its table rows serve 192 queries); then smaller blocks.
    {Kind::Forward,  16, 256, false, 0, {8, 64, 1, true, 3, 4}},
    {Kind::Forward,  16, 256, false, 0, {12, 64, 1, true, 3}},
    {Kind::Forward,  16, 256, false, 0, {12, 64, 1, true, 2}},
    {Kind::Forward,  16, 256, false, 0, {8, 128, 1, true, 2}},
    {Kind::Forward,  16, 256, false, 0, {8, 64, 1, true, 2}},
    // head_dim 256 without pos_mask: 64-key tiles where they fit (H200, S 4096: 8% faster than
    // 32-key tiles; bench/results/attention_h200_tile_variants_d256.json).
    {Kind::Forward, 144, 256, true, 0, {8, 64}},
    // Two 16-row tiles per warp share every K and V fragment (FlashAttention-2's layout) where
    // the accumulators fit in registers; with pos_mask the second score tile does not.
    {Kind::Forward,  16, 128, true, 0, {8, 64, 2}},
    {Kind::Forward,  16, 128, true, 0, {4, 64, 2}},
    // Then the query-side shapes dq uses too.
    {Kind::Forward,  16, 128, false, 0, {8, 64}},
    {Kind::Forward,  16, 128, false, 0, {4, 64}},
    {Kind::Forward,  16, 128, false, 0, {4, 32}},
    {Kind::Forward, 144, 256, false, 0, {8, 32}},
    {Kind::Forward, 144, 256, false, 0, {4, 32}},
    {Kind::Forward, 144, 256, false, 0, {4, 16}},
    // dq: resident query rows, streamed key tiles.
    {Kind::BackwardDq,  16, 128, false, 0, {8, 64}},
    {Kind::BackwardDq,  16, 128, false, 0, {4, 64}},
    {Kind::BackwardDq,  16, 128, false, 0, {4, 32}},
    {Kind::BackwardDq, 144, 256, false, 0, {8, 32}},
    {Kind::BackwardDq, 144, 256, false, 0, {4, 32}},
    {Kind::BackwardDq, 144, 256, false, 0, {4, 16}},
    // dk/dv: resident key and value rows, streamed query tiles.
    {Kind::BackwardDkDv,  16,  64, false, 0, {8, 64}},
    {Kind::BackwardDkDv,  16,  64, false, 0, {4, 64}},
    {Kind::BackwardDkDv,  16,  64, false, 0, {4, 32}},
    {Kind::BackwardDkDv,  80, 128, false, 0, {8, 64}},
    {Kind::BackwardDkDv,  80, 128, false, 0, {8, 32}},
    {Kind::BackwardDkDv,  80, 128, false, 0, {4, 32}},
    {Kind::BackwardDkDv,  80, 128, false, 0, {4, 16}},
    {Kind::BackwardDkDv, 144, 256, false, 0, {4, 32}},
    {Kind::BackwardDkDv, 144, 256, false, 0, {4, 16}},
};
// clang-format on

int32_t dtype_code(DType dtype) {
    switch (dtype) {
        case DType::F16: return 1;
        case DType::BF16: return 2;
        default: return 0;
    }
}

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
        if (t.shape[d] > 1 && (t.strides[d] <= 0 || t.strides[d] >= (int64_t(1) << 39)))
            return false;
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

// One "kind=shape" item: WxN[xM] (mma.sync), wWxN[xS], pWxN[xS], rWxN[xS] or cCxWxN[xS]
// (wgmma); nullopt for anything else.
std::optional<AttentionTileShape> parse_shape(std::string text, int kind) {
    // Scheduling options after the shape: ":pingpong", ":pingpong2", ":setmaxnreg", ":fmaN",
    // ":overlap".
    int32_t pingpong = 0, exp2_fma = 0;
    bool setmaxnreg = false, overlap = false;
    for (size_t colon = text.rfind(':'); colon != std::string::npos; colon = text.rfind(':')) {
        const std::string option = text.substr(colon + 1);
        if (option == "pingpong" || option == "pingpong2")
            pingpong = option == "pingpong" ? 1 : 2;
        else if (option == "setmaxnreg")
            setmaxnreg = true;
        else if (option == "fma1" || option == "fma2" || option == "fma3")
            exp2_fma = option[3] - '0';
        else if (option == "overlap")
            overlap = true;
        else
            return std::nullopt;
        text.resize(colon);
    }
    if ((pingpong > 0 || setmaxnreg || exp2_fma > 0 || overlap) &&
        (text.empty() || text[0] != 'p'))
        return std::nullopt;
    char family = 0;
    if (!text.empty() && (text[0] == 'w' || text[0] == 'p' || text[0] == 'r' || text[0] == 'c')) {
        family = text[0];
        text = text.substr(1);
    }
    std::vector<int> numbers;
    size_t start = 0;
    while (start <= text.size()) {
        size_t end = text.find('x', start);
        if (end == std::string::npos) end = text.size();
        const std::string number = text.substr(start, end - start);
        if (number.empty() || number.size() > 4 ||
            number.find_first_not_of("0123456789") != std::string::npos)
            return std::nullopt;
        numbers.push_back(std::atoi(number.c_str()));
        start = end + 1;
    }
    const size_t first = family == 'c' ? 1 : 0;  // the cluster size comes first
    if (numbers.size() < first + 2 || numbers.size() > first + 3) return std::nullopt;
    for (int n : numbers)
        if (n <= 0) return std::nullopt;
    AttentionTileShape shape{numbers[first], numbers[first + 1]};
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
    shape.keys_by_tma = family != 'r';
    shape.pingpong = pingpong;
    shape.setmaxnreg = setmaxnreg;
    shape.exp2_fma = exp2_fma;
    shape.overlap = overlap;
    return shape;
}

// The head_dim 256 wgmma forward without producers: two warpgroups (or one) that load their
// own 64-key tiles.
bool wide_forward(int head_dim_padded, int producer_warps, int warps, int block_n) {
    return head_dim_padded == 256 && producer_warps == 0 && warps <= 8 && block_n == 64;
}

// The head_dim 256 wgmma forward with producers: two consumer warpgroups that take the
// producers' registers (setmaxnreg: 128 output accumulators a thread; at the 168 registers of
// 384 threads they spill), 64-key tiles by TMA, two in shared memory, no cluster.
bool wide_producer_forward(int head_dim_padded, const AttentionSpec& s) {
    return head_dim_padded == 256 && s.producer_warps == 4 && s.warps == 8 && s.block_n == 64 &&
           s.stages == 2 && s.keys_by_tma && s.setmaxnreg && s.cluster == 1;
}

}  // namespace

AttentionKernelOverride parse_attention_kernel_override(const char* text) {
    AttentionKernelOverride o;
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
            const std::string what = item.substr(eq + 1);
            if (name == "workspace") o.no_workspace = what == "0";
            const int kind = name == "fwd" ? 0 : name == "dq" ? 1 : name == "dkdv" ? 2 : -1;
            if (kind >= 0)
                if (std::optional<AttentionTileShape> shape = parse_shape(what, kind))
                    o.shape[kind] = shape;
        }
        start = end + 1;
    }
    return o;
}

AttentionKernelOverride attention_kernel_override_from_environment() {
    return parse_attention_kernel_override(std::getenv("ROPE_JIT_ATTENTION_KERNELS"));
}

AttentionLaunchPlan attention_launch_plan(const AttentionSpec& s) {
    return ::attention_launch_plan(s.kind, s.head_dim, s.rotary_dim, s.interleaved != 0,
                                   s.table_full != 0, s.table_dtype, s.table_async != 0,
                                   s.pos_mask != 0, s.tensor_cores != 0, s.wgmma != 0, s.warps,
                                   s.m_tiles, s.block_n, s.stages, s.producer_warps);
}

int AttentionSpec::shared_bytes() const {
    return attention_launch_plan(*this).shared_bytes;
}

int AttentionSpec::threads() const {
    return attention_launch_plan(*this).threads;
}

WgmmaRule wgmma_broken_rule(const AttentionSpec& s) {
    const int dp = attention_launch_plan(s).head_dim_padded;
    if (s.kind >= int32_t(Kind::BackwardPrepare)) {
        // The sm_90 backward: two warpgroups over 128 keys, 64-query tiles by TMA; at head_dim
        // 256 over 64 keys with two stages (shared memory).
        if (dp != 64 && dp != 128 && dp != 256) return WgmmaRule::HeadDim;
        if (s.block_n != (dp == 256 ? 64 : 128)) return WgmmaRule::KeyTile;
        if (s.warps != 8 || s.m_tiles != 1) return WgmmaRule::Warps;
        if (s.pos_mask) return WgmmaRule::PosMask;
        if (dp == 256 ? s.stages != 2 : (s.stages != 2 && s.stages != 3)) return WgmmaRule::Stages;
        if (s.producer_warps != 0 || s.keys_by_tma) return WgmmaRule::Producer;
        if (s.cluster != 1) return WgmmaRule::Cluster;
        if (s.pingpong != 0 || s.setmaxnreg != 0 || s.exp2_fma != 0 || s.overlap != 0)
            return WgmmaRule::Schedule;
        return WgmmaRule::None;
    }
    if (s.kind != 0) return WgmmaRule::Forward;
    // head_dim 256: warps that load their own 64-key tiles, at most two warpgroups (a thread
    // holds 128 output accumulators: a third warpgroup caps its registers at 168 and spills
    // them), or two warpgroups beside producers that give them their registers.
    const bool wide = wide_forward(dp, s.producer_warps, s.warps, s.block_n);
    if (dp != 64 && dp != 128 && !wide && !wide_producer_forward(dp, s))
        return WgmmaRule::HeadDim;
    if (s.block_n != 64 && s.block_n != 128) return WgmmaRule::KeyTile;
    if ((s.warps != 4 && s.warps != 8 && s.warps != 12) || s.m_tiles != 1) return WgmmaRule::Warps;
    if (s.pos_mask) return WgmmaRule::PosMask;
    if (s.stages != 2 && s.stages != 3) return WgmmaRule::Stages;
    // Producers read table columns in 8- or 16-byte pieces, so the tables must allow it (as
    // for staging them); the block takes at most three warpgroups (a fourth leaves everyone
    // too few registers: measured, it spills and runs at half speed). A head_dim that pads
    // (56, 120) works: the producers write zeros into the key chunks past head_dim.
    // Keys by TMA need no table pieces (the prepare kernel rotates them), but producer warps
    // (or, at head_dim 256, warps that copy them as they copy values).
    if ((s.producer_warps != 0 && s.producer_warps != 4) ||
        (s.keys_by_tma && s.producer_warps == 0 && !(wide && s.rotary_dim > 0)) ||
        (s.producer_warps > 0 && ((s.rotary_dim > 0 && !s.table_async && !s.keys_by_tma) ||
                                  s.warps + s.producer_warps > 12)))
        return WgmmaRule::Producer;
    if (s.cluster != 1 && (s.producer_warps == 0 || (s.cluster != 2 && s.cluster != 4) ||
                           s.gqa_group % s.cluster != 0 || (s.block_n / s.cluster) % 8 != 0))
        return WgmmaRule::Cluster;
    if ((s.pingpong != 0 || s.setmaxnreg != 0 || s.exp2_fma != 0 || s.overlap != 0) &&
        (s.producer_warps != 4 || s.warps != 8 || (s.setmaxnreg && !s.keys_by_tma) ||
         (s.overlap && (!s.setmaxnreg || s.pingpong != 0 || s.cluster != 1))))
        return WgmmaRule::Schedule;
    return WgmmaRule::None;
}

std::vector<AttentionSpec> choose_attention_specs(const AttentionProblem& p,
                                                  const AttentionDevice& device) {
    return choose_attention_specs(p, device, AttentionKernelOverride{});
}

std::vector<AttentionSpec> choose_attention_specs(const AttentionProblem& p,
                                                  const AttentionDevice& device,
                                                  const AttentionKernelOverride& override) {
    if (p.head_dim > kAttentionMaxHeadDim)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("q: head_dim {} exceeds the {} the CUDA attention kernels support",
                                p.head_dim, kAttentionMaxHeadDim));

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
    base.mask_kind = p.mask_kind == AttentionMaskKind::None   ? 0
                     : p.mask_kind == AttentionMaskKind::Bool ? 1
                                                              : 2;
    base.mask_dtype = base.mask_kind == 2 ? dtype_code(p.attn_mask.dtype) : 0;
    base.causal = p.causal;
    base.gqa_group = int32_t(p.group());
    const int table_columns = attention_launch_plan(base).table_columns;
    if (p.rotate)
        base.table_async =
            table_stageable(p.cos, table_columns) && table_stageable(p.sin, table_columns);

    bool tensor_cores = !override.force_simt && p.dtype != DType::F32 &&
                        device.compute_capability >= 80 && p.head_dim % 8 == 0 &&
                        p.head_dim <= 256 &&
                        (!p.rotate || p.rotary_dim % (base.interleaved ? 8 : 16) == 0);
    for (const TensorRef* t : {&p.q, &p.k, &p.v, &p.out})
        tensor_cores = tensor_cores && vector_friendly(*t);
    if (p.backward)
        for (const TensorRef* t : {&p.dout, &p.dq, &p.dk, &p.dv})
            tensor_cores = tensor_cores && vector_friendly(*t);

    const int dp = attention_launch_plan(base).head_dim_padded;
    // Kernels with a workspace (the sm_90 backward, rotated keys by TMA) need rows to put in it:
    // an empty sequence (out = 0, lse = -inf; empty gradients) runs the kernels without one.
    const bool workspace = !p.no_workspace && p.seqlen_q > 0 && p.seqlen_k > 0;
    auto simt = [&](Kind kind) {
        AttentionSpec spec = base;
        spec.kind = int32_t(kind);
        spec.write_lse = kind == Kind::Forward && p.has_lse;
        spec.table_async = 0;
        spec.warps = 4;
        return spec;
    };
    // The spec of `shape` if the kernel takes it here and its shared memory fits.
    auto fitted = [&](Kind kind, const AttentionTileShape& shape, bool dk,
                      bool dv) -> std::optional<AttentionSpec> {
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
        spec.pingpong = shape.pingpong;
        spec.setmaxnreg = shape.setmaxnreg;
        spec.exp2_fma = shape.exp2_fma;
        spec.overlap = shape.overlap;
        // Rotated keys by TMA come from a workspace, which a call may have to do without. The
        // head_dim 256 forward without producers (every warp loads) takes them too, by cp.async
        // (nothing to gain there without a rotation).
        const bool wide =
            shape.wgmma && wide_forward(dp, shape.producer_warps, shape.warps, shape.block_n);
        spec.keys_by_tma = shape.keys_by_tma && (shape.producer_warps > 0 || wide) &&
                           (base.rotary_dim == 0 ? !wide : workspace);
        spec.compute_dk = dk;
        spec.compute_dv = dv;
        if (shape.block_n % 16 != 0 || shape.warps > 16 ||
            (shape.m_tiles != 1 && !(shape.m_tiles == 2 && kind == Kind::Forward)))
            return std::nullopt;
        if (shape.wgmma && (!device.wgmma || wgmma_broken_rule(spec) != WgmmaRule::None))
            return std::nullopt;
        if (shape.producer_warps > 0 && !(device.tma && tma_friendly(p.k) && tma_friendly(p.v)))
            return std::nullopt;
        // head_dim 256: the query rows and two key and value tiles take 196 KiB, so the staged
        // table rows of a tile (up to 64 KiB) may not fit beside them; the rotation then reads
        // its angles in place.
        if (shape.wgmma && dp == 256 && spec.table_async &&
            spec.shared_bytes() > device.max_shared_bytes)
            spec.table_async = 0;
        if (spec.shared_bytes() > device.max_shared_bytes) return std::nullopt;
        return spec;
    };
    // The override's shape, then the first row of the tile table that fits; none: CUDA cores.
    auto tiled = [&](Kind kind, bool dk, bool dv) -> std::optional<AttentionSpec> {
        if (const std::optional<AttentionTileShape>& shape = override.shape[int(kind)])
            if (std::optional<AttentionSpec> spec = fitted(kind, *shape, dk, dv)) return spec;
        for (const TileRow& row : kTileTable) {
            if (row.kind != kind || dp < row.dp_min || dp > row.dp_max) continue;
            if ((row.without_pos_mask && base.pos_mask) || p.seqlen_k < row.min_keys) continue;
            if (std::optional<AttentionSpec> spec = fitted(kind, row.shape, dk, dv)) return spec;
        }
        return std::nullopt;
    };

    // A kernel of the sm_90 backward's family (kinds 3-5: two warpgroups over 128 keys, over
    // 64 at head_dim 256).
    auto sm90_backward_kernel = [&](Kind kind) {
        AttentionSpec spec = simt(kind);
        spec.tensor_cores = spec.wgmma = 1;
        spec.warps = 8;
        spec.block_n = dp == 256 ? 64 : 128;
        spec.stages = dp == 256 ? 2 : 3;
        return spec;
    };
    std::vector<AttentionSpec> specs;
    // The sm_90 backward (dq accumulated with atomic adds: not bitwise reproducible, so not
    // for a deterministic call), where TMA can read v and dout, unless the override asks for
    // the dq or dk/dv kernels.
    const bool other_backward_asked = override.shape[int(Kind::BackwardDq)].has_value() ||
                                      override.shape[int(Kind::BackwardDkDv)].has_value();
    if (p.backward && tensor_cores && !p.deterministic && workspace &&
        !other_backward_asked && device.wgmma && device.tma && tma_friendly(p.v) &&
        tma_friendly(p.dout)) {
        std::vector<AttentionSpec> family;
        for (Kind kind : {Kind::BackwardPrepare, Kind::Backward, Kind::BackwardDqFinish}) {
            const AttentionSpec spec = sm90_backward_kernel(kind);
            if (wgmma_broken_rule(spec) != WgmmaRule::None ||
                spec.shared_bytes() > device.max_shared_bytes)
                break;
            family.push_back(spec);
        }
        if (family.size() == 3) return family;
    }
    if (!p.backward) {
        const std::optional<AttentionSpec> spec =
            tensor_cores ? tiled(Kind::Forward, true, true) : std::nullopt;
        // Keys by TMA, rotated: the backward's prepare kernel rotates them first (the same
        // kernel, compiled once for both).
        if (spec && spec->keys_by_tma && spec->rotary_dim > 0)
            specs.push_back(sm90_backward_kernel(Kind::BackwardPrepare));
        specs.push_back(spec ? *spec : simt(Kind::Forward));
        return specs;
    }
    // Accumulator registers per thread: dq (and its plain part), dk (and its plain part), dv.
    const int accumulators = dp / 2, rotated_parts = base.pos_mask ? 2 : 1;
    std::optional<AttentionSpec> dq;
    if (tensor_cores && accumulators * rotated_parts <= 128)
        dq = tiled(Kind::BackwardDq, true, true);
    specs.push_back(dq ? *dq : simt(Kind::BackwardDq));

    std::vector<AttentionSpec> passes;
    if (tensor_cores && accumulators * (rotated_parts + 1) <= 128) {
        if (std::optional<AttentionSpec> both = tiled(Kind::BackwardDkDv, true, true))
            passes.push_back(*both);
    } else if (tensor_cores && accumulators * rotated_parts <= 128) {
        std::optional<AttentionSpec> dk = tiled(Kind::BackwardDkDv, true, false);
        std::optional<AttentionSpec> dv = tiled(Kind::BackwardDkDv, false, true);
        if (dk && dv) passes = {*dk, *dv};
    }
    if (passes.empty()) passes.push_back(simt(Kind::BackwardDkDv));
    specs.insert(specs.end(), passes.begin(), passes.end());
    return specs;
}

}  // namespace rope_jit
