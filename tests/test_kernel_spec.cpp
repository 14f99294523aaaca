// Kernel specs: derived from calls, rendered to preambles and JSON, compiled by NVRTC (no GPU
// needed), and prewarmed into the disk cache through the public API.
#include <doctest/doctest.h>

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "api/prewarm_specs.h"
#include "common/bounded_json.h"
#include "common/error.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"
#include "ops/op_registry.h"
#include "cache/disk_cache.h"
#include "jit/kernel_builder.h"
#include "ops/rope/kernel_spec.h"
#include "ops/rope/rope_recipe.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/rope_problem.h"
#include "rope_test_support.h"

using namespace rope_test;
using rope_jit::KernelSpec;

namespace {

struct TempDir {
    TempDir() {
        char pattern[] = "/tmp/rope_jit_spec_XXXXXX";
        path = mkdtemp(pattern);
    }
    ~TempDir() {
        if (std::system(("rm -rf '" + path + "'").c_str()) != 0)
            MESSAGE("could not remove " << path);
    }
    std::string path;
};

// Counts regular files named *.cubin / *.ptx below `dir`.
int count_entries(const std::string& dir) {
    int count = 0;
    DIR* handle = opendir(dir.c_str());
    if (!handle) return 0;
    while (dirent* entry = readdir(handle)) {
        const std::string name = entry->d_name;
        if (name == "." || name == "..") continue;
        const std::string path = dir + "/" + name;
        if (entry->d_type == DT_DIR)
            count += count_entries(path);
        else if (name.size() > 6 &&
                 (name.rfind(".cubin") == name.size() - 6 || name.rfind(".ptx") == name.size() - 4))
            ++count;
    }
    closedir(handle);
    return count;
}

KernelSpec spec_of(rope_jit_rope_args& args) {
    return rope_jit::make_kernel_spec(rope_jit::make_rope_problem(args));
}

rope_jit_kernel_spec public_spec(int32_t head_dim, DLDataType dtype) {
    rope_jit_kernel_spec spec;
    rope_jit_kernel_spec_init(&spec);
    spec.head_dim = head_dim;
    spec.dtype = dtype;
    return spec;
}

}  // namespace

TEST_CASE("a call's spec records what is fixed and picks the widest safe vector") {
    HostTensor q(Dt::BF16, {2, 8, 16, 128}), k(Dt::BF16, {2, 2, 16, 128});
    HostTensor cos_t(Dt::F32, {16, 128}), sin_t(Dt::F32, {16, 128});
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = k.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();

    SUBCASE("contiguous bf16 gets 16-byte vectors") {
        const KernelSpec spec = spec_of(args);
        CHECK(spec.dtype == 2);
        CHECK(spec.head_dim == 128);
        CHECK(spec.rotary_dim == 128);
        CHECK(spec.gqa_group == 4);
        CHECK(spec.has_k == 1);
        CHECK(spec.table_full == 1);
        CHECK(spec.vec == 8);
        CHECK(spec.vec_loads == 1);
        CHECK(spec.k_own_angles == 0);
    }
    SUBCASE("a [B,S,H,D] buffer seen as its transposed view still vectorizes") {
        HostTensor qt(Dt::BF16, {2, 8, 16, 128}, {0, 2, 1, 3}),
            kt(Dt::BF16, {2, 2, 16, 128}, {0, 2, 1, 3});
        args.q = qt.dl();
        args.k = kt.dl();
        CHECK(spec_of(args).vec == 8);
    }
    SUBCASE("a row stride that is not a multiple of 8 narrows the vector") {
        HostTensor qp(Dt::BF16, {2, 8, 16, 128}, {0, 1, 2, 3}, 2);  // rows of 130
        args.q = qp.dl();
        CHECK(spec_of(args).vec == 2);
    }
    SUBCASE("a misaligned base or a strided feature dimension falls back to scalar accesses") {
        q.dl()->byte_offset = 2;  // one bf16 element in: data no longer 4-byte aligned
        HostTensor q_misaligned(Dt::BF16, {2, 8, 16, 128});
        q_misaligned.dl()->byte_offset = 2;
        q_misaligned.bytes().resize(q_misaligned.bytes().size() + 2);
        q_misaligned.dl()->data = q_misaligned.bytes().data();
        args.q = q_misaligned.dl();
        const KernelSpec spec = spec_of(args);
        CHECK(spec.vec_loads == 0);
        CHECK(spec.vec == 1);
    }
    SUBCASE(
        "out of place with partial rotary, the copy of unrotated features gets its own vector "
        "width") {
        HostTensor q_out(Dt::BF16, {2, 8, 16, 128}), k_out(Dt::BF16, {2, 2, 16, 128});
        args.q_out = q_out.dl();
        args.k_out = k_out.dl();
        args.rotary_dim = 24;  // GPT-NeoX: 12 pairs, so 4-element vectors for the rotation
        HostTensor cos24(Dt::F32, {16, 24}), sin24(Dt::F32, {16, 24});
        args.cos = cos24.dl();
        args.sin = sin24.dl();
        const KernelSpec spec = spec_of(args);
        CHECK(spec.vec == 4);
        CHECK(spec.copy_vec == 8);  // features 24..127: 48-byte aligned, whole 16-byte vectors
        args.rotary_offset = 2;     // the unrotated ranges now start and end off 16 bytes
        CHECK(spec_of(args).copy_vec == 2);
        args.rotary_offset = 0;
        args.q_out = args.q;  // in place: nothing is copied
        args.k_out = args.k;
        CHECK(spec_of(args).copy_vec == 1);
    }
    SUBCASE("queries after cached keys give k its own angles") {
        HostTensor k_long(Dt::BF16, {2, 2, 16, 128});
        HostTensor q_short(Dt::BF16, {2, 8, 4, 128});
        args.q = q_short.dl();
        args.k = k_long.dl();
        args.q_position_offset = 12;
        CHECK(spec_of(args).k_own_angles == 1);
    }
}

