// The C API shim: reads the caller's versioned structs, runs the operation, and turns every
// C++ failure into a status plus a thread-local message. Nothing is thrown across the API.
#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include <fmt/format.h>

#include "error.h"
#include "rope_jit/rope_jit.h"
#include "runtime.h"

struct rope_jit_runtime {
    explicit rope_jit_runtime(const rope_jit_config& config) : runtime(config) {}
    rope_jit::Runtime runtime;
};

namespace {

thread_local std::string last_error;

template <typename Body>
rope_jit_status guarded(Body&& body) noexcept {
    last_error.clear();
    try {
        body();
        return ROPE_JIT_OK;
    } catch (const rope_jit::Error& e) {
        last_error = e.what();
        return e.status();
    } catch (const std::bad_alloc&) {
        last_error = "out of host memory";
        return ROPE_JIT_ERROR_OUT_OF_MEMORY;
    } catch (const std::exception& e) {
        last_error = fmt::format("internal error: {}", e.what());
        return ROPE_JIT_ERROR_INTERNAL;
    } catch (...) {
        last_error = "internal error: unknown exception";
        return ROPE_JIT_ERROR_INTERNAL;
    }
}

// Copies a caller's struct into one of this library's size, with defaults for every field
// the caller's (older) struct does not have.
template <typename Struct>
Struct read_versioned(const Struct* user, void (*init)(Struct*), const char* name) {
    Struct args;
    init(&args);
    if (user == nullptr) rope_jit::fail_argument(fmt::format("{}: NULL", name));
    const size_t size = user->struct_size;
    if (size < sizeof(size_t) || size > (size_t(1) << 20))
        rope_jit::fail_argument(fmt::format("{}: struct_size is {}; initialize the struct with its _init "
                                            "function before setting fields",
                                            name, size));
    std::memcpy(static_cast<void*>(&args), user, std::min(size, sizeof(Struct)));
    args.struct_size = sizeof(Struct);
    return args;
}

}  // namespace

extern "C" {

unsigned rope_jit_version_number(void) { return ROPE_JIT_VERSION_NUMBER; }

const char* rope_jit_version_string(void) {
#define ROPE_JIT_STR_(x) #x
#define ROPE_JIT_XSTR_(x) ROPE_JIT_STR_(x)
    return ROPE_JIT_XSTR_(ROPE_JIT_VERSION_MAJOR) "." ROPE_JIT_XSTR_(ROPE_JIT_VERSION_MINOR) "." ROPE_JIT_XSTR_(
        ROPE_JIT_VERSION_PATCH);
#undef ROPE_JIT_XSTR_
#undef ROPE_JIT_STR_
}

const char* rope_jit_status_name(rope_jit_status status) {
    switch (status) {
#define ROPE_JIT_STATUS_NAME_(name, value, message) \
    case ROPE_JIT_##name: return #name;
        ROPE_JIT_STATUS_MAP(ROPE_JIT_STATUS_NAME_)
#undef ROPE_JIT_STATUS_NAME_
    }
    return "UNKNOWN_STATUS";
}

const char* rope_jit_status_message(rope_jit_status status) {
    switch (status) {
#define ROPE_JIT_STATUS_MESSAGE_(name, value, message) \
    case ROPE_JIT_##name: return message;
        ROPE_JIT_STATUS_MAP(ROPE_JIT_STATUS_MESSAGE_)
#undef ROPE_JIT_STATUS_MESSAGE_
    }
    return "unknown status";
}

const char* rope_jit_last_error(void) { return last_error.c_str(); }

void rope_jit_config_init(rope_jit_config* config) {
    if (config == nullptr) return;
    *config = rope_jit_config{};
    config->struct_size = sizeof(rope_jit_config);
    config->backend = ROPE_JIT_BACKEND_AUTO;
    config->cache_dir = nullptr;
    config->disk_cache = 1;
    config->cpu_threads = 0;
    config->debug_checks = 0;
}

void rope_jit_rope_args_init(rope_jit_rope_args* args) {
    if (args == nullptr) return;
    *args = rope_jit_rope_args{};
    args->struct_size = sizeof(rope_jit_rope_args);
    args->style = ROPE_JIT_STYLE_HALF;
}

rope_jit_status rope_jit_runtime_create(const rope_jit_config* config, rope_jit_runtime** out) {
    if (out != nullptr) *out = nullptr;
    return guarded([&] {
        if (out == nullptr) rope_jit::fail_argument("out: NULL (where should the runtime go?)");
        rope_jit_config defaults;
        rope_jit_config_init(&defaults);
        const rope_jit_config resolved =
            config ? read_versioned(config, rope_jit_config_init, "config") : defaults;
        *out = new rope_jit_runtime(resolved);
    });
}

void rope_jit_runtime_free(rope_jit_runtime* runtime) { delete runtime; }

rope_jit_backend_kind rope_jit_backend(const rope_jit_runtime* runtime) {
    return runtime ? runtime->runtime.backend() : ROPE_JIT_BACKEND_CPU;
}

void rope_jit_kernel_spec_init(rope_jit_kernel_spec* spec) {
    if (spec == nullptr) return;
    *spec = rope_jit_kernel_spec{};
    spec->struct_size = sizeof(rope_jit_kernel_spec);
    spec->dtype = DLDataType{kDLFloat, 32, 1};
    spec->style = ROPE_JIT_STYLE_HALF;
    spec->has_k = 1;
    spec->gqa_group = 1;
    spec->positions = ROPE_JIT_POSITIONS_IMPLICIT;
    spec->index_dtype = DLDataType{kDLInt, 64, 1};
    spec->angles = ROPE_JIT_ANGLES_TABLE_FULL;
    spec->table_dtype = DLDataType{kDLFloat, 32, 1};
    spec->in_place = 1;
}

void rope_jit_stats_init(rope_jit_stats* stats) {
    if (stats == nullptr) return;
    *stats = rope_jit_stats{};
    stats->struct_size = sizeof(rope_jit_stats);
}

rope_jit_status rope_jit_prewarm(rope_jit_runtime* runtime, const rope_jit_kernel_spec* specs, size_t n,
                                 const char* target) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.prewarm(specs, n, target);
    });
}

rope_jit_status rope_jit_get_stats(const rope_jit_runtime* runtime, rope_jit_stats* stats) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        if (stats == nullptr) rope_jit::fail_argument("stats: NULL");
        const size_t size = stats->struct_size;
        if (size < sizeof(size_t))
            rope_jit::fail_argument("stats: struct_size is 0; initialize with rope_jit_stats_init");
        const rope_jit::KernelStats& counters = runtime->runtime.stats();
        rope_jit_stats full;
        rope_jit_stats_init(&full);
        full.memory_hits = counters.memory_hits.load(std::memory_order_relaxed);
        full.disk_hits = counters.disk_hits.load(std::memory_order_relaxed);
        full.compiles = counters.compiles.load(std::memory_order_relaxed);
        full.compile_ms = double(counters.compile_microseconds.load(std::memory_order_relaxed)) / 1000.0;
        full.disk_writes = counters.disk_writes.load(std::memory_order_relaxed);
        full.launches = counters.launches.load(std::memory_order_relaxed);
        // An older caller's smaller struct gets the fields it knows.
        std::memcpy(static_cast<void*>(stats), &full, std::min(size, sizeof full));
        stats->struct_size = size;
    });
}

rope_jit_status rope_jit_rope(rope_jit_runtime* runtime, const rope_jit_rope_args* args) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.rope(read_versioned(args, rope_jit_rope_args_init, "args"));
    });
}

}  // extern "C"
