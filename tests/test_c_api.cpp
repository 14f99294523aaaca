// The C API's fixed surface: versions, the status table, struct initialization and
// versioning, runtime lifetime and backend selection.
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "rope_jit/rope_jit.h"
#include "rope_test_support.h"
#include "scratch_files.h"

TEST_CASE("the version call agrees with the header macros") {
    CHECK(rope_jit_version_number() == ROPE_JIT_VERSION_NUMBER);
    CHECK(std::string(rope_jit_version_string()) ==
          std::to_string(ROPE_JIT_VERSION_MAJOR) + "." + std::to_string(ROPE_JIT_VERSION_MINOR) +
              "." + std::to_string(ROPE_JIT_VERSION_PATCH));
}

TEST_CASE("every status has a name and a message from the one table") {
    CHECK(std::string(rope_jit_status_name(ROPE_JIT_OK)) == "OK");
    CHECK(std::string(rope_jit_status_message(ROPE_JIT_OK)) == "success");
    CHECK(std::string(rope_jit_status_name(ROPE_JIT_ERROR_INVALID_ARGUMENT)) ==
          "ERROR_INVALID_ARGUMENT");
    CHECK(std::string(rope_jit_status_name(ROPE_JIT_ERROR_COMPILE)) == "ERROR_COMPILE");
    CHECK(ROPE_JIT_ERROR_INVALID_ARGUMENT == 1);  // values never change meaning
    CHECK(ROPE_JIT_ERROR_INTERNAL == 8);
    CHECK(std::string(rope_jit_status_name(static_cast<rope_jit_status>(999))) == "UNKNOWN_STATUS");
    CHECK(std::string(rope_jit_status_message(static_cast<rope_jit_status>(-1))) ==
          "unknown status");
}

TEST_CASE("init functions fill the documented defaults and accept NULL") {
    rope_jit_config config;
    std::memset(&config, 0x5a, sizeof config);
    rope_jit_config_init(&config);
    CHECK(config.struct_size == sizeof(rope_jit_config));
    CHECK(config.backend == ROPE_JIT_BACKEND_AUTO);
    CHECK(config.cache_dir == nullptr);
    CHECK(config.disk_cache == 1);
    CHECK(config.cpu_threads == 0);
    CHECK(config.debug_checks == 0);

    rope_jit_rope_args args;
    std::memset(&args, 0x5a, sizeof args);
    rope_jit_rope_args_init(&args);
    CHECK(args.struct_size == sizeof(rope_jit_rope_args));
    CHECK(args.q == nullptr);
    CHECK(args.k == nullptr);
    CHECK(args.cos == nullptr);
    CHECK(args.inv_freq == nullptr);
    CHECK(args.positions == nullptr);
    CHECK(args.xpos_scale == nullptr);
    CHECK(args.stream == nullptr);
    CHECK(args.position_offset == 0);
    CHECK(args.rotary_dim == 0);
    CHECK(args.style == ROPE_JIT_STYLE_HALF);
    CHECK(args.backward == 0);

    rope_jit_config_init(nullptr);
    rope_jit_rope_args_init(nullptr);
}

TEST_CASE("a caller compiled against an older, smaller config struct gets defaults for the rest") {
    // An "old" caller knew only struct_size and backend.
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.struct_size = offsetof(rope_jit_config, cache_dir);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.cpu_threads = -5;  // beyond the old struct: must be ignored, not rejected
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    CHECK(rope_jit_backend(runtime) == ROPE_JIT_BACKEND_CPU);
    rope_jit_runtime_free(runtime);
}