TEST_CASE("specs survive the JSON round trip and render every specialization constant") {
    rope_jit_kernel_spec in = public_spec(80, {kDLFloat, 16, 1});
    in.style = ROPE_JIT_STYLE_INTERLEAVED;
    in.positions = ROPE_JIT_POSITIONS_INDICES;
    in.index_dtype = {kDLInt, 32, 1};
    in.gqa_group = 8;
    in.backward = 1;
    const KernelSpec spec = rope_jit::kernel_spec_from_public(in);
    std::string error;
    const std::optional<KernelSpec> back = KernelSpec::from_json(spec.to_json(), &error);
    CAPTURE(error);
    REQUIRE(back.has_value());
    CHECK(*back == spec);
    const std::string preamble = spec.preamble();
    for (const char* name :
         {"BACKWARD_PASS = true", "HAS_ROPE_INDICES = true", "HEAD_DIM = 80", "ROTARY_DIM = 80",
          "GQA_GROUP = 8", "INTERLEAVED = true", "DTYPE = 1", "POSITIONS_INT64 = false", "VEC = 8",
          "IN_PLACE_Q = true", "COPY_VEC = 1"})
        CHECK_MESSAGE(preamble.find(name) != std::string::npos, name);
    CHECK(!KernelSpec::from_json("{\"head_dim\": 7}", &error).has_value());
    CHECK(error.find("head_dim") != std::string::npos);
    CHECK(!KernelSpec::from_json("not json", &error).has_value());
}

TEST_CASE("the template compiles for every kind of specialization") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    rope_jit::KernelStats stats;
    int compiled = 0;
    for (int variant = 0; variant < 12; ++variant) {
        rope_jit_kernel_spec in = public_spec(variant % 3 == 0   ? 64
                                              : variant % 3 == 1 ? 80
                                                                 : 256,
                                              variant % 3 == 0   ? DLDataType{kDLFloat, 32, 1}
                                              : variant % 3 == 1 ? DLDataType{kDLFloat, 16, 1}
                                                                 : DLDataType{kDLBfloat, 16, 1});
        in.style = variant % 2 ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
        in.positions = static_cast<rope_jit_position_mode>(variant % 3);
        in.packed = variant % 4 == 3;
        in.angles = static_cast<rope_jit_angle_source>((variant / 2) % 3);
        in.table_dtype =
            variant % 5 == 0 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
        in.xpos = variant % 6 == 5;
        in.in_place = variant % 2 == 0 && variant != 6;  // 6: partial rotary out of place
        in.backward = variant % 4 == 1;
        in.has_k = variant % 5 != 4;
        in.gqa_group = variant % 3 + 1;
        if (variant % 4 == 2) {  // partial rotary at an offset
            in.rotary_dim = in.head_dim / 2;
            in.rotary_offset = 8;
        }
        const KernelSpec spec = rope_jit::kernel_spec_from_public(in);
        CAPTURE(spec.describe());
        // sm_75: the bfloat16 conversion without cvt.rn.bf16.f32.
        const rope_jit::KernelBinary binary = rope_jit::build_kernel_binary(
            spec, variant % 4 == 0 ? "sm_75" : "sm_90", nullptr, stats);
        REQUIRE(binary.image.size() > 4);
        CHECK(std::string(binary.image.data(), 4) ==
              "\x7f"
              "ELF");
        ++compiled;
    }
    // Multi-section positions and the frequency gradient have no public spec fields: set them
    // on specs derived from public ones.
    for (int variant = 0; variant < 4; ++variant) {
        rope_jit_kernel_spec in = public_spec(128, DLDataType{kDLBfloat, 16, 1});
        in.positions = ROPE_JIT_POSITIONS_INDICES;
        in.style = variant % 2 ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
        in.angles = variant < 2 ? ROPE_JIT_ANGLES_TABLE_FULL : ROPE_JIT_ANGLES_INV_FREQ;
        in.backward = variant >= 2;
        KernelSpec spec = rope_jit::kernel_spec_from_public(in);
        spec.mrope_axes = variant == 3 ? 0 : 3;
        spec.freq_grad = variant >= 2;
        spec.validate();
        CAPTURE(spec.describe());
        const rope_jit::KernelBinary binary =
            rope_jit::build_kernel_binary(spec, "sm_90", nullptr, stats);
        CHECK(std::string(binary.image.data(), 4) ==
              "\x7f"
              "ELF");
        ++compiled;
    }
    CHECK(stats.compiles.load() == uint64_t(compiled));
    MESSAGE("average cold compile: "
            << double(stats.compile_microseconds.load()) / 1000.0 / compiled << " ms");
}

