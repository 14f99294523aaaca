// rope-jit-bench: measures RoPE through the public C API against the copy bandwidth of the
// same machine, in the same process.
//
//   rope-jit-bench [--backend auto|cpu|cuda] [--json FILE] [--quick]
//
// On the CUDA backend: per shape the median kernel time by CUDA events, bytes moved (q and k
// read and written, plus the table rows read), GB/s and its fraction of a device-to-device
// copy measured here; the host overhead of one call against a bare cuLaunchKernel of an
// empty kernel; the cold-compile and warm-disk-cache first-call times. On the CPU backend:
// the same shapes against memcpy of the same bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cuda_driver.h"
#include "nvrtc_compiler.h"
#include "rope_jit/rope_jit.h"

namespace {

using Clock = std::chrono::steady_clock;
using rope_jit::check_cu;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

struct Shape {
    std::string name;
    int64_t B, S, Hq, Hk, D;
    bool bshd;  // [B,S,H,D] buffers, passed as their transposed view
    bool backward;
};

std::vector<Shape> suite(bool quick) {
    std::vector<Shape> shapes = {
        {"llama3-8b prefill", 4, 4096, 32, 8, 128, true, false},
        {"llama3-8b prefill bwd", 4, 4096, 32, 8, 128, true, true},
        {"llama3-8b prefill bhsd", 4, 4096, 32, 8, 128, false, false},
        {"long context", 1, 32768, 32, 8, 128, true, false},
        {"D64 MHA", 8, 2048, 16, 16, 64, true, false},
        {"D256", 2, 4096, 16, 8, 256, true, false},
        {"decode B=64", 64, 1, 32, 8, 128, true, false},
    };
    if (quick) shapes.resize(1);
    return shapes;
}

struct Options {
    rope_jit_backend_kind backend = ROPE_JIT_BACKEND_AUTO;
    std::string json_path;
    bool quick = false;
};

Options parse(int argc, char** argv) {
    Options options;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::runtime_error(arg + ": missing value");
            return argv[++i];
        };
        if (arg == "--backend") {
            const std::string v = value();
            options.backend = v == "cpu" ? ROPE_JIT_BACKEND_CPU : v == "cuda" ? ROPE_JIT_BACKEND_CUDA : ROPE_JIT_BACKEND_AUTO;
        } else if (arg == "--json") {
            options.json_path = value();
        } else if (arg == "--quick") {
            options.quick = true;
        } else {
            throw std::runtime_error("unknown argument " + arg +
                                     "\nusage: rope-jit-bench [--backend auto|cpu|cuda] [--json FILE] [--quick]");
        }
    }
    return options;
}

// The tensors of one shape, in host or device memory, as DLTensors.
struct Tensors {
    std::vector<int64_t> q_shape, k_shape, q_strides, k_strides, table_shape;
    DLTensor q{}, k{}, cos{}, sin{};
    size_t q_bytes = 0, k_bytes = 0, table_bytes = 0;
};

void describe(Tensors& t, const Shape& s, void* q, void* k, void* cos, void* sin, DLDevice device) {
    t.q_shape = {s.B, s.Hq, s.S, s.D};
    t.k_shape = {s.B, s.Hk, s.S, s.D};
    if (s.bshd) {
        t.q_strides = {s.S * s.Hq * s.D, s.D, s.Hq * s.D, 1};
        t.k_strides = {s.S * s.Hk * s.D, s.D, s.Hk * s.D, 1};
    } else {
        t.q_strides = {s.Hq * s.S * s.D, s.S * s.D, s.D, 1};
        t.k_strides = {s.Hk * s.S * s.D, s.S * s.D, s.D, 1};
    }
    t.table_shape = {s.S, s.D};
    const DLDataType bf16{kDLBfloat, 16, 1};
    t.q = {q, device, 4, bf16, t.q_shape.data(), t.q_strides.data(), 0};
    t.k = {k, device, 4, bf16, t.k_shape.data(), t.k_strides.data(), 0};
    t.cos = {cos, device, 2, bf16, t.table_shape.data(), nullptr, 0};
    t.sin = {sin, device, 2, bf16, t.table_shape.data(), nullptr, 0};
}

rope_jit_rope_args args_for(Tensors& t, const Shape& s, void* stream) {
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = &t.q;
    args.k = &t.k;
    args.cos = &t.cos;
    args.sin = &t.sin;
    args.backward = s.backward;
    args.stream = stream;
    return args;
}

void require_ok(rope_jit_status status, const char* what) {
    if (status != ROPE_JIT_OK)
        throw std::runtime_error(fmt::format("{}: {}: {}", what, rope_jit_status_name(status), rope_jit_last_error()));
}

