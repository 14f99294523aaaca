// KV cache write and FP8 outputs (rope_jit_rope_args.kv_layout ... q_scale) on the CPU backend,
// against a reference written in this file from the definitions: each token's cache slot
// (contiguous rows, vLLM slot_mapping, block tables), the pair rotation of each style in
// float64, and float8 e4m3fn by enumeration of its 256 codes (rope_test_support.h). Also: the
// argument checks (each names the argument and writes nothing), the float8 conversion of the
// library against the enumeration, and the kernels compiled with NVRTC for sm_90 and sm_80.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/float8.h"
#include "gpu_rope_kv_problem.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_cuda.h"
#include "ops/rope/rope_plan.h"
#include "ops/rope/rope_recipe.h"
#include "rope_jit/rope_jit.h"
#include "sanitizer_builds.h"

using namespace rope_test;
using namespace kv_test;
using rope_jit::KernelSpec;

TEST_CASE("float8 e4m3fn: the library's conversion is the nearest code by enumeration") {
    // Every code's value and the midpoints between neighbours (ties to even), then a sweep.
    std::vector<float> values = {0.0f,  -0.0f,  448.0f,   449.0f,    463.9f, 464.0f, 480.0f,
                                 1e30f, -1e30f, INFINITY, -INFINITY, 1e-30f, -1e-30f};
    for (int code = 0; code < 256; ++code) {
        const double v = e4m3_value(uint8_t(code));
        if (std::isnan(v)) continue;
        values.push_back(float(v));
        const double next = e4m3_value(uint8_t(code + 1));
        if ((code & 0x7f) < 0x7e && !std::isnan(next))
            values.push_back(float((v + next) / 2));  // exact in float32
    }
    std::mt19937 rng(23);
    std::uniform_real_distribution<float> wide(-500.0f, 500.0f), narrow(-0.05f, 0.05f);
    for (int i = 0; i < 20000; ++i) values.push_back(i % 2 ? wide(rng) : narrow(rng));
    for (float v : values) {
        CAPTURE(v);
        CHECK(int(rope_jit::float_to_e4m3(v)) == int(e4m3_nearest(double(v))));
    }
    CHECK(int(rope_jit::float_to_e4m3(NAN)) == 0x7f);
    CHECK(int(rope_jit::float_to_e4m3(-NAN)) == 0x7f);
    for (int code = 0; code < 256; ++code) {
        const double expected = e4m3_value(uint8_t(code));
        const double got = rope_jit::e4m3_to_float(uint8_t(code));
        CHECK((std::isnan(expected) ? std::isnan(got) : got == expected));
    }
}

TEST_CASE("RoPE with a KV cache write and FP8 outputs matches the definition on the CPU") {
    CpuRuntime cpu;
    rope_jit_runtime* const runtime = cpu.handle;
    std::mt19937 rng(kKvSeed);
    int checked = 0;
    for (int family = 0; family < kKvFamilies; ++family) {
        const KvCase c = kv_case(family);
        const std::string name = describe(c);
        CAPTURE(family);
        CAPTURE(name);
        KvProblem p = make_kv_problem(c, rng);
        KvProblem before = p;
        const rope_jit_rope_args args = kv_args(p, host_views(p));
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        check_against_definition(p, before);
        ++checked;
    }
    CHECK(checked == kKvFamilies);
}

namespace {

// One bad input: the argument its error must name, and how it spoils a good call.
struct BadKvInput {
    const char* what;
    void (*change)(KvProblem&, rope_jit_rope_args&);
};

// Each bad input, applied to a fresh problem of `base`, fails with ERROR_INVALID_ARGUMENT
// naming its argument and writes nothing.
template <size_t N>
void check_refused(rope_jit_runtime* runtime, const KvCase& base, const BadKvInput (&bads)[N],
                   std::mt19937& rng) {
    for (const BadKvInput& bad : bads) {
        const std::string what = bad.what;
        CAPTURE(what);
        KvProblem p = make_kv_problem(base, rng);
        rope_jit_rope_args args = kv_args(p, host_views(p));
        bad.change(p, args);
        KvProblem before = p;
        const rope_jit_status status = rope_jit_rope(runtime, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(bad.what) != std::string::npos);
        CHECK(unchanged(p, before));
    }
}

}  // namespace

