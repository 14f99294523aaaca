// Run-time arguments of the rope kernel, passed by value as its single parameter, and its
// launch plan: what the kernel's specialization implies for its work items, angle sets, row
// sets and shared memory (rope_plan), and how the host sizes its blocks (rope_block_fit). This
// file is compiled twice: into the host launcher (src/ops/rope/rope_cuda.cpp, through
// rope_plan.h) and, embedded, into every kernel by NVRTC, so the two sides cannot disagree on
// any of it. Plain C++ only: the kernels compile without any toolkit header.
#ifndef ROPE_JIT_ROPE_PARAMS_H
#define ROPE_JIT_ROPE_PARAMS_H

#include "host_device.h"
#include "row_divisor.h"

struct RopeKernelParams {
    // q, k and their outputs as [B, H, S, D] views; strides in elements. Packed [T, H, D]
    // tensors arrive lifted to [1, H, T, D].
    const void* q;
    void* q_out;
    const void* k;
    void* k_out;
    long long q_stride[4];
    long long q_out_stride[4];
    long long k_stride[4];
    long long k_out_stride[4];

    // Angle sources: cos/sin tables [P, C], or inv_freq [R/2]; xPos scales like the tables.
    const void* cos;
    const void* sin;
    const void* inv_freq;
    const void* xpos;
    long long cos_stride[2];
    long long sin_stride[2];
    long long xpos_stride[2];
    long long inv_freq_stride;

    // Position sources. positions is [B, S] or [S] (batch stride 0) or, packed, [T].
    const void* positions;
    long long positions_stride[2];
    const void* seqlen_offsets;
    long long seqlen_offsets_stride;
    const void* cu_seqlens;
    long long cu_seqlens_stride;

    long long batch;
    long long seqlen_q;
    long long seqlen_k;
    long long seqlen_max;  // RopeProblem::rotated_seqlen: tokens per batch row the grid covers
    long long heads_q;
    long long heads_k;
    long long num_sequences;
    long long position_offset;
    long long q_position_offset;
    long long units;  // batch * seqlen_max
    int tokens_per_block;
    // 1: one token a block, each thread resolving its own item's rows without shared memory
    // or barriers (the launcher sets it only where the plan's one_token_direct allows it; with
    // the plan's direct_entry it launches rope_direct_kernel, which takes no other path).
    unsigned char direct;
    // 1: the staged path orders a block's items (head, token, chunk) instead of (token, head,
    // chunk), so that a warp reads one head's consecutive tokens: [B, H, S, D] buffers, whose
    // rows of one token lie a head plane apart (the launcher's items_by_head). Bytes, so that
    // the flags keep the 4 bytes `direct` had and no later field moves.
    unsigned char items_by_head;
    // 1: the launch is a programmatic dependent launch (rope_jit_config.programmatic_launch):
    // the kernel's blocks may start while the grid before it finishes, so the kernels that may
    // take the direct path (rope.cu) and the QK-norm kernel fetch their argument block's lines
    // into the constant cache before they wait for it (fetch_argument_lines), where a plain
    // launch would meet the misses one after another on its critical path. A byte beside the
    // flags above: no later field moves.
    unsigned char programmatic;

    // Multi-section positions (M-RoPE): positions carry a leading axis of this stride, and
    // pair i reads axis pair_axis[i].
    long long positions_axis_stride;
    unsigned char pair_axis[256];

    // Learned frequencies (backward with inv_freq): the forward outputs, and the gradient
    // [R/2] float32 the kernel adds into (the launcher zeroes it first on the same stream).
    const void* q_saved;
    const void* k_saved;
    long long q_saved_stride[4];
    long long k_saved_stride[4];
    float* inv_freq_grad;
    long long inv_freq_grad_stride;
};

// The KV cache write and the FP8 outputs (specs with KV_CACHE or Q_FP8): a second group of
// arguments, launched after a kernel's own (WithCache below), so that the other kernels keep
// their parameter block. The k cache arrives as RopeKernelParams' k_out: a
// [blocks, Hk, slots, D] view (contiguous caches: a sequence's rows are its block).
struct RopeCacheParams {
    const void* v;  // [B, Hk, S, Dv] like k
    void* v_cache;  // [blocks, Hk, slots, Dv]
    long long v_stride[4];
    long long v_cache_stride[4];
    const void* slot_mapping;  // [tokens of k]
    long long slot_mapping_stride;
    const void* block_tables;  // [sequences, max_blocks]
    long long block_tables_stride[2];
    long long max_blocks;
    long long cache_blocks, cache_slots;
    // float32 scales of the FP8 outputs (one element each), NULL for 1.
    const float* k_scale;
    const float* v_scale;
    const float* q_scale;
};

