// The C API shim: reads the caller's versioned structs, runs the operation, and turns every
// C++ failure into a status plus a thread-local message. Nothing is thrown across the API.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "cache/cache_maintenance.h"
#include "cuda/device_info.h"
#include "common/error.h"
#include "common/tensor_ref.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/rope_frequencies.h"
#include "rope_jit/rope_jit.h"
#include "api/attention_args.h"
#include "api/prewarm_specs.h"
#include "api/runtime.h"
#include "common/versioned_struct.h"

struct rope_jit_runtime {
    explicit rope_jit_runtime(const rope_jit_config& config) : runtime(config) {}
    rope_jit::Runtime runtime;
};

using rope_jit::read_versioned;

namespace {

thread_local std::string last_error;

template <typename Body>
rope_jit_status guarded(Body&& body) noexcept {
    last_error.clear();
    try {
        body();
        last_error.clear();  // a failed call nested in it (a visitor's) is not this call's error
        return ROPE_JIT_OK;
    } catch (const rope_jit::Error& e) {
        last_error = e.what();
        return e.status();
    } catch (const std::bad_alloc&) {
        last_error = "out of host memory";
        return ROPE_JIT_ERROR_OUT_OF_MEMORY;
    } catch (const std::length_error&) {  // a container asked for more than it can ever hold
        last_error = "out of host memory (a buffer larger than any allocation)";
        return ROPE_JIT_ERROR_OUT_OF_MEMORY;
    } catch (const std::exception& e) {
        last_error = fmt::format("internal error: {}", e.what());
        return ROPE_JIT_ERROR_INTERNAL;
    } catch (...) {
        last_error = "internal error: unknown exception";
        return ROPE_JIT_ERROR_INTERNAL;
    }
}

}  // namespace

extern "C" {

unsigned rope_jit_version_number(void) {
    return ROPE_JIT_VERSION_NUMBER;
}

const char* rope_jit_version_string(void) {
#define ROPE_JIT_STR_(x) #x
#define ROPE_JIT_XSTR_(x) ROPE_JIT_STR_(x)
    return ROPE_JIT_XSTR_(ROPE_JIT_VERSION_MAJOR) "." ROPE_JIT_XSTR_(
        ROPE_JIT_VERSION_MINOR) "." ROPE_JIT_XSTR_(ROPE_JIT_VERSION_PATCH);
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

const char* rope_jit_last_error(void) {
    return last_error.c_str();
}

// Each _init's name in parentheses: rope_jit.h defines rope_jit_X_init(p) as a macro calling
// rope_jit_X_init_sized with the caller's struct size; the plain symbols stay exported.
void(rope_jit_config_init)(rope_jit_config* config) {
    if (config == nullptr) return;
    *config = rope_jit_config{};
    config->struct_size = sizeof(rope_jit_config);
    config->backend = ROPE_JIT_BACKEND_AUTO;
    config->cache_dir = nullptr;
    config->disk_cache = 1;
    config->cpu_threads = 0;
    config->debug_checks = 0;
    config->cache_max_bytes = -1;
    config->background_builds = 1;
    config->programmatic_launch = ROPE_JIT_PROGRAMMATIC_AUTO;
}

void rope_jit_config_init_sized(rope_jit_config* config, size_t size) {
    rope_jit::init_caller_struct(config, size, &(rope_jit_config_init));
}

void(rope_jit_rope_args_init)(rope_jit_rope_args* args) {
    if (args == nullptr) return;
    *args = rope_jit_rope_args{};
    args->struct_size = sizeof(rope_jit_rope_args);
    args->style = ROPE_JIT_STYLE_HALF;
    args->norm_eps = 1e-6;
}

void rope_jit_rope_args_init_sized(rope_jit_rope_args* args, size_t size) {
    rope_jit::init_caller_struct(args, size, &(rope_jit_rope_args_init));
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

void rope_jit_runtime_free(rope_jit_runtime* runtime) {
    delete runtime;
}

rope_jit_backend_kind rope_jit_backend(const rope_jit_runtime* runtime) {
    return runtime ? runtime->runtime.backend() : ROPE_JIT_BACKEND_CPU;
}

void(rope_jit_attention_args_init)(rope_jit_attention_args* args) {
    if (args == nullptr) return;
    *args = rope_jit_attention_args{};
    args->struct_size = sizeof(rope_jit_attention_args);
    args->style = ROPE_JIT_STYLE_HALF;
}

void rope_jit_attention_args_init_sized(rope_jit_attention_args* args, size_t size) {
    rope_jit::init_caller_struct(args, size, &(rope_jit_attention_args_init));
}

void(rope_jit_kernel_spec_init)(rope_jit_kernel_spec* spec) {
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
    spec->norm_weight_dtype = DLDataType{kDLFloat, 32, 1};
    spec->norm_weight_grad = 1;
}

void rope_jit_kernel_spec_init_sized(rope_jit_kernel_spec* spec, size_t size) {
    rope_jit::init_caller_struct(spec, size, &(rope_jit_kernel_spec_init));
}

void(rope_jit_stats_init)(rope_jit_stats* stats) {
    if (stats == nullptr) return;
    *stats = rope_jit_stats{};
    stats->struct_size = sizeof(rope_jit_stats);
}

void rope_jit_stats_init_sized(rope_jit_stats* stats, size_t size) {
    rope_jit::init_caller_struct(stats, size, &(rope_jit_stats_init));
}

rope_jit_status rope_jit_prewarm(rope_jit_runtime* runtime, const rope_jit_kernel_spec* specs,
                                 size_t n, const char* target) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.prewarm(specs, n, target);
    });
}

