// Compiles one generated CUDA source with NVRTC for one target: a cubin for the exact sm_XY
// when this NVRTC knows it, else PTX the driver JIT-compiles at load time.
#pragma once

#include <string>
#include <vector>

namespace rope_jit {

struct CompileResult {
    // A cubin (an ELF image), or PTX text including its terminating NUL, as cuModuleLoadData
    // takes it.
    std::vector<char> binary;
    bool is_ptx = false;
    // What was compiled for: "sm_90" with a cubin, "compute_90" with PTX.
    std::string target_used;
    // Every option given to NVRTC, in order. Anything that changes the binary is in here, so
    // it is what a cache key must hash.
    std::vector<std::string> options;
    // NVRTC's log: warnings on success; "" when it had nothing to say.
    std::string log;
    // Wall time of creating, compiling and extracting the program.
    double milliseconds = 0.0;
};

// What to compile for a requested target, given the architectures NVRTC supports (as
// numbers: 75, 80, 90...). "sm_XY" (optionally with an arch-specific suffix, "sm_90a") stays
// itself when XY is supported; otherwise it becomes "compute_AB" for the newest supported AB
// below XY, which the driver can JIT for the newer GPU. "compute_XY" asks for PTX outright.
// Pure function, so the decision is testable without NVRTC or a GPU.
// Throws Error(ROPE_JIT_ERROR_INVALID_ARGUMENT) for a malformed target, and
// Error(ROPE_JIT_ERROR_UNSUPPORTED) for a GPU older than every supported architecture or an
// arch-specific target NVRTC does not know (its features cannot come from PTX of another arch).
std::string choose_target(const std::string& requested, const std::vector<int>& supported);

// The architecture a target compiles for, as a number: 90 for "sm_90", "sm_90a" or
// "compute_90" (what __CUDA_ARCH__ / 10 is in its code). Throws like choose_target for a
// malformed target.
int target_arch(const std::string& target);

// choose_target for a device of compute capability major.minor with the loaded NVRTC:
// "sm_90" on an H100 with NVRTC 12+, "compute_120" for a GPU newer than NVRTC.
// Throws Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE) when NVRTC cannot be loaded.
std::string choose_target_for_device(int major, int minor);

// The options every compile gets before the caller's. No --use_fast_math: angles computed in
// the kernel need accurate sincosf for large positions.
std::vector<std::string> default_compile_options();

// Every option a compile for `target_used` (choose_target's answer) gets, in order:
// default_compile_options(), --gpu-architecture=<target_used>, then extra_options. What
// compile_cuda passes to NVRTC, and what cache keys hash.
std::vector<std::string> compile_options(const std::string& target_used,
                                         const std::vector<std::string>& extra_options);

// The options compile_cuda adds to every compile now, to make it cheaper without changing
// the code ("--no-cache", "-minimal"; nvrtc_compiler.cpp says why): those of the loaded
// NVRTC's version that it has not refused in this process. Not in CompileResult::options nor
// in cache keys. Empty without NVRTC.
std::vector<std::string> nvrtc_speed_options();

// A header the compiled source may #include by `name` (NVRTC reads it from memory).
struct NamedSource {
    std::string name;
    std::string source;
};

// Compiles `source` (which must include nothing from the CUDA toolkit) for `target` as
// decided by choose_target. `program_name` names the source in NVRTC's diagnostics; `headers`
// are the only files it may include.
// Options: compile_options(target_used, extra_options).
// Throws Error(ROPE_JIT_ERROR_COMPILE) with the program name, target, options and the full
// NVRTC log; Error(ROPE_JIT_ERROR_BACKEND_UNAVAILABLE) when NVRTC cannot be loaded, with the
// reason; and choose_target's errors.
CompileResult compile_cuda(const std::string& source, const std::string& program_name,
                           const std::string& target, const std::vector<std::string>& extra_options,
                           const std::vector<NamedSource>& headers = {});

}  // namespace rope_jit
