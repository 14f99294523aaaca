#include "ops/rope/rope_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "common/error.h"
#include "cuda/kernel_launch.h"
#include "ops/rope/rope_dense_rows.h"
#include "ops/rope/rope_recipe.h"
#include "ops/rope/rope_plan.h"
#include "rope_norm_params.h"

namespace rope_jit {

namespace {

// A host copy of the bytes a device view covers, and the same view over that copy.
TensorRef host_copy(const CudaDriverApi& api, const TensorRef& t, std::vector<char>& storage) {
    if (!t.present() || t.numel() == 0) return t;
    uintptr_t first, last;
    t.byte_extent(&first, &last);
    storage.resize(size_t(last - first + 1));
    check_cu(api.cuMemcpyDtoH(storage.data(), CUdeviceptr(first), storage.size()),
             "cuMemcpyDtoH (debug checks)");
    TensorRef copy = t;
    copy.data = storage.data() + (reinterpret_cast<uintptr_t>(t.data) - first);
    copy.device = {kDLCPU, 0};
    return copy;
}

}  // namespace

KernelRecipe rope_recipe_with_backward(const KernelSpec& spec) {
    KernelRecipe recipe = rope_recipe(spec);
    if (!spec.backward) {
        recipe.follow_ups = [spec] {
            KernelSpec backward = spec;
            backward.backward = 1;
            backward.norm_weight_grad = spec.qk_norm;  // training wants dL/dw too
            return std::vector<KernelRecipe>{rope_recipe(backward)};
        };
    }
    return recipe;
}

RopeLaunch plan_rope_launch(const KernelSpec& spec, int64_t heads_q, int64_t heads_k, int64_t units,
                            int64_t sms, bool token_rows_adjacent) {
    const RopePlan plan = rope_plan(spec);
    RopeBlockFit fit =
        rope_block_fit(plan, heads_q + heads_k, units, sms, spec.block_threads, heads_k);
    const bool fits = fit.problem == kRopeFitOk;
    // Tiny problems (decode: a token per sequence, fewer tokens than multiprocessors): the
    // grid is a single partial wave, so the time is one thread's chain of dependent loads
    // and stores, not bandwidth. One item a thread (a block as wide as its token's items)
    // takes a whole load-rotate-store round off that chain (B=64, 32+8 heads, D128: 64
    // blocks of 320 threads instead of 160 threads of two items).
    const bool tiny = fits && fit.tokens == 1 && units <= sms;
    // Plain RoPE of many tokens takes the direct path too, one token a block, where that costs
    // no locality (a token's rows lie together in memory, or rope_block_fit gave one token a
    // block anyway), the staged path would take one item at a time (item_batch 1), and a
    // token's table row is arithmetic (no positions, seqlen_offsets or cu_seqlens, which each
    // thread would look up on its own) or the tokens are few (decode batches up to two tokens a
    // multiprocessor: B=256 with positions took 2.71 us in a graph against 3.26 us staged).
    // One item a thread, except interleaved tokens of 512 items or more, which take four
    // (blocks of 128 threads or more; H200 runs CO and CP, session 22, Llama-3-8B interleaved,
    // 640 items: 0.902-0.908 of copy at eight, 0.933-0.940 at four, 0.931 at two, 0.890 at
    // sixteen). H200 runs
    // AR-AT against the staged path: Llama-3-8B prefill 0.926 -> 0.935-0.943 of copy, D256
    // 0.906 -> 0.918-0.927, interleaved (640 items) 0.889 -> 0.911 at eight items a thread
    // (0.877 at one), GPT-J's in-place partial rotary (256 items) 0.702 -> 0.764 at one item a
    // thread (0.639 at eight, 32 threads a block), D64 0.859 -> 0.859-0.867; per-token
    // positions lost 9% and packed batches 8%, one token a block of [B,H,S,D] D64 4%, D80/D96
    // without their item batches 10-15%.
    // The measured bounds of that rule: a token's items for one token a block (D64 16+16 heads:
    // 128), interleaved items for several a thread (four each), tokens a multiprocessor with
    // lookups.
    constexpr int64_t kSpreadMinItems = 128, kSpreadInterleavedBatchItems = 512;
    constexpr int64_t kSpreadInterleavedItemsPerThread = 4;
    constexpr int64_t kSpreadLookupTokensPerSm = 2;
    const int64_t rot_items = (heads_q + heads_k) * plan.rot_items;
    // QK-norm on rope.cu (plan.norm_items: forwards with a KV cache) has the direct path only:
    // one token a block, always.
    if (plan.norm_items && units > 0x7fffffffLL)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("q: QK-norm of {} tokens exceeds one launch's grid (a block a "
                                "token)",
                                units));
    const bool spread =
        fits && !tiny &&
        (plan.norm_items ||
         (spec.kv_cache == 0 && plan.one_token_direct && plan.item_batch == 1 && !spec.packed &&
          units <= 0x7fffffffLL &&  // one block a token
          (spec.position_mode == 0 || units <= kSpreadLookupTokensPerSm * sms) &&
          (fit.tokens == 1 || (token_rows_adjacent && rot_items >= kSpreadMinItems))));
    if (spread && fit.tokens > 1) {
        fit.tokens = 1;
        fit.blocks = units;
        fit.shared_bytes = rope_block_smem(plan, 1).bytes;
    }
    // Such blocks, and the KV cache's blocks of one token, skip the shared-memory staging and
    // its barrier: each thread issues its q/k/v loads first and resolves its own position,
    // table row and cache slot meanwhile (rope.cu, rope_one_token).
    const bool direct =
        plan.one_token_direct && fit.tokens == 1 && (tiny || spread || spec.kv_cache != 0);
    // The direct path copies v two vectors an item (plan.v_direct_items): its blocks are sized
    // to those items as rope_block_fit sizes blocks to the staged path's.
    const int64_t token_items =
        rot_items + heads_k * (direct ? plan.v_direct_items : plan.v_items);
    // QK-norm on rope.cu (plan.norm_items) takes an item a thread while the grid is at most a
    // few waves of such blocks; with many tokens a block is two warps that take the token's
    // items in rounds. At 64 registers a multiprocessor holds 1024 threads either way, but
    // Qwen3-8B's 384 items a token (32/8 heads + v, D128) fit two 384-thread blocks (768
    // threads) or 16 of 64. H200 runs CU-CX (session 23), Qwen3-8B prefill 4x4096 with a paged
    // FP8 cache, fractions of copy: 384 threads 0.628-0.630, 256 0.755 (the second round half
    // idle), 192 0.785, 128 0.818, 96 0.809, 64 0.823-0.832, 32 0.818. Below
    // kNormItemsNarrowMinTokensPerSm tokens a multiprocessor an item a thread keeps its one
    // round: decode of 256 and 512 tokens (2 and 4 a multiprocessor) takes 3.23 and 4.95 us in
    // a graph that way against 5.33 and 6.21 us in rounds; 1024 tokens (7.8) tie (0.53-0.59 of
    // copy either way); from 1536 (11.6) rounds win (0.70 against 0.62). (Such a call is
    // never tiny: tiny calls have at most one token a multiprocessor.)
    constexpr int64_t kNormItemsNarrowThreads = 64, kNormItemsNarrowMinTokensPerSm = 10;
    const bool norm_narrow = plan.norm_items && units >= kNormItemsNarrowMinTokensPerSm * sms;
    if (direct && fits && token_items > 0) {
        const bool one_each =
            tiny || plan.norm_items ||
            (spread && !(spec.interleaved && rot_items >= kSpreadInterleavedBatchItems));
        const int64_t per_thread = one_each ? 1
                                   : spread ? kSpreadInterleavedItemsPerThread
                                            : plan.items_per_thread;
        const int64_t work = (token_items + per_thread - 1) / per_thread;
        fit.threads = int(std::min<int64_t>((work + 31) / 32 * 32, spec.block_threads));
        if (norm_narrow)
            fit.threads = int(std::min<int64_t>(fit.threads, kNormItemsNarrowThreads));
    }
    if (tiny && !direct && token_items > 0) {  // the staged path at decode: one item a thread
        const int64_t threads = (token_items + 31) / 32 * 32;
        if (threads > fit.threads && threads <= spec.block_threads) fit.threads = int(threads);
    }
    if (fit.problem == kRopeFitSharedMemory)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("rope: one token's angles need {} bytes of shared memory, over the "
                                "{} a block may use",
                                fit.shared_bytes, kRopeSharedLimit));
    if (fit.problem == kRopeFitGrid)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("q: {} tokens exceed one launch's grid", units));
    // [B, H, S, D] buffers on the staged path: a warp's items take one head's consecutive tokens
    // (contiguous rows) rather than several heads' rows of one token, a head plane apart. H200
    // run BP (session 15): D64 [B, H, S, D] interleaved 0.754 -> 0.832 of copy, Llama-3-8B
    // [B, H, S, D] 0.905 -> 0.906; more tokens a block (16, 32) lost 1-10%.
    const bool items_by_head = !direct && fit.tokens > 1 && !token_rows_adjacent;
    // QK-norm forwards on rope.cu have no other path (their rope_kernel is empty).
    if (plan.norm_items && !direct && fit.blocks > 0)
        throw Error(ROPE_JIT_ERROR_INTERNAL,
                    "rope: a QK-norm forward on rope.cu must take the direct path");
    RopeLaunch launch{fit.blocks, fit.threads, unsigned(fit.shared_bytes), fit.tokens, direct};
    launch.direct_entry = direct && plan.direct_entry;
    launch.items_by_head = items_by_head;
    return launch;
}

