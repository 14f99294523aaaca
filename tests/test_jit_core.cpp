// The op-agnostic JIT core: memory-cache keys of any op (SpecKey), the memory cache itself
// (one build per key however many threads ask), the op registry that turns a stored spec JSON
// back into a recipe, the rule that the core includes no op header, and the device layer
// without a GPU.
#include <doctest/doctest.h>

#include <algorithm>

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.h"
#include "common/error.h"
#include "cuda/cuda_devices.h"
#include "jit/kernel_builder.h"
#include "jit/kernel_cache.h"
#include "jit/nvrtc_loader.h"
#include "ops/attention/attention_recipe.h"
#include "ops/op_registry.h"
#include "ops/rope/rope_plan.h"
#include "ops/rope/rope_recipe.h"

using rope_jit::AttentionSpec;
using rope_jit::CUcontext;
using rope_jit::CUfunction;
using rope_jit::CUmodule;
using rope_jit::KernelSpec;
using rope_jit::LoadedKernel;
using rope_jit::SpecKey;

namespace {

KernelSpec rope_spec() {
    KernelSpec spec;
    spec.dtype = 2;
    spec.head_dim = spec.rotary_dim = 64;
    spec.vec = 8;
    spec.vec_loads = 1;
    spec.validate();
    return spec;
}

AttentionSpec wgmma_spec() {
    AttentionSpec spec;
    spec.dtype = 2;
    spec.head_dim = spec.rotary_dim = 64;
    spec.causal = 1;
    spec.tensor_cores = 1;
    spec.wgmma = 1;
    spec.warps = 8;
    spec.block_n = 64;
    spec.validate();
    return spec;
}

// The global function symbols of a cubin (ELF64): the entries cuModuleGetFunction can find.
// The global functions of a cubin, with their code sizes in bytes (the symbols' st_size).
std::vector<std::pair<std::string, uint64_t>> cubin_function_sizes(const std::vector<char>& image) {
    REQUIRE(image.size() > 64);
    REQUIRE(std::string(image.data(), 4) == "\x7f" "ELF");
    auto read = [&](uint64_t at, int bytes) {
        REQUIRE(at + uint64_t(bytes) <= image.size());
        uint64_t value = 0;
        for (int i = 0; i < bytes; ++i)
            value |= uint64_t(static_cast<unsigned char>(image[size_t(at) + size_t(i)])) << (8 * i);
        return value;
    };
    const uint64_t sections = read(0x28, 8), header_bytes = read(0x3a, 2), count = read(0x3c, 2);
    std::vector<std::pair<std::string, uint64_t>> functions;
    for (uint64_t i = 0; i < count; ++i) {
        const uint64_t header = sections + i * header_bytes;
        if (read(header + 4, 4) != 2) continue;  // SHT_SYMTAB
        const uint64_t strings = read(sections + read(header + 40, 4) * header_bytes + 24, 8);
        const uint64_t first = read(header + 24, 8), bytes = read(header + 32, 8);
        for (uint64_t at = first; at + 24 <= first + bytes; at += 24) {
            const uint64_t info = read(at + 4, 1);
            if ((info & 0xf) != 2 || (info >> 4) != 1) continue;  // STT_FUNC, STB_GLOBAL
            const uint64_t name = strings + read(at, 4);
            REQUIRE(name < image.size());
            functions.emplace_back(image.data() + name, read(at + 16, 8));
        }
    }
    return functions;
}

std::vector<std::string> cubin_functions(const std::vector<char>& image) {
    std::vector<std::string> names;
    for (const auto& function : cubin_function_sizes(image)) names.push_back(function.first);
    return names;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
    for (const std::string& n : names)
        if (n == name) return true;
    return false;
}

// Stand-ins for driver handles: the memory cache only stores and compares them.
CUcontext fake_context(uintptr_t n) {
    return reinterpret_cast<CUcontext>(n * 64);
}
LoadedKernel fake_kernel(uintptr_t n) {
    return LoadedKernel{reinterpret_cast<CUmodule>(n * 64),
                        reinterpret_cast<CUfunction>(n * 64 + 8)};
}

std::string read_text(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

}  // namespace

TEST_CASE("a spec key is its op and its bytes: equal specs match, another op or field does not") {
    const KernelSpec a = rope_spec();
    KernelSpec b = a;
    CHECK(SpecKey::of("rope", a) == SpecKey::of("rope", b));
    CHECK(SpecKey::of("rope", a).hash() == SpecKey::of("rope", b).hash());
    CHECK(std::string(SpecKey::of("rope", a).op()) == "rope");
    b.backward = 1;
    CHECK_FALSE(SpecKey::of("rope", a) == SpecKey::of("rope", b));
    // The same bytes under another op's name are another kernel.
    CHECK_FALSE(SpecKey::of("rope", a) == SpecKey::of("other", a));
    // Specs of different sizes never match, even on a common prefix.
    struct Shorter {
        int32_t first;
    } shorter{a.op};
    CHECK_FALSE(SpecKey::of("rope", a) == SpecKey::of("rope", shorter));
}

TEST_CASE("the memory cache builds each (spec, context) once however many threads ask") {
    rope_jit::KernelCache cache;
    const SpecKey rope = SpecKey::of("rope", rope_spec());
    const SpecKey attention = SpecKey::of("attention", wgmma_spec());
    CHECK(cache.find(rope, fake_context(1)).function == nullptr);

    std::atomic<int> builds{0};
    std::vector<std::thread> threads;
    std::vector<LoadedKernel> seen(8);
    for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
            seen[size_t(t)] = cache.get_or_build(rope, fake_context(1), [&] {
                ++builds;
                std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the others wait
                return fake_kernel(7);
            });
        });
    for (std::thread& thread : threads) thread.join();
    CHECK(builds.load() == 1);
    for (const LoadedKernel& kernel : seen) CHECK(kernel.function == fake_kernel(7).function);
    CHECK(cache.find(rope, fake_context(1)).module == fake_kernel(7).module);

    // Another context, or another op's spec, is another kernel.
    CHECK(cache.find(rope, fake_context(2)).function == nullptr);
    CHECK(cache.find(attention, fake_context(1)).function == nullptr);
    CHECK(cache.get_or_build(attention, fake_context(1), [] { return fake_kernel(9); }).function ==
          fake_kernel(9).function);
    CHECK(cache.find(rope, fake_context(1)).function == fake_kernel(7).function);

    // A failed build reaches its caller and is not cached: the next call builds again.
    const SpecKey failing = SpecKey::of("rope", KernelSpec{});
    CHECK_THROWS_AS(cache.get_or_build(failing, fake_context(1),
                                       []() -> LoadedKernel { throw std::runtime_error("no"); }),
                    std::runtime_error);
    CHECK(cache.find(failing, fake_context(1)).function == nullptr);
    CHECK(cache.get_or_build(failing, fake_context(1), [] { return fake_kernel(3); }).function ==
          fake_kernel(3).function);
}