TEST_CASE("KV cache arguments: every bad input names its argument and writes nothing") {
    CpuRuntime cpu;
    rope_jit_runtime* const runtime = cpu.handle;
    std::mt19937 rng(kKvSeed + 1);
    KvCase base;
    base.layout = ROPE_JIT_KV_CACHE_PAGED_NHD;
    base.index = KvIndex::SlotMapping;
    base.fp8 = true;
    base.scales = true;
    base.q_fp8 = true;
    base.norm = true;
    const BadKvInput bads[] = {
        {"kv_layout",
         [](KvProblem&, rope_jit_rope_args& a) { a.kv_layout = rope_jit_kv_cache_layout(7); }},
        {"kv_layout",
         [](KvProblem&, rope_jit_rope_args& a) { a.kv_layout = ROPE_JIT_KV_CACHE_NONE; }},
        {"k_cache",
         [](KvProblem&, rope_jit_rope_args& a) { a.k_cache = nullptr; }},
        {"k_out",
         [](KvProblem& p, rope_jit_rope_args& a) { a.k_out = p.k.dl(); }},
        {"backward",
         [](KvProblem&, rope_jit_rope_args& a) { a.backward = 1; }},
        {"k_norm_weight",
         [](KvProblem&, rope_jit_rope_args& a) {
             a.k_norm_weight = nullptr;  // QK-norm without k's weights
         }},
        {"v_cache",
         [](KvProblem&, rope_jit_rope_args& a) { a.v_cache = nullptr; }},
        {"v",
         [](KvProblem&, rope_jit_rope_args& a) { a.v = nullptr; }},
        {"slot_mapping",
         [](KvProblem&, rope_jit_rope_args& a) { a.slot_mapping = nullptr; }},
        {"block_tables",
         [](KvProblem& p, rope_jit_rope_args& a) { a.block_tables = p.block_tables.dl(); }},
        {"slot_mapping",
         [](KvProblem& p, rope_jit_rope_args&) {  // one slot past the cache
             p.slot_mapping.set({1}, double(p.k_cache.shape()[0] * p.k_cache.shape()[1]));
         }},
        {"slot_mapping",
         [](KvProblem& p, rope_jit_rope_args& a) { a.slot_mapping = p.inv_freq.dl(); }},
        {"k_cache",
         [](KvProblem& p, rope_jit_rope_args& a) { a.k_cache = p.q.dl(); }},
        {"v_cache",
         [](KvProblem& p, rope_jit_rope_args& a) { a.v_cache = p.k_cache.dl(); }},
        {"k_scale",
         [](KvProblem& p, rope_jit_rope_args& a) { a.k_scale = p.slot_mapping.dl(); }},
        {"q_scale",
         [](KvProblem& p, rope_jit_rope_args& a) {
             a.q_out = p.q_ref_out.dl();  // a float q_out takes no scale
         }},
        {"slot_mapping",
         [](KvProblem&, rope_jit_rope_args& a) { a.kv_layout = ROPE_JIT_KV_CACHE_CONTIGUOUS; }},
        {"k_cache",
         [](KvProblem&, rope_jit_rope_args& a) { a.kv_layout = ROPE_JIT_KV_CACHE_PAGED_HND; }},
    };
    check_refused(runtime, base, bads, rng);
}

