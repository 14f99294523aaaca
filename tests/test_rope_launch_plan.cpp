// The RoPE launch plan (kernels_templates/rope_params.h), which the kernel specializes itself
// with and the launcher sizes blocks and shared memory with: its values for known shapes,
// worked out by hand from the kernel's design, and the launch geometry of known problems.
#include <doctest/doctest.h>

#include <string>

#include "common/error.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_cuda.h"
#include "ops/rope/rope_plan.h"
#include "kernel_spec_variants.h"

using rope_jit::KernelSpec;

namespace {

// bf16, head_dim = rotary_dim = 128, q and k (GQA 4), in place, half style, vectors of 8.
KernelSpec llama_spec() {
    KernelSpec spec = rope_test::llama_like_kernel_spec();
    spec.validate();
    return spec;
}

constexpr RopeShape shape(int head_dim, int rotary_dim, int vec, bool interleaved,
                          bool table_full) {
    RopeShape s{};
    s.head_dim = head_dim;
    s.rotary_dim = rotary_dim;
    s.vec = vec;
    s.interleaved = interleaved;
    s.table_full = table_full;
    s.has_k = true;
    s.in_place_q = s.in_place_k = true;
    return s;
}

// The plan is a constant expression, as the kernel needs it to be.
static_assert(rope_plan(shape(128, 128, 8, false, false)).rot_items == 8, "64 pairs, 8 a chunk");
static_assert(rope_plan(shape(128, 128, 8, true, true)).table_span == 8,
              "4 pairs at every other column");

}  // namespace

TEST_CASE("the launch plan of half and interleaved, half and full tables") {
    const RopePlan half = rope_plan(shape(128, 128, 8, false, false));
    CHECK(half.pairs == 64);
    CHECK(half.pairs_per_item == 8);
    CHECK(half.rot_items == 8);  // a chunk of 8 first halves and its partner chunk
    CHECK(half.table_step == 1);
    CHECK(half.table_span == 8);
    CHECK(half.items_per_thread == 2);
    CHECK(half.roles == 1);
    CHECK(half.row_sets == 1);
    CHECK_FALSE(half.shared_angles);
    CHECK_FALSE(half.copies_unrotated);
    CHECK(half.problem == kRopePlanOk);

    const RopePlan interleaved = rope_plan(shape(128, 128, 8, true, false));
    CHECK(interleaved.pairs_per_item == 4);
    CHECK(interleaved.rot_items == 16);  // 128 features, 8 a chunk
    CHECK(interleaved.table_span == 4);
    CHECK(interleaved.items_per_thread == 8);
    const RopePlan full = rope_plan(shape(128, 128, 8, true, true));
    CHECK(full.table_step == 2);  // pair i at column 2i
    CHECK(full.table_span == 8);
    // A full table of half-style pairs holds pair i at column i: no step.
    CHECK(rope_plan(shape(128, 128, 8, false, true)).table_step == 1);
}

TEST_CASE("items are batched two a thread where a head's items are not a power of two") {
    // Half style, vectors of 8: D64 has 4 items a head, D128 8, D80 5 and D96 6.
    for (int head_dim : {64, 128, 256}) {
        CAPTURE(head_dim);
        const RopePlan plan = rope_plan(shape(head_dim, head_dim, 8, false, false));
        CHECK(plan.item_batch == 1);
        CHECK(plan.threads_per_sm == 1536);
    }
    for (int head_dim : {80, 96}) {
        CAPTURE(head_dim);
        RopeShape s = shape(head_dim, head_dim, 8, false, false);
        CHECK(rope_plan(s).item_batch == 2);
        CHECK(rope_plan(s).threads_per_sm == 1024);
        // Not with the frequency gradient's sums, v copied into a cache, or interleaved pairs
        // (eight items a thread, unmeasured batched).
        s.freq_grad = true;
        CHECK(rope_plan(s).item_batch == 1);
        s = shape(head_dim, head_dim, 8, false, false);
        s.v_dim = head_dim, s.v_vec = 8;
        CHECK(rope_plan(s).item_batch == 1);
        CHECK(rope_plan(shape(head_dim, head_dim, 8, true, false)).item_batch == 1);
        CHECK(rope_plan(shape(head_dim, head_dim, 8, true, false)).threads_per_sm == 1536);
    }
    // Partial rotary stays unbatched: in place (GPT-NeoX, 3 items a head) it measured slower,
    // and out of place it takes one item a thread.
    RopeShape partial = shape(96, 24, 4, false, false);
    CHECK(rope_plan(partial).rot_items == 3);
    CHECK(rope_plan(partial).item_batch == 1);
    partial.in_place_q = partial.in_place_k = false;
    CHECK(rope_plan(partial).items_per_thread == 1);
    CHECK(rope_plan(partial).item_batch == 1);
}