TEST_CASE("an _init writes exactly the caller's struct, whatever size it was compiled with") {
    // The _init functions wrote this library's struct whole: a caller compiled against an
    // older, smaller header had the bytes past its struct overwritten, and struct_size said
    // the library's size (adversarial pass, session 47). rope_jit_X_init is now a macro
    // passing the caller's sizeof to rope_jit_X_init_sized.
    constexpr size_t kOld = offsetof(rope_jit_config, cache_dir);  // struct_size and backend
    constexpr size_t kLarger = sizeof(rope_jit_config) + 16;       // a newer header's struct
    alignas(rope_jit_config) unsigned char memory[kLarger + 16];
    rope_jit_config defaults;
    rope_jit_config_init(&defaults);
    CHECK(defaults.struct_size == sizeof(rope_jit_config));
    for (size_t size : {kOld, sizeof(rope_jit_config), kLarger}) {
        CAPTURE(size);
        std::memset(memory, 0x5a, sizeof memory);
        auto* config = reinterpret_cast<rope_jit_config*>(memory);
        rope_jit_config_init_sized(config, size);
        CHECK(config->struct_size == size);
        const size_t library_part = std::min(size, sizeof(rope_jit_config));
        CHECK(std::memcmp(memory + sizeof(size_t),
                          reinterpret_cast<unsigned char*>(&defaults) + sizeof(size_t),
                          library_part - sizeof(size_t)) == 0);
        for (size_t i = library_part; i < size; ++i) CHECK(memory[i] == 0);
        for (size_t i = size; i < sizeof memory; ++i) CHECK(memory[i] == 0x5a);  // untouched
        config->backend = ROPE_JIT_BACKEND_CPU;
        rope_jit_runtime* runtime = nullptr;
        REQUIRE(rope_jit_runtime_create(config, &runtime) == ROPE_JIT_OK);
        CHECK(rope_jit_backend(runtime) == ROPE_JIT_BACKEND_CPU);
        rope_jit_runtime_free(runtime);
    }
    // A size that cannot hold struct_size, or one past any struct's (garbage), writes nothing;
    // NULL is ignored.
    for (size_t size : {size_t(4), SIZE_MAX}) {
        std::memset(memory, 0x5a, sizeof memory);
        rope_jit_config_init_sized(reinterpret_cast<rope_jit_config*>(memory), size);
        for (unsigned char byte : memory) CHECK(byte == 0x5a);
    }
    rope_jit_config_init_sized(nullptr, sizeof(rope_jit_config));

    // Every struct's macro passes the caller's size, and its sized function fills to it.
    rope_jit_rope_args args;
    rope_jit_rope_args_init_sized(&args, offsetof(rope_jit_rope_args, q_out));
    CHECK(args.struct_size == offsetof(rope_jit_rope_args, q_out));
#define CHECK_INIT_SETS_THE_CALLERS_SIZE(Struct)  \
    do {                                          \
        Struct value;                             \
        Struct##_init(&value);                    \
        CHECK(value.struct_size == sizeof value); \
    } while (0)
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_rope_args);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_attention_args);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_kernel_spec);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_stats);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_freq_config);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_table_config);
    CHECK_INIT_SETS_THE_CALLERS_SIZE(rope_jit_device_info);
#undef CHECK_INIT_SETS_THE_CALLERS_SIZE
}

TEST_CASE("runtime creation reports bad arguments and leaves *out NULL") {
    rope_jit_runtime* runtime = reinterpret_cast<rope_jit_runtime*>(0x1);
    rope_jit_config config;
    rope_jit_config_init(&config);
    SUBCASE("NULL out") {
        CHECK(rope_jit_runtime_create(&config, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("out") != std::string::npos);
    }
    SUBCASE("uninitialized config") {
        config.struct_size = 0;
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("config: struct_size is 0") !=
              std::string::npos);
        CHECK(runtime == nullptr);
    }
    SUBCASE("unknown backend") {
        config.backend = static_cast<rope_jit_backend_kind>(42);
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("backend: unknown value 42") !=
              std::string::npos);
        CHECK(runtime == nullptr);
    }
    SUBCASE("negative thread count") {
        config.cpu_threads = -1;
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("cpu_threads") != std::string::npos);
        CHECK(runtime == nullptr);
    }
    SUBCASE("a thread count above 4096") {
        // Each was taken as a request for that many threads (adversarial test, session 35).
        for (const int threads : {4097, 100000, INT_MAX}) {
            CAPTURE(threads);
            config.cpu_threads = threads;
            runtime = reinterpret_cast<rope_jit_runtime*>(0x1);
            CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(std::string(rope_jit_last_error()) ==
                  "cpu_threads: must be 0 (one per hardware thread) to 4096, got " +
                      std::to_string(threads));
            CHECK(runtime == nullptr);
        }
    }
    SUBCASE("an empty cache_dir with the disk cache on") {
        // It was taken as a relative root, the current directory (adversarial test, session 35).
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.cache_dir = "";
        CHECK(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).rfind("cache_dir: empty", 0) == 0);
        CHECK(runtime == nullptr);
    }
}

TEST_CASE("a NULL config means defaults, and freeing NULL is a no-op") {
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(nullptr, &runtime) == ROPE_JIT_OK);
    CHECK(runtime != nullptr);
    const rope_jit_backend_kind backend = rope_jit_backend(runtime);
    CHECK((backend == ROPE_JIT_BACKEND_CPU || backend == ROPE_JIT_BACKEND_CUDA));
    rope_jit_runtime_free(runtime);
    rope_jit_runtime_free(nullptr);
    CHECK(rope_jit_backend(nullptr) == ROPE_JIT_BACKEND_CPU);
}

