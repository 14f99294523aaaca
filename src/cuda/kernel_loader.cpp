#include "cuda/kernel_loader.h"

#include "common/error.h"
#include "common/stopwatch.h"

namespace rope_jit {

namespace {

// What a block may take without opting in.
constexpr int kDefaultSharedLimit = 48 * 1024;

}  // namespace

LoadedKernel load_kernel_module(const CudaDriverApi& api, const std::vector<char>& image,
                                const std::string& entry, int dynamic_shared_bytes) {
    LoadedKernel kernel;
    check_cu(api.cuModuleLoadData(&kernel.module, image.data()), "cuModuleLoadData");
    const CUresult found = api.cuModuleGetFunction(&kernel.function, kernel.module, entry.c_str());
    if (found != CUDA_SUCCESS) {
        api.cuModuleUnload(kernel.module);
        throw_cuda_error(found, ("cuModuleGetFunction(" + entry + ")").c_str());
    }
    if (dynamic_shared_bytes > kDefaultSharedLimit) {
        const CUresult result = api.cuFuncSetAttribute(
            kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared_bytes);
        if (result != CUDA_SUCCESS) {
            api.cuModuleUnload(kernel.module);
            throw_cuda_error(result, ("loading " + entry).c_str());
        }
    }
    return kernel;
}

KernelLoader::KernelLoader(const CudaDriverApi& api, const DiskCache* disk, KernelStats& stats)
    : api_(api), disk_(disk), stats_(stats) {}

KernelLoader::~KernelLoader() {
    kernels_.unload_all(api_);
}

LoadedKernel KernelLoader::build(const SpecKey& spec, CUcontext context, const std::string& target,
                                 const std::function<KernelRecipe()>& make_recipe) {
    // The caller made `context` current: the module loads there.
    return kernels_.get_or_build(spec, context, [&] {
        const KernelRecipe recipe = make_recipe();
        // With background builds, a binary built there is taken, and on a disk miss the
        // recipe's follow-ups are queued before it compiles (they compile beside it).
        const KernelBinary binary = background_ != nullptr
                                        ? background_->build_now(recipe, target)
                                        : build_kernel_binary(recipe, target, disk_, stats_);
        const Stopwatch stopwatch;
        LoadedKernel kernel =
            load_kernel_module(api_, binary.image, recipe.entry, recipe.dynamic_shared_bytes);
        stats_.module_load_microseconds.fetch_add(stopwatch.microseconds(),
                                                  std::memory_order_relaxed);
        return kernel;
    });
}

}  // namespace rope_jit