TEST_CASE("the launch plan of partial rotary in and out of place, xPos, inv_freq and M-RoPE") {
    RopeShape s = shape(128, 64, 8, false, false);
    CHECK_FALSE(rope_plan(s).chunk_items);  // in place: chunk items would race
    CHECK(rope_plan(s).rot_items == 4);
    s.in_place_q = s.in_place_k = false;
    RopePlan plan = rope_plan(s);
    CHECK(plan.out_of_place_partial);
    CHECK(plan.chunk_items);
    CHECK(plan.rot_items == 8);  // one item per output chunk: 64 features / 8
    CHECK(plan.items_per_thread == 1);
    CHECK(plan.copies_unrotated);
    // Only k out of place: its unrotated features are copied, but q's items rotate in place.
    s.in_place_q = true;
    plan = rope_plan(s);
    CHECK_FALSE(plan.out_of_place_partial);
    CHECK_FALSE(plan.chunk_items);
    CHECK(plan.copies_unrotated);

    s = shape(128, 128, 8, false, false);
    s.has_xpos = s.k_own_angles = true;
    plan = rope_plan(s);
    CHECK(plan.roles == 2);
    CHECK(plan.row_sets == 2);
    CHECK(plan.shared_angles);
    CHECK(plan.shared_pairs == 64);
    s = shape(128, 128, 8, false, false);
    s.mrope_axes = 3;
    s.angles_from_inv_freq = s.freq_grad = true;
    plan = rope_plan(s);
    CHECK(plan.row_sets == 3);
    CHECK(plan.grad_pairs == 64);
    // Per token: cos and sin of 64 pairs (256 bytes each), 3 rows (24 -> 32), the row bases;
    // then the block's 64 gradient sums (256).
    const RopeSmemLayout layout = rope_block_smem(plan, 2);
    CHECK(layout.sin == 512);
    CHECK(layout.rows == 1024);
    CHECK(layout.bases == 1024 + 48);
    CHECK(layout.grad == 1024 + 48 + 2 * int(sizeof(RopeTokenBases)));
    CHECK(layout.bytes == layout.grad + 256);
}

TEST_CASE("the bulk path's plan: out-of-place partial rotary whose items read table spans") {
    RopeShape s = shape(96, 24, 4, false, true);  // GPT-NeoX
    CHECK_FALSE(rope_plan(s).bulk_rows);          // in place: the rows stay where they are
    s.in_place_q = s.in_place_k = false;
    CHECK(rope_plan(s).bulk_rows);
    CHECK_FALSE(rope_plan(s).direct_entry);  // one second entry at most
    RopeShape full = shape(128, 128, 8, false, true);
    full.in_place_q = full.in_place_k = false;
    CHECK_FALSE(rope_plan(full).bulk_rows);  // every feature rotated: the staged path
    // Heads of up to 128 features, whatever their pair items a row; not wider.
    struct Head {
        int head_dim, rotary_dim, vec;
        bool interleaved;
        int items;
        bool bulk;
    };
    for (const Head& h : {Head{112, 64, 8, true, 8, true}, Head{128, 32, 8, false, 2, true},
                          Head{128, 64, 8, false, 4, true}, Head{128, 32, 8, true, 4, true},
                          Head{128, 64, 8, true, 8, true},  // ChatGLM2-6B
                          Head{128, 64, 4, false, 8, true}, Head{256, 64, 8, true, 8, false},
                          Head{256, 32, 8, false, 2, false}, Head{512, 128, 8, false, 8, false}}) {
        RopeShape wide = shape(h.head_dim, h.rotary_dim, h.vec, h.interleaved, true);
        wide.in_place_q = wide.in_place_k = false;
        CAPTURE(h.head_dim);
        CAPTURE(h.rotary_dim);
        CAPTURE(h.interleaved);
        CHECK(rope_plan(wide).bulk_items == h.items);
        CHECK(rope_plan(wide).bulk_rows == h.bulk);
    }
    for (int variant = 0; variant < 6; ++variant) {
        RopeShape other = s;
        other.angles_from_inv_freq = variant == 0 || variant == 2;
        other.has_xpos = other.k_own_angles = variant == 1;
        other.freq_grad = variant == 2;
        other.kv_cache = variant == 3;
        other.q_fp8 = variant == 4;
        other.mrope_axes = variant == 5 ? 3 : 0;
        CAPTURE(variant);
        CHECK_FALSE(rope_plan(other).bulk_rows);
    }
}