TEST_CASE("the op registry finds each op from its spec JSON and rebuilds the same recipe") {
    std::string error;
    const KernelSpec rope = rope_spec();
    const rope_jit::OpRegistration* op = rope_jit::op_of_spec_json(rope.to_json(), &error);
    REQUIRE(op != nullptr);
    CHECK(std::string(op->name) == "rope");
    std::optional<rope_jit::KernelRecipe> recipe = op->recipe(rope.to_json(), &error);
    CAPTURE(error);
    REQUIRE(recipe.has_value());
    const rope_jit::KernelRecipe direct = rope_jit::rope_recipe(rope);
    CHECK(recipe->spec_json == direct.spec_json);
    CHECK(recipe->entry == "rope_kernel");
    CHECK(recipe->second_entry == direct.second_entry);
    CHECK(recipe->template_name == "rope.cu");
    CHECK(recipe->source() == direct.source());
    CHECK(recipe->compile_target("sm_80") == "sm_80");
    CHECK(op->describe(rope.to_json()) == rope.describe());

    const AttentionSpec attention = wgmma_spec();
    op = rope_jit::op_of_spec_json(attention.to_json(), &error);
    REQUIRE(op != nullptr);
    CHECK(std::string(op->name) == "attention");
    recipe = op->recipe(attention.to_json(), &error);
    REQUIRE(recipe.has_value());
    CHECK(recipe->spec_json == attention.to_json());
    CHECK(recipe->entry == "attention_kernel");
    CHECK(recipe->template_name == "attention.cu");
    CHECK(recipe->dynamic_shared_bytes == attention.shared_bytes());
    // wgmma kernels compile for the arch-specific target, and only for an sm_90 device.
    CHECK(recipe->compile_target("sm_90") == "sm_90a");
    CHECK_THROWS_AS(recipe->compile_target("sm_80"), rope_jit::Error);
    CHECK(op->describe(attention.to_json()) == attention.describe());
    // A spec of one op is not a spec of another.
    CHECK_FALSE(rope_jit::find_op("rope")->describe(attention.to_json()).has_value());

    // A spec without "op" is a RoPE manifest entry; an unknown op or text that is no JSON
    // object is refused with a reason.
    op = rope_jit::op_of_spec_json("{\"head_dim\": 64}", &error);
    REQUIRE(op != nullptr);
    CHECK(std::string(op->name) == "rope");
    CHECK(rope_jit::op_of_spec_json("{\"op\": \"softmax\"}", &error) == nullptr);
    CHECK(error.find("softmax") != std::string::npos);
    CHECK(error.find("rope, attention") != std::string::npos);
    CHECK(rope_jit::op_of_spec_json("[1, 2]", &error) == nullptr);
    CHECK(error.find("object") != std::string::npos);
    CHECK(rope_jit::op_of_spec_json("not json", nullptr) == nullptr);
    CHECK_FALSE(op->recipe("{\"head_dim\": 7}", &error).has_value());
    CHECK(error.find("head_dim") != std::string::npos);
}