TEST_CASE("KV cache arguments with block tables: bad entries and mismatched tensors are refused") {
    CpuRuntime cpu;
    rope_jit_runtime* const runtime = cpu.handle;
    std::mt19937 rng(kKvSeed + 4);
    KvCase base;
    base.layout = ROPE_JIT_KV_CACHE_PAGED_HND;
    base.index = KvIndex::BlockTables;
    base.fp8 = true;
    base.scales = true;
    const BadKvInput bads[] = {
        {"block_tables", [](KvProblem& p, rope_jit_rope_args&) {  // a block past the cache
             for (int64_t e = 0; e < p.block_tables.shape()[1]; ++e)
                 p.block_tables.set({0, e}, double(p.k_cache.shape()[0]));
         }},
        {"block_tables", [](KvProblem& p, rope_jit_rope_args&) {  // an unassigned (-1) block
             for (int64_t e = 0; e < p.block_tables.shape()[1]; ++e)
                 p.block_tables.set({0, e}, -1.0);
         }},
        {"v", [](KvProblem& p, rope_jit_rope_args& a) { a.v = p.q.dl(); }},  // Hq heads, not Hk
        {"v_cache", [](KvProblem& p, rope_jit_rope_args& a) { a.v_cache = p.q.dl(); }},
    };
    check_refused(runtime, base, bads, rng);
}

TEST_CASE("a KV cache that shares memory with a QK-norm weight is refused, writing nothing") {
    // The caches are written while the weights are read: a weight on a cache row would change
    // under the call.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 5);
    KvCase c;
    c.dt = Dt::F32;  // caches of the weights' dtype
    c.norm = true;
    for (const std::string cache_name : {"k_cache", "v_cache"})
        for (const std::string weight_name : {"q_norm_weight", "k_norm_weight"}) {
            CAPTURE(cache_name);
            CAPTURE(weight_name);
            KvProblem p = make_kv_problem(c, rng);
            rope_jit_rope_args args = kv_args(p, host_views(p));
            // A float32 [D] weight on the cache's second row.
            HostTensor& cache = cache_name[0] == 'k' ? p.k_cache : p.v_cache;
            int64_t shape[1] = {c.D};
            DLTensor weight = *cache.dl();
            weight.ndim = 1;
            weight.shape = shape;
            weight.strides = nullptr;
            weight.byte_offset = uint64_t(c.D) * 4;
            (weight_name[0] == 'k' ? args.k_norm_weight : args.q_norm_weight) = &weight;
            KvProblem before = p;
            const rope_jit_status status = rope_jit_rope(cpu.handle, &args);
            const std::string message = rope_jit_last_error();
            CAPTURE(message);
            CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(message.find(cache_name + ": shares memory with " + weight_name) !=
                  std::string::npos);
            CHECK(unchanged(p, before));
        }
}

TEST_CASE("with a KV cache k is only read: QK-norm weights on k's memory give the copies' result") {
    // The rotated k goes to k_cache, k itself is only read, and tensors that are only read may
    // share memory: weights that are rows of k act as separate copies of those rows.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 6);
    for (int variant = 0; variant < 2; ++variant) {
        KvCase c;
        c.dt = Dt::F32;
        c.norm = true;
        c.fp8 = c.scales = variant == 1;
        c.layout = variant == 1 ? ROPE_JIT_KV_CACHE_PAGED_HND : ROPE_JIT_KV_CACHE_PAGED_NHD;
        CAPTURE(variant);
        KvProblem p = make_kv_problem(c, rng);
        REQUIRE(c.Hk >= 2);
        // q_norm_weight = k[0, 0, 0, :], k_norm_weight = k[0, 1, 0, :] (features contiguous).
        for (int64_t d = 0; d < c.D; ++d) {
            p.q_norm_weight.set({d}, p.k.get({0, 0, 0, d}));
            p.k_norm_weight.set({d}, p.k.get({0, 1, 0, d}));
        }
        KvProblem before = p, separate = p;
        const rope_jit_rope_args separate_args = kv_args(separate, host_views(separate));
        REQUIRE(rope_jit_rope(cpu.handle, &separate_args) == ROPE_JIT_OK);
        check_against_definition(separate, before);

        rope_jit_rope_args args = kv_args(p, host_views(p));
        int64_t shape[1] = {c.D};
        DLTensor q_weight = *p.k.dl(), k_weight = *p.k.dl();
        q_weight.ndim = k_weight.ndim = 1;
        q_weight.shape = k_weight.shape = shape;
        q_weight.strides = k_weight.strides = nullptr;
        q_weight.byte_offset = uint64_t(p.k.offset({0, 0, 0, 0})) * 4;
        k_weight.byte_offset = uint64_t(p.k.offset({0, 1, 0, 0})) * 4;
        args.q_norm_weight = &q_weight;
        args.k_norm_weight = &k_weight;
        const rope_jit_status status = rope_jit_rope(cpu.handle, &args);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        check_against_definition(p, before);
        // Bit for bit the call with the copies: q, k (unchanged), both caches.
        CHECK(unchanged(p, separate));
    }
}