rope_jit_status rope_jit_prewarm_json(rope_jit_runtime* runtime, const char* specs_json,
                                      const char* target) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.prewarm_json(specs_json, target);
    });
}

rope_jit_status rope_jit_prewarm_plan(const char* specs_json, const char* target,
                                      rope_jit_spec_visitor visitor, void* user_data) {
    return guarded([&] {
        if (specs_json == nullptr) rope_jit::fail_argument("specs_json: NULL");
        if (target == nullptr)
            rope_jit::fail_argument("target: NULL; name an architecture (\"sm_90\")");
        if (visitor == nullptr) rope_jit::fail_argument("visitor: NULL");
        for (const rope_jit::PrewarmKernel& kernel :
             rope_jit::expand_prewarm_json(specs_json, target))
            if (visitor(kernel.spec_json.c_str(), kernel.description.c_str(), user_data) != 0)
                break;
    });
}

rope_jit_status rope_jit_get_stats(const rope_jit_runtime* runtime, rope_jit_stats* stats) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        const size_t size = rope_jit::checked_struct_size(stats, "stats");
        const rope_jit::KernelStats& counters = runtime->runtime.stats();
        rope_jit_stats full;
        rope_jit_stats_init(&full);
        full.memory_hits = counters.memory_hits.load(std::memory_order_relaxed);
        full.disk_hits = counters.disk_hits.load(std::memory_order_relaxed);
        full.compiles = counters.compiles.load(std::memory_order_relaxed);
        full.compile_ms =
            double(counters.compile_microseconds.load(std::memory_order_relaxed)) / 1000.0;
        full.disk_writes = counters.disk_writes.load(std::memory_order_relaxed);
        full.launches = counters.launches.load(std::memory_order_relaxed);
        full.background_builds = counters.background_builds.load(std::memory_order_relaxed);
        full.background_failures = counters.background_failures.load(std::memory_order_relaxed);
        full.background_dropped = counters.background_dropped.load(std::memory_order_relaxed);
        full.attention_workspace_fallbacks =
            counters.attention_workspace_fallbacks.load(std::memory_order_relaxed);
        full.disk_lookup_ms =
            double(counters.disk_lookup_microseconds.load(std::memory_order_relaxed)) / 1000.0;
        full.module_load_ms =
            double(counters.module_load_microseconds.load(std::memory_order_relaxed)) / 1000.0;
        if (const rope_jit::DiskCache* disk = runtime->runtime.disk_cache())
            full.disk_evictions = disk->evictions();
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

rope_jit_status rope_jit_tensors_share_memory(const DLTensor* a, const DLTensor* b,
                                              int* shared) {
    return guarded([&] {
        if (shared == nullptr) rope_jit::fail_argument("shared: NULL");
        *shared = 0;
        if (a == nullptr) rope_jit::fail_argument("a: NULL");
        if (b == nullptr) rope_jit::fail_argument("b: NULL");
        // Addresses compared as given, whatever the devices: under CUDA's unified addressing
        // no two devices' memory has one address, and pinned host memory is one memory seen
        // as CPU and as CUDA host.
        const bool meet = rope_jit::shares_memory(
            rope_jit::make_tensor_ref(a, "a", ROPE_JIT_MEMORY_QUERY_MAX_DIMS),
            rope_jit::make_tensor_ref(b, "b", ROPE_JIT_MEMORY_QUERY_MAX_DIMS));
        *shared = meet ? 1 : 0;
    });
}

