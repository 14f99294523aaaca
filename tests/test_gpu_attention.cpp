// Attention with rotary fused in on the CUDA backend against the CPU backend, through the
// public C API: a randomized sweep of the spec space (tensor-core and CUDA-core kernels,
// forward and backward), the CUDA-core kernels forced for 16-bit inputs, the headline shape,
// and determinism of the backward. Every test is in TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <stdlib.h>  // mkdtemp, setenv

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"
#include "ops/attention/attention_workspace.h"
#include "attention_test_support.h"
#include "ops/attention/cuda_attention.h"
#include "cuda/cuda_driver.h"
#include "cache/disk_cache.h"
#include "jit/nvrtc_loader.h"
#include "gpu_test_support.h"

using namespace attention_test;
using rope_jit::check_cu;
using rope_test::Dt;

namespace {

using gpu_test::driver;

// The shared GPU fixture (gpu_test_support.h), under the names this suite uses.
struct GpuFixture : gpu_test::GpuFixture {
    gpu_test::RuntimeHandle& cpu = cpu_runtime;
    // The CUDA runtime under test: cuda_runtime, or the last one override_kernels created.
    gpu_test::RuntimeHandle& cuda() { return overridden ? *overridden : cuda_runtime; }
    // Sets ROPE_JIT_ATTENTION_KERNELS to `text` and creates a CUDA runtime under it: a runtime
    // reads the override once, when it is created.
    void override_kernels(const char* text) {
        setenv("ROPE_JIT_ATTENTION_KERNELS", text, 1);
        overridden.reset();
        overridden = std::make_unique<gpu_test::RuntimeHandle>(ROPE_JIT_BACKEND_CUDA);
    }
    std::unique_ptr<gpu_test::RuntimeHandle> overridden;
};

// Every tensor of a host Problem mirrored in device memory (the whole backing buffer, so
// strides and padding carry over), and the argument struct that points at the mirrors.
class DeviceProblem {
public:
    explicit DeviceProblem(Problem& p) {
        for (HostTensor* t : {&p.q, &p.k, &p.v, &p.out, &p.lse, &p.cos, &p.sin, &p.mask_float,
                              &p.dout, &p.dq, &p.dk, &p.dv})
            if (!t->shape().empty()) add(t->dl(), t->bytes());
        for (ByteTensor* t : {&p.pos_mask, &p.mask_bool})
            if (t->present()) add(t->dl(), t->bytes());
    }
    DeviceProblem(const DeviceProblem&) = delete;
    DeviceProblem& operator=(const DeviceProblem&) = delete;
    ~DeviceProblem() {
        if (const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api())
            for (auto& m : mirrors_) api->cuMemFree(m->pointer);
    }

    // The host call's arguments with every tensor replaced by its mirror.
    rope_jit_attention_args args(const rope_jit_attention_args& host) const {
        rope_jit_attention_args a = host;
        for (const DLTensor** t : {&a.q, &a.k, &a.v, &a.out, &a.cos, &a.sin, &a.pos_mask,
                                   &a.attn_mask, &a.lse, &a.dout, &a.dq, &a.dk, &a.dv})
            if (*t != nullptr) *t = &find(*t).device;
        return a;
    }

    // A copy of `host` holding the device bytes of its mirror.
    HostTensor download(HostTensor& host) const {
        HostTensor copy = host;
        const Mirror& m = find(host.dl());
        check_cu(driver().cuMemcpyDtoH(copy.bytes().data(), m.pointer, m.size), "cuMemcpyDtoH");
        return copy;
    }

private:
    struct Mirror {
        const DLTensor* host = nullptr;
        rope_jit::CUdeviceptr pointer = 0;
        size_t size = 0;
        DLTensor device{};
    };
    void add(const DLTensor* host, const std::vector<uint8_t>& bytes) {
        auto m = std::make_unique<Mirror>();
        m->host = host;
        m->size = bytes.size();
        check_cu(driver().cuMemAlloc(&m->pointer, m->size), "cuMemAlloc");
        check_cu(driver().cuMemcpyHtoD(m->pointer, bytes.data(), m->size), "cuMemcpyHtoD");
        m->device = *host;
        m->device.data = reinterpret_cast<void*>(static_cast<uintptr_t>(m->pointer));
        m->device.device = {kDLCUDA, 0};
        mirrors_.push_back(std::move(m));
    }
    const Mirror& find(const DLTensor* host) const {
        for (const auto& m : mirrors_)
            if (m->host == host) return *m;
        throw std::invalid_argument("DeviceProblem: tensor not mirrored");
    }
    std::vector<std::unique_ptr<Mirror>> mirrors_;
};

// 0xff bytes are NaN in every float dtype: an element a kernel fails to write cannot pass.
void poison_outputs(Problem& p) {
    for (HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv})
        std::fill(t->bytes().begin(), t->bytes().end(), 0xff);
}

// The kernels the CUDA runtime will choose for this problem's forward and backward.
std::vector<rope_jit::AttentionSpec> kernels_of(Problem& p,
                                                const rope_jit::AttentionDevice& device) {
    const rope_jit_attention_args args = p.args();
    // Under the override the environment holds now, as override_kernels' runtime reads it.
    const rope_jit::AttentionKernelOverride override =
        rope_jit::attention_kernel_override_from_environment();
    std::vector<rope_jit::AttentionSpec> specs =
        choose_attention_specs(rope_jit::make_attention_problem(args, false), device, override);
    for (const rope_jit::AttentionSpec& s :
         choose_attention_specs(rope_jit::make_attention_problem(args, true), device, override))
        specs.push_back(s);
    return specs;
}