TEST_CASE("with a KV cache, k the same view as q is refused when q is rotated in place") {
    // k is only read, so k = q is no double rotation; but q in place is written while k (the
    // same memory) is read, and the message names q. With q_out, q and k are both only read.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 7);
    KvCase c;
    c.group = 1;  // k has q's heads
    c.in_place_q = false;
    KvProblem p = make_kv_problem(c, rng);
    p.k = p.q;  // the reference's k: q's values (the call passes q itself)
    KvProblem before = p;
    rope_jit_rope_args args = kv_args(p, host_views(p));
    args.k = p.q.dl();
    SUBCASE("q in place") {
        args.q_out = nullptr;
        const rope_jit_status status = rope_jit_rope(cpu.handle, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find("q: is the same memory as k") != std::string::npos);
        CHECK(message.find("rotated twice") == std::string::npos);
        CHECK(unchanged(p, before));
    }
    SUBCASE("q into q_out: k_cache holds q's rotation") {
        const rope_jit_status status = rope_jit_rope(cpu.handle, &args);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        check_against_definition(p, before);
    }
}

TEST_CASE("a KV cache call with head_dim 0 refuses v and still checks its slots") {
    // head_dim 0 leaves nothing to rotate: v, which has features of its own, would go
    // uncopied; and the slots are checked as in any call.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 8);
    KvCase base;
    base.D = base.R = 0;
    base.Dv = 4;
    base.layout = ROPE_JIT_KV_CACHE_CONTIGUOUS;
    base.index = KvIndex::Rows;
    const BadKvInput with_v[] = {
        {"v: a KV cache call with head_dim 0", [](KvProblem&, rope_jit_rope_args&) {}},
    };
    check_refused(cpu.handle, base, with_v, rng);
    base.Dv = 0;
    base.layout = ROPE_JIT_KV_CACHE_PAGED_NHD;
    base.index = KvIndex::SlotMapping;
    const BadKvInput bad_slots[] = {
        {"slot_mapping: token 1 has slot", [](KvProblem& p, rope_jit_rope_args&) {
             p.slot_mapping.set({1}, double(p.k_cache.shape()[0] * p.k_cache.shape()[1]));
         }},
    };
    check_refused(cpu.handle, base, bad_slots, rng);
    // Without v and with valid slots: accepted, with nothing to write.
    KvProblem p = make_kv_problem(base, rng);
    KvProblem before = p;
    const rope_jit_rope_args args = kv_args(p, host_views(p));
    const rope_jit_status status = rope_jit_rope(cpu.handle, &args);
    INFO(rope_jit_last_error());
    CHECK(status == ROPE_JIT_OK);
    CHECK(unchanged(p, before));
}