// A kernel's own arguments followed by the cache's: the parameter block of rope.cu's and
// rope_norm.cu's kernels whose spec has a KV cache or FP8 outputs.
template <class Own>
struct WithCache {
    Own own;
    RopeCacheParams cache;
};
using RopeCacheKernelParams = WithCache<RopeKernelParams>;

// The bulk path's own arguments (rope.cu's rope_bulk_kernel, RopePlan::bulk_rows), launched
// after the kernel's RopeKernelParams (WithBulk), so that the other entries keep their parameter
// block; the flat path's too (rope_flat_kernel, RopePlan::flat_rows), which reads the rows and
// divisors, not the tiles. q's rows, then k's, each one run of dense rows in memory order, their outputs laid out
// like them; a tile is up to tile_rows consecutive rows of one tensor.
struct RopeBulkParams {
    long long q_rows, k_rows;  // (token, head) rows of q and of k (0 without k)
    long long q_tiles, tiles;  // tiles of q, and of q and k together (k's follow q's)
    int tile_rows;             // rows a tile (the last tile of each tensor may hold fewer)
    // Row order in memory: 1, a token's heads follow each other ([B, S, H, D], packed
    // [T, H, D]); 0, a head's tokens do ([B, H, S, D]).
    int heads_fastest;
    // A row's (b, s) by multiply-shift divisions (rows < 2^31): heads a token and tokens a
    // batch row, of q and of k.
    RowDivisor q_heads, q_seqlen, k_heads, k_seqlen;
};
template <class Own>
struct WithBulk {
    Own own;
    RopeBulkParams bulk;
};
using RopeBulkKernelParams = WithBulk<RopeKernelParams>;

// Where one token's v row starts in v and v_cache; -1 when the token writes nothing.
struct RopeValueBases {
    long long v_in, v_out;
};

// Where one token's rows start in q, q_out, k, k_out (element offsets of head 0); -1 when the
// token has no q (s >= Sq) or no k (s >= Sk) or lies past the end.
struct RopeTokenBases {
    long long q_in, q_out, k_in, k_out;
    long long q_saved, k_saved;  // the forward outputs (frequency gradient only)
};

// The specialization constants the plan reads (KernelSpec's fields; the preamble's
// HEAD_DIM, ROTARY_DIM, VEC...).
struct RopeShape {
    int head_dim, rotary_dim, rotary_offset, vec, mrope_axes;
    bool interleaved, proportional, has_k, in_place_q, in_place_k;
    bool k_own_angles, angles_from_inv_freq, has_xpos, table_full, freq_grad;
    int v_dim, v_vec;  // v copied into a cache (0: no v), and its access width
    bool qk_norm, backward;  // RMSNorm of each head first (QK-norm); the gradient pass
    bool kv_cache;           // k (and v) written into a KV cache
    bool q_fp8;              // q_out holds float8 e4m3fn
    bool dense_rows;         // q, k and outputs dense rows (KernelSpec::dense_rows)
};

// Work items per head of the rope kernel (ROT_ITEMS in rope.cu): interleaved, one per vector of
// `vec` features; half style, one per vector of first halves and its partner vector, or, with
// chunk_items (out-of-place partial rotary), one per output vector.
ROPE_JIT_HOST_DEVICE constexpr int rope_items_per_head(bool interleaved, bool chunk_items,
                                                       int rotary_dim, int vec) {
    return interleaved || chunk_items ? rotary_dim / vec : rotary_dim / 2 / vec;
}