rope_jit_runtime* make_runtime(rope_jit_backend_kind backend, const char* cache_dir) {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = backend;
    config.cache_dir = cache_dir;
    rope_jit_runtime* runtime = nullptr;
    require_ok(rope_jit_runtime_create(&config, &runtime), "rope_jit_runtime_create");
    return runtime;
}

nlohmann::json case_json(const Shape& s, double seconds, double bytes, double copy_gbps) {
    const double gbps = bytes / seconds / 1e9;
    return {{"name", s.name},      {"B", s.B},
            {"S", s.S},            {"Hq", s.Hq},
            {"Hk", s.Hk},          {"D", s.D},
            {"layout", s.bshd ? "bshd" : "bhsd"},
            {"dtype", "bfloat16"}, {"direction", s.backward ? "backward" : "forward"},
            {"time_us", seconds * 1e6}, {"bytes", bytes},
            {"gbps", gbps},        {"fraction_of_copy", gbps / copy_gbps}};
}

void print_row(const nlohmann::json& c) {
    fmt::print("{:<24} {:>4}x{:<6} {:>3}/{:<3} D{:<4} {:<5} {:>10.2f} us {:>9.1f} GB/s  {:>5.3f} of copy\n",
               c["name"].get<std::string>(), c["B"].get<int64_t>(), c["S"].get<int64_t>(), c["Hq"].get<int64_t>(),
               c["Hk"].get<int64_t>(), c["D"].get<int64_t>(), c["layout"].get<std::string>(),
               c["time_us"].get<double>(), c["gbps"].get<double>(), c["fraction_of_copy"].get<double>());
}

// ---- CPU ------------------------------------------------------------------------------

nlohmann::json bench_cpu(const Options& options) {
    rope_jit_runtime* runtime = make_runtime(ROPE_JIT_BACKEND_CPU, nullptr);
    nlohmann::json cases = nlohmann::json::array();
    fmt::print("backend cpu: RoPE against memcpy of the same bytes, same process\n");
    for (const Shape& s : suite(options.quick)) {
        const size_t q_bytes = size_t(s.B * s.S * s.Hq * s.D) * 2, k_bytes = size_t(s.B * s.S * s.Hk * s.D) * 2;
        const size_t table_bytes = size_t(s.S * s.D) * 2;
        std::vector<char> q(q_bytes, 0x3c), k(k_bytes, 0x3c), cos(table_bytes, 0x3c), sin(table_bytes, 0x3c);
        std::vector<char> copy_src(q_bytes + k_bytes, 1), copy_dst(q_bytes + k_bytes, 2);
        Tensors t;
        describe(t, s, q.data(), k.data(), cos.data(), sin.data(), {kDLCPU, 0});
        rope_jit_rope_args args = args_for(t, s, nullptr);
        require_ok(rope_jit_rope(runtime, &args), "rope_jit_rope");  // warm-up: pool, pages
        std::vector<double> rope_times, copy_times;
        for (int trial = 0; trial < 5; ++trial) {
            Clock::time_point start = Clock::now();
            require_ok(rope_jit_rope(runtime, &args), "rope_jit_rope");
            rope_times.push_back(seconds_since(start));
            start = Clock::now();
            std::memcpy(copy_dst.data(), copy_src.data(), copy_src.size());
            copy_times.push_back(seconds_since(start));
        }
        const double bytes = 2.0 * double(q_bytes + k_bytes) + 2.0 * double(table_bytes);
        const double copy_gbps = 2.0 * double(copy_src.size()) / median(copy_times) / 1e9;
        nlohmann::json c = case_json(s, median(rope_times), bytes, copy_gbps);
        c["copy_gbps"] = copy_gbps;
        print_row(c);
        cases.push_back(c);
    }
    rope_jit_runtime_free(runtime);
    return {{"backend", "cpu"}, {"cases", cases}};
}

// ---- CUDA -----------------------------------------------------------------------------

struct DeviceBuffer {
    explicit DeviceBuffer(size_t bytes) : size(bytes) {
        check_cu(rope_jit::cuda_driver_api()->cuMemAlloc(&pointer, bytes), "cuMemAlloc");
        check_cu(rope_jit::cuda_driver_api()->cuMemsetD8(pointer, 0x3c, bytes), "cuMemsetD8");
    }
    ~DeviceBuffer() { rope_jit::cuda_driver_api()->cuMemFree(pointer); }
    void* get() const { return reinterpret_cast<void*>(pointer); }
    rope_jit::CUdeviceptr pointer = 0;
    size_t size;
};

