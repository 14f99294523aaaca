#include "jit/nvrtc_compiler.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/stopwatch.h"
#include "jit/nvrtc_loader.h"

namespace rope_jit {

namespace {

constexpr nvrtcResult NVRTC_ERROR_OUT_OF_MEMORY = 1;
constexpr nvrtcResult NVRTC_ERROR_INVALID_OPTION = 5;  // nvrtc.h's value

struct ParsedTarget {
    bool is_virtual = false;  // compute_XY rather than sm_XY
    int arch = 0;             // XY as a number: 90, 100, 120
    std::string suffix;       // "a" or "f" for arch-specific targets, else ""
};

ParsedTarget parse_target(const std::string& target) {
    ParsedTarget parsed;
    std::string rest;
    if (target.rfind("sm_", 0) == 0) {
        rest = target.substr(3);
    } else if (target.rfind("compute_", 0) == 0) {
        parsed.is_virtual = true;
        rest = target.substr(8);
    } else {
        fail_argument("target '" + target + "' is neither sm_XY nor compute_XY");
    }
    size_t digits = 0;
    while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) {
        ++digits;
    }
    parsed.suffix = rest.substr(digits);
    // Five digits is far beyond any real architecture and keeps stoi from overflowing.
    if (digits < 2 || digits > 5 ||
        !(parsed.suffix.empty() || parsed.suffix == "a" || parsed.suffix == "f")) {
        fail_argument("target '" + target + "' is neither sm_XY nor compute_XY");
    }
    parsed.arch = std::stoi(rest.substr(0, digits));
    return parsed;
}

std::string join(const std::vector<std::string>& parts) {
    std::string joined;
    for (const std::string& part : parts) {
        if (!joined.empty()) joined += ' ';
        joined += part;
    }
    return joined;
}

// Destroys the program on every path out of compile_cuda, throws included.
class ProgramGuard {
public:
    ProgramGuard(const NvrtcApi& api, nvrtcProgram program) : api_(api), program_(program) {}
    ProgramGuard(const ProgramGuard&) = delete;
    ProgramGuard& operator=(const ProgramGuard&) = delete;
    ~ProgramGuard() { api_.nvrtcDestroyProgram(&program_); }

private:
    const NvrtcApi& api_;
    nvrtcProgram program_;
};

std::string program_log(const NvrtcApi& api, nvrtcProgram program) {
    size_t size = 0;
    if (api.nvrtcGetProgramLogSize(program, &size) != NVRTC_SUCCESS || size <= 1) return "";
    std::string log(size, '\0');
    if (api.nvrtcGetProgramLog(program, &log[0]) != NVRTC_SUCCESS) return "";
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    return log;
}

// Options that make a compile cheaper and change no code, so they are not in
// CompileResult::options (nor in the cache key), with the NVRTC version that has each:
// - --no-cache (NVRTC 12.9 and later): those also keep each program's optimizer and
//   PTX-to-SASS results in the driver's compute cache (CUDA_CACHE_PATH) where libcuda is
//   present. The disk cache keeps our cubins already; on the H200 machine writing that cache
//   took ~90 ms of a ~360 ms cold compile, and its hits (4 and 0 ms for those phases) made later
//   "cold" starts measure as warm ones (run EF, session 29). Our compiles leave it alone.
// - -minimal (NVRTC 12.4 and later): leaves out the builtin declarations of textures,
//   surfaces, the device runtime and the driver's types, which no template uses (they include
//   no toolkit header). NVRTC 13.0's front end then takes ~12 ms less a program; the cubins of
//   five kinds of RoPE module and the wgmma attention forward are byte for byte the same
//   (test_nvrtc_speed_options.cpp).
// An NVRTC that answers NVRTC_ERROR_INVALID_OPTION compiles again without them, the last
// first; those it had to drop for a compile to get past its options stay off in this process
// (compile_cuda). Where dropping them all does not help, the caller's options were at fault.
struct SpeedOption {
    const char* name;
    int major, minor;
};
constexpr SpeedOption kSpeedOptions[] = {{"--no-cache", 12, 9}, {"-minimal", 12, 4}};
constexpr size_t kSpeedOptionCount = sizeof(kSpeedOptions) / sizeof(kSpeedOptions[0]);
std::atomic<bool> speed_option_refused[kSpeedOptionCount];

// The indices in kSpeedOptions of those a compile gets now: of this NVRTC's version, not
// refused before, not among `options` already.
std::vector<size_t> speed_options_for(const NvrtcApi& api,
                                      const std::vector<std::string>& options) {
    int major = 0, minor = 0;
    if (api.nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return {};
    std::vector<size_t> chosen;
    for (size_t i = 0; i < kSpeedOptionCount; ++i) {
        const SpeedOption& option = kSpeedOptions[i];
        const bool has = major > option.major || (major == option.major && minor >= option.minor);
        if (has && !speed_option_refused[i] &&
            std::find(options.begin(), options.end(), option.name) == options.end())
            chosen.push_back(i);
    }
    return chosen;
}

}  // namespace

int target_arch(const std::string& target) {
    return parse_target(target).arch;
}

std::string choose_target(const std::string& requested, const std::vector<int>& supported) {
    const ParsedTarget target = parse_target(requested);
    if (supported.empty()) {
        throw Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE, "NVRTC reports no supported architecture");
    }
    const std::string arch = std::to_string(target.arch) + target.suffix;
    if (std::find(supported.begin(), supported.end(), target.arch) != supported.end()) {
        return (target.is_virtual ? "compute_" : "sm_") + arch;
    }
    if (!target.suffix.empty()) {
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    "target " + requested + " is arch-specific and this NVRTC cannot emit it");
    }
    int fallback = 0;
    for (int candidate : supported) {
        if (candidate <= target.arch) fallback = std::max(fallback, candidate);
    }
    if (fallback == 0) {
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    "target " + requested + " is older than every architecture this NVRTC " +
                        "supports (oldest: sm_" +
                        std::to_string(*std::min_element(supported.begin(), supported.end())) +
                        ")");
    }
    return "compute_" + std::to_string(fallback);
}