TEST_CASE("rope_jit_get_stats and rope_jit_device_describe check struct_size as the args do") {
    // A size that cuts a counter in two was accepted and half of it written (adversarial
    // test, session 32); the message named 0 for any size under a size_t.
    const rope_test::CpuRuntime cpu(1, /*disk_cache=*/false);
    rope_jit_runtime* const runtime = cpu.handle;
    for (const size_t size : {size_t(0), size_t(4), sizeof(size_t) + 4, size_t(1) << 21}) {
        CAPTURE(size);
        rope_jit_stats stats;
        rope_jit_stats_init(&stats);
        stats.struct_size = size;
        stats.memory_hits = 0xeeeeeeeeeeeeeeeeull;
        CHECK(rope_jit_get_stats(runtime, &stats) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()) ==
              "stats: struct_size is " + std::to_string(size) +
                  "; initialize the struct with its _init function before setting fields");
        CHECK(stats.memory_hits == 0xeeeeeeeeeeeeeeeeull);  // nothing written
        rope_jit_device_info info;
        rope_jit_device_info_init(&info);
        info.struct_size = size;
        CHECK(rope_jit_device_describe(runtime, 0, &info) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).rfind("info: struct_size is", 0) == 0);
    }
    // An older caller's smaller struct (whole fields) still gets the fields it has.
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    stats.struct_size = offsetof(rope_jit_stats, disk_hits);
    CHECK(rope_jit_get_stats(runtime, &stats) == ROPE_JIT_OK);
    CHECK(stats.struct_size == offsetof(rope_jit_stats, disk_hits));
}

TEST_CASE("the last error is per thread and cleared by a successful call") {
    CHECK(rope_jit_runtime_create(nullptr, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    const std::string mine = rope_jit_last_error();
    CHECK(!mine.empty());
    std::string theirs = "unset";
    std::thread([&] { theirs = rope_jit_last_error(); }).join();
    CHECK(theirs.empty());
    CHECK(std::string(rope_jit_last_error()) == mine);
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(nullptr, &runtime) == ROPE_JIT_OK);
    CHECK(std::string(rope_jit_last_error()).empty());
    rope_jit_runtime_free(runtime);
}

TEST_CASE("the bounds of cpu_threads and cache_dir admit what they document") {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    rope_jit_runtime* runtime = nullptr;
    SUBCASE("4096 threads (the pool starts only with a call that needs it)") {
        config.cpu_threads = 4096;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        rope_jit_runtime_free(runtime);
    }
    SUBCASE("an empty cache_dir without a disk cache") {
        config.cache_dir = "";
        config.disk_cache = 0;
        REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
        CHECK(std::string(rope_jit_cache_root(runtime)).empty());
        rope_jit_runtime_free(runtime);
    }
}

namespace {

// A visitor's own call that fails, as a caller's callback may make: the error it leaves must
// not outlive the enclosing call that succeeds.
struct NestedFailure {
    int visits = 0;
    std::string nested_error;  // the last error right after the nested call failed
    bool nested_failed = true;
    void fail_once() {
        ++visits;
        nested_failed = nested_failed && rope_jit_runtime_create(nullptr, nullptr) ==
                                             ROPE_JIT_ERROR_INVALID_ARGUMENT;
        nested_error = rope_jit_last_error();
    }
};

}  // namespace

TEST_CASE("a call that succeeds leaves no last error, even when a call nested in it failed") {
    // The visitor's failure stayed as rope_jit_last_error() after the walk returned OK
    // (adversarial test, session 35).
    NestedFailure nested;
    std::string after = "unset";  // the last error right after the enclosing call
    SUBCASE("a prewarm plan's visitor") {
        auto visit = [](const char*, const char*, void* user) -> int {
            static_cast<NestedFailure*>(user)->fail_once();
            return 0;
        };
        CHECK(rope_jit_prewarm_plan(R"({"head_dim": 64})", "sm_90", visit, &nested) == ROPE_JIT_OK);
        after = rope_jit_last_error();
    }
    SUBCASE("a cache walk's visitor") {
        ScratchDir tmp("rope_jit_nested_error");
        const std::string root = tmp.path + "/cache";
        rope_jit_runtime* runtime = cpu_runtime_caching_in(root);
        REQUIRE(rope_jit_cache_check(runtime) == ROPE_JIT_OK);
        write_file(root + "/v1/nvrtc9.9", "stray");  // one item to visit
        auto visit = [](const rope_jit_cache_item*, void* user) -> int {
            static_cast<NestedFailure*>(user)->fail_once();
            return 0;
        };
        CHECK(rope_jit_cache_walk(runtime, visit, &nested) == ROPE_JIT_OK);
        after = rope_jit_last_error();
        rope_jit_runtime_free(runtime);
    }
    REQUIRE(nested.visits > 0);
    CHECK(nested.nested_failed);
    CHECK(nested.nested_error.find("out") != std::string::npos);
    CHECK(after.empty());
}
