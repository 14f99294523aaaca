// KV cache and FP8 test problems, shared by test_rope_kv_cache.cpp (CPU backend against the
// definitions) and test_gpu_rope_kv_cache.cpp (CUDA backend against the CPU backend): a family
// index gives a call (layout, slot source, dtype, style, partial rotary, GQA, varlen,
// positions, FP8 outputs and scales), make_kv_problem its tensors with valid, distinct cache
// slots, and check_against_definition the expected contents, computed here from the
// definitions in float64 (slots from first principles; e4m3fn by enumeration).
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_problem.h"
#include "rope_jit/rope_jit.h"
#include "rope_test_support.h"

namespace kv_test {

using rope_test::Dt;
using rope_test::e4m3_nearest;
using rope_test::e4m3_value;
using rope_test::HostTensor;

constexpr uint32_t kKvSeed = 2323;
constexpr double kNormEps = 1e-5;
constexpr int kKvFamilies = 96;

enum class KvIndex { Rows, SlotMapping, BlockTables };

struct KvCase {
    Dt dt = Dt::BF16;
    rope_jit_style style = ROPE_JIT_STYLE_HALF;
    int64_t D = 64, R = 64, offset = 0, B = 2, S = 5, Hk = 2, group = 2, Dv = 64;
    rope_jit_kv_cache_layout layout = ROPE_JIT_KV_CACHE_PAGED_NHD;
    KvIndex index = KvIndex::SlotMapping;
    Dt index_dt = Dt::I64;
    int64_t block_size = 4;
    bool fp8 = false, scales = false, q_fp8 = false, packed = false, positions = false;
    bool offsets = false, inv_freq = false, bshd = true, in_place_q = true, skip_slots = false;
    bool tiny_scale = false;                 // scales small enough that some values saturate at 448
    bool norm = false, unit_offset = false;  // QK-norm before the rotation (weights [D])
    Dt norm_dt = Dt::F32;                    // the weights' dtype
    int64_t norm_step = 1;                   // their elements' distance (> 1: read one by one)
};

inline std::string describe(const KvCase& c) {
    const char* layouts[] = {"none", "contiguous", "nhd", "hnd"};
    const char* indexes[] = {"rows", "slots", "tables"};
    const char* styles[] = {"half", "interleaved", "proportional"};
    return std::string(rope_test::dt_name(c.dt)) + " " + styles[c.style] + " D" +
           std::to_string(c.D) + " R" + std::to_string(c.R) + "@" + std::to_string(c.offset) +
           " Dv" + std::to_string(c.Dv) + " B" + std::to_string(c.B) + " S" + std::to_string(c.S) +
           " Hk" + std::to_string(c.Hk) + "x" + std::to_string(c.group) + " " + layouts[c.layout] +
           "/" + indexes[int(c.index)] + (c.index_dt == Dt::I32 ? "/i32" : "") + " bs" +
           std::to_string(c.block_size) + (c.fp8 ? " fp8" : "") + (c.scales ? " scales" : "") +
           (c.tiny_scale ? "(tiny)" : "") + (c.q_fp8 ? " q_fp8" : "") +
           (c.packed ? " packed" : "") + (c.positions ? " positions" : "") +
           (c.offsets ? " offsets" : "") + (c.inv_freq ? " inv_freq" : "") +
           (c.bshd ? " bshd" : " bhsd") + (c.in_place_q ? "" : " q_out") +
           (c.skip_slots ? " skips" : "") +
           (c.norm ? (c.unit_offset ? " qk-norm(1+w)" : " qk-norm") : "") +
           (c.norm ? std::string(" w:") + rope_test::dt_name(c.norm_dt) +
                         (c.norm_step > 1 ? "/" + std::to_string(c.norm_step) : "")
                   : "");
}

// Family f: a deterministic mix of every option (the first few are the plain cases).
inline KvCase kv_case(int f) {
    std::mt19937 rng(uint32_t(kKvSeed * 31 + f));
    auto pick = [&](int n) { return int(rng() % uint32_t(n)); };
    KvCase c;
    c.dt = std::vector<Dt>{Dt::BF16, Dt::F16, Dt::F32}[size_t(pick(3))];
    c.style = rope_jit_style(pick(3));
    const int64_t dims[] = {16, 64, 128, 80, 256};
    c.D = dims[pick(5)];
    c.R = c.D;
    if (pick(3) == 0) c.R = c.D / 2;
    if (c.style == ROPE_JIT_STYLE_PROPORTIONAL && c.R == c.D && pick(2)) c.R = c.D / 4;
    if (c.R % 2) c.R -= 1;
    if (c.style != ROPE_JIT_STYLE_PROPORTIONAL && c.R < c.D && pick(2)) c.offset = c.D - c.R;
    c.B = 1 + pick(3);
    c.S = 1 + pick(9);
    c.Hk = 1 + pick(3);
    c.group = std::vector<int64_t>{1, 2, 4}[size_t(pick(3))];
    c.Dv = pick(4) == 0 ? 0 : pick(3) == 0 ? 40 : c.D;
    c.layout = rope_jit_kv_cache_layout(1 + pick(3));
    c.index = c.layout == ROPE_JIT_KV_CACHE_CONTIGUOUS ? KvIndex::Rows
              : pick(2)                                ? KvIndex::SlotMapping
                                                       : KvIndex::BlockTables;
    c.index_dt = pick(2) ? Dt::I64 : Dt::I32;
    c.block_size = std::vector<int64_t>{1, 4, 16}[size_t(pick(3))];
    c.fp8 = pick(2);
    c.scales = c.fp8 && pick(3) != 0;
    c.tiny_scale = c.scales && pick(4) == 0;
    c.q_fp8 = pick(4) == 0;
    c.packed = pick(3) == 0;
    c.positions = pick(3) == 0;
    c.offsets = pick(2);
    c.inv_freq = pick(3) == 0;
    c.bshd = pick(3) != 0;
    c.in_place_q = !c.q_fp8 && pick(2);
    c.skip_slots = c.index == KvIndex::SlotMapping && pick(2);
    c.norm = pick(4) == 0;
    c.unit_offset = c.norm && pick(2);
    c.norm_dt = std::vector<Dt>{Dt::F32, Dt::BF16, Dt::F16}[size_t(pick(3))];
    c.norm_step = pick(4) == 0 ? 3 : 1;
    if (f < 6) {  // plain cases first: each layout and slot source, bf16 and fp8
        c = KvCase{};
        c.layout = rope_jit_kv_cache_layout(1 + f % 3);
        c.index = f % 3 == 0 ? KvIndex::Rows : f < 3 ? KvIndex::SlotMapping : KvIndex::BlockTables;
        c.fp8 = f >= 3;
        c.scales = f >= 3;
        c.offsets = c.index != KvIndex::SlotMapping;
    }
    return c;
}

// The tensors of one call, and what the reference needs to know about its tokens.
struct KvProblem {
    KvCase c;
    HostTensor q, k, v, q_out, k_cache, v_cache, cos, sin, inv_freq, positions, offsets;
    HostTensor cu_seqlens, slot_mapping, block_tables, k_scale, v_scale, q_scale, q_ref_out;
    HostTensor q_norm_weight, k_norm_weight;
    int64_t tokens = 0, num_sequences = 0;
    // Per token t of k (t = b * S + s, or the packed index): its (b, s) in the lifted view, its
    // table row and its cache cell (block, slot), block -1 when skipped.
    std::vector<int64_t> tb, ts, row, block, slot;
};

inline std::vector<HostTensor*> slots_of(KvProblem& p) {
    return {&p.q,
            &p.k,
            &p.v,
            &p.q_out,
            &p.k_cache,
            &p.v_cache,
            &p.cos,
            &p.sin,
            &p.inv_freq,
            &p.positions,
            &p.offsets,
            &p.cu_seqlens,
            &p.slot_mapping,
            &p.block_tables,
            &p.k_scale,
            &p.v_scale,
            &p.q_scale,
            &p.q_ref_out,
            &p.q_norm_weight,
            &p.k_norm_weight};
}

// DLTensor views of the problem's tensors, NULL for the unused ones.
inline std::vector<const DLTensor*> host_views(KvProblem& p) {
    std::vector<const DLTensor*> views;
    for (HostTensor* t : slots_of(p)) views.push_back(t->shape().empty() ? nullptr : t->dl());
    return views;
}

inline KvProblem make_kv_problem(const KvCase& c, std::mt19937& rng) {
    KvProblem p;
    p.c = c;
    const int64_t Hq = c.Hk * c.group, pairs = c.R / 2;
    // Sequences: B of S tokens, or packed: B sequences of random lengths (some empty).
    std::vector<int64_t> starts = {0};
    if (c.packed) {
        for (int64_t b = 0; b < c.B; ++b) starts.push_back(starts.back() + int64_t(rng() % 6));
        p.tokens = starts.back();
        p.num_sequences = c.B;
    } else {
        p.tokens = c.B * c.S;
        p.num_sequences = c.B;
    }
    auto activations = [&](int64_t H, int64_t D) {
        if (c.packed) return HostTensor(c.dt, {p.tokens, H, D});
        return c.bshd ? HostTensor(c.dt, {c.B, H, c.S, D}, {0, 2, 1, 3})
                      : HostTensor(c.dt, {c.B, H, c.S, D});
    };
    p.q = activations(Hq, c.D);
    p.k = activations(c.Hk, c.D);
    p.q.fill_uniform(rng, -2, 2);
    p.k.fill_uniform(rng, -2, 2);
    if (c.Dv > 0) {
        p.v = activations(c.Hk, c.Dv);
        p.v.fill_uniform(rng, -2, 2);
    }
    if (c.q_fp8)
        p.q_out = c.packed ? HostTensor(Dt::F8, {p.tokens, Hq, c.D})
                           : HostTensor(Dt::F8, {c.B, Hq, c.S, c.D}, {0, 2, 1, 3});
    else if (!c.in_place_q)
        p.q_out = activations(Hq, c.D);
    p.q_ref_out = activations(Hq, c.D);

    // Each token's sequence, index, table row and cache position.
    std::uniform_int_distribution<int64_t> small(0, 6);
    std::vector<int64_t> seq_offset(size_t(p.num_sequences)), seq_shift(size_t(p.num_sequences));
    for (int64_t b = 0; b < p.num_sequences; ++b) {
        seq_offset[size_t(b)] = small(rng);
        seq_shift[size_t(b)] = small(rng);
    }
    std::vector<int64_t> sequence(size_t(p.tokens)), index(size_t(p.tokens)),
        position(size_t(p.tokens)), cache_position(size_t(p.tokens));
    p.tb.resize(size_t(p.tokens));
    p.ts.resize(size_t(p.tokens));
    for (int64_t t = 0; t < p.tokens; ++t) {
        if (c.packed) {
            int64_t j = 0;
            while (starts[size_t(j + 1)] <= t) ++j;
            sequence[size_t(t)] = j, index[size_t(t)] = t - starts[size_t(j)];
            p.tb[size_t(t)] = 0, p.ts[size_t(t)] = t;
        } else {
            sequence[size_t(t)] = t / c.S, index[size_t(t)] = t % c.S;
            p.tb[size_t(t)] = t / c.S, p.ts[size_t(t)] = t % c.S;
        }
        const int64_t j = sequence[size_t(t)], i = index[size_t(t)];
        // positions: distinct within a sequence (a shifted index), so cache rows never collide.
        const int64_t given = i + seq_shift[size_t(j)];
        const int64_t offset_row = i + seq_offset[size_t(j)];
        position[size_t(t)] = c.positions ? given : c.offsets ? offset_row : i;
        cache_position[size_t(t)] = c.offsets ? offset_row : c.positions ? given : i;
    }
    p.row = position;
    int64_t max_row = 0;
    for (int64_t r : position) max_row = std::max(max_row, r);
    const int64_t P = max_row + 2;
    if (c.positions) {
        p.positions = c.packed ? HostTensor(Dt::I64, {p.tokens}) : HostTensor(Dt::I64, {c.B, c.S});
        for (int64_t t = 0; t < p.tokens; ++t)
            p.positions.set_at(
                p.positions.offset(c.packed ? std::vector<int64_t>{t}
                                            : std::vector<int64_t>{t / c.S, t % c.S}),
                double(position[size_t(t)]));
    }
    if (c.offsets) {
        p.offsets = HostTensor(Dt::I64, {p.num_sequences});
        for (int64_t b = 0; b < p.num_sequences; ++b)
            p.offsets.set({b}, double(seq_offset[size_t(b)]));
    }
    if (c.packed) {
        p.cu_seqlens = HostTensor(Dt::I64, {c.B + 1});
        for (int64_t b = 0; b <= c.B; ++b) p.cu_seqlens.set({b}, double(starts[size_t(b)]));
    }

    // Angles: a table of cos/sin (float32) or inv_freq.
    std::vector<double> freq(static_cast<size_t>(pairs));
    for (int64_t i = 0; i < pairs; ++i)
        freq[size_t(i)] =
            double(float(std::pow(100.0, -2.0 * double(i) / double(std::max<int64_t>(c.R, 2)))));
    if (c.inv_freq) {
        p.inv_freq = HostTensor(Dt::F32, {pairs});
        for (int64_t i = 0; i < pairs; ++i) p.inv_freq.set({i}, freq[size_t(i)]);
    } else {
        p.cos = HostTensor(Dt::F32, {P, pairs});
        p.sin = HostTensor(Dt::F32, {P, pairs});
        for (int64_t r = 0; r < P; ++r)
            for (int64_t i = 0; i < pairs; ++i) {
                p.cos.set({r, i}, std::cos(double(r) * freq[size_t(i)]));
                p.sin.set({r, i}, std::sin(double(r) * freq[size_t(i)]));
            }
        p.inv_freq = HostTensor(Dt::F32, {1});  // unused by the call; the error test's spare
    }

    // Cache cells. Contiguous: row cache_position of the sequence's block. Slot mapping:
    // distinct random slots (some -1). Block tables: distinct random blocks per (sequence,
    // entry).
    const Dt cache_dt = c.fp8 ? Dt::F8 : c.dt;
    int64_t blocks = 0, slots = c.block_size;
    p.block.assign(size_t(p.tokens), -1);
    p.slot.assign(size_t(p.tokens), -1);
    int64_t max_cache_position = 0;
    for (int64_t v : cache_position) max_cache_position = std::max(max_cache_position, v);
    if (c.layout == ROPE_JIT_KV_CACHE_CONTIGUOUS) {
        blocks = p.num_sequences;
        slots = max_cache_position + 1 + int64_t(rng() % 3);
        for (int64_t t = 0; t < p.tokens; ++t)
            p.block[size_t(t)] = sequence[size_t(t)], p.slot[size_t(t)] = cache_position[size_t(t)];
    } else if (c.index == KvIndex::SlotMapping) {
        blocks = (p.tokens + slots - 1) / slots + 1 + int64_t(rng() % 2);
        std::vector<int64_t> pool(size_t(blocks * slots));
        std::iota(pool.begin(), pool.end(), 0);
        std::shuffle(pool.begin(), pool.end(), rng);
        p.slot_mapping = HostTensor(c.index_dt, {p.tokens});
        for (int64_t t = 0; t < p.tokens; ++t) {
            const bool skip = c.skip_slots && rng() % 4 == 0;
            const int64_t s = skip ? -1 - int64_t(rng() % 3) : pool[size_t(t)];
            p.slot_mapping.set({t}, double(s));
            if (!skip) p.block[size_t(t)] = s / slots, p.slot[size_t(t)] = s % slots;
        }
    } else {
        const int64_t entries = max_cache_position / slots + 1;
        const int64_t max_blocks = entries + 1;
        blocks = p.num_sequences * entries + 1 + int64_t(rng() % 3);
        std::vector<int64_t> pool(static_cast<size_t>(blocks));
        std::iota(pool.begin(), pool.end(), 0);
        std::shuffle(pool.begin(), pool.end(), rng);
        p.block_tables = HostTensor(c.index_dt, {p.num_sequences, max_blocks});
        for (int64_t b = 0; b < p.num_sequences; ++b)
            for (int64_t e = 0; e < max_blocks; ++e)
                p.block_tables.set({b, e},
                                   e < entries ? double(pool[size_t(b * entries + e)]) : -1.0);
        for (int64_t t = 0; t < p.tokens; ++t) {
            const int64_t pos = cache_position[size_t(t)];
            p.block[size_t(t)] = pool[size_t(sequence[size_t(t)] * entries + pos / slots)];
            p.slot[size_t(t)] = pos % slots;
        }
    }
    auto cache = [&](int64_t dim) {
        switch (c.layout) {
            case ROPE_JIT_KV_CACHE_PAGED_HND:
                return HostTensor(cache_dt, {blocks, c.Hk, slots, dim});
            default: return HostTensor(cache_dt, {blocks, slots, c.Hk, dim});
        }
    };
    p.k_cache = cache(c.D);
    for (uint8_t& byte : p.k_cache.bytes()) byte = uint8_t(rng());  // poison: must survive
    if (c.Dv > 0) {
        p.v_cache = cache(c.Dv);
        for (uint8_t& byte : p.v_cache.bytes()) byte = uint8_t(rng());
    }
    auto scale = [&](HostTensor& t) {
        t = HostTensor(Dt::F32, {1});
        t.set({0}, c.tiny_scale ? 0.004 : 0.05 + double(rng() % 100) / 50.0);
    };
    if (c.scales) {
        scale(p.k_scale);
        if (c.Dv > 0) scale(p.v_scale);
    }
    if (c.q_fp8 && c.scales) scale(p.q_scale);
    if (c.norm) {
        auto weights = [&] {
            return c.norm_step > 1 ? HostTensor::spaced(c.norm_dt, c.D, c.norm_step)
                                   : HostTensor(c.norm_dt, {c.D});
        };
        p.q_norm_weight = weights();
        p.k_norm_weight = weights();
        p.q_norm_weight.fill_uniform(rng, -0.5, 1.5);
        p.k_norm_weight.fill_uniform(rng, -0.5, 1.5);
    }
    return p;
}

// QK-norm forwards with a KV cache that rope.cu's direct path takes (RopePlan::norm_items),
// beyond the families' mix: head_dim 512 (a head on all 32 lanes, a token over several rounds
// of a block), interleaved pairs (16 lanes a head), fp32 q (4 features a vector), odd head
// counts, weights of every dtype and strided, many tokens a call, FP8 q.
inline std::vector<KvCase> norm_direct_cases() {
    std::vector<KvCase> cases;
    auto add = [&](Dt dt, rope_jit_style style, int64_t D, int64_t Hk, int64_t group, Dt norm_dt,
                   int64_t norm_step) {
        KvCase c;
        c.dt = dt, c.style = style, c.D = c.R = c.Dv = D, c.Hk = Hk, c.group = group;
        c.norm = true, c.norm_dt = norm_dt, c.norm_step = norm_step;
        cases.push_back(c);
        return &cases.back();
    };
    KvCase* c = add(Dt::BF16, ROPE_JIT_STYLE_HALF, 512, 2, 4, Dt::BF16, 1);
    c->B = 3, c->S = 7, c->fp8 = c->scales = true;
    c = add(Dt::BF16, ROPE_JIT_STYLE_INTERLEAVED, 128, 2, 2, Dt::BF16, 3);
    c->layout = ROPE_JIT_KV_CACHE_PAGED_HND, c->index = KvIndex::BlockTables, c->offsets = true;
    c->in_place_q = false, c->unit_offset = true;
    c = add(Dt::F16, ROPE_JIT_STYLE_HALF, 128, 3, 1, Dt::F16, 1);
    c->B = 4, c->S = 200, c->positions = true, c->layout = ROPE_JIT_KV_CACHE_CONTIGUOUS;
    c->index = KvIndex::Rows, c->offsets = true, c->unit_offset = true, c->Dv = 40;
    c = add(Dt::F32, ROPE_JIT_STYLE_HALF, 64, 1, 4, Dt::F32, 2);
    c->q_fp8 = true, c->in_place_q = false, c->fp8 = true, c->scales = true, c->Dv = 0;
    c = add(Dt::BF16, ROPE_JIT_STYLE_HALF, 256, 3, 2, Dt::F32, 1);
    c->packed = true, c->B = 9, c->skip_slots = true;
    c = add(Dt::BF16, ROPE_JIT_STYLE_PROPORTIONAL, 128, 8, 4, Dt::BF16, 1);
    c->B = 64, c->S = 1, c->positions = true, c->fp8 = c->scales = true;
    // 4096 tokens (10 or more a multiprocessor on GPUs of up to 409), which the launcher gives
    // 64-thread blocks taking a token's items in rounds: Qwen3-8B's heads with a paged FP8
    // cache (384 items, six rounds), and 8/4 heads with v of 40 features (96 + 20 items: a
    // full round and a partial one).
    c = add(Dt::BF16, ROPE_JIT_STYLE_HALF, 128, 8, 4, Dt::BF16, 1);
    c->B = 2, c->S = 2048, c->block_size = 16, c->fp8 = c->scales = true;
    c = add(Dt::F16, ROPE_JIT_STYLE_HALF, 128, 4, 2, Dt::F16, 1);
    c->B = 4, c->S = 1024, c->Dv = 40, c->positions = true;
    return cases;
}

// The call's arguments over views (host_views or device mirrors, in slots_of's order).
inline rope_jit_rope_args kv_args(const KvProblem& p, const std::vector<const DLTensor*>& v) {
    rope_jit_rope_args a;
    rope_jit_rope_args_init(&a);
    a.q = v[0], a.k = v[1], a.v = v[2], a.q_out = v[3], a.k_cache = v[4], a.v_cache = v[5];
    if (!p.c.inv_freq)
        a.cos = v[6], a.sin = v[7];
    else
        a.inv_freq = v[8];
    a.positions = v[9], a.seqlen_offsets = v[10], a.cu_seqlens = v[11];
    a.slot_mapping = v[12], a.block_tables = v[13];
    a.k_scale = v[14], a.v_scale = v[15], a.q_scale = v[16];
    a.q_norm_weight = v[18], a.k_norm_weight = v[19];
    a.norm_eps = kNormEps;
    a.norm_unit_offset = p.c.unit_offset;
    a.kv_layout = p.c.layout;
    a.rotary_dim = int32_t(p.c.R);
    a.rotary_offset = int32_t(p.c.offset);
    a.style = p.c.style;
    return a;
}

// The kernel spec a call selects (what the CUDA backend compiles).
inline rope_jit::KernelSpec spec_of(const rope_jit_rope_args& args) {
    return rope_jit::make_kernel_spec(rope_jit::make_rope_problem(args));
}

// Whether every tensor's bytes are what they were.
inline bool unchanged(KvProblem& now, KvProblem& before) {
    const std::vector<HostTensor*> a = slots_of(now), b = slots_of(before);
    for (size_t i = 0; i < a.size(); ++i)
        if (a[i]->bytes() != b[i]->bytes()) return false;
    return true;
}

// The features of pair i: (o+i, o+i+R/2) pairs, (o+2i, o+2i+1) interleaved, (i, i+D/2)
// proportional.
inline void pair_features(const KvCase& c, int64_t i, int64_t* f1, int64_t* f2) {
    switch (c.style) {
        case ROPE_JIT_STYLE_INTERLEAVED: *f1 = c.offset + 2 * i, *f2 = *f1 + 1; return;
        case ROPE_JIT_STYLE_PROPORTIONAL: *f1 = i, *f2 = i + c.D / 2; return;
        default: *f1 = c.offset + i, *f2 = c.offset + i + c.R / 2; return;
    }
}

// Half the spacing of e4m3fn values around v (|v| <= 448): the most rounding may move it.
inline double e4m3_half_step(double v) {
    const double a = std::fabs(v);
    if (a < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
    return std::ldexp(1.0, int(std::floor(std::log2(a))) - 4);
}

inline double clamp448(double v) {
    return std::max(-448.0, std::min(448.0, v));
}

// Checks one stored element: `rotated` values (computed in float64) within the dtype's
// rounding (FP8: the nearest code, or its neighbour at a near-tie), copies bit for bit (FP8:
// exactly the nearest code of the fp32 quotient).
inline void check_element(Dt dt, double got, uint8_t got_code, double expected, bool rotated,
                          float scale, const char* what) {
    CAPTURE(what);
    CAPTURE(expected);
    CAPTURE(got);
    if (dt == Dt::F8) {
        if (!rotated) {
            CHECK(int(got_code) == int(e4m3_nearest(double(float(expected) / scale))));
        } else {
            const double v = clamp448(expected / double(scale));
            CHECK(std::fabs(got - v) <= e4m3_half_step(v) * 1.001 + 1e-6);
        }
        return;
    }
    if (!rotated) {
        CHECK(got == expected);
        return;
    }
    CHECK(std::fabs(got - expected) <=
          rope_test::tolerance_for(dt) * 0.5 * std::max(1.0, std::fabs(expected)));
}

// The k, v and q contents of a call made on `p` (whose inputs were `before`), against the
// definitions; cache cells no token maps to keep their bytes.
inline void check_against_definition(KvProblem& p, KvProblem& before) {
    const KvCase& c = p.c;
    const int64_t Hq = c.Hk * c.group, pairs = c.R / 2;
    const float k_scale = c.scales ? float(p.k_scale.get({0})) : 1.0f;
    const float v_scale = c.scales && c.Dv > 0 ? float(p.v_scale.get({0})) : 1.0f;
    const float q_scale = c.q_fp8 && c.scales ? float(p.q_scale.get({0})) : 1.0f;
    // k and v are read only.
    CHECK(p.k.bytes() == before.k.bytes());
    CHECK(p.v.bytes() == before.v.bytes());
    auto input_index = [&](int64_t t, int64_t h, int64_t d) {
        return c.packed ? std::vector<int64_t>{t, h, d}
                        : std::vector<int64_t>{t / c.S, h, t % c.S, d};
    };
    auto cache_index = [&](int64_t block, int64_t slot, int64_t h, int64_t d) {
        return c.layout == ROPE_JIT_KV_CACHE_PAGED_HND ? std::vector<int64_t>{block, h, slot, d}
                                                       : std::vector<int64_t>{block, slot, h, d};
    };
    std::vector<char> k_written(p.k_cache.bytes().size(), 0),
        v_written(p.v_cache.bytes().size(), 0);
    std::vector<double> x(size_t(c.D)), y(size_t(c.D));
    std::vector<char> rotated(size_t(c.D), 0);
    for (int64_t i = 0; i < pairs; ++i) {
        int64_t f1, f2;
        pair_features(c, i, &f1, &f2);
        rotated[size_t(f1)] = rotated[size_t(f2)] = 1;
    }
    // QK-norm (c.norm): x = x / sqrt(mean(x^2) + eps) * w' first, every feature computed.
    auto normalize = [&](const HostTensor& weight) {
        if (!c.norm) return;
        double mean_square = 0;
        for (double value : x) mean_square += value * value / double(c.D);
        const double r = 1.0 / std::sqrt(mean_square + kNormEps);
        for (int64_t d = 0; d < c.D; ++d)
            x[size_t(d)] *= r * (weight.get({d}) + (c.unit_offset ? 1.0 : 0.0));
    };
    // y = the rotation of x at table row `row`, in float64 from the stored angles.
    auto rotate = [&](int64_t row) {
        y = x;
        for (int64_t i = 0; i < pairs; ++i) {
            double cs, sn;
            if (c.inv_freq) {
                const double angle = double(row) * p.inv_freq.get({i});
                cs = double(float(std::cos(angle))), sn = double(float(std::sin(angle)));
            } else {
                cs = p.cos.get({row, i}), sn = p.sin.get({row, i});
            }
            int64_t f1, f2;
            pair_features(c, i, &f1, &f2);
            y[size_t(f1)] = x[size_t(f1)] * cs - x[size_t(f2)] * sn;
            y[size_t(f2)] = x[size_t(f2)] * cs + x[size_t(f1)] * sn;
        }
    };
    const Dt cache_dt = c.fp8 ? Dt::F8 : c.dt;
    for (int64_t t = 0; t < p.tokens; ++t) {
        CAPTURE(t);
        // q: rotated into q_out (FP8 or not) or in place.
        HostTensor& q_dst = c.q_fp8 || !c.in_place_q ? p.q_out : p.q;
        for (int64_t h = 0; h < Hq; ++h) {
            for (int64_t d = 0; d < c.D; ++d) x[size_t(d)] = before.q.get(input_index(t, h, d));
            normalize(p.q_norm_weight);
            rotate(p.row[size_t(t)]);
            for (int64_t d = 0; d < c.D; ++d) {
                const int64_t o = q_dst.offset(input_index(t, h, d));
                check_element(c.q_fp8 ? Dt::F8 : c.dt, q_dst.get_at(o), q_dst.bytes()[size_t(o)],
                              rotated[size_t(d)] ? y[size_t(d)] : x[size_t(d)],
                              rotated[size_t(d)] || c.norm, q_scale, "q");
            }
        }
        if (p.block[size_t(t)] < 0) continue;  // skipped: nothing of k and v written
        for (int64_t h = 0; h < c.Hk; ++h) {
            for (int64_t d = 0; d < c.D; ++d) x[size_t(d)] = before.k.get(input_index(t, h, d));
            normalize(p.k_norm_weight);
            rotate(p.row[size_t(t)]);
            for (int64_t d = 0; d < c.D; ++d) {
                const int64_t o =
                    p.k_cache.offset(cache_index(p.block[size_t(t)], p.slot[size_t(t)], h, d));
                for (size_t byte = 0; byte < rope_test::dt_size(cache_dt); ++byte)
                    k_written[size_t(o) * rope_test::dt_size(cache_dt) + byte] = 1;
                check_element(cache_dt, p.k_cache.get_at(o), p.k_cache.bytes()[size_t(o)],
                              rotated[size_t(d)] ? y[size_t(d)] : x[size_t(d)],
                              rotated[size_t(d)] || c.norm, k_scale, "k_cache");
            }
            for (int64_t d = 0; d < c.Dv; ++d) {
                const double value = before.v.get(input_index(t, h, d));
                const int64_t o =
                    p.v_cache.offset(cache_index(p.block[size_t(t)], p.slot[size_t(t)], h, d));
                for (size_t byte = 0; byte < rope_test::dt_size(cache_dt); ++byte)
                    v_written[size_t(o) * rope_test::dt_size(cache_dt) + byte] = 1;
                check_element(cache_dt, p.v_cache.get_at(o), p.v_cache.bytes()[size_t(o)], value,
                              false, v_scale, "v_cache");
            }
        }
    }
    for (size_t i = 0; i < k_written.size(); ++i)
        if (!k_written[i]) REQUIRE(p.k_cache.bytes()[i] == before.k_cache.bytes()[i]);
    for (size_t i = 0; i < v_written.size(); ++i)
        if (!v_written[i]) REQUIRE(p.v_cache.bytes()[i] == before.v_cache.bytes()[i]);
}

}  // namespace kv_test
