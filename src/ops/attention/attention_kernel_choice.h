// Which attention kernels run a problem on a device: the tile tables (tensor-core shapes per
// kernel kind and head_dim, best first), the rules of the wgmma forward, the launch plan
// (block threads, rows per block, shared memory) shared with the kernels, and the
// ROPE_JIT_ATTENTION_KERNELS override, parsed once per runtime.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attention_params.h"
#include "ops/attention/attention_problem.h"
#include "ops/attention/attention_spec.h"

namespace rope_jit {

// What the GPU offers the choice of kernels.
struct AttentionDevice {
    int compute_capability = 0;  // 90 for sm_90
    int max_shared_bytes = 0;    // dynamic shared memory a block may opt in to
    bool wgmma = false;          // the wgmma forward runs: sm_90 and nvrtc_runs_wgmma_forward()
    bool tma = false;            // and the driver encodes TMA descriptors (producer-warp forwards)
};

// The tile fields of a tensor-core kernel: `warps` computing warps of 16-row tiles (`m_tiles`
// of them each, forward only), streamed tiles of `block_n` rows; the wgmma forward (sm_90)
// with `stages` tiles in shared memory, `producer_warps` (0 or 4), clusters of `cluster`
// blocks, and with producer warps keys by TMA (rotated beforehand) or through the producers'
// registers (rotated there).
struct AttentionTileShape {
    int32_t warps = 0, block_n = 0, m_tiles = 1;
    bool wgmma = false;
    int32_t stages = 2;
    int32_t producer_warps = 0;
    int32_t cluster = 1;
    bool keys_by_tma = true;
    // Producer forwards' schedule (AttentionSpec's fields of these names): experiments, but
    // setmaxnreg, which the head_dim 256 producer forward needs.
    int32_t pingpong = 0;
    bool setmaxnreg = false;
    int32_t exp2_fma = 0;
    bool overlap = false;
};

// ROPE_JIT_ATTENTION_KERNELS, parsed: "simt" forces the CUDA-core kernels;
// "fwd=WxN[xM],dq=WxN,dkdv=WxN" (any subset) puts a shape first for the tensor-core kernels of
// that kind (a shape that does not fit falls back to the tables); "fwd=wWxN[xS]" asks for the
// wgmma forward (sm_90; W of 4, 8 or 12) with S tiles in shared memory (2 or 3; 2 by default),
// "fwd=pWxN[xS]" for it with W consumer warps and 4 producer warps (keys by TMA),
// "fwd=rWxN[xS]" the same with the keys rotated in the producers' registers, "fwd=cCxWxN[xS]"
// for 'p' in clusters of C blocks (2 or 4; a divisor of the GQA group); a 'p' shape of 8 warps
// may end in ":pingpong" (the two consumer warpgroups take turns issuing S = Q K^T),
// ":pingpong2" (turns for both products), ":setmaxnreg", ":fma1" to ":fma3" (that many
// quarters of the exponentials on the FMA pipe) and ":overlap" (with setmaxnreg, without
// turns: each warpgroup's softmax runs beside its previous tile's O += P V), in any
// combination the rules allow; "workspace=0" makes the
// CUDA attention act as if its workspace could not be allocated. It is a tool for experiments:
// an item that is not of these forms (an unknown kind, a malformed shape, a wgmma shape for a
// backward kernel) is ignored, so a typo runs the default choice rather than failing calls.
struct AttentionKernelOverride {
    bool force_simt = false;
    bool no_workspace = false;  // "workspace=0": as if the workspace could not be allocated
    std::optional<AttentionTileShape> shape[3];  // by AttentionKernelKind
};

// The override `text` spells (NULL or "": none).
AttentionKernelOverride parse_attention_kernel_override(const char* text);
// The override ROPE_JIT_ATTENTION_KERNELS spells now. The CUDA attention object reads it once,
// when the runtime is created.
AttentionKernelOverride attention_kernel_override_from_environment();

// The kernels that run `problem` (its forward, or its backward) on `device`: tensor cores where
// the dtype, head_dim, rotation layout, strides and alignment allow, the first shape of the
// tile tables whose rules hold and whose shared memory fits, the CUDA-core kernels otherwise.
// The backward is the sm_90 backward's three kernels (prepare, wgmma backward, dq finish;
// kinds 3-5) where the device runs wgmma with TMA, head_dim pads to 64, 128 or 256, there is no
// pos_mask, v and dout suit TMA, the call is not deterministic and the override names no dq
// or dk/dv shape; else dq first, then dk/dv, possibly split into a dk and a dv pass.
// `override` (see above) comes first. Throws Error(UNSUPPORTED) for a head_dim above
// kAttentionMaxHeadDim.
std::vector<AttentionSpec> choose_attention_specs(const AttentionProblem& problem,
                                                  const AttentionDevice& device,
                                                  const AttentionKernelOverride& override);
// The same without an override: what a runtime without ROPE_JIT_ATTENTION_KERNELS runs (and
// what prewarming compiles).
std::vector<AttentionSpec> choose_attention_specs(const AttentionProblem& problem,
                                                  const AttentionDevice& device);

// The launch plan of `spec`: the kernel computes the same from its constants
// (kernels_templates/attention_params.h), so the two cannot disagree.
AttentionLaunchPlan attention_launch_plan(const AttentionSpec& spec);

// The rules of the sm_90 backward's kernels (kinds 3-5): head_dim padded to 64 or 128 with
// 128-key blocks and 2 or 3 query tiles in flight, or to 256 with 64-key blocks and 2; 8 warps,
// no pos_mask, no producer warps or clusters.
// The rules of the wgmma forward: a forward with head_dim padded to 64 or 128 (56-64,
// 120-128), or to 256 with two warpgroups over 64-key tiles (without producer warps, or with
// them, setmaxnreg, two stages and keys by TMA), 64- or 128-key tiles, one to three
// warpgroups of 16-row warps (four or more spill), no pos_mask, 2 or 3 tiles in shared
// memory, no producer warps or one warpgroup of them (with tables read in 8- or 16-byte pieces, three warpgroups in all at most); clusters
// of 2 or 4 blocks only with producer warps, within a GQA group, over shares of whole 8-row
// units. The first one `spec` breaks, or none. No text here: the kernel choice asks on every
// launch; AttentionSpec::validate words the error.
// pingpong, setmaxnreg, exp2_fma and overlap only in a forward with 4 producer warps and 8
// consumer warps (setmaxnreg with keys by TMA: producers that rotate keys need their
// registers; overlap with setmaxnreg, whose registers hold a second score tile, without
// pingpong or clusters).
enum class WgmmaRule {
    None,
    Forward,
    HeadDim,
    KeyTile,
    Warps,
    PosMask,
    Stages,
    Producer,
    Cluster,
    Schedule
};
WgmmaRule wgmma_broken_rule(const AttentionSpec& spec);

}  // namespace rope_jit