TEST_CASE("FP8 scales of one element in any shape, 0-dim included, give the [1] scales' result") {
    // torch.tensor(s) exports a 0-dim tensor; [1, 1, 1, 1, 1] is one element too. A dimension
    // other than 1 is refused whatever the rank.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 9);
    KvCase c;
    c.fp8 = c.scales = c.q_fp8 = true;
    c.in_place_q = false;
    KvProblem p = make_kv_problem(c, rng);
    KvProblem before = p;
    const rope_jit_rope_args args = kv_args(p, host_views(p));  // [1] scales
    REQUIRE(rope_jit_rope(cpu.handle, &args) == ROPE_JIT_OK);
    check_against_definition(p, before);
    int64_t ones[5] = {1, 1, 1, 1, 1};
    for (int ndim : {0, 5}) {
        CAPTURE(ndim);
        KvProblem r = before;
        rope_jit_rope_args a = kv_args(r, host_views(r));
        DLTensor k_scale = *r.k_scale.dl(), v_scale = *r.v_scale.dl(), q_scale = *r.q_scale.dl();
        for (DLTensor* t : {&k_scale, &v_scale, &q_scale}) {
            t->ndim = ndim;
            t->shape = ndim == 0 ? nullptr : ones;
            t->strides = nullptr;
        }
        a.k_scale = &k_scale, a.v_scale = &v_scale, a.q_scale = &q_scale;
        const rope_jit_status status = rope_jit_rope(cpu.handle, &a);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        CHECK(unchanged(r, p));  // q_out and both caches as the [1] scales left them
    }
    HostTensor two(Dt::F32, {2});
    two.set({0}, 1.0);
    two.set({1}, 1.0);
    int64_t not_one[5] = {1, 1, 2, 1, 1};
    DLTensor wide = *two.dl();
    wide.ndim = 5;
    wide.shape = not_one;
    wide.strides = nullptr;
    for (const std::string name : {"k_scale", "v_scale", "q_scale"}) {
        CAPTURE(name);
        KvProblem r = before;
        rope_jit_rope_args a = kv_args(r, host_views(r));
        (name[0] == 'k' ? a.k_scale : name[0] == 'v' ? a.v_scale : a.q_scale) = &wide;
        const rope_jit_status status = rope_jit_rope(cpu.handle, &a);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(name + ": expected one element, but dimension 2 has size 2") !=
              std::string::npos);
        CHECK(unchanged(r, before));
    }
}

TEST_CASE("KV cache and FP8 kernels compile with NVRTC for sm_90 and sm_80") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    const char* const variants[] = {
        // Prefill, paged NHD with slot_mapping, FP8 cache: the bench's case.
        R"({"head_dim": 128, "dtype": "bfloat16", "table_dtype": "bfloat16", "gqa_group": 4,
            "positions": "indices", "kv_cache": "slot-mapping", "kv_fp8": true,
            "v_head_dim": 128})",
        // Decode with block tables and seqlen offsets, FP8 q too.
        R"({"head_dim": 128, "dtype": "bfloat16", "gqa_group": 4, "positions": "seqlen-offsets",
            "kv_cache": "block-tables", "kv_fp8": true, "v_head_dim": 128, "q_fp8": true,
            "in_place_q": false})",
        R"({"head_dim": 64, "rotary_dim": 32, "style": "interleaved", "kv_cache": "contiguous",
            "v_head_dim": 48, "packed": true, "positions": "seqlen-offsets"})",
        R"({"head_dim": 512, "rotary_dim": 128, "style": "proportional", "dtype": "float16",
            "kv_cache": "slot-mapping", "kv_fp8": true, "v_head_dim": 512, "angles": "inv-freq",
            "kv_index_int64": false})",
        R"({"head_dim": 80, "rotary_dim": 32, "rotary_offset": 16, "kv_cache": "slot-mapping",
            "xpos": true, "vec": 1, "vec_loads": false, "copy_vec": 1, "v_head_dim": 7,
            "v_vec": 1, "kv_fp8": true})",
        R"({"head_dim": 128, "positions": "indices", "mrope_axes": 3, "kv_cache":
            "block-tables", "kv_seqlen_offsets": true, "seqlen_offsets_int64": true})",
        R"({"head_dim": 128, "dtype": "bfloat16", "q_fp8": true, "in_place_q": false,
            "has_k": false})",
        // QK-norm + RoPE + paged KV + FP8 (the decode bench's case).
        R"({"head_dim": 128, "dtype": "bfloat16", "table_dtype": "bfloat16", "gqa_group": 4,
            "positions": "indices", "qk_norm": true, "norm_weight_dtype": "bfloat16",
            "kv_cache": "slot-mapping", "kv_fp8": true, "v_head_dim": 128, "q_fp8": true,
            "in_place_q": false})",
        R"({"head_dim": 64, "qk_norm": true, "kv_cache": "block-tables", "positions":
            "seqlen-offsets", "v_head_dim": 40, "style": "interleaved", "packed": true})",
    };
    rope_jit::KernelStats stats;
    for (const char* target : {"sm_90", "sm_80"})
        for (const char* json : variants) {
            std::string error;
            const auto spec = KernelSpec::from_json(json, &error);
            INFO(json, error);
            REQUIRE(spec.has_value());
            CHECK(KernelSpec::from_json(spec->to_json(), nullptr) == spec);
            const std::string name = spec->describe();
            CAPTURE(name);
            CAPTURE(target);
            const rope_jit::KernelBinary binary =
                rope_jit::build_kernel_binary(*spec, target, nullptr, stats);
            REQUIRE(binary.image.size() > 4);
        }
}