// What a RopeShape implies, for the kernel and its launcher alike.
struct RopePlan {
    int pairs;           // rotation pairs: rotary_dim / 2
    int roles;           // angle sets per token: q, and k when it has its own (xPos, q offset)
    int pairs_per_item;  // pairs one work item rotates
    // An out-of-place call (q and k both) that also copies unrotated features (partial rotary).
    bool out_of_place_partial;
    // Half style out of place partial: an item per output chunk, which reads its partner chunk
    // but stores only itself (CHUNK_ITEMS in rope.cu); in place they would race.
    bool chunk_items;
    int rot_items;       // work items per head
    bool shared_angles;  // cos/sin computed once per token into shared memory (else read per item)
    int row_sets;    // table rows resolved per token: one per position axis (M-RoPE), else per role
    int table_step;  // table columns from one pair to the next
    int table_span;  // table columns one item reads
    bool copies_unrotated;  // some output (q or k) is out of place and has unrotated features
    // Work items a thread takes, measured on the H200 (bench/results/h200_kernel_tuning.json,
    // "block_fit"): two half-style items (four 16-byte loads) or eight interleaved ones (one load
    // each) at about 256 threads a block; one when the block also copies the unrotated features
    // of out-of-place partial rotary.
    int items_per_thread;
    // Items a thread loads before it rotates any, and the threads a multiprocessor the kernel's
    // launch bound keeps resident. One item in flight a thread at 1536 threads (40 registers)
    // measured best where a head's items are a power of two; where they are not (half style,
    // D80: 5, D96: 6, two items a thread) two loaded together at 1024 threads (64 registers)
    // took D80 from 0.851 to 0.913 of copy and D96 from 0.878 to 0.926, while D128 lost 0.01,
    // three or four items lost everywhere (H200, run AO; h200_kernel_tuning.json) and GPT-NeoX's
    // in-place partial rotary (3 items a head) lost 3% (run AP): full rotary only.
    int item_batch;
    int threads_per_sm;
    int shared_pairs;  // pairs of shared cos/sin per angle set (0 without shared angles)
    int grad_pairs;    // frequency-gradient sums per block (0 without)
    int problem;       // RopePlanProblem
    int v_items;       // v copies per head of k and token (0 without v)
    // One-token blocks may take the direct path (RopeKernelParams::direct): no angles shared
    // per token (inv_freq, xPos, M-RoPE), no gradient sums, no copy of unrotated features.
    bool one_token_direct;
    // v items per head of k on the direct path: two vectors each where v's vectors pair up,
    // so that a v item has as many bytes in flight as a rotation item (two 16-byte loads) and
    // its cache slot is resolved once for both.
    int v_direct_items;
    // QK-norm forwards that write a KV cache, which rope.cu takes on its direct path only (one
    // token a block, an item a thread or, with many tokens, items in rounds of a 64-thread
    // block (plan_rope_launch), a head's sum of squares a shuffle across its items' lanes), at
    // 1024 threads a multiprocessor (64 registers: at 40 the weights, loaded with
    // the item, spilled 64-112 bytes); rope_norm.cu takes the other QK-norm specs. They need
    // every feature rotated (the norm rescales every feature and the direct path copies none),
    // cos/sin spans of plain tables (one_token_direct), and a head's items a power of two up
    // to a warp, so that each head fills one aligned lane group. H200 runs CD-CE (session 19),
    // Qwen3-8B with a paged FP8 cache: decode B=64 2.90 -> 2.47 us in a graph (rope_norm.cu's
    // rows take a row at a time with a cache), prefill 0.49 -> 0.63 of copy (0.82-0.83 in
    // rounds of 64-thread blocks, session 23). Without a cache
    // rope_norm.cu's runs of 4 rows stay ahead in prefill (0.876 against 0.845 on rope.cu).
    bool norm_items;
    // The direct path has a module entry of its own (rope.cu's rope_direct_kernel), compiled
    // apart from the staged path so that its registers are allocated for it alone: specs with
    // a KV cache (their direct item loop spilled beside the staged path, Llama-3-8B with a paged
    // FP8 cache 28 bytes at 40 registers; H200 runs DA-DD, session 24, that prefill 0.898-0.905
    // -> 0.907-0.917 of copy). The others keep one entry for both paths: their direct cases
    // did not move (within 0.005, run DB), and the staged path compiled alone took more
    // registers where pairs interleave (36 against 31-32 with the direct path beside it: D64
    // [B, H, S, D] interleaved 0.827 -> 0.786, run DC).
    bool direct_entry;
    // Out-of-place partial rotary may move whole rows through shared memory with the bulk copy
    // engine (rope.cu's rope_bulk_kernel, the module's second entry; sm_90 and later): tiles of
    // consecutive dense rows are loaded by cp.async.bulk, rotated in place in shared memory and
    // stored back by one bulk store, so that the unrotated features cost no thread any
    // instruction. Specs whose items read table spans (no angles computed per token, no
    // frequency gradient, one angle set), outputs in the inputs' dtype, no KV cache; the
    // launcher takes it where the tensors' rows are dense and aligned (rope_dense_rows.h).
    // Heads of up to 128 features; the staged path keeps wider ones, whose copies keep up
    // with the bulk engine there. H200, fractions of copy, staged (copies one ahead at 128
    // features, COPIES_AHEAD in rope.cu) -> bulk, bf16 unless named: StableLM-3B 20/80 0.465
    // -> 0.843, Persimmon-8B 32/64 0.648 -> 0.878, Phi-2 32/80 0.851 -> 0.883, GPT-NeoX 24/96
    // 0.818 -> 0.928 (f32 0.914 -> 0.934) (run DH, session 26); 128 features: half style 64
    // rotated 0.815 -> 0.885, 32 rotated 0.859 -> 0.886, interleaved 32 rotated 0.867 -> 0.886
    // (runs DJ-DK); ChatGLM2-6B's interleaved 64 (8 pair items a row) 0.834-0.841 -> 0.873-0.874
    // with two items a thread in flight (run DP, session 27; with one, runs DJ-DK, it lost);
    // GPT-J 64/256 0.923 -> 0.889, Gemma-4 proportional 128/512 0.906 -> 0.887 (run DH). Full
    // rotary loses: in place (run DP) Llama-3-8B 0.94 -> 0.84-0.86, D64 0.885 -> 0.78, D64
    // [B, H, S, D] interleaved 0.825 -> 0.73, D80/D96 0.91-0.92 -> 0.84-0.85: every feature's
    // round trip through shared memory costs more than the threads' direct loads and stores.
    bool bulk_rows;
    // The bulk path's work items a row (PAIR_ITEMS in rope.cu): each rotates pairs_per_item
    // pairs in place (half style: a chunk of first halves and its partner chunk).
    int bulk_items;
    // Calls on dense rows (KernelSpec::dense_rows: which calls, and what each kind measured,
    // in rope_dense_rows.h's flat_rows_call) take the flat path (rope.cu's rope_flat_kernel,
    // the module's second entry, compiled for such specs alone; their rope_kernel is empty,
    // which halves their NVRTC time): their rows, q's then k's, walked as one array of items,
    // an item a thread, a block's items consecutive in memory, each thread finding its row's
    // (b, s) by multiply-shift divisions. Plans with table spans and no gradient sums, without
    // a KV cache, QK-norm or FP8 output, and no unrotated features to copy but those of
    // flat_copies. H200, fractions of copy, staged or direct -> flat: Llama-3-8B [B,H,S,D]
    // 0.905 -> 0.934 (run DU, session 27), [B,S,H,D] 0.932-0.941 -> 0.952-0.953 (runs DW-DX,
    // session 28). Out-of-place partial rotary takes it too (flat_copies): interleaved pairs,
    // and half style in rows of 4 or 8 vectors (flat_shuffles).
    bool flat_rows;
    // The flat path's items a row (FLAT_ITEMS in rope.cu): the rotation items, or (flat_copies)
    // every 16-byte vector of the output row, rotated (whole pairs) or copied: a copy's access
    // pattern, where the bulk path's threads wait on each tile's bulk load. H200 runs ED-EE
    // (session 29), bulk or staged -> flat, fractions of copy: ChatGLM2-6B 64/128 0.877-0.881
    // -> 0.896-0.900, interleaved 32/128 0.888-0.889 -> 0.911-0.917, GPT-J 64/256 (staged)
    // 0.924-0.926 -> 0.947-0.949. Half style lost as chunk items (each rotated vector also
    // loads its partner): Phi-2 32/80 0.880-0.886 -> 0.823-0.828, 64/128 0.885 -> 0.83,
    // Persimmon-8B 32/64 0.875-0.884 -> 0.86, Gemma-4 proportional 128/512 0.91 -> 0.81 (run
    // ED). Half style takes it by shuffles (flat_shuffles, below) in rows of 4 or 8 vectors;
    // float32, vectors under 8 elements and the other half-style rows keep the bulk or staged
    // path.
    int flat_items;
    bool flat_copies;
    // Half-style flat_copies: a rotated vector's partner comes from the lane that loaded it,
    // by warp shuffles, not from a second load (which lost: run ED above), one vector a thread
    // in straight code, every lane on one path up to the shuffle (31 registers, 8 blocks).
    // Shuffles in the item loop lost (Persimmon-8B 0.88 -> 0.70 with divergent paths, 0.86
    // uniform at 40 registers, 6 blocks; runs ER-ET, session 31). H200 run EY (session 33),
    // bulk -> shuffles, fractions of copy, three rounds: Persimmon-8B 32/64 0.876-0.880 ->
    // 0.908-0.913, but D128 64/128 (rows of 16 vectors) 0.881-0.885 -> 0.850-0.853: rows of 4
    // or 8 vectors (a row within a quarter warp) take it, longer rows keep the bulk path.
    bool flat_shuffles;
};
// The bulk path's geometry (RopePlan::bulk_rows): blocks of kRopeBulkThreads threads, each
// with kRopeBulkStages tiles of at most kRopeBulkStageBytes in shared memory (32 KiB: under the
// 48 KiB a block takes without opting in), kRopeBulkBlocksPerSm blocks a multiprocessor, a
// persistent grid of that many blocks a multiprocessor taking tiles grid-stride. The best of
// the prototype's sweep (run DF; stage 8-32 KiB, 2-6 stages, 1-4 blocks, 128 or 256 threads) on
// GPT-NeoX; Phi-2's best (8 KiB x 3, 128 threads) was 0.007 ahead of it.
enum {
    kRopeBulkThreads = 256,
    kRopeBulkStages = 2,
    kRopeBulkStageBytes = 16 * 1024,
    kRopeBulkBlocksPerSm = 4,
};
// The flat path's blocks (RopePlan::flat_rows): kRopeFlatThreads threads, at least
// kRopeFlatBlocksPerSm of them a multiprocessor (a bound of 64 registers: Llama-3-8B's
// half-style item takes 48 there, no spills; bounds of 6 and 8 blocks spilled it, 0.86 and 0.45
// of copy against 0.934; D64 interleaved takes 26 and runs the same at every bound, run DU).
// The registers the kernel takes below that bound still decide its blocks a multiprocessor, and
// with them its bytes in flight: 54 instead of 46 (4 blocks instead of 5) cost 0.025 of copy
// at every shape (run ER, session 31). tests/test_rope_register_budget.cpp keeps the measured
// kernels at their blocks.
enum {
    kRopeFlatThreads = 256,
    kRopeFlatBlocksPerSm = 4,
};
// Why a shape has no kernel. (Enumerators, not constexpr variables: NVRTC would emit those as
// globals of every module.)
enum RopePlanProblem {
    kRopePlanOk = 0,
    kRopePlanVecSplitsPairs =
        1,  // the vector width does not hold whole pairs tiling the rotary range
};