TEST_CASE(
    "prewarming for sm_80 and sm_90 fills the disk cache, and a fresh process compiles nothing") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available");
        return;
    }
    TempDir dir;
    rope_jit_kernel_spec specs[2] = {public_spec(128, {kDLBfloat, 16, 1}),
                                     public_spec(64, {kDLFloat, 16, 1})};
    specs[1].style = ROPE_JIT_STYLE_INTERLEAVED;
    specs[1].backward = 1;

    auto prewarm_in_child = [&](const char* target, uint64_t expect_compiles,
                                uint64_t expect_disk_hits) {
        // A child process: nothing in memory survives from earlier prewarms.
        const pid_t pid = fork();
        if (pid == 0) {
            rope_jit_config config;
            rope_jit_config_init(&config);
            config.backend = ROPE_JIT_BACKEND_CPU;
            config.cache_dir = dir.path.c_str();
            rope_jit_runtime* runtime = nullptr;
            if (rope_jit_runtime_create(&config, &runtime) != ROPE_JIT_OK) _exit(10);
            if (rope_jit_prewarm(runtime, specs, 2, target) != ROPE_JIT_OK) _exit(11);
            rope_jit_stats stats;
            rope_jit_stats_init(&stats);
            if (rope_jit_get_stats(runtime, &stats) != ROPE_JIT_OK) _exit(12);
            rope_jit_runtime_free(runtime);
            if (stats.compiles != expect_compiles) _exit(13);
            if (stats.disk_hits != expect_disk_hits) _exit(14);
            if (stats.disk_writes != expect_compiles) _exit(15);
            _exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    CHECK(prewarm_in_child("sm_80", 2, 0) == 0);
    CHECK(prewarm_in_child("sm_90", 2, 0) == 0);
    CHECK(count_entries(dir.path + "/v1") == 4);
    CHECK(prewarm_in_child("sm_80", 0, 2) == 0);  // fresh process: hits, no compile
    CHECK(prewarm_in_child("sm_90", 0, 2) == 0);
    CHECK(count_entries(dir.path + "/v1") == 4);
}

TEST_CASE(
    "runtimes of one process that miss the same spec at once compile it once and share the entry") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available");
        return;
    }
    TempDir dir;
    const KernelSpec spec = rope_jit::kernel_spec_from_public(public_spec(96, {kDLBfloat, 16, 1}));
    constexpr int kRuntimes = 4;
    // One cache object and counters per thread, as separate runtimes (one per GPU) have.
    std::vector<rope_jit::KernelStats> stats(kRuntimes);
    std::vector<std::vector<char>> images(kRuntimes);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRuntimes; ++r) {
        threads.emplace_back([&, r] {
            const rope_jit::DiskCache disk(dir.path, {});
            images[size_t(r)] =
                rope_jit::build_kernel_binary(spec, "sm_90", &disk, stats[size_t(r)]).image;
        });
    }
    for (std::thread& thread : threads) thread.join();
    uint64_t compiles = 0, disk_hits = 0, disk_writes = 0;
    for (const rope_jit::KernelStats& s : stats) {
        compiles += s.compiles;
        disk_hits += s.disk_hits;
        disk_writes += s.disk_writes;
    }
    CHECK(compiles == 1);
    CHECK(disk_hits == kRuntimes - 1);
    CHECK(disk_writes == 1);
    for (const std::vector<char>& image : images) CHECK(image == images[0]);
    CHECK(count_entries(dir.path + "/v1") == 1);
}