TEST_CASE("the KV cache GPU sweep's calls run on the CPU backend and their kernels compile") {
    // The calls of test_gpu_rope_kv_cache.cpp (which needs a GPU): each is valid, and the
    // kernel it selects compiles for sm_90.
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    CpuRuntime cpu;
    rope_jit_runtime* const runtime = cpu.handle;
    std::mt19937 rng(kKvSeed + 2);
    std::vector<KernelSpec> compiled;
    rope_jit::KernelStats stats;
    SweepCompiles compiles;
    int on_items = 0, on_rows = 0;
    for (int family = 0; family < kKvFamilies; ++family) {
        const KvCase c = kv_case(family);
        KvProblem p = make_kv_problem(c, rng);
        const rope_jit_rope_args args = kv_args(p, host_views(p));
        const rope_jit::KernelSpec spec = spec_of(args);
        INFO(describe(c));
        REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);
        if (std::find(compiled.begin(), compiled.end(), spec) != compiled.end()) continue;
        compiled.push_back(spec);
        const std::string name = spec.describe();
        CAPTURE(name);
        if (compiles.next())
            CHECK(rope_jit::build_kernel_binary(spec, "sm_90", nullptr, stats).image.size() > 4);
        if (spec.qk_norm)
            ++(rope_jit::rope_recipe(spec).template_name == "rope.cu" ? on_items : on_rows);
    }
    MESSAGE(compiled.size() << " KV cache kernels, " << compiles.taken() << " compiled");
    // The GPU sweep reaches both QK-norm kernels: rope.cu's direct path (fully rotated heads)
    // and rope_norm.cu (the others).
    MESSAGE(on_items << " QK-norm kernels on rope.cu, " << on_rows << " on rope_norm.cu");
    CHECK(on_items > 0);
    CHECK(on_rows > 0);
}

TEST_CASE("the direct-path QK-norm cases of the KV cache GPU tests run on the CPU backend and "
          "take rope.cu's norm items") {
    // norm_direct_cases() (test_gpu_rope_kv_cache.cpp compares them on a GPU): each is valid,
    // selects rope.cu's QK-norm path, and its kernel compiles for sm_90.
    CpuRuntime cpu;
    std::mt19937 rng(kKvSeed + 300);
    rope_jit::KernelStats stats;
    SweepCompiles compiles;
    for (const KvCase& c : norm_direct_cases()) {
        KvProblem p = make_kv_problem(c, rng);
        const rope_jit_rope_args args = kv_args(p, host_views(p));
        const rope_jit::KernelSpec spec = spec_of(args);
        const std::string name = describe(c), kernel = spec.describe();
        CAPTURE(name);
        CAPTURE(kernel);
        REQUIRE(rope_jit_rope(cpu.handle, &args) == ROPE_JIT_OK);
        CHECK(rope_jit::rope_plan(spec).norm_items);
        CHECK(spec.norm_weight_vec_loads == (c.norm_step == 1 ? 1 : 0));
        // The many-token cases take their items in rounds of a 64-thread block (132 SMs).
        if (c.B * c.S >= 4096)
            CHECK(rope_jit::plan_rope_launch(spec, c.Hk * c.group, c.Hk, c.B * c.S, 132, true)
                      .threads == 64);
        if (rope_jit::nvrtc_api() != nullptr && compiles.next())
            CHECK(rope_jit::build_kernel_binary(spec, "sm_90", nullptr, stats).image.size() > 4);
    }
}