bool token_rows_adjacent(const TensorRef& q, const TensorRef* k) {
    auto adjacent = [](const TensorRef& t) {
        // [B, H, S, D] view: from one token to the next is S's stride, or B's when S is 1.
        const int64_t token_stride = t.shape[2] > 1 ? t.strides[2] : t.strides[0];
        return t.shape[1] <= 1 || std::abs(t.strides[1]) < std::abs(token_stride);
    };
    return adjacent(q) && (k == nullptr || adjacent(*k));
}

RopeNormLaunch plan_rope_norm_launch(const KernelSpec& spec, const RopeNormRows& work,
                                     int64_t sms) {
    RopeNormLaunch launch;
    const int bytes = rope_norm_smem_bytes(spec.head_dim, spec.norm_weight_grad);
    if (bytes > kRopeSharedLimit)
        throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                    fmt::format("head_dim: QK-norm's weight gradients of {} features need {} "
                                "bytes of shared memory, over the {} a block may use",
                                spec.head_dim, bytes, kRopeSharedLimit));
    // A warp normalizes 32 / lanes rows at a time (rope_norm_params.h). Few rows (decode): the
    // time is one row's chain of dependent loads, so the warps spread over every
    // multiprocessor in small blocks, each group one row. Many rows (more than the launch
    // bound keeps resident, kRopeNormForwardBlocks full blocks a multiprocessor), forward:
    // blocks of kRopeNormRunWarps warps, each group one run of heads of one token
    // (rope_norm_max_run), a block per set of runs. Backward: rows grid-stride, at most 64
    // blocks a multiprocessor (keeping the last, partial wave of blocks short); with weight
    // gradients every block adds its sums into the same D floats, so fewer (16).
    const int lanes = rope_norm_lanes(spec.head_dim, spec.rotary_dim, spec.interleaved != 0,
                                      spec.vec, spec.copy_vec);
    const int64_t rows = work.units * (work.heads_q + work.heads_k + work.heads_v);
    const int64_t warps_needed = (rows + 32 / lanes - 1) / (32 / lanes);
    const int64_t multiprocessors = std::max<int64_t>(sms, 1);
    const int64_t warps = std::clamp<int64_t>(
        (warps_needed + multiprocessors - 1) / multiprocessors, 1, kRopeNormMaxWarps);
    launch.warps = int(warps);
    launch.threads = 32 * warps;
    launch.shared_bytes = unsigned(bytes);
    const bool fp8_or_cache = spec.q_fp8 || spec.kv_fp8 || spec.kv_cache != 0;
    if (!spec.backward &&
        warps_needed > int64_t(kRopeNormForwardBlocks) * kRopeNormMaxWarps * multiprocessors) {
        // The longest run the kernel takes that divides both head counts (v's rows go alone).
        int run = rope_norm_max_run(
            false, fp8_or_cache,
            rope_norm_table_spans(spec.angles_from_inv_freq, spec.has_xpos, spec.mrope_axes),
            spec.rotary_dim < spec.head_dim, spec.head_dim);
        if (work.heads_v > 0) run = 1;
        while (run > 1 && (work.heads_q % run != 0 || work.heads_k % run != 0)) run /= 2;
        launch.run = run;
        // Blocks of kRopeNormRunWarps warps, a block per set of its groups' runs: each group
        // takes one run, and the hardware starts the next block wherever one ends. Qwen3-8B
        // prefill, fractions of copy (H200): two resident 8-warp blocks a multiprocessor taking
        // runs grid-stride, whose last of 19.4 passes left most groups idle, 0.879-0.883 (run
        // CL); a block per set of runs, 8 warps 0.890-0.900 (runs CL, CM), 4 warps 0.912-0.916,
        // 2 warps 0.914, 6 warps 0.830 (two blocks resident: 12 warps) (run CM).
        launch.warps = kRopeNormRunWarps;
        launch.threads = 32 * launch.warps;
        const int64_t runs = work.units * (work.heads_q / run + work.heads_k / run + work.heads_v);
        const int64_t runs_per_block = int64_t(launch.warps) * (32 / lanes);
        launch.blocks = std::min<int64_t>((runs + runs_per_block - 1) / runs_per_block,
                                          std::numeric_limits<int32_t>::max());
        return launch;
    }
    const int64_t blocks_per_sm = spec.norm_weight_grad ? 16 : 64;
    launch.blocks =
        std::min<int64_t>((warps_needed + warps - 1) / warps, blocks_per_sm * multiprocessors);
    return launch;
}