TEST_CASE("prewarm rejects bad specs and targets with a clear status") {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    rope_jit_kernel_spec specs[2] = {public_spec(64, {kDLFloat, 32, 1}),
                                     public_spec(63, {kDLFloat, 32, 1})};
    if (rope_jit::nvrtc_api() != nullptr) {
        CHECK(rope_jit_prewarm(runtime, specs, 2, "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("specs[1]: head_dim") != std::string::npos);
        CHECK(rope_jit_prewarm(runtime, specs, 1, "sm_x") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    }
    CHECK(rope_jit_prewarm(runtime, specs, 1, nullptr) == ROPE_JIT_ERROR_BACKEND_UNAVAILABLE);
    CHECK(std::string(rope_jit_last_error()).find("no GPU") != std::string::npos);
    CHECK(rope_jit_prewarm(runtime, nullptr, 1, "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    specs[0].struct_size = 0;
    CHECK(rope_jit_prewarm(runtime, specs, 1, "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    rope_jit_runtime_free(runtime);
}

TEST_CASE("prewarm reads an array of specs from a caller built against an older, smaller struct") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    // An older header without the last fields: elements lie old_size bytes apart.
    const size_t old_size = offsetof(rope_jit_kernel_spec, in_place) /
                            alignof(rope_jit_kernel_spec) * alignof(rope_jit_kernel_spec);
    REQUIRE(old_size < sizeof(rope_jit_kernel_spec));
    std::vector<char> array(2 * old_size);
    auto put = [&](size_t index, int32_t head_dim) {
        rope_jit_kernel_spec spec = public_spec(head_dim, {kDLFloat, 32, 1});
        spec.struct_size = old_size;
        std::memcpy(array.data() + index * old_size, &spec, old_size);
    };
    put(0, 64);
    put(1, 62);
    const auto* specs = reinterpret_cast<const rope_jit_kernel_spec*>(array.data());
    CHECK(rope_jit_prewarm(runtime, specs, 2, "sm_90") == ROPE_JIT_OK);
    put(1, 63);  // odd: the second element must be read where the caller put it to be refused
    CHECK(rope_jit_prewarm(runtime, specs, 2, "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("specs[1]: head_dim") != std::string::npos);
    rope_jit_runtime_free(runtime);
}

// ---- one JSON vocabulary, derived fields, prewarm from JSON ------------------------------

namespace {

// The spec a manifest entry (JSON text, derived fields left out) stands for.
KernelSpec manifest_spec(const std::string& text) {
    std::string error;
    const std::optional<KernelSpec> spec = KernelSpec::from_json(text, &error);
    INFO(text << ": " << error);
    REQUIRE(spec.has_value());
    return *spec;
}

}  // namespace

TEST_CASE(
    "a manifest entry without derived fields but dense_rows is the spec of a call with "
    "contiguous aligned tensors") {
    // Calls as apply_rope and the HF drop-in make them (python/rope_jit/torch_ops.py,
    // dropin/hf.py): bf16 q [B, S, Hq, D] and k seen as [B, H, S, D] views, out of place into
    // fresh tensors, HF's bf16 cos/sin of [B, S, R] stacked to a [B*S, R] table with int64
    // per-sequence offsets (a batch of 2), or a [S, R] table with implicit positions.
    const int64_t B = 2, S = 16, Hq = 8, Hk = 2, D = 128;
    HostTensor q(Dt::BF16, {B, Hq, S, D}, {0, 2, 1, 3}), k(Dt::BF16, {B, Hk, S, D}, {0, 2, 1, 3});
    HostTensor q_out(Dt::BF16, {B, Hq, S, D}, {0, 2, 1, 3}),
        k_out(Dt::BF16, {B, Hk, S, D}, {0, 2, 1, 3});
    HostTensor cos_t(Dt::BF16, {B * S, D}), sin_t(Dt::BF16, {B * S, D});
    HostTensor offsets(Dt::I64, {B}), positions(Dt::I64, {B, S});
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = k.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    // (Dense rows of a token's heads together, 16-bit, rotated whole: the flat path's kernel.)
    const std::string common = R"("head_dim": 128, "gqa_group": 4, "dtype": "bfloat16", )"
                               R"("table_dtype": "bfloat16", "dense_rows": true)";
    for (int backward = 0; backward < 2; ++backward) {
        args.backward = backward;
        const std::string direction = backward ? R"(, "direction": "backward")" : "";
        args.q_out = q_out.dl();
        args.k_out = k_out.dl();
        args.seqlen_offsets = offsets.dl();
        CHECK(spec_of(args) ==
              manifest_spec("{" + common + direction +
                            R"(, "positions": "seqlen-offsets", "in_place_q": false})"));
        args.seqlen_offsets = nullptr;
        CHECK(spec_of(args) ==
              manifest_spec("{" + common + direction + R"(, "in_place_q": false})"));
        args.positions = positions.dl();
        CHECK(spec_of(args) == manifest_spec("{" + common + direction +
                                             R"(, "positions": "indices", "in_place_q": false})"));
        args.positions = nullptr;
        args.q_out = args.k_out = nullptr;
        CHECK(spec_of(args) == manifest_spec("{" + common + direction + "}"));
    }
    // Partial rotary out of place (GPT-NeoX): the copy of unrotated features vectorizes too.
    HostTensor cos24(Dt::F32, {S, 24}), sin24(Dt::F32, {S, 24});
    args.cos = cos24.dl();
    args.sin = sin24.dl();
    args.rotary_dim = 24;
    args.q_out = q_out.dl();
    args.k_out = k_out.dl();
    args.backward = 0;
    CHECK(spec_of(args) ==
          manifest_spec(R"({"head_dim": 128, "rotary_dim": 24, "gqa_group": 4, "dtype": "bfloat16",
                                             "in_place_q": false})"));
    // And the C struct's spec of the same parameters.
    rope_jit_kernel_spec in = public_spec(128, {kDLBfloat, 16, 1});
    in.rotary_dim = 24;
    in.gqa_group = 4;
    in.in_place = 0;
    CHECK(rope_jit::kernel_spec_from_public(in) == spec_of(args));
}

TEST_CASE("a call of dense rows gets the dense_rows spec, which a manifest and the C struct "
          "name") {
    // dense_rows (the flat path's kernel) is derived from the call's tensors: dense rows, not
    // packed, in [B, H, S, D] memory (more than one head and token), or in [B, S, H, D] memory
    // with 16-bit elements, the whole head rotated and more than one token.
    const int64_t B = 2, S = 16, Hq = 8, Hk = 2, D = 64;
    HostTensor q(Dt::BF16, {B, Hq, S, D}), k(Dt::BF16, {B, Hk, S, D});
    HostTensor cos_t(Dt::BF16, {S, D}), sin_t(Dt::BF16, {S, D});
    HostTensor positions(Dt::I64, {B, S}), offsets(Dt::I64, {B});
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = k.dl();
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    const std::string common =
        R"("head_dim": 64, "gqa_group": 4, "dtype": "bfloat16", "table_dtype": "bfloat16")";
    const KernelSpec spec = spec_of(args);
    CHECK(spec.dense_rows == 1);
    KernelSpec other_kernel = spec;  // the two kernels' descriptions (prewarm's lines) differ
    other_kernel.dense_rows = 0;
    CHECK(spec.describe() == other_kernel.describe() + " +dense_rows");
    CHECK(spec == manifest_spec("{" + common + R"(, "dense_rows": true})"));
    rope_jit_kernel_spec in = public_spec(64, {kDLBfloat, 16, 1});
    in.gqa_group = 4;
    in.dense_rows = 1;
    in.table_dtype = {kDLBfloat, 16, 1};
    CHECK(rope_jit::kernel_spec_from_public(in) == spec);  // prewarm builds the call's kernel
    rope_jit_kernel_spec with_norm = in;
    with_norm.qk_norm = 1;
    CHECK(rope_jit::kernel_spec_from_public(with_norm).dense_rows == 0);
    args.seqlen_offsets = offsets.dl();
    CHECK(spec_of(args).dense_rows == 1);
    args.seqlen_offsets = nullptr;
    args.positions = positions.dl();  // each item looks its position up
    CHECK(spec_of(args).dense_rows == 1);
    CHECK(spec_of(args) ==
          manifest_spec("{" + common + R"(, "positions": "indices", "dense_rows": true})"));
    args.positions = nullptr;
    // The field for the same call on other q and k (and tables of their dtype).
    auto dense_rows_of = [&](HostTensor& q_in, HostTensor& k_in, HostTensor& c, HostTensor& s) {
        rope_jit_rope_args other = args;
        other.q = q_in.dl();
        other.k = k_in.dl();
        other.cos = c.dl();
        other.sin = s.dl();
        return spec_of(other).dense_rows;
    };
    // float32 [B, H, S, D] too.
    HostTensor q32(Dt::F32, {B, Hq, S, D}), k32(Dt::F32, {B, Hk, S, D});
    HostTensor cos32(Dt::F32, {S, D}), sin32(Dt::F32, {S, D});
    CHECK(dense_rows_of(q32, k32, cos32, sin32) == 1);
    // Specs whose plan has no flat path keep dense_rows 0 (one kernel for every layout, which
    // a prewarm without the field still matches): angles from inv_freq, here; and so in JSON
    // and the C struct.
    HostTensor inv_freq(Dt::F32, {D / 2});
    args.cos = args.sin = nullptr;
    args.inv_freq = inv_freq.dl();
    CHECK(spec_of(args).dense_rows == 0);
    // (common's table_dtype replaced, not given twice: a key twice is refused.)
    const std::string inv_freq_common =
        R"("head_dim": 64, "gqa_group": 4, "dtype": "bfloat16", "table_dtype": "float32")";
    CHECK(spec_of(args) == manifest_spec("{" + inv_freq_common + R"(, "angles": "inv-freq"})"));
    CHECK(manifest_spec("{" + inv_freq_common + R"(, "angles": "inv-freq", "dense_rows": true})")
              .dense_rows == 0);
    CHECK(manifest_spec("{" + common + R"(, "qk_norm": true, "dense_rows": true})").dense_rows == 0);
    args.inv_freq = nullptr;
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    // [B, S, H, D] memory, and a single head (both orders at once): dense_rows with 16-bit
    // elements rotated whole over more than one token; not float32, partial rotary or one
    // token a sequence.
    HostTensor q_tokens(Dt::BF16, {B, Hq, S, D}, {0, 2, 1, 3});
    HostTensor k_tokens(Dt::BF16, {B, Hk, S, D}, {0, 2, 1, 3});
    args.q = q_tokens.dl();
    args.k = k_tokens.dl();
    CHECK(spec_of(args).dense_rows == 1);
    CHECK(spec_of(args) == spec);  // one kernel for either order
    HostTensor cos_half(Dt::BF16, {S, D / 2}), sin_half(Dt::BF16, {S, D / 2});
    args.cos = cos_half.dl();
    args.sin = sin_half.dl();
    args.rotary_dim = D / 2;
    CHECK(spec_of(args).dense_rows == 0);  // partial rotary in place
    args.rotary_dim = 0;
    args.cos = cos_t.dl();
    args.sin = sin_t.dl();
    HostTensor q_tokens32(Dt::F32, {B, Hq, S, D}, {0, 2, 1, 3});
    HostTensor k_tokens32(Dt::F32, {B, Hk, S, D}, {0, 2, 1, 3});
    CHECK(dense_rows_of(q_tokens32, k_tokens32, cos32, sin32) == 0);
    HostTensor q_decode(Dt::BF16, {B, Hq, 1, D}), k_decode(Dt::BF16, {B, Hk, 1, D});
    CHECK(dense_rows_of(q_decode, k_decode, cos_t, sin_t) == 0);
    HostTensor q_one(Dt::BF16, {B, 1, S, D});
    args.q = q_one.dl();
    args.k = nullptr;
    CHECK(spec_of(args).dense_rows == 1);
    // With packed tensors the field is refused, naming it.
    std::string error;
    CHECK_FALSE(
        KernelSpec::from_json(R"({"head_dim": 64, "dense_rows": true, "packed": true})", &error));
    CHECK(error.find("dense_rows") != std::string::npos);
    in.packed = 1;
    CHECK_THROWS_WITH_AS(rope_jit::kernel_spec_from_public(in), doctest::Contains("dense_rows"),
                         rope_jit::Error);
}

TEST_CASE("rope specs: every field round-trips through JSON, and bad JSON names the field") {
    // Specs of many kinds: each field away from its default somewhere.
    std::vector<KernelSpec> specs;
    for (
        const char* text :
        {R"({"head_dim": 64})", R"({"head_dim": 80, "style": "interleaved", "positions": "indices",
              "positions_int64": false, "direction": "backward", "gqa_group": 8, "dtype": "float16"})",
         R"({"head_dim": 96, "rotary_dim": 24, "rotary_offset": 8, "in_place_q": false, "has_k": false})",
         R"({"head_dim": 64, "angles": "inv-freq", "inv_freq_dtype": "bfloat16", "xpos": true,
              "direction": "backward", "freq_grad": true, "packed": true, "positions": "seqlen-offsets"})",
         R"({"head_dim": 64, "angles": "table-half", "positions": "indices", "mrope_axes": 3, "vec": 2,
              "vec_loads": false, "table_vec_loads": false, "block_threads": 256, "copy_vec": 1})"})
        specs.push_back(manifest_spec(text));
    for (const KernelSpec& spec : specs) {
        CAPTURE(spec.to_json());
        std::string error;
        const std::optional<KernelSpec> back = KernelSpec::from_json(spec.to_json(), &error);
        REQUIRE_MESSAGE(back.has_value(), error);
        CHECK(*back == spec);
    }
    // The vocabulary: names, not codes.
    const std::string text = specs[3].to_json();
    for (const char* piece :
         {R"("angles":"inv-freq")", R"("direction":"backward")", R"("inv_freq_dtype":"bfloat16")",
          R"("positions":"seqlen-offsets")", R"("op":"rope")", R"("xpos":true)"})
        CHECK_MESSAGE(text.find(piece) != std::string::npos, piece);
    const struct {
        const char* json;
        const char* error;
    } bad[] = {
        {R"({"head_dim": 64, "colour": "blue"})", "unknown field 'colour'"},
        {R"({"rotary_dim": 64})", "head_dim: required"},
        {R"({"head_dim": "64"})", "head_dim: expected an integer, got \"64\""},
        {R"({"head_dim": -2})", "head_dim: must be in [2, 1048576], got -2"},
        {R"({"head_dim": 63})", "kernel spec: head_dim must be even, got 63"},
        {R"({"head_dim": 18446744073709551615})", "head_dim: must be in [2, 1048576]"},
        {R"({"head_dim": 64, "dtype": "bf16"})",
         "dtype: expected one of float32, float16, bfloat16, got \"bf16\""},
        {R"({"head_dim": 64, "angles": "table_full"})",
         "angles: expected one of table-half, table-full, inv-freq"},
        {R"({"head_dim": 64, "backward": true})", "unknown field 'backward'"},
        // A key with a NUL or a newline is written escaped: the C API's message is one line.
        {R"({"head_dim": 64, "\u0000x\n": 1})", R"(unknown field '\u0000x\n')"},
        {"not json", "not valid JSON: parse error at line 1, column 2"},
        // A number past double's range is a JSON number the parser cannot hold: named, with
        // where it stopped (was only "not valid JSON"; adversarial pass, session 49).
        {R"({"head_dim": 1e400})", "not valid JSON: number overflow parsing '1e400' (at byte"},
        // The token quoted is ASCII: an e-acute's first byte reads '?' (nlohmann stops there), a
        // control byte as nlohmann writes it.
        {"{\"head_dim\": \xc3\xa9}", "last read: '\"head_dim\": ?'"},
        {"{\"head_dim\": 6\x01}", "last read: '6<U+0001>'"},
        {"[64]", "not a JSON object"},
        {R"({"head_dim": 64, "has_k": 1})", "has_k: expected true or false, got 1"},
        {R"({"head_dim": 64, "op": "attention"})", "op: expected \"rope\""},
        {R"({"head_dim": 64, "angles": "inv-freq", "table_dtype": "bfloat16"})",
         "table_dtype: must be float32"},
        {R"({"head_dim": 64, "positions_int64": true})",
         "positions_int64: needs positions \"indices\""},
        // D2: near INT32_MAX the sum rotary_offset + rotary_dim overflowed int32.
        {R"({"head_dim": 128, "rotary_dim": 2, "rotary_offset": 2147483646})",
         "rotary_offset: must be in"},
    };
    for (const auto& [json, expected] : bad) {
        std::string error;
        CHECK_MESSAGE(!KernelSpec::from_json(json, &error).has_value(), json);
        CHECK_MESSAGE(error.find(expected) != std::string::npos, json << " -> " << error);
    }
}

TEST_CASE("D2: prewarm refuses rotary ranges whose sum overflows int32, without overflowing") {
    rope_jit_kernel_spec in = public_spec(128, {kDLFloat, 32, 1});
    in.rotary_dim = INT32_MAX - 1;
    in.rotary_offset = 4;
    CHECK_THROWS_AS(rope_jit::kernel_spec_from_public(in), rope_jit::Error);
    KernelSpec spec = rope_jit::kernel_spec_from_public(public_spec(128, {kDLFloat, 32, 1}));
    spec.rotary_offset = INT32_MAX - 1;
    spec.rotary_dim = 2;
    spec.head_dim = INT32_MAX - 1;
    CHECK_THROWS_AS(spec.validate(),
                    rope_jit::Error);  // out of range, and the sum is taken in int64
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    CHECK(rope_jit_prewarm(runtime, &in, 1, "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("rotary_dim") != std::string::npos);
    CHECK(rope_jit_prewarm_json(
              runtime, R"({"head_dim": 128, "rotary_dim": 2147483646, "rotary_offset": 4})",
              "sm_90") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    rope_jit_runtime_free(runtime);
}

TEST_CASE("JSON nested deeper than 16 levels is refused before any value of it is printed") {
    // nlohmann's dump() recurses: the errors that quote a value overflowed the stack on a
    // 200 KB "[[[...]]]" (adversarial test, session 32), in rope_jit_prewarm_json and in the
    // cache walk that reads an entry's stored spec.
    CHECK(rope_jit::json_nesting_depth(R"({"a": [1, {"b": "[[[["}]})", 99) == 3);
    CHECK(rope_jit::json_nesting_depth(R"("\"[[[")", 99) == 0);
    CHECK(rope_jit::json_nesting_depth(std::string(1000, '['), 16) == 17);  // stops past the limit
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    const std::string deep_field = R"({"head_dim": )" + deep + "}";
    std::string why;
    CHECK(rope_jit::parse_bounded_json(deep, &why).is_discarded());
    CHECK(why == "nests deeper than 16 levels");
    CHECK(rope_jit::parse_bounded_json(std::string(16, '[') + std::string(16, ']')).is_array());
    // A key twice in one object (nlohmann kept the last: adversarial pass, session 38); the
    // same key in two objects is fine.
    CHECK(rope_jit::parse_bounded_json(R"([{"a": 1, "b": {"a": 2, "x\n": 3, "x\n": 4}}])", &why)
              .is_discarded());
    CHECK(why == "key 'x\\n' given twice in one object");
    CHECK(rope_jit::parse_bounded_json(R"([{"a": 1}, {"a": 2, "b": {"a": 3}}])").is_array());
    std::string error;
    CHECK_FALSE(KernelSpec::from_json(R"({"head_dim": 128, "head_dim": 64})", &error).has_value());
    CHECK(error == "key 'head_dim' given twice in one object");
    CHECK_FALSE(KernelSpec::from_json(deep_field, &error).has_value());
    CHECK(error == "nests deeper than 16 levels");
    CHECK_FALSE(rope_jit::AttentionSpec::from_json(deep_field, &error).has_value());
    CHECK(error == "nests deeper than 16 levels");
    CHECK(rope_jit::op_of_spec_json(deep_field, &error) == nullptr);
    const rope_test::CpuRuntime runtime(1, /*disk_cache=*/false);
    for (const std::string& text : {deep, deep_field, "[" + deep_field + "]"}) {
        CHECK(rope_jit_prewarm_json(runtime.handle, text.c_str(), "sm_90") ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()) == "json: nests deeper than 16 levels");
    }
}

TEST_CASE("prewarm plans: targets are checked, entries are named in errors, duplicates merge") {
    std::vector<std::string> seen;
    auto visit = [](const char* spec_json, const char*, void* user) {
        static_cast<std::vector<std::string>*>(user)->push_back(spec_json);
        return 0;
    };
    for (const char* target :
         {"sm_9", "sm_90x", "sm_0", "sm_12345678901234567890", "volta", "sm_", ""}) {
        CHECK_MESSAGE(rope_jit_prewarm_plan(R"({"head_dim": 64})", target, visit, &seen) ==
                          ROPE_JIT_ERROR_INVALID_ARGUMENT,
                      target);
        CHECK(std::string(rope_jit_last_error()).find("target") != std::string::npos);
    }
    CHECK(seen.empty());
    CHECK(rope_jit_prewarm_plan(
              R"([{"head_dim": 64}, {"head_dim": 64, "rotary_dim": 64}, {"head_dim": 32}])",
              "sm_90", visit, &seen) == ROPE_JIT_OK);
    REQUIRE(seen.size() == 2);
    CHECK(seen[0] == manifest_spec(R"({"head_dim": 64})").to_json());
    CHECK(rope_jit_prewarm_plan(R"([{"head_dim": 64}, {"head_dim": 64, "style": "diagonal"}])",
                                "sm_90", visit, &seen) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error())
              .find("json[1]: style: expected one of half, interleaved") != std::string::npos);
    CHECK(rope_jit_prewarm_plan(R"({"op": "conv", "head_dim": 64})", "sm_90", visit, &seen) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(rope_jit_prewarm_plan("[1, 2]", "sm_90", visit, &seen) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(rope_jit_prewarm_plan(nullptr, "sm_90", visit, &seen) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(rope_jit_prewarm_plan("{}", nullptr, visit, &seen) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
}

TEST_CASE(
    "an attention call entry stands for the kernels a real call of that shape picks on the "
    "target") {
    // A Llama-shaped call as rope_jit.torch_ops.attention makes it: bf16 [B, H, S, D] tensors,
    // lse, causal, a bf16 table; its kernels on a device of each target's table entry.
    const int64_t B = 2, Hq = 8, Hk = 2, S = 64, D = 128;
    for (const bool full : {false, true}) {
        HostTensor q(Dt::BF16, {B, Hq, S, D}), k(Dt::BF16, {B, Hk, S, D}),
            v(Dt::BF16, {B, Hk, S, D});
        HostTensor out(Dt::BF16, {B, Hq, S, D}), lse(Dt::F32, {B, Hq, S});
        HostTensor cos_t(Dt::BF16, {S, full ? D : D / 2}), sin_t(Dt::BF16, {S, full ? D : D / 2});
        HostTensor dout(Dt::BF16, {B, Hq, S, D}), dq(Dt::BF16, {B, Hq, S, D}),
            dk(Dt::BF16, {B, Hk, S, D}), dv(Dt::BF16, {B, Hk, S, D});
        rope_jit_attention_args args;
        rope_jit_attention_args_init(&args);
        args.q = q.dl();
        args.k = k.dl();
        args.v = v.dl();
        args.out = out.dl();
        args.lse = lse.dl();
        args.cos = cos_t.dl();
        args.sin = sin_t.dl();
        args.causal = 1;
        args.dout = dout.dl();
        args.dq = dq.dl();
        args.dk = dk.dl();
        args.dv = dv.dl();
        for (const char* target : {"sm_80", "sm_86", "sm_90", "sm_120"}) {
            for (const bool backward : {false, true}) {
                CAPTURE(target);
                CAPTURE(backward);
                const rope_jit::AttentionProblem problem =
                    rope_jit::make_attention_problem(args, backward);
                const std::vector<rope_jit::AttentionSpec> expected =
                    rope_jit::choose_attention_specs(problem,
                                                     rope_jit::attention_device_for_target(target));
                const std::string entry = fmt::format(
                    R"({{"op": "attention", "head_dim": 128, "gqa_group": 4, "dtype": "bfloat16",
                         "table_dtype": "bfloat16", "table_full": {}, "causal": true, "write_lse": true,
                         "direction": "{}"}})",
                    full ? "true" : "false", backward ? "backward" : "forward");
                const std::vector<rope_jit::PrewarmKernel> kernels =
                    rope_jit::expand_prewarm_json(entry, target);
                REQUIRE(kernels.size() == expected.size());
                // The backward on sm_90: prepare, wgmma backward and dq finish.
                const bool sm90 = std::string(target) == "sm_90";
                // (The forward on sm_90: prepare, then the forward taking rotated keys by TMA.)
                CHECK(kernels.size() == (sm90 ? (backward ? 3u : 2u) : (backward ? 2u : 1u)));
                for (size_t i = 0; i < kernels.size(); ++i) {
                    CHECK(kernels[i].attention);
                    CHECK(kernels[i].attention_spec == expected[i]);
                    CHECK(kernels[i].spec_json == expected[i].to_json());
                    // And the listed kernel JSON is itself a valid entry that stands for itself.
                    const std::vector<rope_jit::PrewarmKernel> again =
                        rope_jit::expand_prewarm_json(kernels[i].spec_json, target);
                    REQUIRE(again.size() == 1);
                    CHECK(again[0].attention_spec == expected[i]);
                }
            }
        }
    }
    // The device a target stands for, from the table.
    CHECK(rope_jit::attention_device_for_target("sm_90").max_shared_bytes == 232448);
    CHECK(rope_jit::attention_device_for_target("sm_80").max_shared_bytes == 166912);
    CHECK(rope_jit::attention_device_for_target("sm_89").max_shared_bytes == 101376);
    CHECK(rope_jit::attention_device_for_target("sm_91").max_shared_bytes ==
          232448);  // nearest older
    CHECK(rope_jit::attention_device_for_target("sm_90a").compute_capability == 90);
    CHECK_FALSE(rope_jit::attention_device_for_target("sm_80").wgmma);
    // A call entry does not take the fields the kernel choice sets.
    CHECK_THROWS_WITH_AS(rope_jit::expand_prewarm_json(
                             R"({"op": "attention", "head_dim": 64, "warps": 8})", "sm_90"),
                         doctest::Contains("warps: the kernel choice sets it"), rope_jit::Error);
    CHECK_THROWS_WITH_AS(
        rope_jit::expand_prewarm_json(R"({"op": "attention", "head_dim": 1000})", "sm_90"),
        doctest::Contains("head_dim: must be in [1, 512]"), rope_jit::Error);
}
