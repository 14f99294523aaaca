#include "cuda/kernel_loader.h"

#include "common/error.h"
#include "common/stopwatch.h"

namespace rope_jit {

namespace {

// What a block may take without opting in.
constexpr int kDefaultSharedLimit = 48 * 1024;

}  // namespace

LoadedKernel load_kernel_module(const CudaDriverApi& api, const std::vector<char>& image,
                                const std::string& entry, int dynamic_shared_bytes,
                                const std::string& second_entry) {
    LoadedKernel kernel;
    check_cu(api.cuModuleLoadData(&kernel.module, image.data()), "cuModuleLoadData");
    // Finds `name` (opted in to the shared memory), or unloads the module and throws.
    auto function_of = [&](const std::string& name) {
        CUfunction function = nullptr;
        CUresult result = api.cuModuleGetFunction(&function, kernel.module, name.c_str());
        std::string what = "cuModuleGetFunction(" + name + ")";
        if (result == CUDA_SUCCESS && dynamic_shared_bytes > kDefaultSharedLimit) {
            result = api.cuFuncSetAttribute(
                function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared_bytes);
            what = "loading " + name;
        }
        if (result != CUDA_SUCCESS) {
            api.cuModuleUnload(kernel.module);
            throw_cuda_error(result, what.c_str());
        }
        return function;
    };
    kernel.function = function_of(entry);
    if (!second_entry.empty()) kernel.second_function = function_of(second_entry);
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
            load_kernel_module(api_, binary.image, recipe.entry, recipe.dynamic_shared_bytes,
                               recipe.second_entry);
        kernel.arch = binary.arch;
        stats_.module_load_microseconds.fetch_add(stopwatch.microseconds(),
                                                  std::memory_order_relaxed);
        return kernel;
    });
}

}  // namespace rope_jit