namespace {

// The kernel's run-time arguments (rope_params.h), one group at a time.

// q and k, and where they go.
void set_tensors(const RopeProblem& p, RopeKernelParams& params) {
    params.q = p.q.data;
    params.q_out = p.q_out.data;
    copy_strides(params.q_stride, p.q, 4);
    copy_strides(params.q_out_stride, p.q_out, 4);
    if (p.has_k) {
        params.k = p.k.data;
        params.k_out = p.k_out.data;
        copy_strides(params.k_stride, p.k, 4);
        copy_strides(params.k_out_stride, p.k_out, 4);
    }
}

// Where the angles come from: cos/sin tables or inv_freq, and the xPos scales.
void set_angles(const RopeProblem& p, RopeKernelParams& params) {
    if (p.angles == AngleSource::Table) {
        params.cos = p.cos.data;
        params.sin = p.sin.data;
        copy_strides(params.cos_stride, p.cos, 2);
        copy_strides(params.sin_stride, p.sin, 2);
    } else {
        params.inv_freq = p.inv_freq.data;
        params.inv_freq_stride = p.inv_freq.strides[0];
    }
    if (p.has_xpos) {
        params.xpos = p.xpos_scale.data;
        copy_strides(params.xpos_stride, p.xpos_scale, 2);
    }
}

// Where the positions come from: per-token indices (per section with M-RoPE), per-sequence
// offsets, and the packed batch's sequence starts.
void set_positions(const RopeProblem& p, RopeKernelParams& params) {
    if (p.positions.present()) {
        // With M-RoPE, positions lead with an axis; each axis is an [S], [B, S] or [T] view.
        const TensorRef axis = p.position_axis(0);
        params.positions = axis.data;
        // [S] and packed [T] are read at (0, s): their batch stride is 0.
        params.positions_stride[0] = axis.ndim == 2 ? axis.strides[0] : 0;
        params.positions_stride[1] = axis.strides[axis.ndim - 1];
        if (p.multi_section()) {
            params.positions_axis_stride = p.positions.strides[0];
            if (p.pair_axis.size() > sizeof params.pair_axis)
                throw Error(ROPE_JIT_ERROR_UNSUPPORTED,
                            fmt::format("mrope_sections: the CUDA kernels take at most {} pairs "
                                        "with M-RoPE, got {}",
                                        sizeof params.pair_axis, p.pair_axis.size()));
            for (size_t i = 0; i < p.pair_axis.size(); ++i)
                params.pair_axis[i] = (unsigned char)p.pair_axis[i];
        }
    }
    if (p.seqlen_offsets.present()) {
        params.seqlen_offsets = p.seqlen_offsets.data;
        params.seqlen_offsets_stride = p.seqlen_offsets.strides[0];
    }
    if (p.cu_seqlens.present()) {
        params.cu_seqlens = p.cu_seqlens.data;
        params.cu_seqlens_stride = p.cu_seqlens.strides[0];
    }
}

// Learned frequencies: the forward outputs and the gradient the kernel adds into.
void set_frequency_gradient(const RopeProblem& p, RopeKernelParams& params) {
    if (!p.has_freq_grad) return;
    params.q_saved = p.q_saved.data;
    copy_strides(params.q_saved_stride, p.q_saved, 4);
    if (p.has_k) {
        params.k_saved = p.k_saved.data;
        copy_strides(params.k_saved_stride, p.k_saved, 4);
    }
    params.inv_freq_grad = reinterpret_cast<float*>(p.inv_freq_grad.data);
    params.inv_freq_grad_stride = p.inv_freq_grad.strides[0];
}

// Sizes, and the tokens the grid covers: units = batch * RopeProblem::rotated_seqlen.
void set_sizes(const RopeProblem& p, RopeKernelParams& params) {
    params.batch = p.batch;
    params.seqlen_q = p.seqlen_q;
    params.seqlen_k = p.has_k ? p.seqlen_k : 0;
    params.seqlen_max = p.rotated_seqlen();
    params.heads_q = p.heads_q;
    params.heads_k = p.heads_k;
    params.num_sequences = p.num_sequences;
    params.position_offset = p.position_offset;
    params.q_position_offset = p.q_position_offset;
    params.units = p.batch * params.seqlen_max;
}

RopeKernelParams rope_kernel_params(const RopeProblem& p) {
    RopeKernelParams params{};
    set_tensors(p, params);
    set_angles(p, params);
    set_positions(p, params);
    set_frequency_gradient(p, params);
    set_sizes(p, params);
    return params;
}

// The KV cache's and the FP8 outputs' arguments (RopeCacheParams): v and its cache (the k
// cache is k_out), the slot sources and the scales.
RopeCacheParams rope_cache_params(const RopeProblem& p) {
    RopeCacheParams params{};
    auto scale = [](const TensorRef& t) {
        return t.present() ? reinterpret_cast<const float*>(t.data) : nullptr;
    };
    params.q_scale = scale(p.q_scale);
    if (!p.has_kv_cache) return params;
    params.k_scale = scale(p.k_scale);
    params.v_scale = scale(p.v_scale);
    params.cache_blocks = p.cache_blocks();
    params.cache_slots = p.cache_slots();
    if (p.has_v) {
        params.v = p.v.data;
        params.v_cache = p.v_cache.data;
        copy_strides(params.v_stride, p.v, 4);
        copy_strides(params.v_cache_stride, p.v_cache, 4);
    }
    if (p.slot_mapping.present()) {
        params.slot_mapping = p.slot_mapping.data;
        params.slot_mapping_stride = p.slot_mapping.strides[0];
    }
    if (p.block_tables.present()) {
        params.block_tables = p.block_tables.data;
        copy_strides(params.block_tables_stride, p.block_tables, 2);
        params.max_blocks = p.block_tables.shape[1];
    }
    return params;
}

// The QK-norm kernels' arguments (rope_norm_params.h): `rope` (rope_kernel_params), the
// weights, and in the backward the pre-norm inputs and the weight gradients.
RopeNormParams rope_norm_params(const RopeProblem& p, const RopeKernelParams& rope,
                                const RopeNormLaunch& launch) {
    RopeNormParams params{};
    params.rope = rope;
    params.q_weight = p.q_norm_weight.data;
    params.q_weight_stride = p.q_norm_weight.strides[0];
    if (p.has_k) {
        params.k_weight = p.k_norm_weight.data;
        params.k_weight_stride = p.k_norm_weight.strides[0];
    }
    if (p.backward) {
        params.q_input = p.q_norm_input.data;
        copy_strides(params.q_input_stride, p.q_norm_input, 4);
        if (p.has_k) {
            params.k_input = p.k_norm_input.data;
            copy_strides(params.k_input_stride, p.k_norm_input, 4);
        }
    }
    if (p.q_norm_weight_grad.present()) {
        params.q_weight_grad = reinterpret_cast<float*>(p.q_norm_weight_grad.data);
        params.q_weight_grad_stride = p.q_norm_weight_grad.strides[0];
    }
    if (p.k_norm_weight_grad.present()) {
        params.k_weight_grad = reinterpret_cast<float*>(p.k_norm_weight_grad.data);
        params.k_weight_grad_stride = p.k_norm_weight_grad.strides[0];
    }
    // Runs a token has: q's and k's heads in runs of launch.run, v's rows one by one.
    params.heads_div = row_divisor((p.heads_q + (p.has_k ? p.heads_k : 0)) / launch.run +
                                         (p.has_v ? p.heads_k : 0));
    params.seqlen_div = row_divisor(params.rope.seqlen_max);
    params.eps = float(p.norm_eps);
    params.warps = launch.warps;
    params.run = launch.run;
    return params;
}

}  // namespace