ROPE_JIT_HOST_DEVICE constexpr RopePlan rope_plan(const RopeShape& s) {
    RopePlan plan{};
    plan.pairs = s.rotary_dim / 2;
    plan.roles = s.k_own_angles ? 2 : 1;
    plan.pairs_per_item = s.interleaved ? s.vec / 2 : s.vec;
    if (plan.pairs_per_item < 1 || (s.interleaved && s.vec % 2 != 0) ||
        plan.pairs % plan.pairs_per_item != 0)
        plan.problem = kRopePlanVecSplitsPairs;
    plan.out_of_place_partial =
        s.head_dim > s.rotary_dim && !s.in_place_q && (!s.has_k || !s.in_place_k);
    plan.chunk_items = !s.interleaved && plan.out_of_place_partial;
    plan.rot_items =
        s.vec > 0 ? rope_items_per_head(s.interleaved, plan.chunk_items, s.rotary_dim, s.vec) : 0;
    plan.shared_angles = s.angles_from_inv_freq || s.has_xpos || s.mrope_axes > 0;
    plan.row_sets = s.mrope_axes > 0 ? s.mrope_axes : plan.roles;
    plan.table_step = table_column(s.table_full, s.interleaved, 1);
    plan.table_span = table_columns(s.table_full, s.interleaved, plan.pairs_per_item);
    plan.copies_unrotated =
        s.head_dim > s.rotary_dim && (!s.in_place_q || (s.has_k && !s.in_place_k));
    plan.items_per_thread = plan.out_of_place_partial ? 1 : s.interleaved ? 8 : 2;
    const bool items_power_of_two =
        plan.rot_items > 0 && (plan.rot_items & (plan.rot_items - 1)) == 0;
    // (Half style over the whole head: two items a thread, items_per_thread above.)
    plan.item_batch = !s.interleaved && s.rotary_dim == s.head_dim && !s.freq_grad &&
                              s.v_dim == 0 && !items_power_of_two
                          ? 2
                          : 1;
    plan.threads_per_sm = plan.item_batch > 1 ? 1024 : 1536;
    plan.shared_pairs = plan.shared_angles ? plan.pairs : 0;
    plan.grad_pairs = s.freq_grad ? plan.pairs : 0;
    plan.v_items = s.v_dim > 0 && s.v_vec > 0 ? s.v_dim / s.v_vec : 0;
    plan.one_token_direct = !plan.shared_angles && !s.freq_grad && !plan.copies_unrotated;
    plan.v_direct_items = s.v_vec > 1 && plan.v_items % 2 == 0 ? plan.v_items / 2 : plan.v_items;
    plan.norm_items = s.qk_norm && !s.backward && s.kv_cache && s.rotary_dim == s.head_dim &&
                      plan.one_token_direct && plan.item_batch == 1 && items_power_of_two &&
                      plan.rot_items <= 32;
    if (plan.norm_items) plan.threads_per_sm = 1024;
    plan.direct_entry = plan.one_token_direct && s.kv_cache != 0;
    plan.bulk_items = plan.pairs_per_item > 0 ? plan.pairs / plan.pairs_per_item : 0;
    // Out-of-place partial rotary on the flat path: vectors of 8 elements (16 bytes: 16-bit
    // elements) that tile the whole row, rotated ones and copied ones alike; interleaved pairs,
    // or half style in rows of 4 or 8 vectors, whose partners lie in the same warp
    // (flat_shuffles).
    const bool vectors_tile = s.vec == 8 && s.head_dim % s.vec == 0 && s.rotary_offset % s.vec == 0;
    const int row_vectors = vectors_tile ? s.head_dim / s.vec : 0;
    const bool halves_in_warp = !s.interleaved && !s.proportional &&
                                (row_vectors == 4 || row_vectors == 8) &&
                                (s.rotary_dim / 2) % s.vec == 0;
    plan.flat_copies = s.dense_rows && plan.copies_unrotated && plan.out_of_place_partial &&
                       vectors_tile && (s.interleaved || halves_in_warp);
    plan.flat_shuffles = plan.flat_copies && !s.interleaved;
    plan.flat_rows = s.dense_rows && !plan.shared_angles && !s.freq_grad &&
                     (!plan.copies_unrotated || plan.flat_copies) && !s.kv_cache && !s.qk_norm &&
                     !s.q_fp8 && s.v_dim == 0;
    plan.flat_items = plan.flat_copies && s.vec > 0 ? s.head_dim / s.vec : plan.rot_items;
    plan.bulk_rows = plan.out_of_place_partial && s.head_dim <= 128 && !plan.flat_rows &&
                     !plan.shared_angles && !s.freq_grad && plan.roles == 1 && !s.kv_cache &&
                     !s.qk_norm && !s.q_fp8 && s.v_dim == 0;
    return plan;
}