std::string choose_target_for_device(int major, int minor) {
    require_nvrtc();
    return choose_target("sm_" + std::to_string(major * 10 + minor), nvrtc_supported_archs());
}

std::vector<std::string> default_compile_options() {
    return {"-std=c++17"};
}

std::vector<std::string> compile_options(const std::string& target_used,
                                         const std::vector<std::string>& extra_options) {
    std::vector<std::string> options = default_compile_options();
    options.push_back("--gpu-architecture=" + target_used);
    options.insert(options.end(), extra_options.begin(), extra_options.end());
    return options;
}

CompileResult compile_cuda(const std::string& source, const std::string& program_name,
                           const std::string& target, const std::vector<std::string>& extra_options,
                           const std::vector<NamedSource>& headers) {
    const NvrtcApi& api = require_nvrtc();
    const Stopwatch stopwatch;

    CompileResult result;
    result.target_used = choose_target(target, nvrtc_supported_archs());
    result.is_ptx = result.target_used.rfind("compute_", 0) == 0;
    result.options = compile_options(result.target_used, extra_options);

    const std::string context = "NVRTC " + nvrtc_version_string() + " failed to compile '" +
                                program_name + "' for " + result.target_used;

    std::vector<const char*> header_sources, header_names;
    for (const NamedSource& header : headers) {
        header_names.push_back(header.name.c_str());
        header_sources.push_back(header.source.c_str());
    }
    std::vector<size_t> speed = speed_options_for(api, result.options);
    std::vector<size_t> dropped;  // dropped after NVRTC_ERROR_INVALID_OPTION, last first
    nvrtcProgram program = nullptr;
    std::optional<ProgramGuard> guard;
    nvrtcResult compiled = NVRTC_SUCCESS;
    for (;;) {
        const nvrtcResult created = api.nvrtcCreateProgram(
            &program, source.c_str(), program_name.c_str(), static_cast<int>(headers.size()),
            header_sources.data(), header_names.data());
        if (created != NVRTC_SUCCESS) {
            throw Error(created == NVRTC_ERROR_OUT_OF_MEMORY ? ROPE_JIT_ERROR_OUT_OF_MEMORY
                                                             : ROPE_JIT_ERROR_COMPILE,
                        context + ": nvrtcCreateProgram: " + nvrtc_error_name(created));
        }
        guard.emplace(api, program);
        std::vector<const char*> option_pointers;
        for (const std::string& option : result.options) option_pointers.push_back(option.c_str());
        for (size_t i : speed) option_pointers.push_back(kSpeedOptions[i].name);
        compiled = api.nvrtcCompileProgram(program, static_cast<int>(option_pointers.size()),
                                           option_pointers.data());
        if (compiled != NVRTC_ERROR_INVALID_OPTION || speed.empty()) break;
        dropped.push_back(speed.back());
        speed.pop_back();
        guard.reset();
    }
    if (compiled != NVRTC_ERROR_INVALID_OPTION)
        for (size_t i : dropped) speed_option_refused[i] = true;
    result.log = program_log(api, program);
    if (compiled != NVRTC_SUCCESS) {
        std::string speed_text;
        for (size_t i : speed) speed_text += std::string(" ") + kSpeedOptions[i].name;
        throw Error(compiled == NVRTC_ERROR_OUT_OF_MEMORY ? ROPE_JIT_ERROR_OUT_OF_MEMORY
                                                          : ROPE_JIT_ERROR_COMPILE,
                    context + " (" + nvrtc_error_name(compiled) + ")\noptions: " +
                        join(result.options) + speed_text + "\nlog:\n" + result.log);
    }

    size_t size = 0;
    const auto get_size = result.is_ptx ? api.nvrtcGetPTXSize : api.nvrtcGetCUBINSize;
    const auto get_binary = result.is_ptx ? api.nvrtcGetPTX : api.nvrtcGetCUBIN;
    const char* what = result.is_ptx ? "PTX" : "cubin";
    nvrtcResult extracted = get_size(program, &size);
    if (extracted == NVRTC_SUCCESS && size == 0) {
        throw Error(ROPE_JIT_ERROR_COMPILE, context + ": NVRTC produced an empty " + what +
                                                "\noptions: " + join(result.options));
    }
    if (extracted == NVRTC_SUCCESS) {
        result.binary.resize(size);
        extracted = get_binary(program, result.binary.data());
    }
    if (extracted != NVRTC_SUCCESS) {
        throw Error(ROPE_JIT_ERROR_COMPILE, context + ": retrieving the " + what + ": " +
                                                nvrtc_error_name(extracted) +
                                                "\noptions: " + join(result.options));
    }

    result.milliseconds = stopwatch.milliseconds();
    return result;
}

std::vector<std::string> nvrtc_speed_options() {
    const NvrtcApi* api = nvrtc_api();
    std::vector<std::string> names;
    if (api != nullptr)
        for (size_t i : speed_options_for(*api, {})) names.push_back(kSpeedOptions[i].name);
    return names;
}

}  // namespace rope_jit