RopeCuda::RopeCuda(CudaDevices& devices, KernelLoader& kernels, KernelStats& stats,
                   bool debug_checks, bool programmatic_launch)
    : devices_(devices),
      kernels_(kernels),
      stats_(stats),
      debug_checks_(debug_checks),
      programmatic_launch_(programmatic_launch) {}

bool RopeCuda::launches_programmatically(const RopeProblem& p, const LoadedKernel& kernel) const {
    // A call that zeroes a gradient output first launches plainly: its kernel follows a
    // memset, not a kernel, and backward calls are not what the overlap is for.
    const bool zeroes_first =
        p.has_freq_grad || p.q_norm_weight_grad.present() || p.k_norm_weight_grad.present();
    return rope_jit::launches_programmatically(
        devices_.api(), programmatic_launch_ && !zeroes_first,
        devices_.device(p.device.device_id).compute_capability, kernel.arch);
}

void RopeCuda::check_positions_on_device(const RopeProblem& problem, CUstream stream) {
    // Debug mode only: waits for the stream so the indices it produces are final, then
    // checks host copies with the CPU backend's rules.
    check_cu(devices_.api().cuStreamSynchronize(stream), "cuStreamSynchronize (debug checks)");
    RopeProblem copy = problem;
    std::vector<char> positions, offsets, cu_seqlens;
    copy.positions = host_copy(devices_.api(), problem.positions, positions);
    copy.seqlen_offsets = host_copy(devices_.api(), problem.seqlen_offsets, offsets);
    copy.cu_seqlens = host_copy(devices_.api(), problem.cu_seqlens, cu_seqlens);
    std::vector<char> slot_mapping, block_tables;
    copy.slot_mapping = host_copy(devices_.api(), problem.slot_mapping, slot_mapping);
    copy.block_tables = host_copy(devices_.api(), problem.block_tables, block_tables);
    check_positions_on_host(copy);
}

