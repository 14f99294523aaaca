// The device layer and the kernel loader on a real GPU: devices enumerate with their targets and
// attributes, a launch on the NULL stream resolves to the current or the primary context, and
// kernels of two ops share one loader: each (spec, context) is built once, then found in memory,
// and a RoPE spec and an attention spec with the same bytes stay different kernels. Every test
// is in TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <string>
#include <thread>

#include "common/error.h"
#include "cuda/cuda_devices.h"
#include "cuda/kernel_loader.h"
#include "cuda/memory_pool_warmup.h"
#include "jit/nvrtc_loader.h"
#include "ops/attention/attention_recipe.h"
#include "ops/rope/rope_recipe.h"

using rope_jit::CudaDevices;
using rope_jit::KernelLoader;
using rope_jit::LoadedKernel;
using rope_jit::SpecKey;

namespace {

bool have_gpu_and_nvrtc() {
    if (rope_jit::cuda_device_count() > 0 && rope_jit::nvrtc_api() != nullptr) return true;
    MESSAGE("skipped: needs a CUDA device and NVRTC");
    return false;
}

}  // namespace

TEST_SUITE_BEGIN("gpu");

TEST_CASE("the device layer enumerates every device with its target and attributes") {
    if (!have_gpu_and_nvrtc()) return;
    CudaDevices devices;
    REQUIRE(devices.device_count() == rope_jit::cuda_device_count());
    for (int ordinal = 0; ordinal < devices.device_count(); ++ordinal) {
        CAPTURE(ordinal);
        const rope_jit::CudaDevice& device = devices.device(ordinal);
        CHECK(device.target == rope_jit::cuda_device_target(ordinal));
        CHECK(device.target == "sm_" + std::to_string(device.compute_capability));
        CHECK(device.multiprocessors > 0);
        CHECK(device.max_shared_optin >= 48 * 1024);
    }
    CHECK_THROWS_WITH_AS(devices.check_ordinal(devices.device_count(), "k"),
                         doctest::Contains("k: lives on CUDA device"), rope_jit::Error);
    devices.check_ordinal(0, "q");

    // With no context current, the NULL stream runs in device 0's primary context; once that
    // context is current, it is the current one.
    const rope_jit::CudaDriverApi& api = devices.api();
    rope_jit::CUcontext before = nullptr;
    rope_jit::check_cu(api.cuCtxGetCurrent(&before), "cuCtxGetCurrent");
    const rope_jit::LaunchContext launch = devices.resolve_context(0, nullptr);
    CHECK(launch.current == before);
    REQUIRE(launch.context != nullptr);
    {
        rope_jit::ContextScope scope(api, launch.context, launch.current);
        const rope_jit::LaunchContext again = devices.resolve_context(0, nullptr);
        CHECK(again.context == launch.context);
        CHECK(again.current == launch.context);
    }
}

TEST_CASE("the memory pool warm-up leaves another thread's global-mode capture intact") {
    if (!have_gpu_and_nvrtc()) return;
    CudaDevices devices;
    const rope_jit::CudaDriverApi& api = devices.api();
    const rope_jit::LaunchContext launch = devices.resolve_context(0, nullptr);
    REQUIRE(launch.context != nullptr);
    rope_jit::ContextScope scope(api, launch.context, launch.current);

    // A stream under capture in the default (global) mode, as torch.cuda.graph captures.
    rope_jit::CUstream captured = nullptr;
    REQUIRE(api.cuStreamCreate(&captured, rope_jit::CU_STREAM_NON_BLOCKING) == 0);
    REQUIRE(api.cuStreamBeginCapture(captured, rope_jit::CU_STREAM_CAPTURE_MODE_GLOBAL) == 0);
    CHECK_FALSE(rope_jit::stream_not_capturing(api, captured));
    {
        // Its thread creates a stream and allocates while the capture runs: in relaxed mode
        // that is not an unsafe call that would invalidate the capture.
        rope_jit::MemoryPoolWarmup warmup(api, launch.context);
    }
    rope_jit::CUgraph graph = nullptr;
    CHECK(api.cuStreamEndCapture(captured, &graph) == 0);
    if (graph != nullptr) api.cuGraphDestroy(graph);
    CHECK(rope_jit::stream_not_capturing(api, captured));
    CHECK(api.cuStreamDestroy(captured) == 0);
    // The pool works afterwards (the warm-up's allocation was freed).
    rope_jit::CUdeviceptr pointer = 0;
    REQUIRE(api.cuMemAllocAsync(&pointer, 1 << 20, nullptr) == 0);
    CHECK(api.cuMemFreeAsync(pointer, nullptr) == 0);
    CHECK(api.cuCtxSynchronize() == 0);
}

TEST_CASE("kernels of two ops share one loader: built once per context, then found in memory") {
    if (!have_gpu_and_nvrtc()) return;
    CudaDevices devices;
    rope_jit::KernelStats stats;
    {
        KernelLoader loader(devices.api(), nullptr, stats);
        const rope_jit::LaunchContext launch = devices.resolve_context(0, nullptr);
        rope_jit::ContextScope scope(devices.api(), launch.context, launch.current);

        rope_jit::KernelSpec rope;
        rope.dtype = 2;
        rope.head_dim = rope.rotary_dim = 64;
        rope.vec = 8;
        rope.vec_loads = 1;
        const SpecKey rope_key = SpecKey::of(rope_jit::kRopeOp, rope);
        int recipes = 0;
        auto rope_recipe = [&] {
            ++recipes;
            return rope_jit::rope_recipe(rope);
        };
        const std::string& target = devices.target(0);
        const LoadedKernel first = loader.kernel_for(rope_key, launch.context, target, rope_recipe);
        const LoadedKernel second =
            loader.kernel_for(rope_key, launch.context, target, rope_recipe);
        CHECK(first.function != nullptr);
        CHECK(second.function == first.function);
        CHECK(recipes == 1);
        CHECK(stats.compiles.load() == 1);
        CHECK(stats.memory_hits.load() == 1);

        rope_jit::AttentionSpec attention;
        attention.dtype = 2;
        attention.head_dim = attention.rotary_dim = 64;
        const LoadedKernel fused =
            loader.kernel_for(SpecKey::of(rope_jit::kAttentionOp, attention), launch.context,
                              target, [&] { return rope_jit::attention_recipe(attention); });
        CHECK(fused.function != nullptr);
        CHECK(fused.function != first.function);
        CHECK(stats.compiles.load() == 2);
        CHECK(stats.memory_hits.load() == 1);
    }  // the loader unloads both modules while the primary context is still retained
}

TEST_SUITE_END();