rope_jit_status rope_jit_tensor_has_distinct_elements(const DLTensor* t, int* distinct) {
    return guarded([&] {
        if (distinct == nullptr) rope_jit::fail_argument("distinct: NULL");
        *distinct = 0;
        if (t == nullptr) rope_jit::fail_argument("t: NULL");
        *distinct = rope_jit::has_distinct_elements(
                        rope_jit::make_tensor_ref(t, "t", ROPE_JIT_MEMORY_QUERY_MAX_DIMS))
                        ? 1
                        : 0;
    });
}

rope_jit_status rope_jit_attention(rope_jit_runtime* runtime, const rope_jit_attention_args* args) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.attention(rope_jit::read_attention_args(args),
                                   false);
    });
}

rope_jit_status rope_jit_attention_backward(rope_jit_runtime* runtime,
                                            const rope_jit_attention_args* args) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        runtime->runtime.attention(rope_jit::read_attention_args(args),
                                   true);
    });
}

rope_jit_status rope_jit_attention_workspace_size(rope_jit_runtime* runtime,
                                                  const rope_jit_attention_args* args,
                                                  int backward, size_t* bytes) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        if (bytes == nullptr) rope_jit::fail_argument("bytes: NULL");
        *bytes = 0;
        *bytes = runtime->runtime.attention_workspace_size(rope_jit::read_attention_args(args),
                                                           backward != 0);
    });
}

// ---- diagnostics and cache maintenance ------------------------------------------------------

rope_jit_status rope_jit_nvrtc_version(const char** version) {
    return guarded([&] {
        if (version == nullptr) rope_jit::fail_argument("version: NULL");
        *version = "";
        rope_jit::require_nvrtc_identity();  // the memo serves without loading NVRTC
        *version = rope_jit::nvrtc_version_string().c_str();
    });
}

void(rope_jit_device_info_init)(rope_jit_device_info* info) {
    if (info == nullptr) return;
    *info = rope_jit_device_info{};
    info->struct_size = sizeof(rope_jit_device_info);
}

void rope_jit_device_info_init_sized(rope_jit_device_info* info, size_t size) {
    rope_jit::init_caller_struct(info, size, &(rope_jit_device_info_init));
}

int rope_jit_device_count(const rope_jit_runtime* runtime) {
    return runtime && runtime->runtime.cuda() ? runtime->runtime.cuda()->device_count() : 0;
}

rope_jit_status rope_jit_device_describe(const rope_jit_runtime* runtime, int ordinal,
                                         rope_jit_device_info* info) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        const size_t size = rope_jit::checked_struct_size(info, "info");
        const rope_jit::DeviceDescription device =
            rope_jit::describe_device(runtime->runtime.cuda(), ordinal);
        rope_jit_device_info full;
        rope_jit_device_info_init(&full);
        std::snprintf(full.name, sizeof full.name, "%s", device.name.c_str());
        std::snprintf(full.target, sizeof full.target, "%s", device.target.c_str());
        std::memcpy(static_cast<void*>(info), &full, std::min(size, sizeof full));
        info->struct_size = size;
    });
}

const char* rope_jit_cache_root(const rope_jit_runtime* runtime) {
    const rope_jit::DiskCache* disk = runtime ? runtime->runtime.disk_cache() : nullptr;
    return disk ? disk->root().c_str() : "";
}

rope_jit_status rope_jit_cache_check(const rope_jit_runtime* runtime) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        const rope_jit::DiskCache& disk =
            rope_jit::require_disk_cache(runtime->runtime.disk_cache());
        std::string why;
        if (!disk.writable(&why))
            throw rope_jit::Error(
                ROPE_JIT_ERROR_CACHE,
                fmt::format("kernel cache directory '{}' is not writable: {}", disk.root(), why));
    });
}

