#include "ops/rope/rope_dense_rows.h"

#include <algorithm>

#include "ops/rope/rope_plan.h"

namespace rope_jit {

namespace {

// Whether the [B, H, S, D] view `t` is one dense run of rows in the order that puts heads
// (heads_fastest) or tokens next to each other. A dimension of one element may have any stride.
bool dense_rows(const TensorRef& t, bool heads_fastest) {
    const int64_t B = t.shape[0], H = t.shape[1], S = t.shape[2], D = t.shape[3];
    int64_t expected[4];  // by [B, H, S, D] dimension
    expected[3] = 1;
    if (heads_fastest) {
        expected[1] = D;
        expected[2] = H * D;
    } else {
        expected[2] = D;
        expected[1] = S * D;
    }
    expected[0] = H * S * D;
    const int64_t sizes[4] = {B, H, S, D};
    for (int d = 0; d < 4; ++d)
        if (sizes[d] > 1 && t.strides[d] != expected[d]) return false;
    return true;
}

// Whether an input and its output are dense in that order, with 16-byte aligned addresses.
bool bulk_pair(const TensorRef& in, const TensorRef& out, bool heads_fastest) {
    const auto aligned = [](const TensorRef& t) {
        return reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
    };
    return dense_rows(in, heads_fastest) && dense_rows(out, heads_fastest) && aligned(in) &&
           aligned(out);
}

// The rows of q and of k, and the divisors that split a row index into (b, s), with the rows
// in [B, S, H, D] order (heads_fastest: a token's heads together) or [B, H, S, D].
RopeBulkParams dense_row_counts(const RopeProblem& p, bool heads_fastest) {
    RopeBulkParams rows{};
    rows.q_rows = p.batch * p.heads_q * p.seqlen_q;
    rows.k_rows = p.has_k ? p.batch * p.heads_k * p.seqlen_k : 0;
    rows.heads_fastest = heads_fastest ? 1 : 0;
    rows.q_heads = row_divisor(p.heads_q);
    rows.q_seqlen = row_divisor(p.seqlen_q);
    if (p.has_k) {
        rows.k_heads = row_divisor(p.heads_k);
        rows.k_seqlen = row_divisor(p.seqlen_k);
    }
    return rows;
}

// Row indices the kernels split in 32 bits; the flat kernel's item index, in 32 bits.
constexpr int64_t kMaxRows = 0x7fffffff;
constexpr int64_t kMaxItems = 0xffffffffLL;

// Whether q and k, and their outputs, are each one dense run of rows in that order.
bool dense_call(const RopeProblem& p, bool heads_fastest) {
    return dense_rows(p.q, heads_fastest) && dense_rows(p.q_out, heads_fastest) &&
           (!p.has_k || (dense_rows(p.k, heads_fastest) && dense_rows(p.k_out, heads_fastest)));
}

// The order of the rows the flat path walks (true: a token's heads together), or nothing.
std::optional<bool> flat_row_order(const RopeProblem& p) {
    if (p.packed) return std::nullopt;
    // The kernel counts rows under 2^31 and items under 2^32: a row has at most head_dim / 2
    // items (a rotation item takes a pair or more; a vector of flat_copies, 8 features).
    for (const int64_t rows : {p.batch * p.heads_q * p.seqlen_q,
                               p.has_k ? p.batch * p.heads_k * p.seqlen_k : 0})
        if (rows > kMaxRows || rows * std::max<int64_t>(p.head_dim / 2, 1) > kMaxItems)
            return std::nullopt;
    const bool heads_fastest = dense_call(p, true);
    if (!heads_fastest) return dense_call(p, false) ? std::optional<bool>(false) : std::nullopt;
    const bool out_of_place = !p.q_in_place && (!p.has_k || !p.k_in_place);
    const bool flat_wins =
        p.seqlen_q > 1 && dtype_size(p.dtype) == 2 && (p.rotary_dim == p.head_dim || out_of_place);
    return flat_wins ? std::optional<bool>(true) : std::nullopt;
}

}  // namespace

std::optional<RopeBulkParams> bulk_rows_of(const KernelSpec& spec, const RopeProblem& p,
                                           int compute_capability) {
    if (!rope_plan(spec).bulk_rows || compute_capability < 90) return std::nullopt;
    const int64_t row_bytes = p.head_dim * int64_t(dtype_size(p.dtype));
    if (row_bytes % 16 != 0 || row_bytes > kRopeBulkStageBytes) return std::nullopt;
    // The order both tensors share: a single head, or a single token, fits either.
    bool order_found = false, heads_fastest = true;
    for (const bool order : {true, false}) {
        if (bulk_pair(p.q, p.q_out, order) && (!p.has_k || bulk_pair(p.k, p.k_out, order))) {
            order_found = true;
            heads_fastest = order;
            break;
        }
    }
    if (!order_found) return std::nullopt;
    RopeBulkParams bulk = dense_row_counts(p, heads_fastest);
    if (bulk.q_rows > kMaxRows || bulk.k_rows > kMaxRows) return std::nullopt;
    bulk.tile_rows = int(kRopeBulkStageBytes / row_bytes);
    bulk.q_tiles = (bulk.q_rows + bulk.tile_rows - 1) / bulk.tile_rows;
    bulk.tiles = bulk.q_tiles + (bulk.k_rows + bulk.tile_rows - 1) / bulk.tile_rows;
    return bulk;
}

bool flat_rows_call(const RopeProblem& p) { return flat_row_order(p).has_value(); }

std::optional<RopeBulkParams> flat_rows_of(const KernelSpec& spec, const RopeProblem& p) {
    const RopePlan plan = rope_plan(spec);
    const std::optional<bool> heads_fastest = flat_row_order(p);
    if (!plan.flat_rows || !heads_fastest) return std::nullopt;
    const RopeBulkParams rows = dense_row_counts(p, *heads_fastest);
    for (const int64_t n : {rows.q_rows, rows.k_rows})
        if (n > kMaxRows || n * plan.flat_items > kMaxItems) return std::nullopt;
    return rows;
}

RopeBulkLaunch plan_rope_flat_launch(const KernelSpec& spec, const RopeBulkParams& rows) {
    const int64_t items = (rows.q_rows + rows.k_rows) * rope_plan(spec).flat_items;
    RopeBulkLaunch launch;
    launch.blocks = (items + kRopeFlatThreads - 1) / kRopeFlatThreads;
    launch.threads = kRopeFlatThreads;
    return launch;
}

RopeBulkLaunch plan_rope_bulk_launch(const RopeBulkParams& bulk, int64_t sms) {
    RopeBulkLaunch launch;
    launch.blocks = std::min<int64_t>(bulk.tiles, std::max<int64_t>(sms, 1) * kRopeBulkBlocksPerSm);
    launch.threads = kRopeBulkThreads;
    launch.shared_bytes = 128 + unsigned(kRopeBulkStages) * kRopeBulkStageBytes;
    return launch;
}

}  // namespace rope_jit