// The entries of rope.cu that have a body in a module of `plan`; the others stay in it as
// empty kernels, so that every module has the four entries the loader may ask for, and their
// source is left out of it (rope.cu's #if on the preamble's ROPE_JIT_KERNEL_*, which
// KernelSpec::preamble defines from this): NVRTC parses a discarded `if constexpr` branch and
// lowers every function it holds all the same. A flat spec's module then compiles
// rope_flat_kernel alone: Llama-3-8B's forward 95 -> 74 ms of NVRTC on a 2-core machine,
// 181 -> 148 ms (medians) on the H200 machine's host (run EJ, session 30).
struct RopeModuleKernels {
    bool rope;    // rope_kernel: the staged path, and the direct path without direct_entry
    bool direct;  // rope_direct_kernel (direct_entry)
    bool bulk;    // rope_bulk_kernel (bulk_rows)
    bool flat;    // rope_flat_kernel (flat_rows)
};
ROPE_JIT_HOST_DEVICE constexpr RopeModuleKernels rope_module_kernels(const RopePlan& plan) {
    // QK-norm specs on rope.cu (norm_items) take the direct path's own entry only.
    return {!plan.norm_items && !plan.flat_rows, plan.direct_entry, plan.bulk_rows,
            plan.flat_rows};
}