// Median seconds per repetition of `body` on `stream`, by events around `repeat` launches.
double time_on_stream(rope_jit::CUstream stream, int repeat, const std::function<void()>& body) {
    const rope_jit::CudaDriverApi& api = *rope_jit::cuda_driver_api();
    rope_jit::CUevent start, stop;
    check_cu(api.cuEventCreate(&start, rope_jit::CU_EVENT_DEFAULT), "cuEventCreate");
    check_cu(api.cuEventCreate(&stop, rope_jit::CU_EVENT_DEFAULT), "cuEventCreate");
    for (int i = 0; i < 3; ++i) body();  // warm-up
    std::vector<double> trials;
    for (int trial = 0; trial < 7; ++trial) {
        check_cu(api.cuEventRecord(start, stream), "cuEventRecord");
        for (int i = 0; i < repeat; ++i) body();
        check_cu(api.cuEventRecord(stop, stream), "cuEventRecord");
        check_cu(api.cuEventSynchronize(stop), "cuEventSynchronize");
        float ms = 0;
        check_cu(api.cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
        trials.push_back(double(ms) / 1e3 / repeat);
    }
    api.cuEventDestroy(start);
    api.cuEventDestroy(stop);
    return median(trials);
}

nlohmann::json bench_cuda(const Options& options) {
    const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api();
    if (api == nullptr) throw std::runtime_error("no CUDA driver: " + rope_jit::cuda_driver_load_error());
    rope_jit::CUdevice device = 0;
    check_cu(api->cuDeviceGet(&device, 0), "cuDeviceGet");
    rope_jit::CUcontext context = nullptr;
    check_cu(api->cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
    check_cu(api->cuCtxSetCurrent(context), "cuCtxSetCurrent");
    char name[256] = {};
    api->cuDeviceGetName(name, sizeof name, device);
    rope_jit::CUstream stream = nullptr;
    check_cu(api->cuStreamCreate(&stream, rope_jit::CU_STREAM_NON_BLOCKING), "cuStreamCreate");

    // Copy bandwidth: device-to-device copies of 2 GiB, counting bytes read and written.
    double copy_gbps;
    {
        const size_t bytes = size_t(2) << 30;
        DeviceBuffer src(bytes), dst(bytes);
        const double seconds = time_on_stream(nullptr, 5, [&] {
            check_cu(api->cuMemcpyDtoD(dst.pointer, src.pointer, bytes), "cuMemcpyDtoD");
        });
        copy_gbps = 2.0 * double(bytes) / seconds / 1e9;
    }
    fmt::print("backend cuda on {}: device copy bandwidth {:.1f} GB/s (read + write)\n", name, copy_gbps);

    char cache_template[] = "/tmp/rope_jit_bench_cache_XXXXXX";
    const std::string cache_dir = mkdtemp(cache_template);
    nlohmann::json cases = nlohmann::json::array();
    nlohmann::json jit;
    rope_jit_runtime* runtime = make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str());
    for (const Shape& s : suite(options.quick)) {
        const size_t q_bytes = size_t(s.B * s.S * s.Hq * s.D) * 2, k_bytes = size_t(s.B * s.S * s.Hk * s.D) * 2;
        const size_t table_bytes = size_t(s.S * s.D) * 2;
        DeviceBuffer q(q_bytes), k(k_bytes), cos(table_bytes), sin(table_bytes);
        Tensors t;
        describe(t, s, q.get(), k.get(), cos.get(), sin.get(), {kDLCUDA, 0});
        rope_jit_rope_args args = args_for(t, s, stream);
        if (jit.empty()) {
            // First call of the process: compiles (empty cache). Then a second runtime on the same
            // cache directory: its first call loads from disk.
            Clock::time_point start = Clock::now();
            require_ok(rope_jit_rope(runtime, &args), "rope_jit_rope");
            check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
            jit["cold_first_call_ms"] = seconds_since(start) * 1e3;
            rope_jit_runtime* warm = make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str());
            start = Clock::now();
            require_ok(rope_jit_rope(warm, &args), "rope_jit_rope");
            check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
            jit["warm_cache_first_call_ms"] = seconds_since(start) * 1e3;
            rope_jit_runtime_free(warm);
        }
        const int repeat = s.S * s.B < 256 ? 200 : 20;
        const double seconds = time_on_stream(stream, repeat, [&] { require_ok(rope_jit_rope(runtime, &args), "rope"); });
        const double bytes = 2.0 * double(q_bytes + k_bytes) + 2.0 * double(table_bytes);
        nlohmann::json c = case_json(s, seconds, bytes, copy_gbps);
        print_row(c);
        cases.push_back(c);
    }

    // Host overhead: wall time per call of many back-to-back decode calls, against a bare
    // cuLaunchKernel of an empty kernel, both on the same stream.
    const Shape decode{"decode", 1, 1, 32, 8, 128, true, false};
    DeviceBuffer q(size_t(32 * 128 * 2)), k(size_t(8 * 128 * 2)), cos(256 * 2), sin(256 * 2);
    Tensors t;
    describe(t, decode, q.get(), k.get(), cos.get(), sin.get(), {kDLCUDA, 0});
    rope_jit_rope_args args = args_for(t, decode, stream);
    const rope_jit::CompileResult empty = rope_jit::compile_cuda("extern \"C\" __global__ void empty_kernel() {}",
                                                                 "empty.cu", rope_jit::cuda_device_target(0), {});
    rope_jit::CUmodule module = nullptr;
    rope_jit::CUfunction function = nullptr;
    check_cu(api->cuModuleLoadData(&module, empty.binary.data()), "cuModuleLoadData");
    check_cu(api->cuModuleGetFunction(&function, module, "empty_kernel"), "cuModuleGetFunction");
    auto host_time = [&](const std::function<void()>& call) {
        std::vector<double> trials;
        for (int trial = 0; trial < 5; ++trial) {
            check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
            const int calls = 2000;
            Clock::time_point start = Clock::now();
            for (int i = 0; i < calls; ++i) call();
            trials.push_back(seconds_since(start) / calls);
        }
        check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
        return median(trials) * 1e6;
    };
    const double rope_us = host_time([&] { require_ok(rope_jit_rope(runtime, &args), "rope"); });
    const double empty_us = host_time([&] {
        check_cu(api->cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel");
    });
    const double decode_stream_us =
        time_on_stream(stream, 200, [&] { require_ok(rope_jit_rope(runtime, &args), "rope"); }) * 1e6;
    // Inside a CUDA graph, as decode loops run: 100 calls captured once, the graph replayed.
    const int graph_calls = 100;
    rope_jit::CUgraph graph = nullptr;
    rope_jit::CUgraphExec graph_exec = nullptr;
    check_cu(api->cuStreamBeginCapture(stream, rope_jit::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    for (int i = 0; i < graph_calls; ++i) require_ok(rope_jit_rope(runtime, &args), "rope (captured)");
    check_cu(api->cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
    check_cu(api->cuGraphInstantiate(&graph_exec, graph, 0), "cuGraphInstantiate");
    const double decode_gpu_us =
        time_on_stream(stream, 5, [&] { check_cu(api->cuGraphLaunch(graph_exec, stream), "cuGraphLaunch"); }) * 1e6 /
        graph_calls;
    api->cuGraphExecDestroy(graph_exec);
    api->cuGraphDestroy(graph);
    fmt::print("host overhead per call: rope {:.2f} us, bare empty cuLaunchKernel {:.2f} us (+{:.2f} us)\n", rope_us,
               empty_us, rope_us - empty_us);
    fmt::print("decode B=1 S=1 32/8 D128: {:.2f} us per call inside a CUDA graph ({:.2f} us back to back on a stream)\n",
               decode_gpu_us, decode_stream_us);
    fmt::print("first call, cold compile: {:.1f} ms; first call of a fresh runtime, warm disk cache: {:.1f} ms\n",
               jit["cold_first_call_ms"].get<double>(), jit["warm_cache_first_call_ms"].get<double>());
    api->cuModuleUnload(module);
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    rope_jit_get_stats(runtime, &stats);
    rope_jit_runtime_free(runtime);
    api->cuStreamDestroy(stream);
    if (std::system(("rm -rf '" + cache_dir + "'").c_str()) != 0) fmt::print(stderr, "could not remove {}\n", cache_dir);
    return {{"backend", "cuda"},
            {"device", name},
            {"copy_gbps", copy_gbps},
            {"cases", cases},
            {"host_overhead_us", {{"rope_call", rope_us}, {"empty_launch", empty_us}, {"difference", rope_us - empty_us}}},
            {"decode_us_per_call_in_graph", decode_gpu_us},
            {"decode_us_per_call_on_stream", decode_stream_us},
            {"jit", jit},
            {"compiles", stats.compiles},
            {"compile_ms", stats.compile_ms}};
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options options = parse(argc, argv);
        rope_jit_runtime* probe = make_runtime(options.backend, nullptr);
        const bool cuda = rope_jit_backend(probe) == ROPE_JIT_BACKEND_CUDA;
        rope_jit_runtime_free(probe);
        nlohmann::json result = cuda ? bench_cuda(options) : bench_cpu(options);
        result["version"] = rope_jit_version_string();
        if (!options.json_path.empty()) {
            std::FILE* file = std::fopen(options.json_path.c_str(), "w");
            if (file == nullptr) throw std::runtime_error("cannot write " + options.json_path);
            fmt::print(file, "{}\n", result.dump(2));
            std::fclose(file);
        }
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rope-jit-bench: {}\n", e.what());
        return 1;
    }
}