void RopeCuda::run(const RopeProblem& p, void* stream_handle) {
    const int ordinal = p.device.device_id;
    devices_.check_ordinal(ordinal, "q");
    const CudaDriverApi& api = devices_.api();
    CUstream stream = static_cast<CUstream>(stream_handle);
    const LaunchContext launch = devices_.resolve_context(ordinal, stream);
    ContextScope scope(api, launch.context, launch.current);
    if (debug_checks_) check_positions_on_device(p, stream);

    // The kernel for this call's spec, then its arguments and its blocks (rope_params.h).
    const KernelSpec spec = make_kernel_spec(p);
    const LoadedKernel kernel =
        kernels_.kernel_for(SpecKey::of(kRopeOp, spec), launch.context, devices_.target(ordinal),
                            [&spec] { return rope_recipe_with_backward(spec); });
    if (takes_norm_kernel(spec)) {
        run_norm(p, spec, kernel, stream);
        return;
    }
    RopeKernelParams params = rope_kernel_params(p);
    const bool programmatic = launches_programmatically(p, kernel);
    params.programmatic = programmatic ? 1 : 0;
    // Plain RoPE of dense rows: the flat path (RopePlan::flat_rows), first, since its calls need
    // nothing of the staged launch's plan (rope_flat_kernel reads neither tokens_per_block,
    // direct nor items_by_head) and no bulk path applies to them. make_kernel_spec keeps
    // dense_rows only for calls flat_rows_of takes, whose module's rope_kernel is empty (rope.cu).
    if (spec.dense_rows) {
        const std::optional<RopeBulkParams> flat = flat_rows_of(spec, p);
        if (!flat)
            throw Error(ROPE_JIT_ERROR_INTERNAL,
                        "rope: a call of a dense_rows spec that the flat path does not take");
        run_rows(params, *flat, plan_rope_flat_launch(spec, *flat), kernel, programmatic, stream,
                 "cuLaunchKernel(rope_flat_kernel)");
        return;
    }
    const RopeLaunch shape =
        plan_rope_launch(spec, p.heads_q, p.has_k ? p.heads_k : 0, params.units,
                         devices_.device(ordinal).multiprocessors,
                         token_rows_adjacent(p.q, p.has_k ? &p.k : nullptr));
    params.tokens_per_block = shape.tokens_per_block;
    params.direct = shape.direct ? 1 : 0;
    params.items_by_head = shape.items_by_head ? 1 : 0;
    if (p.has_freq_grad) {
        // The kernel adds into the gradient: zero it first, ordered on the same stream.
        check_cu(api.cuMemsetD2D32Async(CUdeviceptr(params.inv_freq_grad),
                                        size_t(params.inv_freq_grad_stride) * sizeof(float), 0u, 1,
                                        size_t(p.pairs()), stream),
                 "cuMemsetD2D32Async(inv_freq_grad)");
    }
    if (shape.blocks == 0) return;  // no token: nothing to rotate (a gradient was still zeroed)
    // Out-of-place partial rotary over dense, aligned rows on sm_90 and later: the bulk path
    // (RopePlan::bulk_rows, rope_dense_rows.h). The module's architecture decides with the
    // device's: compiled for an older one (an NVRTC that cannot target the device), its bulk
    // entry is empty and the staged path runs.
    const CudaDevice& device = devices_.device(ordinal);
    if (const std::optional<RopeBulkParams> bulk =
            bulk_rows_of(spec, p, std::min(device.compute_capability, kernel.arch))) {
        run_rows(params, *bulk, plan_rope_bulk_launch(*bulk, device.multiprocessors), kernel,
                 programmatic, stream, "cuLaunchKernel(rope_bulk_kernel)");
        return;
    }

    // The direct path of a plan with direct_entry has an entry of its own (rope_recipe.cpp).
    const CUfunction function = shape.direct_entry ? kernel.second_function : kernel.function;
    if (function == nullptr)
        throw Error(ROPE_JIT_ERROR_INTERNAL, "rope: the direct path's kernel was not loaded");
    auto launch_with = [&](void* arguments) {
        launch_kernel(api,
                      {function, unsigned(shape.blocks), unsigned(shape.threads),
                       shape.shared_bytes, arguments},
                      stream, programmatic,
                      shape.direct_entry ? "cuLaunchKernel(rope_direct_kernel)"
                                   : "cuLaunchKernel(rope_kernel)");
    };
    // QK-norm forwards on rope.cu (RopePlan::norm_items) take the norm kernel's arguments (the
    // rope ones, the weights, eps); KV cache and FP8 kernels the cache arguments after their own
    // (rope_params.h).
    const bool cache_args = spec.kv_cache != 0 || spec.q_fp8 != 0;
    if (spec.qk_norm) {
        RopeNormParams norm_params = rope_norm_params(p, params, RopeNormLaunch{});
        if (cache_args) {
            RopeNormCacheParams cache_params{norm_params, rope_cache_params(p)};
            launch_with(&cache_params);
        } else {
            launch_with(&norm_params);
        }
    } else if (cache_args) {
        RopeCacheKernelParams cache_params{params, rope_cache_params(p)};
        launch_with(&cache_params);
    } else {
        launch_with(&params);
    }
    stats_.launches.fetch_add(1, std::memory_order_relaxed);
}