TEST_CASE("the bulk path takes dense, aligned rows of q and k in one order, else the staged path") {
    // GPT-NeoX-like: bf16, head_dim 96, 24 rotated, q and k out of place.
    KernelSpec spec = rope_test::llama_like_kernel_spec();
    spec.head_dim = 96;
    spec.rotary_dim = 24;
    spec.vec = 4;
    spec.gqa_group = 1;
    spec.in_place_q = spec.in_place_k = 0;
    spec.validate();
    REQUIRE(rope_jit::rope_plan(spec).bulk_rows);
    const int64_t B = 2, H = 4, S = 300, D = 96;
    // [B, H, S, D] views: heads_fastest ([B, S, H, D] memory) or a head's tokens together.
    auto view = [&](bool heads_fastest, uintptr_t address) {
        rope_jit::TensorRef t;
        t.ndim = 4;
        t.dtype = rope_jit::DType::BF16;
        t.data = reinterpret_cast<char*>(address);
        const int64_t shape[4] = {B, H, S, D};
        const int64_t strides[4] = {H * S * D, heads_fastest ? D : S * D,
                                    heads_fastest ? H * D : D, 1};
        for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
        return t;
    };
    auto problem = [&](bool q_order, bool k_order) {
        rope_jit::RopeProblem p;
        p.batch = B, p.seqlen_q = p.seqlen_k = S, p.heads_q = p.heads_k = H, p.head_dim = D;
        p.dtype = rope_jit::DType::BF16;
        p.has_k = true;
        p.q = view(q_order, 0x100000), p.q_out = view(q_order, 0x200000);
        p.k = view(k_order, 0x300000), p.k_out = view(k_order, 0x400000);
        return p;
    };
    for (const bool heads_fastest : {true, false}) {
        CAPTURE(heads_fastest);
        const rope_jit::RopeProblem p = problem(heads_fastest, heads_fastest);
        const auto bulk = rope_jit::bulk_rows_of(spec, p, 90);
        REQUIRE(bulk.has_value());
        CHECK(bulk->heads_fastest == int(heads_fastest));
        CHECK(bulk->q_rows == B * H * S);
        CHECK(bulk->k_rows == B * H * S);
        CHECK(bulk->tile_rows == kRopeBulkStageBytes / (D * 2));  // 85 rows of 192 bytes
        CHECK(bulk->q_tiles == (B * H * S + 84) / 85);
        CHECK(bulk->tiles == 2 * bulk->q_tiles);
        // The divisors that split a row index into (b, s) in the kernel, in either order.
        CHECK(bulk->q_heads.divisor == H);
        CHECK(bulk->q_seqlen.divisor == S);
        CHECK(bulk->k_heads.divisor == H);
        CHECK(bulk->k_seqlen.divisor == S);
        for (const unsigned row : {0u, 1u, 299u, 300u, 1199u, 1200u, 2399u}) {
            CAPTURE(row);
            const unsigned outer = row_divide(row, heads_fastest ? bulk->q_heads : bulk->q_seqlen);
            CHECK(outer == row / unsigned(heads_fastest ? H : S));
            CHECK(row_divide(outer, heads_fastest ? bulk->q_seqlen : bulk->q_heads) ==
                  row / unsigned(H * S));  // b
        }
        CHECK_FALSE(rope_jit::bulk_rows_of(spec, p, 89).has_value());  // no bulk copy engine
        const rope_jit::RopeBulkLaunch launch = rope_jit::plan_rope_bulk_launch(*bulk, 132);
        CHECK(launch.blocks == std::min<int64_t>(bulk->tiles, 132 * kRopeBulkBlocksPerSm));
        CHECK(launch.threads == kRopeBulkThreads);
        CHECK(launch.shared_bytes == 128 + kRopeBulkStages * kRopeBulkStageBytes);
        CHECK(launch.shared_bytes <= unsigned(kRopeSharedLimit));
    }
    CHECK_FALSE(rope_jit::bulk_rows_of(spec, problem(true, false), 90).has_value());
    rope_jit::RopeProblem p = problem(true, true);
    p.q_out = view(false, 0x200000);  // q_out laid out unlike q
    CHECK_FALSE(rope_jit::bulk_rows_of(spec, p, 90).has_value());
    p = problem(true, true);
    p.k.data += 2;  // k not 16-byte aligned
    CHECK_FALSE(rope_jit::bulk_rows_of(spec, p, 90).has_value());
    p = problem(true, true);
    p.q.strides[2] = 2 * H * D;  // q's tokens a row apart: not one dense run
    CHECK_FALSE(rope_jit::bulk_rows_of(spec, p, 90).has_value());
    p = problem(true, true);
    p.has_k = false;  // q alone; k's views are not looked at
    p.k = view(false, 0x300001);
    const auto q_only = rope_jit::bulk_rows_of(spec, p, 90);
    REQUIRE(q_only.has_value());
    CHECK(q_only->k_rows == 0);
    CHECK(q_only->k_heads.divisor == 0);  // no k rows to divide
    CHECK(q_only->tiles == q_only->q_tiles);
    // One token a sequence: the token stride is never stepped, any value passes.
    p = problem(true, true);
    p.seqlen_q = p.seqlen_k = 1;
    for (rope_jit::TensorRef* t : {&p.q, &p.q_out, &p.k, &p.k_out})
        t->shape[2] = 1, t->strides[2] = 7, t->strides[0] = H * D;
    CHECK(rope_jit::bulk_rows_of(spec, p, 90).has_value());
    // A row that is not a multiple of 16 bytes (head_dim 36 in bf16: 72 bytes).
    KernelSpec narrow = spec;
    narrow.head_dim = 36;
    narrow.rotary_dim = 16;
    narrow.vec = 4;
    narrow.validate();
    p = problem(true, true);
    p.head_dim = 36;
    for (rope_jit::TensorRef* t : {&p.q, &p.q_out, &p.k, &p.k_out}) {
        t->shape[3] = 36;
        t->strides[0] = H * S * 36, t->strides[1] = 36, t->strides[2] = H * 36;
    }
    CHECK_FALSE(rope_jit::bulk_rows_of(narrow, p, 90).has_value());
    // In place: no bulk path at all (its plan has none).
    KernelSpec in_place = spec;
    in_place.in_place_q = in_place.in_place_k = 1;
    CHECK_FALSE(rope_jit::bulk_rows_of(in_place, problem(true, true), 90).has_value());
}