// Byte offsets of a block's shared memory: per token, cos and sin of each angle set when the
// kernel computes them once per token, the table row of each row set, and the row bases; the
// block's frequency-gradient sums; per token, its v row bases (v copied into a cache).
struct RopeSmemLayout {
    int cos, sin, rows, bases, grad;
    int bytes;
    int value_bases;
};

// Reserves `bytes` (rounded up to 16) at *at and returns their offset.
ROPE_JIT_HOST_DEVICE constexpr int rope_take(int* at, int bytes) {
    const int offset = *at;
    *at += (bytes + 15) / 16 * 16;
    return offset;
}

ROPE_JIT_HOST_DEVICE constexpr RopeSmemLayout rope_smem_layout(int tokens, int angle_sets,
                                                               int shared_pairs, int row_sets,
                                                               int grad_pairs,
                                                               bool value_bases = false) {
    RopeSmemLayout l{};
    int at = 0;
    int* const cursor = &at;
    l.cos = rope_take(cursor, tokens * angle_sets * shared_pairs * 4);
    l.sin = rope_take(cursor, tokens * angle_sets * shared_pairs * 4);
    l.rows = rope_take(cursor, tokens * row_sets * 8);
    l.bases = rope_take(cursor, tokens * static_cast<int>(sizeof(RopeTokenBases)));
    l.grad = rope_take(cursor, grad_pairs * 4);
    l.value_bases =
        rope_take(cursor, value_bases ? tokens * static_cast<int>(sizeof(RopeValueBases)) : 0);
    l.bytes = at;
    return l;
}