void RopeCuda::run_rows(const RopeKernelParams& params, const RopeBulkParams& rows,
                        const RopeBulkLaunch& shape, const LoadedKernel& kernel,
                        bool programmatic, CUstream stream, const char* what) {
    if (kernel.second_function == nullptr)
        throw Error(ROPE_JIT_ERROR_INTERNAL,
                    fmt::format("rope: the module's second entry was not loaded ({})", what));
    if (shape.blocks == 0) return;
    RopeBulkKernelParams arguments{params, rows};
    launch_kernel(devices_.api(),
                  {kernel.second_function, unsigned(shape.blocks), unsigned(shape.threads),
                   shape.shared_bytes, &arguments},
                  stream, programmatic, what);
    stats_.launches.fetch_add(1, std::memory_order_relaxed);
}

void RopeCuda::run_norm(const RopeProblem& p, const KernelSpec& spec, const LoadedKernel& kernel,
                        CUstream stream) {
    const CudaDriverApi& api = devices_.api();
    // Rows: q's and k's heads, and v's, which the kernel copies into its cache (KV cache).
    const RopeNormRows rows{p.batch * p.rotated_seqlen(), p.heads_q,
                            p.has_k ? p.heads_k : 0, p.has_v ? p.heads_k : 0};
    const RopeNormLaunch shape =
        plan_rope_norm_launch(spec, rows, devices_.device(p.device.device_id).multiprocessors);
    RopeNormParams params = rope_norm_params(p, rope_kernel_params(p), shape);
    const bool programmatic = launches_programmatically(p, kernel);
    params.rope.programmatic = programmatic ? 1 : 0;
    // The kernel adds into the weight gradients: zero them first, ordered on the same stream.
    for (const TensorRef* grad : {&p.q_norm_weight_grad, &p.k_norm_weight_grad})
        if (grad->present())
            check_cu(api.cuMemsetD2D32Async(CUdeviceptr(grad->data),
                                            size_t(grad->strides[0]) * sizeof(float), 0u, 1,
                                            size_t(p.head_dim), stream),
                     "cuMemsetD2D32Async(norm weight gradient)");
    if (shape.blocks == 0) return;  // no row: nothing to normalize (gradients were zeroed)
    auto launch_with = [&](void* arguments) {
        launch_kernel(api,
                      {kernel.function, unsigned(shape.blocks), unsigned(shape.threads),
                       shape.shared_bytes, arguments},
                      stream, programmatic, "cuLaunchKernel(rope_norm_kernel)");
    };
    if (spec.kv_cache != 0 || spec.q_fp8 != 0) {
        // With a KV cache or FP8 outputs the cache arguments follow (rope_norm_params.h).
        RopeNormCacheParams cache_params{params, rope_cache_params(p)};
        launch_with(&cache_params);
    } else {
        launch_with(&params);
    }
    stats_.launches.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace rope_jit