TEST_CASE("the flat path's plan: plain RoPE of the direct path's kind, no cache, norm or FP8") {
    RopeShape s = shape(128, 128, 8, false, true);  // Llama, in place
    CHECK_FALSE(rope_plan(s).flat_rows);  // not a call on dense rows: no flat entry to compile
    s.dense_rows = true;
    CHECK(rope_plan(s).flat_rows);
    s.in_place_q = s.in_place_k = false;  // out of place, full rotary: still one store an item
    CHECK(rope_plan(s).flat_rows);
    RopeShape partial = shape(64, 32, 8, false, true);  // in place: only the rotated spans
    partial.dense_rows = true;
    CHECK(rope_plan(partial).flat_rows);
    // Out of place, half style: unrotated features to copy; rows of 8 vectors, 4 a warp, so
    // that a rotated vector takes its partner from another lane (flat_shuffles).
    partial.in_place_q = partial.in_place_k = false;
    CHECK(rope_plan(partial).flat_rows);
    CHECK(rope_plan(partial).flat_copies);
    CHECK(rope_plan(partial).flat_shuffles);
    CHECK(rope_plan(partial).flat_items == 8);
    CHECK_FALSE(rope_plan(partial).bulk_rows);
    RopeShape quarter = partial;  // rows of 4 vectors
    quarter.head_dim = 32, quarter.rotary_dim = 16;
    CHECK(rope_plan(quarter).flat_shuffles);
    CHECK(rope_plan(quarter).flat_items == 4);
    // Other half-style rows: Phi-2's rows of 10 vectors, D128 64/128's of 16 (shuffles lost
    // there, H200 run EY), proportional pairs (a partner half a row away): the bulk path up
    // to 128 features. A rotated half that is not whole vectors (8 of 64: halves of 4 features
    // in 8-element vectors) has no shuffles.
    RopeShape phi2 = partial;
    phi2.head_dim = 80;
    CHECK_FALSE(rope_plan(phi2).flat_rows);
    CHECK(rope_plan(phi2).bulk_rows);
    RopeShape half128 = partial;
    half128.head_dim = 128, half128.rotary_dim = 64;
    CHECK_FALSE(rope_plan(half128).flat_rows);
    CHECK(rope_plan(half128).bulk_rows);
    RopeShape proportional = partial;
    proportional.proportional = true;
    CHECK_FALSE(rope_plan(proportional).flat_rows);
    CHECK(rope_plan(proportional).bulk_rows);
    RopeShape split = partial;
    split.rotary_dim = 8;
    CHECK_FALSE(rope_plan(split).flat_shuffles);
    CHECK_FALSE(rope_plan(split).flat_rows);
    // Interleaved pairs in 8-element vectors: every vector of the row rotated or copied
    // (flat_copies), no bulk entry.
    RopeShape pairs = partial;
    pairs.interleaved = true;
    CHECK(rope_plan(pairs).flat_rows);
    CHECK(rope_plan(pairs).flat_copies);
    CHECK(rope_plan(pairs).flat_items == 8);  // 64 features, 8 a vector
    CHECK_FALSE(rope_plan(pairs).bulk_rows);
    // Vectors under 8 elements (float32), or that do not tile the row (a span at feature 4):
    // the bulk path.
    RopeShape narrow = pairs;
    narrow.vec = 4;
    CHECK_FALSE(rope_plan(narrow).flat_rows);
    CHECK(rope_plan(narrow).bulk_rows);
    RopeShape shifted = pairs;
    shifted.rotary_offset = 4;
    CHECK_FALSE(rope_plan(shifted).flat_rows);
    CHECK(rope_plan(shifted).bulk_rows);
    for (int variant = 0; variant < 8; ++variant) {
        RopeShape other = shape(64, 64, 8, true, true);
        other.dense_rows = true;
        other.angles_from_inv_freq = variant == 0;
        other.has_xpos = variant == 1;
        other.freq_grad = variant == 2;  // (with inv_freq)
        other.angles_from_inv_freq |= variant == 2;
        other.kv_cache = variant == 3;
        other.qk_norm = variant == 4;
        other.q_fp8 = variant == 5;
        other.mrope_axes = variant == 6 ? 3 : 0;
        other.v_dim = variant == 7 ? 64 : 0;
        CAPTURE(variant);
        CHECK_FALSE(rope_plan(other).flat_rows);
    }
    // At most one second entry a plan (rope_recipe.cpp names one).
    for (const bool kv : {false, true})
        for (const bool in_place : {false, true})
            for (const int rotary : {32, 64}) {
                RopeShape x = shape(64, rotary, 8, false, true);
                x.dense_rows = true;
                x.kv_cache = kv;
                x.in_place_q = x.in_place_k = in_place;
                const RopePlan plan = rope_plan(x);
                CHECK(int(plan.flat_rows) + int(plan.bulk_rows) + int(plan.direct_entry) <= 1);
            }
}