TEST_CASE("a kernel built from its stored spec JSON is the entry the launcher's spec built") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available");
        return;
    }
    char pattern[] = "/tmp/rope_jit_core_XXXXXX";
    const std::string root = mkdtemp(pattern);
    {
        rope_jit::DiskCache disk(root, {});
        rope_jit::KernelStats stats;
        const KernelSpec spec = rope_spec();
        const rope_jit::KernelBinary built =
            rope_jit::build_kernel_binary(spec, "sm_90", &disk, stats);
        CHECK(stats.compiles.load() == 1);
        // The miss's lookups are timed too (reading a directory takes microseconds at least).
        const uint64_t lookups_after_miss = stats.disk_lookup_microseconds.load();
        const std::optional<rope_jit::KernelRecipe> recipe =
            rope_jit::op_of_spec_json(spec.to_json(), nullptr)->recipe(spec.to_json(), nullptr);
        REQUIRE(recipe.has_value());
        const rope_jit::KernelBinary again =
            rope_jit::build_kernel_binary(*recipe, "sm_90", &disk, stats);
        CHECK(stats.compiles.load() == 1);
        CHECK(stats.disk_hits.load() == 1);
        CHECK(again.image == built.image);
        // The hit read and checked a whole file: its lookup adds to the time.
        CHECK(stats.disk_lookup_microseconds.load() > lookups_after_miss);
    }
    CHECK(std::system(("rm -rf '" + root + "'").c_str()) == 0);
}