// The shared memory of a block of `tokens` tokens of a kernel with this plan.
ROPE_JIT_HOST_DEVICE constexpr RopeSmemLayout rope_block_smem(const RopePlan& plan, int tokens) {
    return rope_smem_layout(tokens, plan.roles, plan.shared_pairs, plan.row_sets, plan.grad_pairs,
                            plan.v_items > 0);
}

// Dynamic shared memory a launch may take without opting in.
enum { kRopeSharedLimit = 48 * 1024 };

// A launch's blocks: `tokens` consecutive tokens a block, `threads` threads, `shared_bytes` of
// dynamic shared memory, `blocks` blocks; problem says why there is no launch.
struct RopeBlockFit {
    int tokens, threads;
    long long blocks;
    int shared_bytes;
    int problem;  // RopeFitProblem
};
enum RopeFitProblem {
    kRopeFitOk = 0,
    kRopeFitSharedMemory = 1,  // one token needs more shared memory (shared_bytes) than the limit
    kRopeFitGrid = 2,          // more blocks than one launch's grid
};

// Blocks of whole tokens, sized to their items (a block of 256 threads for a token's 320 items
// ran a second, mostly idle round), halved while the grid would leave multiprocessors idle
// (under two blocks each) or the shared memory would not fit. `heads` = heads of q plus heads
// of k; units = batch * the longer of q's and k's sequences; sms = the device's
// multiprocessors; max_threads = the kernel's launch bound (BLOCK_THREADS); heads_k = heads of
// k, whose v rows (plan.v_items copies each) the same threads copy.
ROPE_JIT_HOST_DEVICE constexpr RopeBlockFit rope_block_fit(const RopePlan& plan, long long heads,
                                                           long long units, long long sms,
                                                           int max_threads, long long heads_k = 0) {
    RopeBlockFit fit{};
    long long items_per_token = heads * plan.rot_items + heads_k * plan.v_items;
    if (items_per_token < 1) items_per_token = 1;
    long long tokens = plan.items_per_thread * 256 / items_per_token;
    tokens = tokens < 1 ? 1 : tokens > 64 ? 64 : tokens;
    while (tokens > 1 && (units + tokens - 1) / tokens < 2 * sms) tokens /= 2;
    while (tokens > 1 && rope_block_smem(plan, int(tokens)).bytes > kRopeSharedLimit) tokens /= 2;
    fit.tokens = int(tokens);
    fit.shared_bytes = rope_block_smem(plan, fit.tokens).bytes;
    if (fit.shared_bytes > kRopeSharedLimit) {
        fit.problem = kRopeFitSharedMemory;
        return fit;
    }
    const long long thread_work =
        (tokens * items_per_token + plan.items_per_thread - 1) / plan.items_per_thread;
    const long long threads = (thread_work + 31) / 32 * 32;
    fit.threads = int(threads < max_threads ? threads : max_threads);
    fit.blocks = (units + tokens - 1) / tokens;
    if (fit.blocks > 0x7fffffffLL) fit.problem = kRopeFitGrid;
    return fit;
}

#endif