TEST_CASE("the flat path takes dense rows: [B, H, S, D] ones, and [B, S, H, D] ones of 16-bit "
          "elements rotated whole over more than one token; else the others") {
    KernelSpec spec = llama_spec();  // bf16, D128, in place
    CHECK_FALSE(rope_jit::rope_plan(spec).flat_rows);
    spec.dense_rows = 1;  // what make_kernel_spec derives for the calls below
    spec.validate();
    REQUIRE(rope_jit::rope_plan(spec).flat_rows);
    const int64_t B = 2, Hq = 4, Hk = 2, S = 300, D = 128;
    // [B, H, S, D] views in memory order [B, H, S, D] (dense_rows) or [B, S, H, D].
    auto view = [&](int64_t H, bool dense_rows) {
        rope_jit::TensorRef t;
        t.ndim = 4;
        t.dtype = rope_jit::DType::BF16;
        t.data = reinterpret_cast<char*>(uintptr_t(1) << 20);
        const int64_t shape[4] = {B, H, S, D};
        const int64_t strides[4] = {H * S * D, dense_rows ? S * D : D, dense_rows ? D : H * D, 1};
        for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
        return t;
    };
    auto problem = [&](bool dense_rows) {
        rope_jit::RopeProblem p;
        p.batch = B, p.seqlen_q = p.seqlen_k = S, p.heads_q = Hq, p.heads_k = Hk, p.head_dim = D;
        p.rotary_dim = D;
        p.dtype = rope_jit::DType::BF16;
        p.has_k = true;
        p.q = p.q_out = view(Hq, dense_rows);
        p.k = p.k_out = view(Hk, dense_rows);
        return p;
    };
    const auto rows = rope_jit::flat_rows_of(spec, problem(true));
    REQUIRE(rows.has_value());
    CHECK(rows->q_rows == B * Hq * S);
    CHECK(rows->k_rows == B * Hk * S);
    CHECK(rows->heads_fastest == 0);
    CHECK(rows->q_heads.divisor == Hq);
    CHECK(rows->q_seqlen.divisor == S);
    CHECK(rows->k_heads.divisor == Hk);
    CHECK(rows->k_seqlen.divisor == S);
    // A row's (b, s) as the kernel finds it: the plane (b, h) = row / S, b = plane / H.
    for (const unsigned row : {0u, 299u, 300u, 1199u, 1200u, 2399u}) {
        CAPTURE(row);
        const unsigned plane = row_divide(row, rows->q_seqlen);
        CHECK(plane == row / S);
        CHECK(row_divide(plane, rows->q_heads) == row / (Hq * S));
    }
    const rope_jit::RopeBulkLaunch launch = rope_jit::plan_rope_flat_launch(spec, *rows);
    const int64_t items = (B * Hq * S + B * Hk * S) * rope_jit::rope_plan(spec).rot_items;
    CHECK(launch.threads == kRopeFlatThreads);
    CHECK(launch.blocks == (items + kRopeFlatThreads - 1) / kRopeFlatThreads);
    CHECK(launch.shared_bytes == 0);
    // [B, S, H, D] memory: a token's heads together, its row's (b, s) = (row / H) split by S.
    const auto token_rows = rope_jit::flat_rows_of(spec, problem(false));
    REQUIRE(token_rows.has_value());
    CHECK(token_rows->q_rows == B * Hq * S);
    CHECK(token_rows->k_rows == B * Hk * S);
    CHECK(token_rows->heads_fastest == 1);
    for (const unsigned row : {0u, 3u, 4u, 1199u, 1200u, 2399u}) {
        CAPTURE(row);
        const unsigned token = row_divide(row, token_rows->q_heads);
        CHECK(token == row / Hq);
        CHECK(row_divide(token, token_rows->q_seqlen) == row / (Hq * S));
    }
    // There: float32 (the direct path is faster), partial rotary in place, no.
    rope_jit::RopeProblem tokens = problem(false);
    tokens.dtype = rope_jit::DType::F32;
    CHECK_FALSE(rope_jit::flat_rows_call(tokens));
    CHECK_FALSE(rope_jit::flat_rows_of(spec, tokens).has_value());
    tokens = problem(false);
    tokens.rotary_dim = D / 2;
    CHECK_FALSE(rope_jit::flat_rows_call(tokens));
    // In [B, H, S, D] memory both are flat (measured apart only there: rope_dense_rows.h).
    rope_jit::RopeProblem heads = problem(true);
    heads.dtype = rope_jit::DType::F32;
    heads.rotary_dim = D / 2;
    CHECK(rope_jit::flat_rows_call(heads));
    // q and k in different orders; an output laid out unlike its input; rows with padding.
    rope_jit::RopeProblem p = problem(true);
    p.k = p.k_out = view(Hk, false);
    CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    p = problem(true);
    p.q_out = view(Hq, false);
    CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    p = problem(true);
    p.q.strides[1] = p.q_out.strides[1] = (S + 1) * D;  // a head plane one row longer
    CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    // q alone: k's views are not looked at.
    p = problem(true);
    p.has_k = false;
    p.k = view(Hk, false);
    const auto q_only = rope_jit::flat_rows_of(spec, p);
    REQUIRE(q_only.has_value());
    CHECK(q_only->k_rows == 0);
    CHECK(q_only->k_heads.divisor == 0);
    // One token a sequence (the two orders are one): decode keeps the direct path.
    p = problem(true);
    p.seqlen_q = p.seqlen_k = 1;
    for (rope_jit::TensorRef* t : {&p.q, &p.q_out, &p.k, &p.k_out}) t->shape[2] = 1;
    CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    // One head (the two orders are one) over many tokens: the token order, flat.
    p = problem(true);
    p.heads_q = p.heads_k = 1;
    p.q = p.q_out = p.k = p.k_out = view(1, true);
    const auto one_head = rope_jit::flat_rows_of(spec, p);
    REQUIRE(one_head.has_value());
    CHECK(one_head->heads_fastest == 1);
    // A positions tensor: each item looks its position up, flat in either order. A packed
    // batch: no.
    for (const bool order : {true, false}) {
        p = problem(order);
        p.position_mode = rope_jit::PositionMode::Indices;
        CHECK(rope_jit::flat_rows_call(p));
        CHECK(rope_jit::flat_rows_of(spec, p).has_value());
        p.packed = true;
        CHECK_FALSE(rope_jit::flat_rows_call(p));
        CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    }
    // Sequence offsets (position_mode 2): the kernel reads them by the row's b.
    KernelSpec with_offsets = spec;
    with_offsets.position_mode = 2;
    p = problem(true);
    p.position_mode = rope_jit::PositionMode::SeqlenOffsets;
    CHECK(rope_jit::flat_rows_of(with_offsets, p).has_value());
    // A spec without dense_rows (not derived from such a call): no flat entry, no flat path.
    KernelSpec other_layout = spec;
    other_layout.dense_rows = 0;
    CHECK_FALSE(rope_jit::flat_rows_of(other_layout, problem(true)).has_value());
    // A plan without flat_rows (a KV cache): no.
    KernelSpec kv = spec;
    kv.kv_cache = 1;
    CHECK_FALSE(rope_jit::flat_rows_of(kv, problem(true)).has_value());
    // Rows or items past the kernel's 32-bit counts: the other paths.
    p = problem(true);
    p.batch = (int64_t(1) << 32) / (Hq * S * rope_jit::rope_plan(spec).rot_items) + 1;
    for (rope_jit::TensorRef* t : {&p.q, &p.q_out, &p.k, &p.k_out}) t->shape[0] = p.batch;
    CHECK_FALSE(rope_jit::flat_rows_of(spec, p).has_value());
    // Not a flat call then (so its spec has no dense_rows: a dense_rows module's rope_kernel is
    // empty); flat_rows_call bounds items by half the features, at or above the items a row.
    CHECK_FALSE(rope_jit::flat_rows_call(p));
    p = problem(true);
    p.batch = (int64_t(1) << 32) / (Hq * S * (D / 2));
    for (rope_jit::TensorRef* t : {&p.q, &p.q_out, &p.k, &p.k_out}) t->shape[0] = p.batch;
    CHECK(rope_jit::flat_rows_call(p));
    CHECK(rope_jit::flat_rows_of(spec, p).has_value());
}