// The forward kernel of kernels_of's list (a prepare kernel may come first).
rope_jit::AttentionSpec forward_kernel(const std::vector<rope_jit::AttentionSpec>& specs) {
    for (const rope_jit::AttentionSpec& s : specs)
        if (s.kind == int32_t(rope_jit::AttentionKernelKind::Forward)) return s;
    throw std::logic_error("no forward kernel");
}

rope_jit::AttentionDevice device_zero() {
    rope_jit::CUdevice device = 0;
    check_cu(driver().cuDeviceGet(&device, 0), "cuDeviceGet");
    int major = 0, minor = 0, shared = 0;
    check_cu(driver().cuDeviceGetAttribute(
                 &major, rope_jit::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
             "cc");
    check_cu(driver().cuDeviceGetAttribute(
                 &minor, rope_jit::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
             "cc");
    check_cu(driver().cuDeviceGetAttribute(
                 &shared, rope_jit::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
             "shared");
    return rope_jit::attention_device(major * 10 + minor, shared);
}

// Compiles every distinct spec into the runtimes' disk cache on all cores, so the sweep itself
// only loads kernels.
void prewarm(const std::vector<rope_jit::AttentionSpec>& specs) {
    std::vector<rope_jit::AttentionSpec> distinct;
    for (const rope_jit::AttentionSpec& s : specs)
        if (std::find(distinct.begin(), distinct.end(), s) == distinct.end()) distinct.push_back(s);
    const rope_jit::DiskCache disk(gpu_test::kernel_cache_dir(), {});
    const std::string target = rope_jit::cuda_device_target(0);
    rope_jit::KernelStats stats;
    std::atomic<size_t> next{0};
    std::mutex mutex;
    std::string failure;
    std::vector<std::thread> threads;
    const unsigned workers = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    for (unsigned w = 0; w < workers; ++w)
        threads.emplace_back([&] {
            for (size_t i = next++; i < distinct.size(); i = next++) {
                try {
                    rope_jit::build_attention_binary(distinct[i], target, &disk, stats);
                } catch (const std::exception& e) {
                    std::lock_guard<std::mutex> lock(mutex);
                    failure += distinct[i].describe() + ": " + e.what() + "\n";
                }
            }
        });
    for (std::thread& t : threads) t.join();
    MESSAGE("prewarmed " << distinct.size() << " attention kernels");
    INFO(failure);
    REQUIRE(failure.empty());
}

struct Tolerance {
    double out, lse, grad;
};

// Normalized tolerances of one call: the dtype's rounding of rotated q/k and of P on tensor
// cores, float32 arithmetic on CUDA cores.
Tolerance gpu_tolerance(Dt dt) {
    if (dt == Dt::F32) return {2e-5, 2e-5, 2e-4};
    if (dt == Dt::F16) return {5e-3, 5e-3, 1.5e-2};
    return {3e-2, 3e-2, 8e-2};
}

// Compares every output of one CUDA forward + backward with the CPU backend's; returns a
// one-line report and whether it passed.
struct Comparison {
    bool passed = true;
    std::string report;
};

Comparison run_and_compare(GpuFixture& f, Problem& p, bool backward) {
    poison_outputs(p);
    DeviceProblem device(p);
    const rope_jit_attention_args host_args = p.args();
    const rope_jit_attention_args device_args = device.args(host_args);
    Comparison result;
    auto call = [&](rope_jit_runtime* runtime, const rope_jit_attention_args& a, bool bwd) {
        const rope_jit_status status =
            bwd ? rope_jit_attention_backward(runtime, &a) : rope_jit_attention(runtime, &a);
        if (status != ROPE_JIT_OK) {
            result.passed = false;
            result.report += std::string(bwd ? " backward" : " forward") +
                             " failed: " + rope_jit_status_name(status) + ": " +
                             rope_jit_last_error();
        }
        return status == ROPE_JIT_OK;
    };
    if (!call(f.cuda().get(), device_args, false)) return result;
    if (backward && !call(f.cuda().get(), device_args, true)) return result;
    check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
    if (!call(f.cpu.get(), host_args, false)) return result;
    if (backward && !call(f.cpu.get(), host_args, true)) return result;

    const Tolerance tol = gpu_tolerance(p.c.dt);
    auto compare = [&](const char* name, HostTensor& expected, double limit, double floor) {
        const double err =
            normalized_error(device.download(expected).values(), expected.values(), floor);
        char text[96];
        std::snprintf(text, sizeof text, " %s=%.2e", name, err);
        result.report += text;
        if (!(err <= limit)) {
            result.passed = false;
            result.report += "(FAIL)";
        }
    };
    compare("out", p.out, tol.out, 0.05);
    // lse: absolute error, with -inf required exactly where the CPU has it.
    {
        const std::vector<double> got = device.download(p.lse).values(), expected = p.lse.values();
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            if (std::isinf(expected[i]))
                worst = std::max(worst, got[i] == expected[i] ? 0.0 : 1e30);
            else
                worst =
                    std::max(worst, std::isfinite(got[i]) ? std::fabs(got[i] - expected[i]) : 1e30);
        }
        char text[64];
        std::snprintf(text, sizeof text, " lse=%.2e", worst);
        result.report += text;
        if (!(worst <= tol.lse * 10)) {
            result.passed = false;
            result.report += "(FAIL)";
        }
    }
    if (backward) {
        compare("dq", p.dq, tol.grad, 1e-3);
        compare("dk", p.dk, tol.grad, 1e-3);
        compare("dv", p.dv, tol.grad, 1e-3);
    }
    return result;
}

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> options) {
    return *(options.begin() + rng() % options.size());
}

Config random_gpu_config(std::mt19937& rng) {
    Config c;
    c.dt = pick(rng, {Dt::BF16, Dt::BF16, Dt::F16, Dt::F32});
    c.table_dt = pick(rng, {Dt::F32, Dt::F32, Dt::BF16});
    c.mask_dt = pick(rng, {Dt::F32, Dt::BF16});
    c.D = pick<int64_t>(rng, {64, 128, 128, 256, 32, 96, 72});
    c.R = pick<int64_t>(rng, {c.D, c.D, c.D / 2, 0, 16});
    c.interleaved = rng() & 1;
    c.table_full = rng() & 1;
    c.B = 1 + rng() % 2;
    c.Hk = 1 + rng() % 2;
    c.Hq = c.Hk * pick<int64_t>(rng, {1, 4, 8});
    c.Sq = 1 + rng() % 200;
    c.Sk = rng() % 3 == 0 ? 1 + rng() % 200 : c.Sq;
    c.causal = rng() & 1;
    c.pos_mask = c.R > 0 && rng() % 4 == 0;
    c.pos_mask_batched = rng() & 1;
    c.mask = pick(rng, {Mask::None, Mask::None, Mask::None, Mask::BoolKeys, Mask::BoolFull,
                        Mask::AddKeys, Mask::AddFull});
    c.mask_batch_broadcast = rng() % 4 == 0;
    c.scale = rng() % 4 == 0 ? 0.05 : 0.0;
    c.bshd = rng() % 3 == 0;
    c.pad = rng() % 10 == 0 ? 1 : 0;
    return c;
}

// Runs configs (forward and backward), prewarming their kernels first; one CHECK per config
// with the chosen kernels and every error in its message.
void sweep(GpuFixture& f, const std::vector<Config>& configs, uint32_t seed) {
    const rope_jit::AttentionDevice device = device_zero();
    std::vector<rope_jit::AttentionSpec> specs;
    {
        std::mt19937 rng(seed);
        for (const Config& c : configs) {
            Problem p(c, rng);
            for (const rope_jit::AttentionSpec& s : kernels_of(p, device)) specs.push_back(s);
        }
    }
    prewarm(specs);
    std::mt19937 rng(seed);
    int failures = 0;
    for (size_t n = 0; n < configs.size(); ++n) {
        Problem p(configs[n], rng);
        std::string kernels;
        for (const rope_jit::AttentionSpec& s : kernels_of(p, device))
            kernels += "\n    " + s.describe();
        const Comparison result = run_and_compare(f, p, true);
        if (!result.passed) ++failures;
        MESSAGE((result.passed ? "ok  " : "FAIL")
                << " [" << n << "] " << describe(configs[n]) << " ->" << result.report
                << (result.passed ? std::string() : kernels));
        CHECK_MESSAGE(result.passed, describe(configs[n]), result.report, kernels);
    }
    MESSAGE((configs.size() - size_t(failures))
            << " of " << configs.size() << " configurations matched the CPU");
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE(
        "CUDA attention forward and backward match the CPU reference over a randomized sweep") {
        GpuFixture f;
        std::mt19937 rng(20241);
        std::vector<Config> configs;
        for (int i = 0; i < 48; ++i) configs.push_back(random_gpu_config(rng));
        sweep(f, configs, 7);
    }

    TEST_CASE("the CUDA-core kernels match the CPU reference for 16-bit inputs too") {
        GpuFixture f;
        f.override_kernels("simt");
        std::mt19937 rng(99);
        std::vector<Config> configs;
        for (int i = 0; i < 8; ++i) {
            Config c = random_gpu_config(rng);
            if (c.dt == Dt::F32) c.dt = Dt::BF16;
            c.Sq = std::min<int64_t>(c.Sq, 64);
            c.Sk = std::min<int64_t>(c.Sk, 64);
            configs.push_back(c);
        }
        sweep(f, configs, 8);
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE("every tile shape the override offers gives the same results") {
        GpuFixture f;
        std::vector<Config> configs;
        Config c;
        c.dt = Dt::BF16;
        c.B = 1;
        c.Hq = 4;
        c.Hk = 2;
        c.Sq = 150;
        c.Sk = 150;
        c.D = 128;
        c.R = 128;
        c.causal = true;
        c.pos_mask = true;
        c.mask = Mask::AddFull;
        configs.push_back(c);
        c.pos_mask = false;
        c.interleaved = true;
        c.table_full = true;
        c.mask = Mask::BoolKeys;
        configs.push_back(c);
        c.D = c.R = 64;  // D64 with 128-key tiles too
        c.interleaved = false;
        c.table_full = false;
        c.mask = Mask::None;
        configs.push_back(c);
        const rope_jit::AttentionDevice device = device_zero();
        for (const std::string shapes : {"fwd=4x64,dq=4x64,dkdv=4x32",
                                         "fwd=8x32,dq=8x32,dkdv=8x16",
                                         "fwd=4x16,dq=4x16,dkdv=8x64",
                                         "fwd=4x32x2",
                                         "fwd=8x64x2",
                                         "fwd=2x16x2",
                                         "fwd=8x64,dq=8x64,dkdv=8x32",
                                         "fwd=w8x128",
                                         "fwd=w8x64",
                                         "fwd=w4x64",
                                         "fwd=w12x64",
                                         "fwd=w12x64x3",
                                         "fwd=w8x64x3",
                                         "fwd=p8x64x3",
                                         "fwd=r8x64x3",
                                         "fwd=r8x128",
                                         "fwd=p8x64",
                                         "fwd=p4x64x3",
                                         "fwd=p8x128",
                                         "fwd=c2x8x64x3",
                                         "fwd=c2x4x128",
                                         "fwd=c2x8x128x2",
                                         "fwd=p8x128x2:pingpong",
                                         "fwd=p8x128x2:pingpong2",
                                         "fwd=p8x128x2:setmaxnreg",
                                         "fwd=p8x64x3:pingpong:setmaxnreg",
                                         "fwd=p8x128x2:fma1",
                                         "fwd=p8x128x2:pingpong2:setmaxnreg:fma2",
                                         "fwd=p8x128x3:setmaxnreg:overlap",
                                         "fwd=p8x64x3:setmaxnreg:overlap"}) {
            CAPTURE(shapes);
            f.override_kernels(shapes.c_str());
            // A wgmma shape must be what the configs without pos_mask run, where wgmma runs at all
            // and the shape's shared memory fits (else the choice falls back, as it should).
            int warps = 0, block_n = 0, stages = 2, cluster = 1;
            // 'w': every warp loads; 'p': with producer warps (keys by TMA); 'r': producer warps
            // rotating keys in registers; 'c': in clusters (keys by TMA)
            char family = 0;
            const bool parsed = shapes.rfind("fwd=c", 0) == 0
                                    ? std::sscanf(shapes.c_str(), "fwd=c%dx%dx%dx%d", &cluster,
                                                  &warps, &block_n, &stages) >= 3
                                    : std::sscanf(shapes.c_str(), "fwd=%c%dx%dx%d", &family, &warps,
                                                  &block_n, &stages) >= 3 &&
                                          (family == 'w' || family == 'p' || family == 'r');
            if (device.wgmma && parsed) {
                for (size_t n = 1; n < configs.size(); ++n) {
                    std::mt19937 probe(1);
                    Problem p(configs[n], probe);
                    const rope_jit::AttentionSpec spec = forward_kernel(kernels_of(p, device));
                    rope_jit::AttentionSpec wanted = spec;
                    wanted.tensor_cores = wanted.wgmma = 1;
                    wanted.warps = warps;
                    wanted.block_n = block_n;
                    wanted.stages = stages;
                    wanted.producer_warps = family == 'w' ? 0 : 4;
                    wanted.keys_by_tma = family != 'w' && family != 'r';
                    wanted.cluster = cluster;
                    wanted.m_tiles = 1;
                    // The consumer-schedule options after the shape (":pingpong", ...).
                    wanted.pingpong = shapes.find(":pingpong2") != std::string::npos  ? 2
                                      : shapes.find(":pingpong") != std::string::npos ? 1
                                                                                      : 0;
                    wanted.setmaxnreg = shapes.find(":setmaxnreg") != std::string::npos;
                    const size_t fma = shapes.find(":fma");
                    wanted.exp2_fma = fma == std::string::npos ? 0 : shapes[fma + 4] - '0';
                    wanted.overlap = shapes.find(":overlap") != std::string::npos;
                    CAPTURE(spec.describe());
                    if (wanted.shared_bytes() <= device.max_shared_bytes) CHECK(spec == wanted);
                }
            }
            sweep(f, configs, 5);
        }
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE(
        "the sm_90 wgmma forward matches the CPU reference over long sequences and every feature "
        "it takes") {
        const rope_jit::AttentionDevice device = device_zero();
        if (!device.wgmma) {
            MESSAGE("device sm_" << device.compute_capability << " with NVRTC "
                                 << rope_jit::nvrtc_version_string() << ": no wgmma forward here");
            return;
        }
        GpuFixture f;
        std::mt19937 rng(4242);
        std::vector<Config> configs;
        for (int i = 0; i < 24; ++i) {
            Config c = random_gpu_config(rng);
            c.dt = rng() & 1 ? Dt::BF16 : Dt::F16;
            // 56 and 120 pad to 64 and 128: the zero-filled features past head_dim.
            c.D = pick<int64_t>(rng, {128, 64, 120, 56});
            c.R = pick<int64_t>(rng, {c.D, c.D, c.D / 2, 0, 16});
            const int64_t chunk = c.interleaved ? 8 : 16;  // whole 16-byte chunks of pairs
            c.R = c.R / chunk * chunk;
            c.pos_mask = false;
            c.pad = 0;
            c.Sq = 1 + rng() % 700;
            c.Sk = rng() % 3 == 0 ? 1 + rng() % 700 : c.Sq;
            configs.push_back(c);
        }
        // head_dim 256 and 248 (two warpgroups over 64-key tiles): lengths short for the CPU
        // reference, ragged around the 64-key tiles; GQA groups 1-8.
        std::vector<Config> wide;
        for (int i = 0; i < 8; ++i) {
            Config c = random_gpu_config(rng);
            c.dt = rng() & 1 ? Dt::BF16 : Dt::F16;
            c.D = pick<int64_t>(rng, {256, 256, 256, 248});  // 248 pads to 256
            c.R = pick<int64_t>(rng, {c.D, c.D, c.D / 2, 0, 16});
            c.R = c.R / (c.interleaved ? 8 : 16) * (c.interleaved ? 8 : 16);
            c.pos_mask = false;
            c.pad = 0;
            c.Hk = 1 + rng() % 2;
            c.Hq = c.Hk * pick<int64_t>(rng, {1, 2, 4, 8});
            c.Sq = pick<int64_t>(rng, {1, 63, 64, 65, 129, 200, 300});
            c.Sk = rng() % 3 == 0 ? pick<int64_t>(rng, {1, 64, 127, 191, 300}) : c.Sq;
            wide.push_back(c);
        }
        // Issue 19's head_dim 256 shape in small (bf16, halves, float32 half tables read in
        // place, causal, GQA 2), and GQA 1 with staged bf16 tables and a boolean mask.
        Config issue;
        issue.dt = Dt::BF16;
        issue.D = issue.R = 256;
        issue.Hq = 4;
        issue.Hk = 2;
        issue.Sq = issue.Sk = 300;
        issue.causal = true;
        wide.push_back(issue);
        Config staged = issue;
        staged.dt = Dt::F16;
        staged.table_dt = Dt::BF16;
        staged.Hq = staged.Hk = 2;
        staged.B = 2;
        staged.Sq = 65;
        staged.Sk = 250;
        staged.causal = false;
        staged.mask = Mask::BoolFull;
        wide.push_back(staged);
        // Every config above must run the wgmma forward, or the sweep would test something else.
        std::vector<Config> all = configs;
        all.insert(all.end(), wide.begin(), wide.end());
        for (const Config& c : all) {
            std::mt19937 probe(1);
            Problem p(c, probe);
            const std::vector<rope_jit::AttentionSpec> specs = kernels_of(p, device);
            CAPTURE(describe(c));
            CHECK(forward_kernel(specs).wgmma == 1);
        }
        // The default choice, then each family forced (every warp loading; producer warps; blocks
        // of a cluster sharing tiles, where the GQA group allows), then the consumer-schedule
        // experiments: all of them over 128-key tiles, and turns for both products over 64-key
        // tiles (where the first warpgroup skips the diagonal's last tile but takes its turns);
        // each warpgroup's softmax beside its previous product, over 128- and 64-key tiles.
        for (const char* shapes : {"", "fwd=w12x64x3", "fwd=p8x64x3", "fwd=r8x64x3",
                                   "fwd=c4x8x64x3", "fwd=c2x8x128x2",
                                   "fwd=p8x128x2:pingpong:setmaxnreg:fma2",
                                   "fwd=p8x64x3:pingpong2", "fwd=p8x128x3:setmaxnreg:overlap",
                                   "fwd=p8x64x3:setmaxnreg:overlap"}) {
            CAPTURE(shapes);
            f.override_kernels(shapes);
            sweep(f, configs, 11);
        }
        // head_dim 256: the default (two consumer warpgroups beside producers that give them
        // their registers, keys by TMA), two or one warpgroup(s) loading their own tiles, and
        // the fallback without a workspace (warps that load and rotate each key tile).
        for (const char* shapes :
             {"", "fwd=w8x64x2", "fwd=w4x64x2", "workspace=0", "fwd=p8x64x2:setmaxnreg:overlap"}) {
            CAPTURE(shapes);
            f.override_kernels(shapes);
            sweep(f, wide, 12);
        }
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE(
        "the sm_90 wgmma backward matches the CPU reference over ragged lengths, GQA groups, "
        "masks, "
        "partial rotary and both styles") {
        const rope_jit::AttentionDevice device = device_zero();
        if (!device.wgmma || !device.tma) {
            MESSAGE("device sm_" << device.compute_capability << ": no wgmma backward here");
            return;
        }
        GpuFixture f;
        std::mt19937 rng(9090);
        std::vector<Config> configs;
        for (int i = 0; i < 40; ++i) {
            Config c = random_gpu_config(rng);
            c.dt = rng() & 1 ? Dt::BF16 : Dt::F16;
            c.D = pick<int64_t>(rng, {128, 64, 120, 56});
            c.R = pick<int64_t>(rng, {c.D, c.D, c.D / 2, 0, 16});
            const int64_t chunk = c.interleaved ? 8 : 16;
            c.R = c.R / chunk * chunk;
            c.pos_mask = false;
            c.pad = 0;
            c.Hk = 1 + rng() % 2;
            c.Hq = c.Hk * pick<int64_t>(rng, {1, 2, 4, 8});
            // Lengths around and between the 64-query tiles and 128-key blocks.
            c.Sq = pick<int64_t>(rng, {1, 63, 64, 65, 127, 129, 200, 255, 300, 520});
            c.Sk = rng() % 3 == 0 ? pick<int64_t>(rng, {1, 64, 127, 128, 129, 333}) : c.Sq;
            configs.push_back(c);
        }
        // head_dim 256 (64-key blocks, the features split between the warpgroups).
        for (int i = 0; i < 12; ++i) {
            Config c = configs[size_t(i)];
            c.D = 256;
            c.R = pick<int64_t>(rng, {256, 256, 128, 0, 16});
            c.Sq = pick<int64_t>(rng, {1, 63, 64, 65, 129, 200});
            c.Sk = rng() % 3 == 0 ? pick<int64_t>(rng, {1, 64, 65, 130}) : c.Sq;
            configs.push_back(c);
        }
        // Every config must run the wgmma backward, or the sweep would test something else.
        for (const Config& c : configs) {
            std::mt19937 probe(1);
            Problem p(c, probe);
            const std::vector<rope_jit::AttentionSpec> specs = kernels_of(p, device);
            CAPTURE(describe(c));
            REQUIRE(specs.size() >= 4);
            const size_t n = specs.size();
            CHECK(specs[n - 3].kind == int32_t(rope_jit::AttentionKernelKind::BackwardPrepare));
            CHECK(specs[n - 2].kind == int32_t(rope_jit::AttentionKernelKind::Backward));
            CHECK(specs[n - 1].kind == int32_t(rope_jit::AttentionKernelKind::BackwardDqFinish));
        }
        sweep(f, configs, 17);
        // The same problems through the deterministic kernels.
        for (Config& c : configs) c.deterministic = true;
        configs.resize(8);
        sweep(f, configs, 17);
    }

    TEST_CASE("empty query or key sequences on the default kernels match the CPU (no workspace)") {
        GpuFixture f;
        for (const int64_t sq : {0, 70})
            for (const int64_t sk : {0, 70}) {
                Config c;
                c.dt = Dt::BF16;
                c.B = 2;
                c.Hq = 4;
                c.Hk = 2;
                c.Sq = sq;
                c.Sk = sk;
                c.D = c.R = 128;
                c.causal = sk > 0;
                std::mt19937 rng(5);
                Problem p(c, rng);
                const Comparison result = run_and_compare(f, p, true);
                CAPTURE(describe(c));
                MESSAGE(describe(c) << " ->" << result.report);
                CHECK(result.passed);
            }
    }

    TEST_CASE(
        "the headline shape (bf16, D128, causal, GQA 4) runs on tensor cores and matches the CPU") {
        GpuFixture f;
        Config c;
        c.dt = Dt::BF16;
        c.B = 1;
        c.Hq = 8;
        c.Hk = 2;
        c.Sq = 700;
        c.Sk = 700;
        c.D = 128;
        c.R = 128;
        c.causal = true;
        std::mt19937 rng(1);
        Problem p(c, rng);
        for (const rope_jit::AttentionSpec& s : kernels_of(p, device_zero())) {
            CAPTURE(s.describe());
            CHECK(s.tensor_cores == 1);
        }
        const Comparison result = run_and_compare(f, p, true);
        MESSAGE(describe(c) << " ->" << result.report);
        CHECK(result.passed);
    }

    TEST_CASE(
        "the head_dim 64 and 256 defaults tuned for length (128-key producer tiles, 64-key tiles) "
        "match the CPU") {
        GpuFixture f;
        const rope_jit::AttentionDevice device = device_zero();
        Config c;
        c.dt = Dt::BF16;
        c.B = 1;
        c.Hq = 4;
        c.Hk = 1;
        c.Sq = 200;  // few queries over many keys: the long-key rule at a CPU reference's cost
        c.Sk = 4100;
        c.D = c.R = 64;
        Config wide = c;
        wide.Sq = wide.Sk = 300;
        wide.D = wide.R = 256;
        wide.causal = true;
        wide.interleaved = true;
        for (const Config& config : {c, wide}) {
            std::mt19937 rng(7);
            Problem p(config, rng);
            const rope_jit::AttentionSpec forward = forward_kernel(kernels_of(p, device));
            CAPTURE(forward.describe());
            if (config.D == 64 && device.wgmma && device.tma)
                CHECK((forward.producer_warps == 4 && forward.block_n == 128));
            if (config.D == 256) CHECK((forward.tensor_cores == 1 && forward.block_n == 64));
            if (config.D == 256 && device.wgmma)  // two warpgroups; with TMA beside producers
                CHECK((forward.wgmma == 1 && forward.warps == 8 &&
                       forward.producer_warps == (device.tma ? 4 : 0) &&
                       forward.setmaxnreg == (device.tma ? 1 : 0)));
            const Comparison result = run_and_compare(f, p, true);
            MESSAGE(describe(config) << " ->" << result.report);
            CHECK(result.passed);
        }
    }

    TEST_CASE(
        "a NaN in a query row gives that row NaN out, lse and dq on every kernel family, and only "
        "that row") {
        GpuFixture f;
        // CUDA cores (fp32), mma.sync tiles, and the sm_90 default (wgmma where it runs).
        const std::vector<std::pair<Dt, const char*>> families = {
            {Dt::F32, ""}, {Dt::BF16, "fwd=8x64x2,dq=8x64,dkdv=8x64"}, {Dt::BF16, ""}};
        for (const auto& [dt, shapes] : families)
            for (const bool causal : {false, true}) {
                f.override_kernels(shapes);
                Config c;
                c.dt = dt;
                c.B = 1;
                c.Hq = c.Hk = 1;
                c.Sq = c.Sk = 100;
                c.D = c.R = 64;
                c.causal = causal;
                std::mt19937 rng(3);
                Problem p(c, rng);
                p.q.set({0, 0, 37, 3}, std::numeric_limits<double>::quiet_NaN());
                CAPTURE(describe(c));
                CAPTURE(forward_kernel(kernels_of(p, device_zero())).describe());
                poison_outputs(p);
                DeviceProblem device(p);
                const rope_jit_attention_args args = device.args(p.args());
                REQUIRE(rope_jit_attention(f.cuda().get(), &args) == ROPE_JIT_OK);
                REQUIRE(rope_jit_attention_backward(f.cuda().get(), &args) == ROPE_JIT_OK);
                check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
                const HostTensor out = device.download(p.out), lse = device.download(p.lse),
                                 dq = device.download(p.dq), dk = device.download(p.dk);
                int wrong_rows = 0;
                for (int64_t i = 0; i < c.Sq; ++i) {
                    bool nan_row = std::isnan(lse.get({0, 0, i}));
                    for (int64_t d = 0; d < c.D; ++d)
                        nan_row = nan_row && std::isnan(out.get({0, 0, i, d})) &&
                                  std::isnan(dq.get({0, 0, i, d}));
                    bool finite_row = std::isfinite(lse.get({0, 0, i}));
                    for (int64_t d = 0; d < c.D; ++d)
                        finite_row = finite_row && std::isfinite(out.get({0, 0, i, d})) &&
                                     std::isfinite(dq.get({0, 0, i, d}));
                    wrong_rows += i == 37 ? !nan_row : !finite_row;
                }
                CHECK(wrong_rows == 0);
                CHECK(std::isnan(dk.get({0, 0, 0, 0})));  // a key row 37 sees
                // A key masked from row 37: finite on the CUDA cores, which skip masked pairs; the
                // tensor-core backward may give it NaN when it shares a tile with row 37 (documented).
                if (causal && dt == Dt::F32) CHECK(std::isfinite(dk.get({0, 0, 99, 0})));
            }
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE(
        "without a workspace (its allocation failed) the kernels without one run, match the CPU, "
        "and the fallback is counted") {
        GpuFixture f;
        // The headline family at a head_dim of each width, and head_dim 256's forward (which
        // takes keys rotated beforehand when it has a workspace).
        std::vector<Config> configs;
        Config c;
        c.dt = Dt::BF16;
        c.B = 2;
        c.Hq = 8;
        c.Hk = 2;
        c.Sq = 300;
        c.Sk = 300;
        c.causal = true;
        for (int64_t d : {64, 128, 256}) {
            c.D = c.R = d;
            configs.push_back(c);
        }
        f.override_kernels("workspace=0");
        sweep(f, configs, 11);
        rope_jit_stats stats;
        rope_jit_stats_init(&stats);
        REQUIRE(rope_jit_get_stats(f.cuda().get(), &stats) == ROPE_JIT_OK);
        // Each configuration's forward and backward would have taken a workspace on sm_90.
        if (device_zero().wgmma) CHECK(stats.attention_workspace_fallbacks >= configs.size() * 2);
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE(
        "a caller's workspace serves the sm_90 forward and backward: the library-allocated run's "
        "bits (dq within rounding), the CPU's values, no fallback, and one too small, "
        "misaligned or in host memory is refused before anything runs") {
        GpuFixture f;
        f.override_kernels("");  // the defaults, whatever an earlier test left in the environment
        rope_jit_runtime* runtime = f.cuda().get();
        // The headline family: bf16, D128, causal, GQA 4, lengths off the tiles.
        Config c;
        c.dt = Dt::BF16;
        c.B = 2;
        c.Hq = 8;
        c.Hk = 2;
        c.Sq = 300;
        c.Sk = 300;
        c.D = c.R = 128;
        c.causal = true;
        std::mt19937 rng(21);
        Problem p(c, rng);
        poison_outputs(p);
        DeviceProblem library_allocated(p), caller_given(p);
        const rope_jit_attention_args host_args = p.args();
        rope_jit_attention_args own = library_allocated.args(host_args);
        rope_jit_attention_args given = caller_given.args(host_args);

        size_t forward_bytes = 1, backward_bytes = 1;
        REQUIRE(rope_jit_attention_workspace_size(runtime, &given, 0, &forward_bytes) ==
                ROPE_JIT_OK);
        REQUIRE(rope_jit_attention_workspace_size(runtime, &given, 1, &backward_bytes) ==
                ROPE_JIT_OK);
        const rope_jit::AttentionDevice device = device_zero();
        if (!device.wgmma || !device.tma) {
            MESSAGE("device sm_" << device.compute_capability << ": no workspace kernels here");
            CHECK(forward_bytes == 0);
            CHECK(backward_bytes == 0);
            unsetenv("ROPE_JIT_ATTENTION_KERNELS");
            return;
        }
        // The sizes are those of the kernels the calls run (a prepare kernel first in each).
        for (const bool backward : {false, true}) {
            const rope_jit::AttentionProblem problem =
                rope_jit::make_attention_problem(given, backward);
            const std::vector<rope_jit::AttentionSpec> specs =
                choose_attention_specs(problem, device, rope_jit::AttentionKernelOverride{});
            REQUIRE(!specs.empty());
            CHECK(specs[0].kind == int32_t(rope_jit::AttentionKernelKind::BackwardPrepare));
            CHECK(rope_jit::attention_workspace_for(problem, specs).bytes ==
                  (backward ? backward_bytes : forward_bytes));
        }
        CHECK(forward_bytes > 0);
        CHECK(backward_bytes > forward_bytes);

        // One block for both calls (they run in order on one stream), its contents garbage.
        rope_jit::CUdeviceptr block = 0;
        check_cu(driver().cuMemAlloc(&block, backward_bytes + 256), "cuMemAlloc");
        check_cu(driver().cuMemsetD8(block, 0xff, backward_bytes + 256), "cuMemsetD8");
        char* const workspace = reinterpret_cast<char*>(static_cast<uintptr_t>(block));
        REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 256 == 0);
        auto stats = [&] {
            rope_jit_stats s;
            rope_jit_stats_init(&s);
            REQUIRE(rope_jit_get_stats(runtime, &s) == ROPE_JIT_OK);
            return s;
        };

        // Refused before anything runs: too small (each call) or misaligned.
        {
            const uint64_t launches = stats().launches;
            auto expect_invalid = [&](bool backward, const std::string& needle) {
                const rope_jit_status status = backward
                                                   ? rope_jit_attention_backward(runtime, &given)
                                                   : rope_jit_attention(runtime, &given);
                const std::string message = rope_jit_last_error();
                CAPTURE(message);
                CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
                CHECK(message.find(needle) != std::string::npos);
            };
            given.workspace = workspace;
            given.workspace_bytes = forward_bytes - 1;
            expect_invalid(false, "workspace_bytes: " + std::to_string(forward_bytes - 1) +
                                      " bytes, but this forward needs a workspace of " +
                                      std::to_string(forward_bytes) + " bytes");
            given.workspace_bytes = backward_bytes - 256;
            expect_invalid(true, "workspace_bytes: " + std::to_string(backward_bytes - 256) +
                                     " bytes, but this backward needs a workspace of " +
                                     std::to_string(backward_bytes) + " bytes");
            given.workspace = workspace + 128;
            given.workspace_bytes = backward_bytes;
            expect_invalid(true, "is not 256-byte aligned");
            // Host memory (aligned, large enough): the driver says it is not device memory.
            std::vector<unsigned char> host(backward_bytes + 256);
            const uintptr_t host_at = (reinterpret_cast<uintptr_t>(host.data()) + 255) / 256 * 256;
            given.workspace = reinterpret_cast<void*>(host_at);
            given.workspace_bytes = backward_bytes;
            expect_invalid(false, "is not device memory the CUDA driver knows");
            expect_invalid(true, "is not device memory the CUDA driver knows");
            check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
            CHECK(stats().launches == launches);
            // Nothing written: the outputs still hold their poison.
            for (HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv})
                CHECK(caller_given.download(*t).bytes() == t->bytes());
        }

        // The library's own workspace, then the caller's.
        const uint64_t fallbacks = stats().attention_workspace_fallbacks;
        REQUIRE(rope_jit_attention(runtime, &own) == ROPE_JIT_OK);
        REQUIRE(rope_jit_attention_backward(runtime, &own) == ROPE_JIT_OK);
        given.workspace = workspace;
        given.workspace_bytes = backward_bytes;  // more than the forward needs: fine
        REQUIRE(rope_jit_attention(runtime, &given) == ROPE_JIT_OK);
        REQUIRE(rope_jit_attention_backward(runtime, &given) == ROPE_JIT_OK);
        check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
        CHECK(stats().attention_workspace_fallbacks == fallbacks);
        // The bytes past the workspace's size are never touched.
        std::vector<unsigned char> tail(256);
        check_cu(driver().cuMemcpyDtoH(tail.data(), block + backward_bytes, tail.size()),
                 "cuMemcpyDtoH");
        CHECK(std::count(tail.begin(), tail.end(), 0xff) == 256);
        check_cu(driver().cuMemFree(block), "cuMemFree");

        // out, lse, dk and dv: the same bits (no atomics); dq's float32 atomic adds may round
        // differently.
        for (HostTensor* t : {&p.out, &p.lse, &p.dk, &p.dv}) {
            HostTensor mine = caller_given.download(*t), library = library_allocated.download(*t);
            CHECK(mine.bytes() == library.bytes());
        }
        HostTensor dq_mine = caller_given.download(p.dq);
        HostTensor dq_library = library_allocated.download(p.dq);
        CHECK(normalized_error(dq_mine.values(), dq_library.values(), 1e-3) <= 1e-2);

        // And the CPU backend's values.
        REQUIRE(rope_jit_attention(f.cpu.get(), &host_args) == ROPE_JIT_OK);
        REQUIRE(rope_jit_attention_backward(f.cpu.get(), &host_args) == ROPE_JIT_OK);
        const Tolerance tol = gpu_tolerance(c.dt);
        const std::pair<HostTensor*, double> limits[] = {
            {&p.out, tol.out}, {&p.dq, tol.grad}, {&p.dk, tol.grad}, {&p.dv, tol.grad}};
        for (const auto& [t, limit] : limits) {
            const double err = normalized_error(caller_given.download(*t).values(), t->values(),
                                                t == &p.out ? 0.05 : 1e-3);
            CAPTURE(err);
            CHECK(err <= limit);
        }
        const std::vector<double> lse = caller_given.download(p.lse).values(),
                                  expected_lse = p.lse.values();
        double worst = 0;
        for (size_t i = 0; i < lse.size(); ++i)
            worst = std::max(worst, std::fabs(lse[i] - expected_lse[i]));
        CHECK(worst <= tol.lse * 10);
        unsetenv("ROPE_JIT_ATTENTION_KERNELS");
    }

    TEST_CASE("the CUDA backward asked to be deterministic is: the same bits on every run") {
        GpuFixture f;
        for (const bool pos_mask : {true, false})
            for (Dt dt : {Dt::BF16, Dt::F32}) {
                const std::string dtype = rope_test::dt_name(dt);
                CAPTURE(dtype);
                CAPTURE(pos_mask);
                Config c;
                c.deterministic = true;
                c.dt = dt;
                c.B = 2;
                c.Hq = 8;
                c.Hk = 2;
                c.Sq = 300;
                c.Sk = 300;
                c.D = 64;
                c.R = 64;
                c.causal = true;
                c.pos_mask = pos_mask;
                std::mt19937 rng(4);
                Problem p(c, rng);
                DeviceProblem device(p);
                const rope_jit_attention_args a = device.args(p.args());
                REQUIRE(rope_jit_attention(f.cuda().get(), &a) == ROPE_JIT_OK);
                REQUIRE(rope_jit_attention_backward(f.cuda().get(), &a) == ROPE_JIT_OK);
                check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
                const HostTensor dq = device.download(p.dq), dk = device.download(p.dk),
                                 dv = device.download(p.dv);
                for (int repeat = 0; repeat < 3; ++repeat) {
                    REQUIRE(rope_jit_attention_backward(f.cuda().get(), &a) == ROPE_JIT_OK);
                    check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize");
                    CHECK(device.download(p.dq).bytes() == const_cast<HostTensor&>(dq).bytes());
                    CHECK(device.download(p.dk).bytes() == const_cast<HostTensor&>(dk).bytes());
                    CHECK(device.download(p.dv).bytes() == const_cast<HostTensor&>(dv).bytes());
                }
            }
    }

}  // TEST_SUITE("gpu")