TEST_CASE(
    "a RoPE module holds the entries its recipe names: the direct path's own with a KV cache, "
    "the bulk path's out of place with partial rotary, the flat path's for plain RoPE") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available");
        return;
    }
    KernelSpec kv = rope_spec();  // k and v into a paged FP8 cache
    kv.gqa_group = 4;
    kv.kv_cache = 2;
    kv.kv_fp8 = 1;
    kv.v_dim = 64;
    kv.v_vec = 8;
    kv.position_mode = 1;
    kv.in_place_k = 0;
    KernelSpec partial = rope_spec();  // copies unrotated features: no direct path, bulk rows
    partial.rotary_dim = 32;
    partial.in_place_q = partial.in_place_k = 0;
    KernelSpec partial_inv_freq = partial;  // angles computed per token: no bulk path either
    partial_inv_freq.angles_from_inv_freq = 1;
    partial_inv_freq.table_full = 0;
    struct Case {
        const char* what;
        KernelSpec spec;
        std::string second_entry;
    };
    KernelSpec plain_inv_freq = rope_spec();  // angles computed per token: no flat path
    plain_inv_freq.dense_rows = 1;
    plain_inv_freq.angles_from_inv_freq = 1;
    plain_inv_freq.table_full = 0;
    KernelSpec dense_rows = rope_spec();  // [B, H, S, D] buffers
    dense_rows.dense_rows = 1;
    KernelSpec dense_rows_out_of_place = dense_rows;
    dense_rows_out_of_place.in_place_q = dense_rows_out_of_place.in_place_k = 0;
    // Without a cache rope_kernel takes the direct path too (RopePlan::direct_entry).
    std::vector<Case> cases = {{"plain", rope_spec(), ""},
                               {"plain, [B,H,S,D]", dense_rows, "rope_flat_kernel"},
                               {"plain, [B,H,S,D], out of place", dense_rows_out_of_place,
                                "rope_flat_kernel"},
                               {"plain, inv_freq", plain_inv_freq, ""},
                               {"paged KV + FP8", kv, "rope_direct_kernel"},
                               {"partial rotary out of place", partial, "rope_bulk_kernel"},
                               {"partial rotary out of place, inv_freq", partial_inv_freq, ""}};
    for (Case& c : cases) {
        CAPTURE(c.what);
        c.spec.validate();
        const RopePlan plan = rope_jit::rope_plan(c.spec);
        CHECK(plan.direct_entry == (c.second_entry == "rope_direct_kernel"));
        CHECK(plan.bulk_rows == (c.second_entry == "rope_bulk_kernel"));
        CHECK(plan.flat_rows == (c.second_entry == "rope_flat_kernel"));
        const rope_jit::KernelRecipe recipe = rope_jit::rope_recipe(c.spec);
        CHECK(recipe.entry == "rope_kernel");
        CHECK(recipe.second_entry == c.second_entry);
        rope_jit::KernelStats stats;
        const std::vector<char> image =
            rope_jit::build_kernel_binary(recipe, "sm_90", nullptr, stats).image;
        const std::vector<std::string> functions = cubin_functions(image);
        CHECK(contains(functions, "rope_kernel"));
        if (!c.second_entry.empty()) CHECK(contains(functions, c.second_entry));
        CHECK_FALSE(contains(functions, "rope_norm_kernel"));
        // The kernel's own plan (rope.cu's spec_shape) agrees with the host's: the entry the
        // recipe names has code, rope.cu's other second entries are empty (one size).
        uint64_t named = 0, main_entry = 0;
        std::vector<uint64_t> others;
        for (const auto& [name, bytes] : cubin_function_sizes(image)) {
            if (name == c.second_entry) named = bytes;
            else if (name == "rope_kernel") main_entry = bytes;
            else others.push_back(bytes);
        }
        REQUIRE_FALSE(others.empty());
        CHECK(std::all_of(others.begin(), others.end(), [&](uint64_t b) { return b == others[0]; }));
        if (!c.second_entry.empty()) CHECK(named > 4 * others[0]);
        // A flat plan's rope_kernel is empty too (its calls all take the flat entry); the
        // others' has code.
        if (plan.flat_rows) CHECK(main_entry == others[0]);
        else CHECK(main_entry > 4 * others[0]);
    }
}

TEST_CASE("the JIT core, the disk cache and the device layer include no op header") {
    const std::string src = std::string(ROPE_JIT_TEST_DATA_DIR) + "/../src/";
    int files = 0;
    for (const char* folder : {"jit", "cache", "cuda"}) {
        DIR* dir = opendir((src + folder).c_str());
        REQUIRE(dir != nullptr);
        while (dirent* entry = readdir(dir)) {
            const std::string name = entry->d_name;
            if (name.size() < 3 ||
                (name.substr(name.size() - 2) != ".h" && name.substr(name.size() - 4) != ".cpp"))
                continue;
            const std::string path = src + folder + "/" + name;
            const std::string text = read_text(path);
            ++files;
            std::istringstream lines(text);
            for (std::string line; std::getline(lines, line);) {
                if (line.rfind("#include \"ops/", 0) != 0) continue;
                // The registry is op-agnostic: it is how the core meets ops by name.
                CAPTURE(path);
                CAPTURE(line);
                CHECK(line == "#include \"ops/op_registry.h\"");
            }
        }
        closedir(dir);
    }
    CHECK(files >= 15);
}

TEST_CASE("without a CUDA device the device layer is unavailable, and says so") {
    if (rope_jit::cuda_device_count() > 0) {
        MESSAGE("skipped: this machine has a CUDA device (the gpu suite covers the device layer)");
        return;
    }
    try {
        rope_jit::CudaDevices devices;
        FAIL("CudaDevices was created without a device");
    } catch (const rope_jit::Error& e) {
        CHECK(e.status() == ROPE_JIT_ERROR_BACKEND_UNAVAILABLE);
        CHECK(std::string(e.what()).size() > 0);
    }
}