TEST_CASE("a vector width that splits pairs has no plan, and the spec does not validate") {
    CHECK(rope_plan(shape(128, 128, 1, true, false)).problem ==
          kRopePlanVecSplitsPairs);  // half a pair
    CHECK(rope_plan(shape(12, 12, 4, false, false)).problem ==
          kRopePlanVecSplitsPairs);  // 6 pairs by 4
    CHECK(rope_plan(shape(12, 12, 2, false, false)).problem == kRopePlanOk);
    KernelSpec spec = llama_spec();
    spec.head_dim = spec.rotary_dim = 12;
    spec.vec = 4;
    CHECK_THROWS_WITH_AS(spec.validate(), doctest::Contains("vec 4 does not divide the 6 pairs"),
                         rope_jit::Error);
}

TEST_CASE("launch geometry: blocks fit their tokens' items, the grid and shared memory") {
    const KernelSpec spec = llama_spec();
    // Llama 3 8B, 4 x 4096 tokens: 40 heads of 8 items = 320 items a token: one token a block
    // (rope_block_fit: two items a thread), taken on the direct path, one item a thread, so 320
    // threads; shared memory as sized for one token (one table row and the row bases).
    rope_jit::RopeLaunch launch = rope_jit::plan_rope_launch(spec, 32, 8, 4 * 4096, 132, true);
    CHECK(launch.tokens_per_block == 1);
    CHECK(launch.threads == 320);
    CHECK(launch.blocks == 4 * 4096);
    CHECK(launch.shared_bytes == 16 + sizeof(RopeTokenBases));
    CHECK(launch.direct);
    CHECK_FALSE(launch.items_by_head);  // one token a block: no order to choose
    // One head: 16 items a token, 512 / 16 = 32 tokens a block, 256 threads.
    launch = rope_jit::plan_rope_launch(spec, 1, 1, 1 << 20, 132, true);
    CHECK(launch.tokens_per_block == 32);
    CHECK(launch.threads == 256);
    CHECK(launch.blocks == (1 << 20) / 32);
    CHECK_FALSE(launch.items_by_head);  // [B, S, H, D]: a token's heads lie together
    // The same tokens of a [B, H, S, D] buffer: items ordered by head, so that a warp reads
    // one head's consecutive rows; the geometry is the same.
    const rope_jit::RopeLaunch by_head = rope_jit::plan_rope_launch(spec, 1, 1, 1 << 20, 132, false);
    CHECK(by_head.items_by_head);
    CHECK(by_head.tokens_per_block == 32);
    CHECK(by_head.threads == 256);
    // Few tokens: blocks halve until every multiprocessor has two, down to one token.
    launch = rope_jit::plan_rope_launch(spec, 1, 1, 1000, 132, true);
    CHECK(launch.tokens_per_block == 2);  // 32 -> 16 -> 8 -> 4 -> 2 (500 blocks >= 264)
    CHECK(launch.blocks == 500);
    CHECK(launch.threads == 32);

    // Decode (B = 64, a token each, under one block per multiprocessor): one item a thread,
    // 320 threads, as for many tokens.
    launch = rope_jit::plan_rope_launch(spec, 32, 8, 64, 132, true);
    CHECK(launch.tokens_per_block == 1);
    CHECK(launch.blocks == 64);
    CHECK(launch.threads == 320);
    CHECK(launch.shared_bytes == 16 + sizeof(RopeTokenBases));
    launch = rope_jit::plan_rope_launch(spec, 32, 8, 132, 132, true);
    CHECK(launch.threads == 320);
    launch = rope_jit::plan_rope_launch(spec, 32, 8, 133, 132, true);
    CHECK(launch.threads == 320);
    // A token's items past the block bound (64 heads of 16 items): unchanged.
    KernelSpec d256 = spec;
    d256.head_dim = d256.rotary_dim = 256;
    launch = rope_jit::plan_rope_launch(d256, 32, 32, 8, 132, true);
    CHECK(launch.threads == rope_jit::plan_rope_launch(d256, 32, 32, 1 << 16, 132, true).threads);
    // One head of one token: a warp.
    launch = rope_jit::plan_rope_launch(spec, 1, 0, 1, 132, true);
    CHECK(launch.threads == 32);
    CHECK(launch.blocks == 1);

    CHECK_THROWS_WITH_AS(rope_jit::plan_rope_launch(spec, 32, 8, int64_t(3) << 40, 132, true),
                         doctest::Contains("exceed one launch's grid"), rope_jit::Error);
    KernelSpec wide = spec;
    wide.head_dim = wide.rotary_dim = 8192;
    wide.angles_from_inv_freq = 1, wide.k_own_angles = 1, wide.table_vec_loads = 0;
    CHECK_THROWS_WITH_AS(rope_jit::plan_rope_launch(wide, 8, 8, 100, 132, true),
                         doctest::Contains("65600 bytes of shared memory"), rope_jit::Error);
}