rope_jit_status rope_jit_cache_walk(const rope_jit_runtime* runtime, rope_jit_cache_visitor visitor,
                                    void* user_data) {
    return guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        if (visitor == nullptr) rope_jit::fail_argument("visitor: NULL");
        const rope_jit::DiskCache& disk =
            rope_jit::require_disk_cache(runtime->runtime.disk_cache());
        for (const rope_jit::CacheItem& found : rope_jit::scan_cache(disk)) {
            rope_jit_cache_item item{};
            item.struct_size = sizeof item;
            item.state = rope_jit_cache_item_state(int(found.state));
            item.path = found.path.c_str();
            item.problem = found.problem.c_str();
            item.key = found.key_hex.c_str();
            item.nvrtc_version = found.nvrtc_version.c_str();
            item.target = found.target.c_str();
            item.kind = found.kind.c_str();
            item.spec_json = found.spec_json.c_str();
            item.spec = found.spec_description.c_str();
            item.bytes = found.bytes;
            item.payload_bytes = found.payload_bytes;
            item.modified = found.modified;
            item.accessed = found.accessed;
            if (visitor(&item, user_data) != 0) break;
        }
    });
}

rope_jit_status rope_jit_cache_remove(const rope_jit_runtime* runtime, const char* path) {
    return rope_jit_cache_remove_counted(runtime, path, nullptr, nullptr);
}

rope_jit_status rope_jit_cache_remove_counted(const rope_jit_runtime* runtime, const char* path,
                                              uint64_t* removed_entries,
                                              uint64_t* removed_bytes) {
    // Reported whatever the status: what a removal that failed partway took is gone all the
    // same (and a refused call removed nothing).
    rope_jit::RemovedCount removed;
    const rope_jit_status status = guarded([&] {
        if (runtime == nullptr) rope_jit::fail_argument("runtime: NULL");
        if (path == nullptr) rope_jit::fail_argument("path: NULL");
        rope_jit::remove_cache_item(rope_jit::require_disk_cache(runtime->runtime.disk_cache()),
                                    path, &removed);
    });
    if (removed_entries != nullptr) *removed_entries = removed.entries;
    if (removed_bytes != nullptr) *removed_bytes = removed.bytes;
    return status;
}

// ---- frequency builders and angle tables ------------------------------------------------------

void(rope_jit_freq_config_init)(rope_jit_freq_config* config) {
    if (config == nullptr) return;
    *config = rope_jit_freq_config{};
    config->struct_size = sizeof(rope_jit_freq_config);
    config->rope_type = ROPE_JIT_ROPE_TYPE_DEFAULT;
    config->theta = 10000.0;
    config->beta_fast = 32.0;
    config->beta_slow = 1.0;
    config->truncate = 1;
    config->low_freq_factor = 1.0;
    config->high_freq_factor = 4.0;
    config->theta_rescale_factor = 1.0;
    config->max_freq = 10.0;
    config->num_freqs = 1;
}

void rope_jit_freq_config_init_sized(rope_jit_freq_config* config, size_t size) {
    rope_jit::init_caller_struct(config, size, &(rope_jit_freq_config_init));
}

rope_jit_status rope_jit_inv_freq(const rope_jit_freq_config* config, float* inv_freq, size_t n,
                                  float* attention_factor) {
    return guarded([&] {
        const rope_jit_freq_config resolved =
            read_versioned(config, rope_jit_freq_config_init, "config");
        if (inv_freq == nullptr && n > 0)
            rope_jit::fail_argument("inv_freq: NULL (where should the frequencies go?)");
        const rope_jit::Frequencies built = rope_jit::compute_frequencies(resolved, n);
        rope_jit::check_inv_freq_outputs(resolved, inv_freq, n, attention_factor);
        for (size_t i = 0; i < n; ++i) inv_freq[i] = float(built.inv_freq[i]);
        if (attention_factor != nullptr) *attention_factor = float(built.attention_factor);
    });
}

void(rope_jit_table_config_init)(rope_jit_table_config* config) {
    if (config == nullptr) return;
    *config = rope_jit_table_config{};
    config->struct_size = sizeof(rope_jit_table_config);
    config->interpolate_factor = 1.0;
    config->attention_factor = 1.0;
    config->style = ROPE_JIT_STYLE_HALF;
    config->xpos_scale_base = 512.0;
}

void rope_jit_table_config_init_sized(rope_jit_table_config* config, size_t size) {
    rope_jit::init_caller_struct(config, size, &(rope_jit_table_config_init));
}

rope_jit_status rope_jit_rope_tables(const rope_jit_table_config* config, const DLTensor* cos,
                                     const DLTensor* sin, const DLTensor* xpos_scale) {
    return guarded([&] {
        rope_jit::fill_rope_tables(read_versioned(config, rope_jit_table_config_init, "config"),
                                   cos, sin, xpos_scale);
    });
}

}  // extern "C"
