// What rope_jit_prewarm_json and rope_jit_prewarm_plan read: spec entries as JSON text in
// each op's one vocabulary (kernel_spec.h, attention_spec.h), expanded for one target into
// the exact kernels a process running those calls on that target loads.
//
// An entry is a JSON object with "op" ("rope" when left out, or "attention"):
// - a RoPE entry is a KernelSpec JSON object (derived fields may be left out);
// - an attention entry with "kind" is one AttentionSpec (what `rope-jit-cache list --json`
//   prints); without "kind" it describes a call (AttentionCall below) and stands for the
//   kernels choose_attention_specs picks for that call on the target: the forward, or the
//   backward's dq and dk/dv kernels.
#pragma once

#include <string>
#include <vector>

#include "ops/attention/attention_kernel_choice.h"
#include "ops/attention/attention_spec.h"
#include "ops/rope/kernel_spec.h"

namespace rope_jit {

// One kernel to prewarm.
struct PrewarmKernel {
    bool attention = false;
    KernelSpec rope;               // when !attention
    AttentionSpec attention_spec;  // when attention
    std::string spec_json;         // canonical
    std::string description;       // describe()
};

// The kernels of `json_text` (an entry or an array of entries) for `target` ("sm_90"), in
// order, duplicates removed. Throws Error(INVALID_ARGUMENT) naming the entry ("[2]") and the
// field for malformed JSON, unknown fields or bad values, and for a malformed target.
std::vector<PrewarmKernel> expand_prewarm_json(const std::string& json_text,
                                               const std::string& target);

// The order in which to start compiling `kernels` side by side: the slowest kinds first (the
// attention backward's main kernels, then the attention forwards, then the rest: RoPE and the
// attention backward's row kernels, which compile 3-5x faster), each group in list order, so
// that a parallel prewarm's wall time approaches its slowest kernel's.
std::vector<size_t> prewarm_start_order(const std::vector<PrewarmKernel>& kernels);

// What the kernel choice of attention knows of a GPU of `target` ("sm_90", "sm_80",
// "sm_90a"...) when there is none to ask: its compute capability, the dynamic shared memory a
// block may opt in to on that architecture (a table; an unknown one takes the nearest older
// entry), wgmma for sm_90 targets where nvrtc_runs_wgmma_forward says the loaded NVRTC builds
// it, TMA with wgmma.
// Throws Error(INVALID_ARGUMENT) for a malformed target.
AttentionDevice attention_device_for_target(const std::string& target);

// The compute capability of "sm_XY[a|f]" or "compute_XY" (2 to 4 digits, no leading zero) as
// XY; throws Error(INVALID_ARGUMENT) naming the target otherwise.
int target_compute_capability(const std::string& target);

}  // namespace rope_jit