TEST_CASE("launch geometry: which one-token launches skip the shared-memory staging (direct)") {
    const KernelSpec spec = llama_spec();
    // Decode and prefill of one token a block: direct, whatever the layout.
    CHECK(rope_jit::plan_rope_launch(spec, 32, 8, 64, 132, true).direct);
    CHECK(rope_jit::plan_rope_launch(spec, 32, 8, 132, 132, true).direct);
    CHECK(rope_jit::plan_rope_launch(spec, 32, 8, 133, 132, true).direct);
    CHECK(rope_jit::plan_rope_launch(spec, 32, 8, 4 * 4096, 132, true).direct);
    CHECK(rope_jit::plan_rope_launch(spec, 32, 8, 4 * 4096, 132, false).direct);
    // Few heads: several tokens a block even at decode, so staged.
    CHECK_FALSE(rope_jit::plan_rope_launch(spec, 1, 1, 1000, 132, true).direct);
    // D64, 16 + 16 heads (128 items a token): rope_block_fit puts 4 tokens in a block; where a
    // token's rows lie together ([B, S, H, D]) one token a block on the direct path instead,
    // 128 threads; [B, H, S, D] keeps the staged blocks, whose tokens lie together.
    KernelSpec d64 = spec;
    d64.head_dim = d64.rotary_dim = 64;
    d64.gqa_group = 1;
    rope_jit::RopeLaunch launch = rope_jit::plan_rope_launch(d64, 16, 16, 8 * 2048, 132, true);
    CHECK(launch.direct);
    CHECK(launch.tokens_per_block == 1);
    CHECK(launch.threads == 128);
    CHECK(launch.blocks == 8 * 2048);
    launch = rope_jit::plan_rope_launch(d64, 16, 16, 8 * 2048, 132, false);
    CHECK_FALSE(launch.direct);
    CHECK(launch.tokens_per_block == 4);
    // Interleaved pairs: one token a block too, at four items a thread where a token has 512
    // items or more (Llama: 640 items, 160 threads), else one (GPT-J's partial rotary in place,
    // 16 + 16 heads of 8 items: 256 threads).
    KernelSpec interleaved = spec;
    interleaved.interleaved = 1;
    interleaved.validate();
    launch = rope_jit::plan_rope_launch(interleaved, 32, 8, 4 * 4096, 132, true);
    CHECK(launch.direct);
    CHECK(launch.threads == 160);
    KernelSpec gptj = interleaved;
    gptj.head_dim = 256, gptj.rotary_dim = 64, gptj.gqa_group = 1;
    gptj.validate();
    launch = rope_jit::plan_rope_launch(gptj, 16, 16, 8 * 2048, 132, true);
    CHECK(launch.direct);
    CHECK(launch.threads == 256);
    // Positions, seqlen_offsets and packed batches (a lookup per thread) stay staged.
    KernelSpec positions = spec;
    positions.position_mode = 1;
    CHECK_FALSE(rope_jit::plan_rope_launch(positions, 32, 8, 4 * 4096, 132, true).direct);
    positions.position_mode = 2;
    CHECK_FALSE(rope_jit::plan_rope_launch(positions, 32, 8, 4 * 4096, 132, true).direct);
    KernelSpec packed = spec;
    packed.packed = 1;
    CHECK_FALSE(rope_jit::plan_rope_launch(packed, 32, 8, 4 * 4096, 132, true).direct);
    // ... except at decode, up to two tokens a multiprocessor, where each thread resolving
    // its own rows is shorter than the staged path's barrier.
    CHECK(rope_jit::plan_rope_launch(positions, 32, 8, 64, 132, true).direct);
    CHECK(rope_jit::plan_rope_launch(positions, 32, 8, 264, 132, true).direct);
    CHECK_FALSE(rope_jit::plan_rope_launch(positions, 32, 8, 265, 132, true).direct);
    // Item batches (D80: 5 items a head) stay staged.
    KernelSpec d80 = spec;
    d80.head_dim = d80.rotary_dim = 80;
    d80.gqa_group = 1;
    CHECK(rope_jit::rope_plan(d80).item_batch == 2);
    CHECK_FALSE(rope_jit::plan_rope_launch(d80, 32, 32, 4 * 4096, 132, true).direct);
    // Angles computed once per token into shared memory (inv_freq) keep the staged path.
    KernelSpec inv_freq = spec;
    inv_freq.angles_from_inv_freq = 1, inv_freq.table_vec_loads = 0, inv_freq.table_full = 0;
    CHECK_FALSE(rope_jit::plan_rope_launch(inv_freq, 32, 8, 64, 132, true).direct);
    // ... and take one item a thread at decode all the same: 320 threads.
    CHECK(rope_jit::plan_rope_launch(inv_freq, 32, 8, 64, 132, true).threads == 320);

    // Paged KV cache with v, FP8 (the llama3-8b prefill of rope-jit-bench): 40 heads of 8
    // rotation items and 8 heads of 8 v items (two 16-byte vectors each on the direct path) =
    // 384 items, one token and 192 threads a block, direct at every size.
    KernelSpec kv = spec;
    kv.in_place_k = 0, kv.kv_cache = 2, kv.kv_index_int64 = 1, kv.kv_fp8 = 1;
    kv.v_dim = 128, kv.v_vec = 8;
    kv.validate();
    launch = rope_jit::plan_rope_launch(kv, 32, 8, 4 * 4096, 132, true);
    CHECK(launch.tokens_per_block == 1);
    CHECK(launch.threads == 192);
    CHECK(launch.direct);
    launch = rope_jit::plan_rope_launch(kv, 32, 8, 64, 132, true);  // decode: an item a thread
    CHECK(launch.threads == 384);
    CHECK(launch.direct);
    CHECK(rope_jit::rope_plan(kv).v_items == 16);
    CHECK(rope_jit::rope_plan(kv).v_direct_items == 8);
    // v's vectors pair up only when they are vectors and even in number: 8 heads of 5 items
    // with 40 features of v (v_vec 8), or of 128 items with scalar copies (v_vec 1), stay so.
    KernelSpec odd = kv;
    odd.v_dim = 40;
    odd.validate();
    CHECK(rope_jit::rope_plan(odd).v_direct_items == 5);
    launch = rope_jit::plan_rope_launch(odd, 32, 8, 4 * 4096, 132, true);
    CHECK(launch.threads == 192);  // (320 + 40) / 2 = 180 items, rounded up to warps
    KernelSpec scalar = kv;
    scalar.v_vec = 1;
    scalar.validate();
    CHECK(rope_jit::rope_plan(scalar).v_direct_items == 128);
    // Partial rotary: k's unrotated features are copied into the cache, which the direct path
    // does not do.
    KernelSpec partial = kv;
    partial.rotary_dim = 64;
    partial.validate();
    CHECK_FALSE(rope_jit::plan_rope_launch(partial, 32, 8, 64, 132, true).direct);
}