TEST_CASE("a prewarmed KV cache spec is the one a call with contiguous tensors uses") {
    // rope_jit_kernel_spec's kv fields describe the same kernel as the call (bf16, 32/8 heads,
    // D128, per-token positions, paged NHD at slot_mapping or block tables, FP8 or not).
    std::mt19937 rng(kKvSeed + 3);
    for (int variant = 0; variant < 4; ++variant) {
        KvCase c;
        c.D = c.R = c.Dv = 128;
        c.Hk = 8, c.group = 4, c.S = 3, c.block_size = 16;
        c.bshd = true;
        c.positions = true;
        c.offsets = false;
        c.index = variant % 2 ? KvIndex::BlockTables : KvIndex::SlotMapping;
        c.fp8 = variant >= 2;
        c.norm = variant == 3;
        CAPTURE(variant);
        KvProblem p = make_kv_problem(c, rng);
        KernelSpec from_call = spec_of(kv_args(p, host_views(p)));
        // The test's float32 tables live in a std::vector (16-byte aligned): their 32-byte
        // spans may not load as vectors, which a prewarmed spec assumes.
        from_call.table_vec_loads = 1;

        rope_jit_kernel_spec spec;
        rope_jit_kernel_spec_init(&spec);
        spec.dtype = DLDataType{kDLBfloat, 16, 1};
        spec.head_dim = 128;
        spec.gqa_group = 4;
        spec.positions = ROPE_JIT_POSITIONS_INDICES;
        spec.angles = ROPE_JIT_ANGLES_TABLE_HALF;
        spec.kv_layout = ROPE_JIT_KV_CACHE_PAGED_NHD;
        spec.kv_block_tables = c.index == KvIndex::BlockTables;
        spec.kv_fp8 = c.fp8;
        spec.v_head_dim = 128;
        spec.qk_norm = c.norm;
        const KernelSpec from_public = rope_jit::kernel_spec_from_public(spec);
        const std::string call = from_call.to_json(), prewarmed = from_public.to_json();
        CHECK(call == prewarmed);
    }
    // Every layout prewarms from the struct's defaults (int64 indices, which only a paged
    // cache's slot_mapping or block_tables have).
    for (rope_jit_kv_cache_layout layout :
         {ROPE_JIT_KV_CACHE_CONTIGUOUS, ROPE_JIT_KV_CACHE_PAGED_NHD, ROPE_JIT_KV_CACHE_PAGED_HND}) {
        CAPTURE(int(layout));
        rope_jit_kernel_spec spec;
        rope_jit_kernel_spec_init(&spec);
        spec.dtype = DLDataType{kDLBfloat, 16, 1};
        spec.head_dim = 128;
        spec.kv_layout = layout;
        KernelSpec prewarmed;
        REQUIRE_NOTHROW(prewarmed = rope_jit::kernel_spec_from_public(spec));
        CHECK(prewarmed.kv_cache == (layout == ROPE_JIT_KV_CACHE_CONTIGUOUS ? 1 : 2));
        CHECK(prewarmed.kv_index_int64 == (layout == ROPE_JIT_KV_CACHE_CONTIGUOUS ? 0 : 1));
    }
}