TEST_CASE("token rows are adjacent in [B, S, H, D] and packed buffers, not in [B, H, S, D]") {
    // [B, H, S, D] views (as RopeProblem holds q and k) of 2 x 8 heads x 16 tokens x 64.
    auto view = [](int64_t heads, int64_t tokens, int64_t head_stride, int64_t token_stride) {
        rope_jit::TensorRef t;
        t.ndim = 4;
        const int64_t shape[4] = {2, heads, tokens, 64};
        const int64_t strides[4] = {heads * tokens * 64, head_stride, token_stride, 1};
        for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
        return t;
    };
    const rope_jit::TensorRef bshd = view(8, 16, 64, 8 * 64), bhsd = view(8, 16, 16 * 64, 64);
    CHECK(rope_jit::token_rows_adjacent(bshd, nullptr));
    CHECK(rope_jit::token_rows_adjacent(bshd, &bshd));
    CHECK_FALSE(rope_jit::token_rows_adjacent(bhsd, nullptr));
    CHECK_FALSE(rope_jit::token_rows_adjacent(bshd, &bhsd));
    CHECK(rope_jit::token_rows_adjacent(view(1, 16, 16 * 64, 64), nullptr));  // one head
    // One token a sequence: from token to token is the batch stride.
    CHECK(rope_jit::token_rows_adjacent(view(8, 1, 64, 64), nullptr));
    CHECK_FALSE(rope_jit::token_rows_adjacent(view(8, 1, 1 << 20, 64), nullptr));
}
