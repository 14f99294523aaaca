/*
 * rope_jit.h - the public C API of rope-jit.
 *
 * rope-jit applies rotary position embeddings (RoPE) to attention queries and keys. On a
 * machine with an NVIDIA GPU it specializes a CUDA kernel for each call's fixed parameters,
 * compiles it with NVRTC, caches the binary on disk and launches it on the caller's stream;
 * without one it runs a CPU reference with the same semantics.
 *
 * This header is the whole public surface. It is plain C (C99 and C++ compatible).
 *
 * ABI promise: within one major version, statuses keep their values and meanings, functions
 * keep their signatures, and argument structs only grow at their end. Every argument struct
 * opens with `struct_size`, which its `_init` function sets, so a newer library reads an
 * older caller's struct correctly (fields past the caller's size take their defaults).
 * Each `rope_jit_X_init(p)` is a macro calling `rope_jit_X_init_sized(p, sizeof(rope_jit_X))`
 * with the size the caller was compiled with: the library writes that many bytes (its
 * defaults, zeros past its own struct) and sets struct_size to it, so a newer library, whose
 * struct is larger, never writes past the caller's. The plain `rope_jit_X_init` symbols (the
 * name in parentheses, or through dlsym) write the library's own size: for bindings that
 * pass a buffer at least that large.
 *
 * Threads: a runtime may be used by any number of threads at once. Error messages are
 * per thread (see rope_jit_last_error).
 *
 * Exceptions and aborts: none ever cross this API. Every failure is a status.
 *
 * ------------------------------------------------------------------------------------------
 * RoPE in brief
 *
 * For every token (batch b, index s within its sequence) the runtime picks a table row p
 * (its position; see rope_jit_rope_args for the rules) and rotates R/2 feature pairs of
 * every head of q (and k) by the angles of row p:
 *
 *     for i in 0 .. R/2-1:
 *         (x1, x2) = pair(i)                  # two features of the head vector x
 *         c, s     = cos[p, col(i)], sin[p, col(i)]
 *         if backward: s = -s                 # the gradient of a rotation is its inverse
 *         y1 = x1*c - x2*s
 *         y2 = x2*c + x1*s
 *
 * Pair styles, with o = rotary_offset and R = rotary_dim:
 *
 *     ROPE_JIT_STYLE_HALF (GPT-NeoX, Llama, HF rotate_half):   pair(i) = (x[o+i],  x[o+i+R/2])
 *         x: [ a0 a1 a2 a3 | b0 b1 b2 b3 ]    pairs (a0,b0) (a1,b1) (a2,b2) (a3,b3)
 *
 *     ROPE_JIT_STYLE_INTERLEAVED (GPT-J, flash-attn interleaved): pair(i) = (x[o+2i], x[o+2i+1])
 *         x: [ a0 b0 a1 b1 a2 b2 a3 b3 ]      pairs (a0,b0) (a1,b1) (a2,b2) (a3,b3)
 *
 *     ROPE_JIT_STYLE_PROPORTIONAL (Gemma-4 partial rotary): pair(i) = (x[i], x[i+D/2]),
 *     D = head_dim: half style whose partner lies head_dim/2 (not R/2) away, so that partial
 *     rotary turns the first R/2 features of each half and passes the rest through:
 *         x: [ a0 a1 n n | b0 b1 n n ]        R = 4, D = 8: pairs (a0,b0) (a1,b1)
 *     It is HF rotate_half over the whole head with the angles of pairs R/2..D/2-1 zero.
 *     rotary_offset must be 0; tables and inv_freq hold the R/2 rotated pairs only (a full
 *     table [P, R] is laid out as for STYLE_HALF).
 *
 * Features outside [o, o+R) (STYLE_PROPORTIONAL: outside the pairs) are copied unchanged. All
 * arithmetic is fp32 (the CPU reference computes on-the-fly angles in fp64).
 * ------------------------------------------------------------------------------------------
 */
#ifndef ROPE_JIT_H
#define ROPE_JIT_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ROPE_JIT_API
#else
#define ROPE_JIT_API __attribute__((visibility("default")))
#endif

/* ========================================================================================
 * Version
 * ======================================================================================== */

#define ROPE_JIT_VERSION_MAJOR 0
#define ROPE_JIT_VERSION_MINOR 1
#define ROPE_JIT_VERSION_PATCH 0
/* One number that orders versions: MAJOR*10000 + MINOR*100 + PATCH. */
#define ROPE_JIT_VERSION_NUMBER \
    (ROPE_JIT_VERSION_MAJOR * 10000 + ROPE_JIT_VERSION_MINOR * 100 + ROPE_JIT_VERSION_PATCH)

/* The ROPE_JIT_VERSION_NUMBER the library was built with (may differ from the header's when
 * the library was upgraded without recompiling the caller). */
ROPE_JIT_API unsigned rope_jit_version_number(void);

/* The library version as "MAJOR.MINOR.PATCH". Static storage; never NULL. */
ROPE_JIT_API const char* rope_jit_version_string(void);

/* ========================================================================================
 * Statuses
 *
 * One table generates the enum, the names and the messages. Values never change meaning.
 * ======================================================================================== */

#define ROPE_JIT_STATUS_MAP(X)                                                                \
    X(OK, 0, "success")                                                                       \
    X(ERROR_INVALID_ARGUMENT, 1, "invalid argument")                                          \
    X(ERROR_UNSUPPORTED, 2, "valid but unsupported combination of arguments")                 \
    X(ERROR_BACKEND_UNAVAILABLE, 3, "the requested backend is not available on this machine") \
    X(ERROR_OUT_OF_MEMORY, 4, "out of host or device memory")                                 \
    X(ERROR_COMPILE, 5, "kernel compilation failed")                                          \
    X(ERROR_CUDA, 6, "a CUDA driver call failed")                                             \
    X(ERROR_CACHE, 7, "the kernel cache could not be used")                                   \
    X(ERROR_INTERNAL, 8, "internal error (a bug in rope-jit)")

typedef enum rope_jit_status {
#define ROPE_JIT_STATUS_ENUM_(name, value, message) ROPE_JIT_##name = value,
    ROPE_JIT_STATUS_MAP(ROPE_JIT_STATUS_ENUM_)
#undef ROPE_JIT_STATUS_ENUM_
} rope_jit_status;

/* The enum name of a status without its prefix ("OK", "ERROR_INVALID_ARGUMENT"), or
 * "UNKNOWN_STATUS" for a value not in the table. Static storage; never NULL. */
ROPE_JIT_API const char* rope_jit_status_name(rope_jit_status status);

/* A one-line description of a status ("invalid argument"). Static storage; never NULL. */
ROPE_JIT_API const char* rope_jit_status_message(rope_jit_status status);

/* The detailed message of the last failed call made by the calling thread: which argument
 * was wrong and why, or the NVRTC log and options of a failed compile. "" when the thread's
 * last call succeeded or it made none. The pointer stays valid until the thread's next
 * rope_jit call. */
ROPE_JIT_API const char* rope_jit_last_error(void);

/* ========================================================================================
 * Handles and enums
 * ======================================================================================== */

/* A runtime: the backend choice, the kernel cache (memory and disk) and the CPU worker
 * threads. Opaque; create with rope_jit_runtime_create, free with rope_jit_runtime_free. */
typedef struct rope_jit_runtime rope_jit_runtime;

/* Where work runs. */
typedef enum rope_jit_backend_kind {
    /* CUDA when a CUDA device and the driver are present, else CPU. In both cases a call
     * whose tensors all live in host memory runs on the CPU reference. */
    ROPE_JIT_BACKEND_AUTO = 0,
    /* CUDA only: creating the runtime fails with ERROR_BACKEND_UNAVAILABLE without a GPU. */
    ROPE_JIT_BACKEND_CUDA = 1,
    /* The CPU reference only: tensors must be in host memory. */
    ROPE_JIT_BACKEND_CPU = 2
} rope_jit_backend_kind;

/* rope_jit_config.programmatic_launch: whether the CUDA backend launches its RoPE kernels as
 * programmatic dependent launches (see that field). */
typedef enum rope_jit_programmatic_launch {
    /* Where the GPU (compute capability 9.0 and later) and the driver (CUDA 12.3 and later,
     * which capture them into CUDA graphs as programmatic edges) take them; plain launches
     * elsewhere. The default. */
    ROPE_JIT_PROGRAMMATIC_AUTO = -1,
    /* Plain launches. */
    ROPE_JIT_PROGRAMMATIC_OFF = 0,
    /* Wherever the GPU (9.0 and later) and the driver (cuLaunchKernelEx: CUDA 12.0 and later)
     * take them (CUDA graphs describe programmatic edges from 12.3 on: AUTO leaves the drivers
     * before it out). */
    ROPE_JIT_PROGRAMMATIC_ON = 1
} rope_jit_programmatic_launch;

/* Which two features of a head form a rotated pair (see "RoPE in brief" above). */
typedef enum rope_jit_style {
    ROPE_JIT_STYLE_HALF = 0,        /* (x[o+i], x[o+i+R/2]): GPT-NeoX, Llama, HF, Unsloth */
    ROPE_JIT_STYLE_INTERLEAVED = 1, /* (x[o+2i], x[o+2i+1]): GPT-J, rotary-embedding-torch */
    /* (x[i], x[i+D/2]) for i < R/2: Gemma-4 "proportional" partial rotary. rope_jit_rope,
     * prewarm specs and the table builder take it; rope_jit_attention does not (it fails with
     * ERROR_INVALID_ARGUMENT naming style). */
    ROPE_JIT_STYLE_PROPORTIONAL = 2
} rope_jit_style;

/* Where rope_jit_rope_args.k_cache and v_cache keep a token's row (see "KV cache" there).
 * Hk = heads of k, D = head_dim (Dv = v's head_dim for v_cache). */
typedef enum rope_jit_kv_cache_layout {
    ROPE_JIT_KV_CACHE_NONE = 0,       /* no cache (default) */
    ROPE_JIT_KV_CACHE_CONTIGUOUS = 1, /* [B, S_max, Hk, D]: one row per sequence position */
    ROPE_JIT_KV_CACHE_PAGED_NHD = 2,  /* [num_blocks, block_size, Hk, D] (vLLM, FlashInfer NHD) */
    ROPE_JIT_KV_CACHE_PAGED_HND = 3   /* [num_blocks, Hk, block_size, D] (FlashInfer HND) */
} rope_jit_kv_cache_layout;

/* DLPack 1.1's type code of float8 e4m3fn (4 exponent bits, bias 7, 3 mantissa bits, no
 * infinities, NaN 0x7f/0xff, largest finite 448): DLDataType {10, 8, 1}. The DLPack header
 * this library builds against (version 0.6) predates it; PyTorch exports torch.float8_e4m3fn
 * with this code. */
#define ROPE_JIT_DLPACK_FLOAT8_E4M3FN 10

/* ========================================================================================
 * Runtime configuration
 * ======================================================================================== */

typedef struct rope_jit_config {
    /* sizeof(rope_jit_config) as the caller compiled it. Set by rope_jit_config_init. */
    size_t struct_size;
    /* Where work runs. Default ROPE_JIT_BACKEND_AUTO. */
    rope_jit_backend_kind backend;
    /* Root of the on-disk kernel cache, or NULL for the default: $ROPE_JIT_CACHE_DIR, else
     * $XDG_CACHE_HOME/rope_jit, else ~/.cache/rope_jit. The string is copied. An empty string
     * with disk_cache on is ERROR_INVALID_ARGUMENT (for no disk cache, set disk_cache = 0). */
    const char* cache_dir;
    /* 1 (default): read and write the disk cache. 0: keep compiled kernels in memory only.
     * (Here and in debug_checks and background_builds, as in C, any nonzero value is on.) */
    int disk_cache;
    /* Worker threads of the CPU reference; 0 (default) = the number of hardware threads; at
     * most 4096 (more is ERROR_INVALID_ARGUMENT). Where the system grants fewer threads, the
     * reference runs on those it got. */
    int cpu_threads;
    /* 1: on the CUDA backend, check positions against the table size on the device before
     * every call (slower; for debugging). The CPU backend always checks. Default 0. */
    int debug_checks;
    /* Size limit of the disk cache, in bytes: after each kernel it writes, the runtime removes
     * the least recently used entries (last loaded or written) of its cache format and NVRTC
     * version, in its writable root, until they fit; never the entry just written, nor temp
     * files, lock files, read-only roots or other versions' entries. A process loading an
     * entry that another evicts at that moment reads it whole or recompiles it; no call
     * fails. The runtime walks the cache for them only when its own writes since its last
     * walk could pass the limit or that walk is over a second old, so the cache may exceed
     * the limit by what other processes or runtimes wrote since its last walk, never by its
     * own writes. 0 = unbounded. -1 (default) = $ROPE_JIT_CACHE_MAX_BYTES (bytes, or with a
     * K, M, G or T suffix, powers of 1024, optionally followed by B or iB: 500M, 2GiB;
     * 0 = unbounded) when set, else 1 GiB (1073741824).
     * Other negative values, or a malformed $ROPE_JIT_CACHE_MAX_BYTES, make
     * rope_jit_runtime_create fail with ERROR_INVALID_ARGUMENT naming it. */
    int64_t cache_max_bytes;
    /* 1 (default): when the CUDA backend compiles a forward kernel (a real cache miss, not a
     * disk hit), it compiles that kernel's backward kernels on background threads (one per
     * hardware thread but the caller's, 1 to 4), starting when the forward's own compile
     * starts, so they compile side by side with it (RoPE: the same spec backward; attention,
     * for a forward that writes lse: the backward kernels of the same problem), into the
     * disk cache and kept in memory, so the first backward call finds them (or waits only
     * for what is left of them). The forward never waits for them;
     * their errors are dropped (the backward call reports its own); rope_jit_runtime_free
     * drops queued ones and waits for a running compile. 0: off. The environment variable
     * ROPE_JIT_BACKGROUND_BUILDS=0 turns it off as well (1 or empty leave it to this field;
     * any other value makes rope_jit_runtime_create fail with ERROR_INVALID_ARGUMENT naming
     * it). */
    int background_builds;
    /* A rope_jit_programmatic_launch value: whether the CUDA backend launches its RoPE
     * kernels (rope_jit_rope, with or without QK-norm, KV cache and FP8 outputs; not the
     * fused attention) as programmatic dependent launches. Such a kernel may start while the
     * kernel before it on the stream finishes, and waits for that kernel's completion and
     * memory (griddepcontrol.wait) before it reads or writes any tensor, so the results are
     * the same; what overlaps is the launch and the kernel's set-up, a few tenths of a
     * microsecond a call (1% of a 34 us prefill call, a fifth of a 2 us decode step;
     * FlashInfer's enable_pdl, TensorRT-LLM).
     * It lets the next kernel start the same way once every block of this one has begun
     * (griddepcontrol.launch_dependents; the persistent grid of out-of-place partial rotary,
     * once every block has left its loop over tiles), which matters only to a next kernel
     * launched programmatically too. Inside a CUDA graph captured from the stream the dependency
     * becomes a programmatic edge. Calls that zero a gradient output first (inv_freq_grad,
     * the norm weight gradients) launch plainly. Default ROPE_JIT_PROGRAMMATIC_AUTO. The
     * environment variable ROPE_JIT_PROGRAMMATIC_LAUNCH, when set and not empty, overrides
     * it: 1 as ROPE_JIT_PROGRAMMATIC_ON, 0 as ROPE_JIT_PROGRAMMATIC_OFF (any other value, or
     * a field value other than -1, 0 and 1, makes rope_jit_runtime_create fail with
     * ERROR_INVALID_ARGUMENT naming it). */
    int programmatic_launch;
} rope_jit_config;

/* Fills *config with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_config_init_sized(rope_jit_config* config, size_t size);
ROPE_JIT_API void(rope_jit_config_init)(rope_jit_config* config);
#define rope_jit_config_init(config) \
    rope_jit_config_init_sized((config), sizeof(rope_jit_config))

/* ========================================================================================
 * RoPE arguments
 *
 * Tensors are DLPack DLTensors: data, device, dtype, shape and strides in elements (strides
 * NULL = C-contiguous); byte_offset is honoured (for a tensor with elements, data +
 * byte_offset and every byte the strides reach from there must be an address: a sum that
 * wraps around the 64-bit address space fails with ERROR_INVALID_ARGUMENT naming the tensor).
 * Nothing is copied, whatever the strides.
 * A device type that is none of DLPack's enumerators (16, -1: read as an integer) fails with
 * ERROR_INVALID_ARGUMENT naming the tensor, in every call that takes tensors.
 * The runtime never keeps a pointer to a tensor or its data after the call returns (on the
 * CUDA backend the kernel reads and writes the data asynchronously on `stream`).
 *
 * Shapes (B batch, H heads, S tokens per sequence, D head_dim, T packed tokens, P table
 * rows, R rotary_dim):
 *   q, q_out        [B, Hq, S, D] in that logical order, any strides (a [B,S,H,D] buffer is
 *                   passed as its transposed view), or [T, Hq, D] packed (with cu_seqlens,
 *                   or alone as one sequence of T tokens)
 *   k, k_out        [B, Hk, Sk, D] or [T, Hk, D]; Hq must be a multiple of Hk (GQA/MQA)
 *   cos, sin        [P, R/2] ("half" tables: column i holds pair i) or [P, R] ("full"
 *                   tables as HF builds them: pair i in column i for STYLE_HALF, in
 *                   column 2i for STYLE_INTERLEAVED); float32, float16 or bfloat16, both
 *                   of one dtype
 *   xpos_scale      like cos (same shape)
 *   inv_freq        [R/2] float; angle of pair i at position p is p * inv_freq[i]
 *   positions       [S] or [B, S] ([T] when packed), int32 or int64; with M-RoPE
 *                   sections a leading axis [A, ...] (see mrope_sections)
 *   seqlen_offsets  [B], int32 or int64 (checked so also beside positions, which then give
 *                   the rows; with a KV cache it still places the tokens in the cache)
 *   cu_seqlens      [B+1], int32 or int64, cu_seqlens[0] = 0, non-decreasing,
 *                   cu_seqlens[B] = T
 *
 * The table row p of a token (batch b, index s in its sequence) is, in this order:
 *   1. positions[b, s] (positions[s] if positions is [S]; positions[t] when packed);
 *   2. else s + seqlen_offsets[b];
 *   3. else s + position_offset (+ q_position_offset for q only).
 * Every p must lie in [0, P) (or in [0, 2^63 - 1) with inv_freq and no xpos_scale);
 * otherwise the call fails with ERROR_INVALID_ARGUMENT and writes nothing. Implicit positions
 * (rule 3) are checked on every backend; positions, seqlen_offsets and cu_seqlens are read
 * and checked on the CPU backend (also in a call with nothing to rotate), and on the CUDA
 * backend with rope_jit_config.debug_checks (not in a call with nothing to rotate, which
 * returns before reading device memory).
 *
 * Memory: a tensor the call writes (q_out, or q when in place; k_out or k likewise) may share
 * no element with any other tensor of the call (an input it is not the same view of, the
 * other output, a table, inv_freq, an index tensor); such a call fails with
 * ERROR_INVALID_ARGUMENT naming both. Views of one buffer that interleave without touching
 * the same elements are fine: q and k as slices of a fused qkv, rotated in place. Tensors that
 * are only read may share memory freely. A written tensor must also address each of its
 * elements once, which the call checks by a sufficient test (each stride, in increasing
 * order, exceeds the span of the smaller ones): "any strides" below means any such strides,
 * and a rare layout whose elements are distinct in another way (strides 2 and 3 over
 * extents 3 and 2) is refused too, naming the tensor.
 *
 * dtypes: q, k, q_out and k_out share one dtype: float32, float16 or bfloat16; q_out may
 * instead be float8 e4m3fn (see "FP8 outputs" in rope_jit_rope_args).
 * ======================================================================================== */

typedef struct rope_jit_rope_args {
    /* sizeof(rope_jit_rope_args) as the caller compiled it. Set by rope_jit_rope_args_init. */
    size_t struct_size;

    /* Queries. Required. Rotated in place unless q_out is given. */
    const DLTensor* q;
    /* Keys, or NULL to rotate q alone. Rotated in place unless k_out is given. With implicit
     * positions (no `positions`) k may have a different S than q (cached keys). */
    const DLTensor* k;
    /* Outputs, or NULL for in place. Same shape and dtype as q (k), any strides. An output
     * may be the very same view as its input (in place); one that shares elements with its
     * input any other way, or with another tensor of the call, is rejected (see "Memory"). */
    const DLTensor* q_out;
    const DLTensor* k_out;

    /* The angle tables, both or neither. When NULL, angles are computed from inv_freq. */
    const DLTensor* cos;
    const DLTensor* sin;
    /* Inverse frequencies, used when cos and sin are NULL. Default NULL. */
    const DLTensor* inv_freq;

    /* Position sources, all optional (NULL); see the row rules above. */
    const DLTensor* positions;
    const DLTensor* seqlen_offsets;
    const DLTensor* cu_seqlens;

    /* Added to the implicit position of every token of q and k. Default 0. |value| < 2^53. */
    int64_t position_offset;
    /* Added, for q only, on top of position_offset to implicit positions: queries that follow
     * cached keys (q has the last Sq of Sk tokens: q_position_offset = Sk - Sq). Default 0.
     * |value| < 2^53. */
    int64_t q_position_offset;

    /* Number of rotated features R; 0 (default) = head_dim. Even, and
     * rotary_offset + rotary_dim <= head_dim. */
    int32_t rotary_dim;
    /* First rotated feature o. Default 0; must be 0 with ROPE_JIT_STYLE_PROPORTIONAL. */
    int32_t rotary_offset;
    /* Pair style. Default ROPE_JIT_STYLE_HALF. ROPE_JIT_STYLE_PROPORTIONAL works with every
     * other field of this struct (positions, varlen, GQA, both table formats, inv_freq, xPos,
     * M-RoPE sections, which then split its R/2 pairs, and the frequency gradient). */
    rope_jit_style style;
    /* 1: apply the inverse rotation (the backward pass: q and k hold gradients). Default 0. */
    int backward;

    /* xPos scales, or NULL (default) for none: the rotated pair of table row p and pair i is
     * multiplied by xpos_scale[p, col(i)] for q and divided by it for k (also in backward). */
    const DLTensor* xpos_scale;

    /* The CUstream to launch on (CUDA backend). It must belong to the tensors' device (else
     * ERROR_INVALID_ARGUMENT). NULL = the legacy default stream of the tensors' device: of the
     * current context when that belongs to the device, else of the device's primary context
     * (the one the CUDA runtime and PyTorch use). Ignored by the CPU backend. The call never
     * synchronizes it. A calling thread with no current context is left with the launch's
     * context current, as after a CUDA runtime call; any other current context is restored. */
    void* stream;

    /* ---- Multi-section positions (M-RoPE, axial RoPE) -----------------------------------
     *
     * Vision-language models give a token several positions (time, height, width) and let
     * each take its own share of the R/2 pairs. With A = num_mrope_sections > 0:
     *   - `positions` is required and gains a leading axis: [A, S], [A, B, S], or [A, T]
     *     when packed (int32 or int64);
     *   - pair i of token (b, s) uses table row (or inv_freq position)
     *     positions[axis(i), b, s], where axis(i) follows mrope_sections[0..A):
     *       contiguous (mrope_interleaved = 0): pairs [0, n0) read axis 0, [n0, n0+n1)
     *         axis 1, ... (Qwen2-VL / Qwen2.5-VL `mrope_section`; rotary-embedding-torch's
     *         get_axial_freqs is the case of equal sections);
     *       interleaved (mrope_interleaved = 1): axis a >= 1 takes pairs a, a+A, ...,
     *         a + A*(n_a - 1) and axis 0 the rest (Qwen3-VL; A = 3 there).
     *   Sections count pairs (not features), are >= 0 and sum to R/2. In STYLE_HALF pair i is
     *   (x[o+i], x[o+i+R/2]), so the split applies to both halves alike, exactly as Qwen2-VL's
     *   `mrope_section * 2` split of its [.., R] cos/sin. Tables and inv_freq are shared by
     *   every axis; xpos_scale is read at the pair's row too.
     * The CUDA backend takes at most 256 pairs (R <= 512) with M-RoPE. */

    /* Pairs per section, host memory, read during the call only; NULL (default) = none.
     * At most ROPE_JIT_MAX_MROPE_SECTIONS entries. */
    const int32_t* mrope_sections;
    /* Number of sections A (= position axes); 0 (default) = one position per token. */
    int32_t num_mrope_sections;
    /* 0 (default): contiguous sections; 1: interleaved sections (see above). */
    int mrope_interleaved;

    /* ---- Learned frequencies ------------------------------------------------------------
     *
     * With trainable inverse frequencies (rotary-embedding-torch learned_freq=True) the
     * backward must also give d(loss)/d(inv_freq). For pair i of a token at position p the
     * angle is t = p * inv_freq[i], and the forward output is y = scale * R(t) x (scale: the
     * xPos scale for q, its inverse for k, else 1), so dy1/dt = -y2 and dy2/dt = y1: the
     * gradient needs only the forward's *outputs*, which survive an in-place forward:
     *
     *     inv_freq_grad[i] = sum over q and k, every batch, token and head of
     *                        p_i * (g2 * y1 - g1 * y2)
     *
     * with (g1, g2) pair i of the incoming gradient (q, k of this backward call), (y1, y2)
     * pair i of the forward output (q_saved, k_saved), p_i the token's position for pair i
     * (its axis' position with M-RoPE). Valid only with backward = 1 and angles from inv_freq
     * (cos and sin NULL). */

    /* Output [R/2] float32, or NULL (default): overwritten (not accumulated into) with the
     * gradient above. The CPU backend sums in float64 in a fixed order (the same bits at any
     * cpu_threads); the CUDA backend zeroes the output on args->stream, then adds float32
     * block sums with atomics (so its last bits may vary from run to run). Must not overlap
     * any other tensor of the call. */
    const DLTensor* inv_freq_grad;
    /* The forward pass's outputs: what rope_jit_rope wrote to q_out (k_out) in the forward
     * call. Same shape and dtype as q (k), any strides; read only; must not overlap q_out
     * (k_out). Required with inv_freq_grad (k_saved when k is given); NULL (default)
     * otherwise. */
    const DLTensor* q_saved;
    const DLTensor* k_saved;

    /* ---- QK-norm: RMSNorm of each head before the rotation ------------------------------
     *
     * Qwen3, Gemma 3 and OLMo 2 normalize every head vector x of q and k over its D features
     * before rotating it. With q_norm_weight given, this call does the same:
     *
     *     n = x / sqrt(mean(x^2) + norm_eps) * w'     w' = w, or 1 + w with norm_unit_offset
     *     y = rope(n)                                 (every other field as without the norm)
     *
     * for every head of q (weights q_norm_weight) and of k (k_norm_weight). All D features are
     * normalized; features outside the rotated pairs leave as n. Arithmetic in fp32.
     *
     * Backward (backward = 1): q and k hold dL/dy and the call writes dL/dx into q_out and
     * k_out (or in place). With g = the inverse rotation of dL/dy, xh = x * r and
     * r = 1 / sqrt(mean(x^2) + norm_eps):
     *
     *     dL/dx = r * (w' * g - xh * mean(w' * g * xh))
     *     dL/dw = sum over every token and head of g * xh      (the same for 1 + w)
     *
     * which needs the forward's inputs x (q_norm_input, k_norm_input). The weight gradients
     * are optional outputs; the CPU backend sums them in float64 in a fixed order (the same
     * bits at any cpu_threads); the CUDA backend zeroes them on args->stream, then adds
     * float32 block sums with atomics, so their last bits may vary from run to run. Not
     * combinable with inv_freq_grad. The CUDA backend takes head_dim <= 3072 (<= 6144 without
     * weight gradients). */

    /* Norm weights [D] (float32, float16 or bfloat16, both of one dtype; any stride), or NULL
     * (default): no norm. k_norm_weight is required when k is given and q_norm_weight is,
     * and must be NULL otherwise. */
    const DLTensor* q_norm_weight;
    const DLTensor* k_norm_weight;
    /* The epsilon inside the square root: at most FLT_MAX, and at least FLT_MIN
     * (1.17549435e-38) once rounded to float (the CUDA kernels add it in fp32, where a
     * smaller one reads as 0 and a head of zeros would give NaN). Default 1e-6. */
    double norm_eps;
    /* 1: the weights are offsets from 1 (Gemma's (1 + w)); 0 (default): y = n * w. */
    int norm_unit_offset;
    /* Backward with norm weights: the forward's q and k as they were before the norm (same
     * shape and dtype as q and k, any strides, read only, not overlapping what the call
     * writes). Required then (k_norm_input when k is given); NULL (default) otherwise. */
    const DLTensor* q_norm_input;
    const DLTensor* k_norm_input;
    /* Backward with norm weights: outputs [D] float32 for dL/dw of q's and k's weights, or
     * NULL (default) for none; overwritten (not accumulated into), see above. Each must have
     * its own memory. k_norm_weight_grad needs k. */
    const DLTensor* q_norm_weight_grad;
    const DLTensor* k_norm_weight_grad;

    /* ---- KV cache: k and v written into a cache in the same launch (inference) ----------
     *
     * With kv_layout != ROPE_JIT_KV_CACHE_NONE the call writes, for every token of k, the
     * rotated k (all D features: the unrotated ones copied) into k_cache, and v's row (copied,
     * or quantized) into v_cache, at the token's cache slot; q is rotated as usual (in place,
     * or into q_out). k itself is only read: k_out must be NULL (the rotated k exists in the
     * cache only). Forward only (backward = 0, so no inv_freq_grad); k is required. Every
     * other field works as without a cache: positions, seqlen_offsets, cu_seqlens, GQA, the
     * three styles, partial rotary, xPos, M-RoPE, and QK-norm (q_norm_weight: the cache then
     * holds k normalized and rotated, all D features computed).
     *
     * A token's cache position pos (its index in its sequence's cache) is, in this order:
     *   seqlen_offsets[sequence] + s (s: its index in its sequence) when seqlen_offsets is
     *   given; else positions[b, s] (positions[t] when packed; not with M-RoPE sections); else
     *   s + position_offset.
     * Its slot, by layout (T: k's tokens; token t = b * Sk + s, or the packed index):
     *   CONTIGUOUS   k_cache[sequence, pos, h, :]; pos must lie in [0, S_max).
     *   PAGED_*      with slot_mapping: slot = slot_mapping[t]; a negative slot skips the token
     *                (nothing written for it, as vLLM pads); else block = slot / block_size,
     *                offset = slot % block_size, and slot < num_blocks * block_size.
     *                With block_tables: block = block_tables[sequence, pos / block_size],
     *                offset = pos % block_size; pos / block_size < max_blocks_per_seq and
     *                block in [0, num_blocks).
     *                NHD: k_cache[block, offset, h, :]; HND: k_cache[block, h, offset, :].
     * Indices out of range make the call fail with ERROR_INVALID_ARGUMENT naming the tensor
     * and the token, before anything is written, on the CPU backend (and on the CUDA backend
     * with rope_jit_config.debug_checks). Without debug checks the CUDA kernel skips a token
     * whose slot is out of range (writes nothing of its k and v; never out of bounds) and
     * reports nothing. Two tokens of one call with the same slot: the slot's contents are
     * unspecified (different threads write its parts, so it may mix the two tokens).
     *
     * Shapes and dtypes:
     *   v             [B, Hk, Sk, Dv] ([B,S,H,D] buffers as their transposed view, like k) or
     *                 packed [T, Hk, Dv]; k's dtype; any Dv >= 1 (need not be D).
     *   k_cache       by layout, with Hk heads of D features; v_cache likewise with Dv. Both
     *                 of one dtype: k's dtype or float8 e4m3fn. Any strides (the cache may be
     *                 a view of a bigger buffer, e.g. k and v halves of one tensor); each must
     *                 have distinct elements and share none with any other tensor of the call.
     *                 Paged caches of k and v have the same num_blocks and block_size.
     *   slot_mapping  [T] (T = B * Sk, or the packed T), int32 or int64.
     *   block_tables  [num_sequences, max_blocks_per_seq], int32 or int64.
     * Exactly one of slot_mapping and block_tables with the PAGED layouts, neither with
     * CONTIGUOUS. v and v_cache: both or neither (a cache of k alone). */
    rope_jit_kv_cache_layout kv_layout;
    const DLTensor* v;
    const DLTensor* k_cache;
    const DLTensor* v_cache;
    const DLTensor* slot_mapping;
    const DLTensor* block_tables;

    /* ---- FP8 outputs ---------------------------------------------------------------------
     *
     * k_cache/v_cache, and q_out, may have dtype float8 e4m3fn (ROPE_JIT_DLPACK_FLOAT8_E4M3FN).
     * Such an output stores quantize(y / scale) of each result y (the fp32 rotated value, or
     * the input value for copied features and v): the division in fp32, then round to the
     * nearest e4m3 value (ties to even), saturating: anything beyond +-448, infinities
     * included, becomes +-448; NaN becomes 0x7f. (This is what vLLM's and FlashInfer's FP8
     * caches store; the rotated value is not rounded to k's dtype first.)
     * Scales: float32 tensors of one element (any shape of numel 1, 0-dim included) on the
     * call's device (device memory on the CUDA backend, read by the kernel: a CUDA graph may
     * change them between replays), or NULL for 1.0. A scale must be finite and > 0 (it is
     * not checked: 0 gives +-448 or NaN, a negative scale flips signs). A scale is only
     * accepted for an FP8 output (k_scale and v_scale: FP8 caches; q_scale: an FP8 q_out). */
    const DLTensor* k_scale;
    const DLTensor* v_scale;
    const DLTensor* q_scale;
} rope_jit_rope_args;

/* The most sections rope_jit_rope_args.mrope_sections (and rope_jit_table_config) may have. */
#define ROPE_JIT_MAX_MROPE_SECTIONS 8

/* Fills *args with the defaults above (every tensor NULL) and sets struct_size. NULL is
 * ignored. */
ROPE_JIT_API void rope_jit_rope_args_init_sized(rope_jit_rope_args* args, size_t size);
ROPE_JIT_API void(rope_jit_rope_args_init)(rope_jit_rope_args* args);
#define rope_jit_rope_args_init(args) \
    rope_jit_rope_args_init_sized((args), sizeof(rope_jit_rope_args))

/* ========================================================================================
 * Kernel specs (for prewarming caches)
 *
 * Everything that is fixed in one compiled kernel. rope_jit_rope derives the spec of each
 * call itself; this struct lets a caller (or rope-jit-cache) compile kernels ahead of time,
 * for a GPU architecture, on any machine. A prewarmed spec is the one a call with the same
 * parameters and C-contiguous, 16-byte-aligned tensors uses.
 * ======================================================================================== */

/* Where token positions come from (see "RoPE arguments"). */
typedef enum rope_jit_position_mode {
    ROPE_JIT_POSITIONS_IMPLICIT = 0,      /* s + position_offset */
    ROPE_JIT_POSITIONS_INDICES = 1,       /* a positions tensor (HAS_ROPE_INDICES) */
    ROPE_JIT_POSITIONS_SEQLEN_OFFSETS = 2 /* s + seqlen_offsets[b] */
} rope_jit_position_mode;

/* Where the angles come from. */
typedef enum rope_jit_angle_source {
    ROPE_JIT_ANGLES_TABLE_HALF = 0, /* cos/sin [P, R/2] */
    ROPE_JIT_ANGLES_TABLE_FULL = 1, /* cos/sin [P, R] */
    ROPE_JIT_ANGLES_INV_FREQ = 2    /* computed from inv_freq [R/2] */
} rope_jit_angle_source;

typedef struct rope_jit_kernel_spec {
    /* sizeof(rope_jit_kernel_spec) as the caller compiled it. Set by rope_jit_kernel_spec_init. */
    size_t struct_size;
    /* dtype of q, k and outputs: float32 (default), float16 or bfloat16. */
    DLDataType dtype;
    /* Features per head (even). Required (default 0 is invalid). */
    int32_t head_dim;
    /* Rotated features; 0 (default) = head_dim. */
    int32_t rotary_dim;
    /* First rotated feature. Default 0 (0 with ROPE_JIT_STYLE_PROPORTIONAL). */
    int32_t rotary_offset;
    /* Default ROPE_JIT_STYLE_HALF; any of the three. */
    rope_jit_style style;
    /* 1: backward (inverse rotation). Default 0. */
    int backward;
    /* 1: q and k in one launch. Default 1. */
    int has_k;
    /* Hq / Hk with k (0: q has no heads, and k alone is rotated). Default 1. */
    int32_t gqa_group;
    /* Default ROPE_JIT_POSITIONS_IMPLICIT. */
    rope_jit_position_mode positions;
    /* dtype of positions, seqlen_offsets and cu_seqlens: int64 (default) or int32. */
    DLDataType index_dtype;
    /* 1: packed [T, H, D] tensors with cu_seqlens. Default 0. */
    int packed;
    /* Default ROPE_JIT_ANGLES_TABLE_FULL (HF-style tables). */
    rope_jit_angle_source angles;
    /* dtype of the cos/sin tables (or of inv_freq): float32 (default), float16, bfloat16. */
    DLDataType table_dtype;
    /* 1: xPos scales (of table_dtype). Default 0. */
    int xpos;
    /* 1 (default): in place; 0: separate outputs. */
    int in_place;
    /* 1: QK-norm before the rotation (rope_jit_rope_args.q_norm_weight). Default 0. */
    int qk_norm;
    /* With qk_norm: 1 for weights 1 + w (norm_unit_offset). Default 0. */
    int norm_unit_offset;
    /* With qk_norm: dtype of the norm weights. Default float32. */
    DLDataType norm_weight_dtype;
    /* With qk_norm and backward: 1 (default) when the call also computes the weight
     * gradients (q_norm_weight_grad or k_norm_weight_grad given). */
    int norm_weight_grad;
    /* KV cache write (rope_jit_rope_args.kv_layout): the layout; ROPE_JIT_KV_CACHE_NONE
     * (default) for none. NHD and HND compile to one kernel (their strides differ only). */
    rope_jit_kv_cache_layout kv_layout;
    /* With a paged layout: 1 for block_tables, 0 (default) for slot_mapping. */
    int kv_block_tables;
    /* With a cache: the float8 e4m3fn cache (0, default: the cache has q's dtype). */
    int kv_fp8;
    /* With a cache: v's head_dim; 0 (default) for no v (a cache of k alone). */
    int32_t v_head_dim;
    /* 1: q_out is float8 e4m3fn (then in_place must be 0). Default 0. */
    int q_fp8;
    /* 1: q and k (and outputs) each one dense run of rows, for the kernel that walks them as
     * one array (plain RoPE: table angles; no QK-norm, KV cache, FP8 output, xPos or
     * unrotated features to copy; for other specs it is ignored, their kernel serves every
     * layout). Calls get it with such rows either in [B, H, S, D] memory (a head's tokens next
     * to each other, more than one head and token), or in [B, S, H, D] memory (a token's heads
     * together, as C-contiguous [B, S, H, D] tensors) with 16-bit elements, the whole head
     * rotated and more than one token a sequence. Not with packed. Default 0: the kernel of
     * decode (one token), of float32 and partial rotary on [B, S, H, D] memory, and of every
     * other layout. */
    int dense_rows;
} rope_jit_kernel_spec;

/* Fills *spec with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_kernel_spec_init_sized(rope_jit_kernel_spec* spec, size_t size);
ROPE_JIT_API void(rope_jit_kernel_spec_init)(rope_jit_kernel_spec* spec);
#define rope_jit_kernel_spec_init(spec) \
    rope_jit_kernel_spec_init_sized((spec), sizeof(rope_jit_kernel_spec))

/* Counters of one runtime since its creation. */
typedef struct rope_jit_stats {
    /* sizeof(rope_jit_stats) as the caller compiled it. Set by rope_jit_stats_init. */
    size_t struct_size;
    uint64_t memory_hits; /* launches whose kernel was already loaded */
    uint64_t disk_hits;   /* kernels read from the disk cache instead of compiled */
    uint64_t compiles;    /* kernels compiled with NVRTC (one built in the background counts
                            * when a call takes it, so that compiles + disk_hits counts the
                            * kernels the calls loaded) */
    double compile_ms;    /* total wall time of those compiles, milliseconds */
    uint64_t disk_writes; /* cache entries written */
    uint64_t launches;    /* kernels launched */
    /* ---- Background builds (rope_jit_config.background_builds); later fields after them. */
    uint64_t background_builds;   /* kernels built in the background; each counts in compiles
                                   * (or disk_hits) once a call takes it */
    uint64_t background_failures; /* background builds that failed (error dropped) */
    uint64_t background_dropped;  /* background builds refused (queue full) or dropped when the
                                   * runtime was freed first */
    uint64_t attention_workspace_fallbacks; /* attention calls that ran the kernels without a
                                             * workspace because the stream-ordered allocation
                                             * failed (out of memory, or no memory pool; or
                                             * "workspace=0" in ROPE_JIT_ATTENTION_KERNELS) */
    /* ---- Where loading time goes besides compile_ms, in milliseconds of wall time: what a
     * first call in a process with a warm cache spends. Summed over the threads that did it
     * for calls and prewarms; background builds' own lookups are not counted. */
    double disk_lookup_ms; /* disk cache lookups, hits and misses (read, checks) */
    double module_load_ms; /* loading kernels into the GPU context (cuModuleLoadData, attributes;
                            * waits for the driver included) */
    /* ---- Later fields. */
    uint64_t disk_evictions; /* cache entries the size limit (cache_max_bytes) removed after
                              * this runtime's writes: ones written before may be among them */
} rope_jit_stats;

/* Zeroes *stats and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_stats_init_sized(rope_jit_stats* stats, size_t size);
ROPE_JIT_API void(rope_jit_stats_init)(rope_jit_stats* stats);
#define rope_jit_stats_init(stats) \
    rope_jit_stats_init_sized((stats), sizeof(rope_jit_stats))

/* ========================================================================================
 * Functions
 * ======================================================================================== */

/* Creates a runtime. `config` may be NULL (defaults). On success *out owns a new runtime
 * that the caller frees with rope_jit_runtime_free. Fails with ERROR_INVALID_ARGUMENT (NULL
 * out, bad config), ERROR_BACKEND_UNAVAILABLE (ROPE_JIT_BACKEND_CUDA without a usable GPU)
 * or ERROR_OUT_OF_MEMORY; *out is then set to NULL. An unusable cache directory is not an
 * error: the runtime warns once on stderr and keeps kernels in memory. */
ROPE_JIT_API rope_jit_status rope_jit_runtime_create(const rope_jit_config* config,
                                                     rope_jit_runtime** out);

/* Frees a runtime and everything it owns. NULL is a no-op. No call may be in flight on it. */
ROPE_JIT_API void rope_jit_runtime_free(rope_jit_runtime* runtime);

/* The backend this runtime runs device work on: ROPE_JIT_BACKEND_CUDA or
 * ROPE_JIT_BACKEND_CPU (never AUTO). ROPE_JIT_BACKEND_CPU for NULL. */
ROPE_JIT_API rope_jit_backend_kind rope_jit_backend(const rope_jit_runtime* runtime);

/* Applies RoPE as *args describes (see "RoPE arguments"). On the CPU backend the work is
 * done when the call returns; on the CUDA backend it is enqueued on args->stream. On any
 * failure nothing has been written. Thread-safe. */
ROPE_JIT_API rope_jit_status rope_jit_rope(rope_jit_runtime* runtime,
                                           const rope_jit_rope_args* args);

/* The most dims a tensor given to rope_jit_tensors_share_memory or
 * rope_jit_tensor_has_distinct_elements may have: a binding asks them of the memory under a
 * batching transform too (torch.func.vmap's view of a 4-dim q has 5 dims, one more a level). */
#define ROPE_JIT_MEMORY_QUERY_MAX_DIMS 8

/* Sets *shared to 1 when some byte of an element of a is also a byte of an element of b, else
 * 0: the rule rope_jit_rope applies to what a call writes (see "RoPE arguments"). Exact for
 * views that interleave in one buffer (q and k sliced from a fused qkv share nothing); a view
 * pair too irregular to settle within the search's bound answers 1. Empty tensors share
 * nothing; addresses are compared whatever the devices (CUDA's unified addressing gives no
 * two devices one address). For bindings that write a call's results themselves (the Python
 * package copies an in-place result under autograd into q and k) and must refuse what
 * rope_jit_rope would. a and b are tensors of rope_jit_rope's dtypes with 1 to
 * ROPE_JIT_MEMORY_QUERY_MAX_DIMS dims; ERROR_INVALID_ARGUMENT, naming it, for a malformed one
 * or a NULL argument, and *shared is then 0. Touches no memory of either tensor; needs no
 * runtime. */
ROPE_JIT_API rope_jit_status rope_jit_tensors_share_memory(const DLTensor* a, const DLTensor* b,
                                                           int* shared);

/* Sets *distinct to 1 when no two indices of t address the same element, else 0: the rule
 * rope_jit_rope applies to each tensor it writes (see "RoPE arguments"), by the sufficient
 * test that t's strides, in increasing order of size, each exceed the span of the dimensions
 * with smaller strides (a zero stride over several indices, or overlapping strides such as an
 * as_strided view's, fails it). Empty tensors are distinct. For bindings that write a call's
 * results themselves and must refuse what rope_jit_rope would. t is a tensor of
 * rope_jit_rope's dtypes with 1 to ROPE_JIT_MEMORY_QUERY_MAX_DIMS dims;
 * ERROR_INVALID_ARGUMENT, naming it, for a malformed one or a NULL argument, and *distinct is
 * then 0. Touches no memory of t; needs no runtime. */
ROPE_JIT_API rope_jit_status rope_jit_tensor_has_distinct_elements(const DLTensor* t,
                                                                   int* distinct);

/* Compiles the kernels of specs[0..n) for `target` ("sm_80", "sm_90"; NULL = the
 * architecture of CUDA device 0) and stores them in the runtime's disk cache, so that later
 * processes load them without compiling. Compiles on one thread per hardware thread; on a
 * compile error the compiles under way finish and no new one starts. Needs NVRTC, not a
 * GPU: it works on any backend.
 * Specs already in the cache are not compiled again. The elements of specs lie
 * specs[0].struct_size bytes apart (a caller built against an older header passes its own
 * size), and each must have that struct_size. Every spec is checked before any compiles.
 * Fails on the first bad spec (ERROR_INVALID_ARGUMENT, naming its index) or the compile
 * error of the lowest-indexed spec that failed (ERROR_COMPILE, naming its index, with the
 * NVRTC log); ERROR_BACKEND_UNAVAILABLE without NVRTC, or with target NULL and no GPU. A
 * malformed target ("sm_9", "sm_90x") is ERROR_INVALID_ARGUMENT. A kernel that compiles but
 * cannot be stored (no disk cache, or its root unusable, read-only or full) is not an error:
 * it is dropped with one warning, and compiled again by the next prewarm or call that needs
 * it; rope_jit_stats tells (disk_writes does not grow with compiles), which is how
 * rope-jit-cache prewarm decides to exit 1. RoPE kernels only:
 * rope_jit_prewarm_json takes every op's specs. */
ROPE_JIT_API rope_jit_status rope_jit_prewarm(rope_jit_runtime* runtime,
                                              const rope_jit_kernel_spec* specs, size_t n,
                                              const char* target);

/* Prewarms kernels of every op from specs written as JSON, in the vocabulary the cache
 * stores and `rope-jit-cache list --json` prints (so a listed spec can be passed back
 * unchanged). `specs_json` is one spec object or an array of them; each names its "op":
 *
 *   RoPE ("op": "rope", the default): the fields of a kernel spec. Required: "head_dim".
 *     Enumerations by name: "dtype", "table_dtype", "inv_freq_dtype", "xpos_dtype":
 *     "float32" | "float16" | "bfloat16"; "direction": "forward" | "backward"; "style":
 *     "half" | "interleaved" | "proportional"; "positions": "implicit" | "indices" |
 *     "seqlen-offsets";
 *     "angles": "table-full" | "table-half" | "inv-freq". Integers: "rotary_dim" (default
 *     head_dim), "rotary_offset", "gqa_group", "mrope_axes". Booleans: "has_k" (default
 *     true), "packed", "xpos", "in_place_q" (default true), "in_place_k", "freq_grad",
 *     "positions_int64", "seqlen_offsets_int64", "cu_seqlens_int64", "k_own_angles", "qk_norm",
 *     "norm_unit_offset", "norm_weight_grad" (QK-norm; "norm_weight_dtype" names a dtype);
 *     KV cache and FP8: "kv_cache": "none" | "contiguous" | "slot-mapping" | "block-tables"
 *     (NHD and HND share a kernel), "kv_fp8", "q_fp8" (booleans), "v_head_dim" (0 = no v),
 *     and the derived "kv_index_int64", "kv_seqlen_offsets", "v_vec"; "dense_rows" (see
 *     rope_jit_kernel_spec.dense_rows; default false, unlike the other derived fields).
 *     Left out, the derived fields (index dtypes: int64 where read; in_place_k = in_place_q;
 *     "vec", "vec_loads", "copy_vec", "table_vec_loads", "norm_weight_vec_loads",
 *     "block_threads") take what a call with C-contiguous, 16-byte-aligned tensors gets; the
 *     others take rope_jit_kernel_spec_init's defaults. Example: {"head_dim": 128, "dtype":
 *     "bfloat16", "table_dtype": "bfloat16", "direction": "backward", "gqa_group": 4,
 *     "in_place_q": false}: the kernel of decode (one token a sequence) and of strided
 *     layouts. A prefill call on C-contiguous tensors (more than one token) takes the
 *     dense_rows kernel wherever its plan has the flat path (plain RoPE of 16-bit [B, S, H, D]
 *     rotated whole, and of [B, H, S, D]), so a manifest that prewarms prefill names both:
 *     "dense_rows": [false, true] (merged where the plan has no flat path).
 *   Attention ("op": "attention") describing a call: "head_dim" (required), "dtype",
 *     "table_dtype", "mask_dtype", "rotary_dim" (default head_dim; 0 = no rotation),
 *     "style", "table_full" ([P, R] tables; default false: [P, R/2]), "pos_mask", "mask"
 *     ("none" | "bool" | "additive"), "causal", "gqa_group", "write_lse" (the forward writes
 *     lse), "direction" ("forward": the forward kernel; "backward": the dq and dk/dv
 *     kernels) and "seqlen_k" (keys per sequence, default 1024; the kernel choice depends on
 *     it only through classes). Such an entry stands for the kernels a call with contiguous,
 *     16-byte-aligned tensors runs on a GPU of `target` (the tile choice of that
 *     architecture and this NVRTC).
 *   Attention with "kind" ("forward" | "backward-dq" | "backward-dkdv"): one exact kernel,
 *     every field as `list --json` prints it.
 *
 * Unknown fields, wrong types and values out of range fail with ERROR_INVALID_ARGUMENT naming
 * the entry ("json[2]") and the field, before anything is compiled; so does JSON that is not
 * valid or nests deeper than 16 levels of [ and { (a spec needs 2). `target` as for
 * rope_jit_prewarm (NULL = device 0's); a malformed target ("sm_9", "sm_90x") is
 * ERROR_INVALID_ARGUMENT. Compiles on one thread per hardware thread, the slowest kernels
 * (attention backward, then forward) first. Other failures as rope_jit_prewarm's (an error
 * names no index). */
ROPE_JIT_API rope_jit_status rope_jit_prewarm_json(rope_jit_runtime* runtime,
                                                   const char* specs_json, const char* target);

/* Called once per kernel by rope_jit_prewarm_plan: its spec as canonical JSON (every field;
 * what the cache stores) and a short description, both NUL-terminated and valid during the
 * call. Returns 0 to go on, anything else to stop. */
typedef int (*rope_jit_spec_visitor)(const char* spec_json, const char* description,
                                     void* user_data);

/* The kernels rope_jit_prewarm_json(runtime, specs_json, target) would prewarm, in order and
 * without duplicates, compiling nothing: calls visitor for each. `target` is required here.
 * Fails as rope_jit_prewarm_json does for bad JSON or a bad target, and with
 * ERROR_INVALID_ARGUMENT for a NULL argument. */
ROPE_JIT_API rope_jit_status rope_jit_prewarm_plan(const char* specs_json, const char* target,
                                                   rope_jit_spec_visitor visitor, void* user_data);

/* Copies the runtime's counters into *stats (up to stats->struct_size bytes). Fails with
 * ERROR_INVALID_ARGUMENT for a NULL argument or a struct_size that no version of the struct
 * has (under 8 bytes, or one that cuts a field in two), writing nothing. */
ROPE_JIT_API rope_jit_status rope_jit_get_stats(const rope_jit_runtime* runtime,
                                                rope_jit_stats* stats);

/* ========================================================================================
 * Attention with rotary embeddings fused in (the flash_attn_with_rotary contract)
 *
 * Softmax attention whose queries and keys are rotated as they are loaded, so rotated q and
 * k never exist in memory. Shapes (B batch, Hq/Hk heads, Sq/Sk tokens, D head_dim, P table
 * rows, R rotary_dim):
 *   q, out, dout, dq   [B, Hq, Sq, D] in that logical order, any strides
 *   k, v, dk, dv       [B, Hk, Sk, D]; Hq must be a multiple of Hk (GQA/MQA: query head h
 *                      reads kv head h / (Hq / Hk))
 *   cos, sin           [P, R/2] or [P, R] (as rope_jit_rope_args), P >= max(Sq, Sk); token s
 *                      of q and token s of k use table row s
 *   pos_mask           [N] or [B, N], N >= max(Sq, Sk), bool/uint8: token s has a position
 *                      when pos_mask[s] != 0
 *   attn_mask          [B, Sk] or [B, Sq, Sk] (a leading 1 broadcasts over the batch): bool
 *                      or uint8 (0 = masked out), or float32/float16/bfloat16 (added to the
 *                      scores; -inf masks out)
 *   lse                [B, Hq, Sq] float32
 *
 * The scores, in exact arithmetic, for query i of head h and key j of its kv head:
 *
 *     rot(x, s) = x with its first R features rotated by table row s (rope_jit_rope, style
 *                 `style`, rotary_offset 0)
 *     both(i,j) = pos_mask absent, or pos_mask[i] and pos_mask[j] both set
 *     score     = scale * (both(i,j) ? rot(q_i, i) . rot(k_j, j) : q_i . k_j)
 *               + attn_mask (additive masks)
 *     masked    = (causal and j > i) or (bool mask and attn_mask == 0)  -> score = -inf
 *     out_i     = sum_j softmax_j(score) v_j
 *     lse_i     = log(sum_j exp(score))  (natural log)
 *
 * Without cos/sin the scores are plain (no rotation): the op is ordinary attention. Causal
 * masking is top-left aligned (key j is visible to query i when j <= i, whatever Sq and Sk).
 * A query that sees no key at all gets out = 0 and lse = -inf (softmax of nothing). A NaN
 * score is not a masked one: a query with any NaN score (a NaN in q, in a key it sees, or in
 * an additive mask) gets NaN out and lse, and its gradients are NaN: its dq and the dk and dv
 * of the keys it sees (on the CUDA backend also of keys masked from it inside a tile it
 * shares with them, and a NaN in a key or value masked from a query may also make that
 * query's dq NaN when they share a tile). A NaN or infinite v of a key a query sees makes
 * its out NaN even where that key's probability underflows to 0 (0 * NaN, as in P.V).
 *
 * The backward takes each row's probabilities as exp(score - lse) from the float32 lse, as
 * FlashAttention does: a row whose every score is pushed far down by a finite additive mask
 * (-1e9, or the dtype's lowest value as HF's padding masks use: |lse| past about 1e6) gets
 * gradients from a rounded lse, off by a factor up to e^(half the float32 spacing at |lse|),
 * and Sk times too large at the lowest value. Mask such rows with -inf, or with a bool mask: a
 * row that sees no key gets zero gradients.
 *
 * Precision: q, k, v, out and the gradients share one dtype, float32, float16 or bfloat16;
 * every product is accumulated in float32. On the CUDA backend fp16/bf16 run on tensor cores
 * (sm_80 and newer, head_dim a multiple of 8 up to 256, rows 16-byte aligned with unit feature
 * stride; rotated q/k and the softmax probabilities are rounded to the input dtype before their
 * matrix products, as FlashAttention does; on sm_90, with an NVRTC of CUDA 13 or newer, the
 * forward at head_dim 56-64, 120-128 or 248-256 without pos_mask uses warpgroup matrix
 * products, compiled for sm_90a, at 56-64 and 120-128 fed by a producer warpgroup that brings
 * keys and values in by the tensor memory accelerator when the driver offers TMA (CUDA 12 or
 * newer), the keys rotated first into a workspace (see below; without one, the producers
 * rotate them in their registers, which needs cos/sin rows of 16-byte aligned whole 16-byte
 * pieces), at 248-256 by two warpgroups that load their own tiles); float32 and every other
 * case run on the CUDA cores in float32 (head_dim up to 512; sequences below 2^31 tokens). On
 * sm_90 with TMA the backward at head_dim 56-64, 120-128 or 248-256 without pos_mask runs on
 * warpgroup matrix products too: q and k are rotated once into the workspace and dq is
 * accumulated there in float32 with atomic adds (set `deterministic` for reproducible bits: the
 * mma.sync kernels then run).
 *
 * The workspace: the sm_90 kernels above need device memory of their own for the call
 * (rotated q and k, and for the backward dq's float32 accumulator and per-row values: about
 * 8 * B * Hq * Sq * D bytes for the backward, 2 * B * Hk * Sk * D for the forward;
 * rope_jit_attention_workspace_size gives the exact number, 0 where the kernels need none).
 * The caller may pass it (args->workspace, from its own allocator: the Python package passes
 * memory from PyTorch's caching allocator); without one it is allocated per call on the call's
 * stream (cuMemAllocAsync from the device's default memory pool, freed on the stream after the
 * kernels). Where the pool has no room, kernels without a workspace run instead (slower; same
 * results). A CUDA graph that captures such a call holds the allocation's alloc and free
 * nodes, so the driver allows one executable instantiation of it at a time (a caller's
 * workspace adds no node: the graph then uses that memory on every replay). The process's
 * first allocation from a device's pool sets the pool up (about 10 ms on an H200), which a
 * caller's workspace avoids: the first call on a device that allocates a workspace, unless its
 * stream is capturing, touches the pool (1 byte, freed at once) from a short-lived second
 * thread on a private stream while it loads its kernels. The CPU backend computes in float64
 * and rounds the results once; its backward is deterministic.
 *
 * Nothing is expanded or copied: masks, tables and pos_mask are read in place.
 *
 * Overlap, for the outputs below, is judged by byte ranges: each tensor covers the bytes from
 * its first element to its last, whatever lies between. Outputs interleaved in one buffer
 * without sharing an element (out and lse as views of one allocation, a packed dqkv's dq, dk
 * and dv) therefore overlap and are refused: give each its own memory.
 * ======================================================================================== */

typedef struct rope_jit_attention_args {
    /* sizeof(rope_jit_attention_args) as the caller compiled it. Set by
     * rope_jit_attention_args_init. */
    size_t struct_size;

    /* Queries, keys and values. Required. Read only. */
    const DLTensor* q;
    const DLTensor* k;
    const DLTensor* v;
    /* The attention output. Forward: required, written (must not overlap any input).
     * Backward: required, read (the forward's result). */
    const DLTensor* out;

    /* The angle tables, both or neither (NULL: no rotation). Default NULL. */
    const DLTensor* cos;
    const DLTensor* sin;
    /* Which tokens have a position, or NULL (default): all of them. Tokens without one (CLS,
     * register tokens) take part unrotated; see "both" above. Needs cos/sin. */
    const DLTensor* pos_mask;
    /* Boolean or additive mask, or NULL (default): none. */
    const DLTensor* attn_mask;

    /* 1: causal (top-left aligned). Default 0. */
    int causal;
    /* Softmax scale; 0 (default) = 1/sqrt(D). Must be finite. */
    double scale;
    /* Rotated features R (even, <= D); 0 (default) = D. Ignored without cos/sin. */
    int32_t rotary_dim;
    /* Pair style. Default ROPE_JIT_STYLE_HALF (rotary-embedding-torch uses INTERLEAVED). */
    rope_jit_style style;

    /* Log-sum-exp of every query row. Forward: optional output (NULL, the default, skips
     * it). Backward: required input (the forward's). */
    const DLTensor* lse;

    /* The CUstream to launch on (CUDA backend): as rope_jit_rope_args.stream (NULL = the
     * legacy default stream of the tensors' device). */
    void* stream;

    /* Backward only (rope_jit_attention_backward); ignored by the forward, but for one rule:
     * the forward's out, lse and workspace may not overlap those of them given that are valid
     * tensors (the caller's memory, when one args struct serves both calls), else
     * ERROR_INVALID_ARGUMENT naming both. Set them NULL in a struct reused for a forward
     * whose outputs take their memory once it is freed. */
    /* Gradient of the loss with respect to out. Required, read. */
    const DLTensor* dout;
    /* Gradients with respect to q, k and v. Required, overwritten (not accumulated into);
     * none may overlap another tensor of the call. */
    const DLTensor* dq;
    const DLTensor* dk;
    const DLTensor* dv;
    /* Backward: 1 asks for bitwise-reproducible gradients (the same inputs give the same bits
     * on every run). Default 0: the fastest kernels, which on sm_90 (the wgmma backward, see
     * above) accumulate dq with float32 atomic adds, whose order varies between runs (the
     * results differ by rounding only). A caller built against a header without this field
     * (a smaller struct_size) gets 1, as that header promised. The CPU backend is always
     * reproducible. */
    int deterministic;

    /* ---- Later fields: a caller built before them (a smaller struct_size) gets the
     * defaults, as for every field. */
    /* Device memory the call uses as its workspace (see "The workspace" above), or NULL
     * (default): the library allocates one on the stream when the call's kernels need it.
     * Forward and backward alike. Requirements, each checked before anything is enqueued:
     * - at least rope_jit_attention_workspace_size bytes for this call (forward or backward),
     *   else ERROR_INVALID_ARGUMENT naming `workspace_bytes` with both numbers;
     * - 256-byte aligned, else ERROR_INVALID_ARGUMENT naming `workspace` (checked on every
     *   backend, even where it goes unused);
     * - sharing no byte with a tensor of the call, else ERROR_INVALID_ARGUMENT naming it;
     * - when the call's kernels use it: device memory of the tensors' device, else
     *   ERROR_INVALID_ARGUMENT naming `workspace` (asked of the driver).
     * The library never frees it and
     * keeps no reference to it: it must stay valid, and be used by nothing else (another call
     * in flight included), until the call's work on its stream has finished; a CUDA graph
     * that captures the call uses it on every replay. Its contents on entry do not matter and
     * are unspecified afterwards. A call whose kernels need no workspace (size 0: the CPU
     * backend, a GPU other than sm_90, the deterministic backward...) leaves it untouched. */
    void* workspace;
    /* The bytes available at `workspace`. Default 0; must be 0 when workspace is NULL. */
    size_t workspace_bytes;
} rope_jit_attention_args;

/* Fills *args with the defaults above (every tensor NULL) and sets struct_size. NULL is
 * ignored. */
ROPE_JIT_API void rope_jit_attention_args_init_sized(rope_jit_attention_args* args, size_t size);
ROPE_JIT_API void(rope_jit_attention_args_init)(rope_jit_attention_args* args);
#define rope_jit_attention_args_init(args) \
    rope_jit_attention_args_init_sized((args), sizeof(rope_jit_attention_args))

/* Attention forward: writes args->out (and args->lse when given). On the CPU backend the work
 * is done when the call returns; on the CUDA backend it is enqueued on args->stream. Fails
 * with ERROR_INVALID_ARGUMENT (naming the argument) and writes nothing on any bad input;
 * ERROR_UNSUPPORTED for a head_dim above 512 on the CUDA backend; ERROR_OUT_OF_MEMORY where
 * the CPU backend's working memory (a float64 copy of each kv head's keys and values a
 * thread) cannot be had, also before anything is written. On the CPU backend a call with
 * nothing to compute (no query token, or no head) returns at once, whatever its other sizes
 * (a backward still zeroes dk and dv). Thread-safe. */
ROPE_JIT_API rope_jit_status rope_jit_attention(rope_jit_runtime* runtime,
                                                const rope_jit_attention_args* args);

/* Attention backward: from q, k, v, out, lse (the forward's results, same arguments) and
 * dout, writes dq, dk and dv (gradients of the loss through the rotation: dq and dk are with
 * respect to the unrotated q and k). Both backends use out and lse as passed, not recomputed:
 * the probabilities are exp(score - lse) (0 in rows whose lse is -inf) and each row's
 * dout . out is subtracted from dout . v, so another out or lse gives another result. No
 * gradient flows to attn_mask or the tables. With args->deterministic the result is bitwise
 * reproducible (see the field). Same failures as rope_jit_attention. */
ROPE_JIT_API rope_jit_status rope_jit_attention_backward(rope_jit_runtime* runtime,
                                                         const rope_jit_attention_args* args);

/* The bytes of workspace (args->workspace) that rope_jit_attention (backward = 0) or
 * rope_jit_attention_backward (backward nonzero) needs for `args`, written to *bytes: the size
 * that call would otherwise allocate, computed by the same kernel choice. 0 when its kernels
 * need none: the CPU backend, a GPU other than sm_90, the deterministic backward, an empty
 * problem, and every other case that runs the kernels without a workspace. Pass the args of
 * the call itself (every tensor the call takes; they are checked as the call checks them,
 * with the same failures, but their data is not read); args->workspace and workspace_bytes
 * are ignored. Enqueues nothing, never synchronizes and allocates no device memory, so it may
 * be called during a CUDA graph capture. The size depends on the shapes, dtypes, strides and
 * alignment of the tensors and the options, never on their contents, and on the runtime: its
 * device's kernels, its NVRTC, and ROPE_JIT_ATTENTION_KERNELS as it was when the runtime was
 * created; a size holds for calls on the runtime that gave it. ERROR_INVALID_ARGUMENT for a
 * NULL `bytes` (or anything the call would refuse); ERROR_UNSUPPORTED where the workspace
 * would pass 2^59 bytes. Thread-safe. */
ROPE_JIT_API rope_jit_status rope_jit_attention_workspace_size(
    rope_jit_runtime* runtime, const rope_jit_attention_args* args, int backward, size_t* bytes);

/* ========================================================================================
 * Frequency builders and angle tables
 *
 * What feeds rope_jit_rope: the inverse frequencies inv_freq[R/2] (pair i of a token at
 * position p turns by p * inv_freq[i]) and the attention factor that some scalings multiply
 * cos and sin by, built as HF transformers (ROPE_INIT_FUNCTIONS, rope_parameters) and
 * rotary-embedding-torch (RotaryEmbedding) define them; then cos/sin/xPos tables for a range
 * (or a list) of positions. Both run on the host, need no runtime, compute in float64 and
 * round to the output type at the end, so they are at least as exact as the float32
 * references (within a float32 ulp of the exact values; see float32_angles to reproduce a
 * reference's own rounding instead).
 * With R = rotary_dim, n = R/2 and i in [0, n):
 *
 *   HF transformers (rope_type; `dim` = R = int(head_dim * partial_rotary_factor)):
 *     DEFAULT   inv[i] = theta^(-2i/R)                                   attention 1
 *     LINEAR    DEFAULT / factor                                         attention 1
 *     DYNAMIC   DEFAULT with theta' = theta * (factor * L / M - (factor - 1))^(R / (R-2)),
 *               L = max(seq_len, M), M = max_position_embeddings          attention 1
 *     YARN      ramp_i = clamp((i - low) / (high - low), 0, 1) (high += 0.001 if equal);
 *               inv[i] = DEFAULT[i] * (ramp_i / factor + 1 - ramp_i), where
 *               low/high = max(0, floor(d(beta_fast))), min(R-1, ceil(d(beta_slow)))
 *               (floor/ceil only with truncate), d(r) = R ln(O / (2 pi r)) / (2 ln theta),
 *               O = original_max_position_embeddings;
 *               attention = attention_factor if given, else m(factor, mscale) /
 *               m(factor, mscale_all_dim) if both are non-zero, else m(factor, 1), with
 *               m(s, k) = s <= 1 ? 1 : 0.1 k ln(s) + 1
 *     LLAMA3    wavelength w = 2 pi / DEFAULT[i], O = original_max_position_embeddings:
 *               w > O / low_freq_factor:  DEFAULT / factor;  w < O / high_freq_factor:
 *               DEFAULT; otherwise (1 - a) DEFAULT / factor + a DEFAULT with
 *               a = (O / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
 *                                                                        attention 1
 *     LONGROPE  inv[i] = DEFAULT[i] / ext[i], ext = long_factor when seq_len > O, else
 *               short_factor; attention = attention_factor if given, else 1 when
 *               factor <= 1, else sqrt(1 + ln(factor) / ln(O))
 *     PROPORTIONAL (Gemma 4) inv[i] = theta^(-2i/D) / factor (factor 0 = 1), D = head_dim
 *               (0 = R), R = 2 * int(partial_rotary_factor * D / 2)  attention 1
 *               (HF appends D/2 - R/2 zero frequencies, which rotate nothing:
 *               ROPE_JIT_STYLE_PROPORTIONAL takes the R/2 pairs alone)
 *   rotary-embedding-torch (RotaryEmbedding(dim = R, freqs_for = ...)):
 *     LANG      theta' = theta * theta_rescale_factor^(R / (R-2)); inv[i] = theta'^(-2i/R)
 *     PIXEL     inv[i] = pi * (1 + i * (max_freq / 2 - 1) / (n - 1))   (torch.linspace)
 *     CONSTANT  inv[i] = 1 for i in [0, num_freqs)  (n = num_freqs; rotary_dim unused)
 *               attention 1 for all three
 *
 * "Unset" optional values are 0 (as HF's missing keys): YARN and LONGROPE take factor =
 * max_position_embeddings / O when factor is 0, and O = max_position_embeddings when O is 0.
 * ======================================================================================== */

/* The frequency recipe (HF rope_type names, then rotary-embedding-torch freqs_for names). */
typedef enum rope_jit_rope_type {
    ROPE_JIT_ROPE_TYPE_DEFAULT = 0,  /* HF "default" */
    ROPE_JIT_ROPE_TYPE_LINEAR = 1,   /* HF "linear" (position interpolation) */
    ROPE_JIT_ROPE_TYPE_DYNAMIC = 2,  /* HF "dynamic" (dynamic NTK) */
    ROPE_JIT_ROPE_TYPE_YARN = 3,     /* HF "yarn" */
    ROPE_JIT_ROPE_TYPE_LLAMA3 = 4,   /* HF "llama3" (Llama 3.1+) */
    ROPE_JIT_ROPE_TYPE_LONGROPE = 5, /* HF "longrope" (Phi-3) */
    ROPE_JIT_ROPE_TYPE_LANG = 6,     /* rotary-embedding-torch freqs_for="lang" */
    ROPE_JIT_ROPE_TYPE_PIXEL = 7,    /* rotary-embedding-torch freqs_for="pixel" */
    ROPE_JIT_ROPE_TYPE_CONSTANT = 8, /* rotary-embedding-torch freqs_for="constant" */
    ROPE_JIT_ROPE_TYPE_PROPORTIONAL = 9 /* HF "proportional" (Gemma 4's partial rotary) */
} rope_jit_rope_type;

typedef struct rope_jit_freq_config {
    /* sizeof(rope_jit_freq_config) as the caller compiled it. Set by rope_jit_freq_config_init. */
    size_t struct_size;
    /* The recipe. Default ROPE_JIT_ROPE_TYPE_DEFAULT. */
    rope_jit_rope_type rope_type;
    /* R: the rotated features (HF `dim`, rotary-embedding-torch `dim`). Even and > 0, except
     * for CONSTANT, which ignores it. Default 0 (must be set). */
    int32_t rotary_dim;
    /* The base (HF rope_theta, rotary-embedding-torch theta). > 0; YARN also needs != 1.
     * Default 10000. */
    double theta;
    /* The scaling factor of LINEAR, DYNAMIC, YARN, LLAMA3 (required, > 0) and LONGROPE
     * (optional where max_position_embeddings is given: see "unset" above). Default 0 =
     * unset. */
    double factor;
    /* HF max_position_embeddings (DYNAMIC: required; YARN, LONGROPE: see "unset" above).
     * Default 0 = unset. */
    int64_t max_position_embeddings;
    /* HF original_max_position_embeddings O (LLAMA3: required; YARN, LONGROPE: optional).
     * Default 0 = unset. */
    int64_t original_max_position_embeddings;
    /* The current sequence length (DYNAMIC, LONGROPE), as HF's `seq_len` argument; 0
     * (default) = none (DYNAMIC then uses max_position_embeddings, LONGROPE short_factor). */
    int64_t seq_len;
    /* YARN, LONGROPE: the attention factor to report; 0 (default) = derive it (see above). */
    double attention_factor;
    /* YARN: rotations bounding the ramp. 0 = the default, as in HF. Defaults 32 and 1. */
    double beta_fast;
    double beta_slow;
    /* YARN: DeepSeek's mscale and mscale_all_dim; 0 (default) = unset. */
    double mscale;
    double mscale_all_dim;
    /* YARN: 1 (default) rounds the ramp bounds outward (floor/ceil); 0 keeps them real. */
    int truncate;
    /* LLAMA3: default 1 and 4 (Llama 3.1's values). high_freq_factor > low_freq_factor > 0. */
    double low_freq_factor;
    double high_freq_factor;
    /* LONGROPE: the per-pair rescale factors [R/2], host memory, read during the call only.
     * Both required for LONGROPE, each element > 0. Default NULL. */
    const float* short_factor;
    const float* long_factor;
    /* LANG: NTK-aware rescale of theta (see above). Default 1 (none). */
    double theta_rescale_factor;
    /* PIXEL: the highest frequency, as rotary-embedding-torch's max_freq. Default 10. */
    double max_freq;
    /* CONSTANT: the number of frequencies. Default 1. */
    int32_t num_freqs;
    /* LONGROPE: the number of elements the caller holds in short_factor and long_factor, so
     * that the call can refuse lists of the wrong length instead of reading past them (a
     * binding that knows its arrays' sizes sets them). 0 (default) = not stated: the caller
     * vouches for rotary_dim / 2 elements. Otherwise it must be rotary_dim / 2, else
     * ERROR_INVALID_ARGUMENT naming the list. */
    size_t num_short_factor;
    size_t num_long_factor;
    /* PROPORTIONAL: the head_dim D whose exponents the rotated pairs take (theta^(-2i/D));
     * even and >= rotary_dim, or 0 (default) = rotary_dim. */
    int32_t head_dim;
} rope_jit_freq_config;

/* Fills *config with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_freq_config_init_sized(rope_jit_freq_config* config, size_t size);
ROPE_JIT_API void(rope_jit_freq_config_init)(rope_jit_freq_config* config);
#define rope_jit_freq_config_init(config) \
    rope_jit_freq_config_init_sized((config), sizeof(rope_jit_freq_config))

/* The most inverse frequencies (pairs) rope_jit_inv_freq computes and rope_jit_rope_tables
 * takes: 2^24, far past any model's rotary_dim / 2, so that a mistyped count is an error rather
 * than gigabytes of host memory. */
#define ROPE_JIT_MAX_FREQUENCIES (1 << 24)

/* Computes the inverse frequencies of *config into inv_freq[0..n) (float32, host memory) and,
 * when attention_factor is not NULL, the attention factor (the `attention_scaling` HF
 * multiplies cos and sin by) into *attention_factor. n must be rotary_dim / 2 (num_freqs for
 * CONSTANT), at most ROPE_JIT_MAX_FREQUENCIES. Fails with ERROR_INVALID_ARGUMENT, naming the
 * field, on a bad config or size, and where an output overlaps another or the caller's
 * short_factor or long_factor; the outputs are then untouched. Thread-safe. */
ROPE_JIT_API rope_jit_status rope_jit_inv_freq(const rope_jit_freq_config* config, float* inv_freq,
                                               size_t n, float* attention_factor);

/* How rope_jit_rope_tables lays out positions and values. Row r of every table holds, for
 * each pair i (n = num_freqs pairs):
 *
 *     t       = position of pair i at row r, divided by interpolate_factor
 *     cos     = attention_factor * cos(t * inv_freq[i])
 *     sin     = attention_factor * sin(t * inv_freq[i])
 *     xpos    = ((2i + 0.4 R) / (1.4 R)) ^ ((t - xpos_center) / xpos_scale_base),  R = 2n
 *
 * where the position is position_start + r, or positions[axis(i) * P + r] when positions
 * is given (axis(i) = 0 without sections; P = the tables' rows). Each table is [P, n] (half:
 * column i) or [P, 2n] (full: pair i in columns i and i + n for STYLE_HALF, as HF's
 * cat(freqs, freqs), and for STYLE_PROPORTIONAL; in columns 2i and 2i + 1 for
 * STYLE_INTERLEAVED, as rotary-embedding-torch's repeat), which is exactly what
 * rope_jit_rope_args reads. */
typedef struct rope_jit_table_config {
    /* sizeof(rope_jit_table_config) as the caller compiled it. Set by
     * rope_jit_table_config_init. */
    size_t struct_size;
    /* The inverse frequencies [num_freqs], host memory, read during the call only. Required. */
    const float* inv_freq;
    /* n: pairs per row. Required, in [1, ROPE_JIT_MAX_FREQUENCIES]. */
    size_t num_freqs;
    /* Position of row 0 when `positions` is NULL (row r: position_start + r). Default 0. */
    double position_start;
    /* Explicit positions, host memory, or NULL (default): [A, P] row-major float64, where A is
     * num_mrope_sections (1 without sections) and P the tables' rows. Float positions cover
     * rotary-embedding-torch's pixel grids (torch.linspace(-1, 1, steps)). */
    const double* positions;
    /* Positions are divided by it (rotary-embedding-torch interpolate_factor; HF linear scaling
     * is the same thing folded into inv_freq). > 0. Default 1. */
    double interpolate_factor;
    /* Multiplies cos and sin (HF attention_scaling from rope_jit_inv_freq). Default 1. */
    double attention_factor;
    /* Column layout of full tables. Default ROPE_JIT_STYLE_HALF (STYLE_PROPORTIONAL: the
     * same layout). */
    rope_jit_style style;
    /* Axial tables: the split of the n pairs into position axes, as in rope_jit_rope_args
     * (mrope_sections, num_mrope_sections, mrope_interleaved). Default NULL, 0, 0. With
     * sections, pair i reads axis axis(i) of `positions` (every axis reads position_start + r
     * when positions is NULL). rotary-embedding-torch's get_axial_freqs(d0, d1, ...) is the
     * table with one row per grid cell, equal sections and inv_freq repeated per axis. */
    const int32_t* mrope_sections;
    int32_t num_mrope_sections;
    int mrope_interleaved;
    /* 1: round t and t * inv_freq[i] to float32 before taking cos/sin, as PyTorch-based
     * references do (HF, rotary-embedding-torch), to reproduce their tables to the last bits
     * at large angles; 0 (default): exact float64 angles. */
    int float32_angles;
    /* xPos: the decay length (rotary-embedding-torch xpos_scale_base). > 0. Default 512. */
    double xpos_scale_base;
    /* xPos: the position whose scale is 1. rotary-embedding-torch uses seq_len // 2 for a table
     * of seq_len rows from position 0 (before interpolate_factor divides t). Default 0. */
    double xpos_center;
    /* The number of doubles the caller holds in `positions`, so that the call can refuse a
     * list shorter than the tables instead of reading past it (a binding that knows the
     * array's size sets it). 0 (default) = not stated: the caller vouches for A * P. Otherwise
     * it must be at least A * P, else ERROR_INVALID_ARGUMENT naming positions. */
    size_t num_positions;
} rope_jit_table_config;

/* Fills *config with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_table_config_init_sized(rope_jit_table_config* config, size_t size);
ROPE_JIT_API void(rope_jit_table_config_init)(rope_jit_table_config* config);
#define rope_jit_table_config_init(config) \
    rope_jit_table_config_init_sized((config), sizeof(rope_jit_table_config))

/* Fills the tables of *config: cos, sin and xpos_scale, each optional (NULL) but not all
 * three. Each is a 2-D [P, n] or [P, 2n] tensor in host-accessible memory (kDLCPU,
 * kDLCUDAHost or kDLCUDAManaged; copy to the GPU yourself), float32, float16 or bfloat16,
 * with strides that keep its elements distinct; all given tables have the same P (P = 0 is a
 * no-op) and share no memory with each other, config->inv_freq, config->positions (read
 * while the tables are written) or config->mrope_sections. Values are computed in float64
 * and rounded to float32 (then to float16/bfloat16 for those tables, as a float32
 * table converted with PyTorch's .to() would be). Fails with ERROR_INVALID_ARGUMENT
 * (naming the argument) on bad input, writing nothing. Thread-safe. */
ROPE_JIT_API rope_jit_status rope_jit_rope_tables(const rope_jit_table_config* config,
                                                  const DLTensor* cos, const DLTensor* sin,
                                                  const DLTensor* xpos_scale);

/* ========================================================================================
 * Diagnostics and cache maintenance (what rope-jit-cache uses)
 *
 * The disk cache lives under one root directory (rope_jit_config.cache_dir):
 *   <root>/v<format>/nvrtc<MAJOR.MINOR>/<target>/<2 hex>/<key>.cubin (or .ptx)
 * Each file is one kernel with a checked header (its cubin or PTX at most 64 MiB; a larger
 * or malformed file is judged by its first bytes, never read whole). Writers publish files
 * by rename, readers never lock, and a damaged file, or one whose stored spec is not the
 * kernel asked for, is set aside and recompiled, so the functions below may run while other
 * processes use the same cache. Only trusted files are loaded: owned by the caller or root,
 * writable by no one else, below directories owned by the caller or root that no one else
 * can write (above the root: only with the sticky bit, as /tmp). Only names of the cache's
 * layout are reported or removed: anything else under a root given by mistake is left alone.
 * ======================================================================================== */

/* Sets *version to "MAJOR.MINOR" of the NVRTC library kernels are compiled with ("13.0";
 * static storage), loading NVRTC on the first call unless the NVRTC identity memo of the
 * default cache root still describes that library (README, Cold start). Fails with
 * ERROR_BACKEND_UNAVAILABLE when no usable NVRTC is found (rope_jit_last_error() lists every
 * library tried); *version is then "". ERROR_INVALID_ARGUMENT for a NULL version. */
ROPE_JIT_API rope_jit_status rope_jit_nvrtc_version(const char** version);

/* One CUDA device as the runtime sees it. */
typedef struct rope_jit_device_info {
    /* sizeof(rope_jit_device_info) as the caller compiled it. Set by rope_jit_device_info_init. */
    size_t struct_size;
    /* The device's name ("NVIDIA H200"), NUL-terminated, cut to fit. */
    char name[256];
    /* The compile target of the device ("sm_90"), NUL-terminated: what rope_jit_prewarm
     * compiles for when asked for this device's architecture. */
    char target[32];
} rope_jit_device_info;

/* Zeroes *info and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_device_info_init_sized(rope_jit_device_info* info, size_t size);
ROPE_JIT_API void(rope_jit_device_info_init)(rope_jit_device_info* info);
#define rope_jit_device_info_init(info) \
    rope_jit_device_info_init_sized((info), sizeof(rope_jit_device_info))

/* The number of CUDA devices the runtime launches on: 0 on the CPU backend and for NULL. */
ROPE_JIT_API int rope_jit_device_count(const rope_jit_runtime* runtime);

/* Fills *info (up to info->struct_size bytes) for device `ordinal` in [0, count). Fails with
 * ERROR_INVALID_ARGUMENT for a NULL runtime or info, an uninitialized info, or an ordinal out
 * of range (any ordinal on the CPU backend). */
ROPE_JIT_API rope_jit_status rope_jit_device_describe(const rope_jit_runtime* runtime, int ordinal,
                                                      rope_jit_device_info* info);

/* The root directory of the runtime's disk cache, as configured (rope_jit_config.cache_dir,
 * else the default, which may not exist yet); "" when the runtime keeps kernels in memory
 * only (disk_cache = 0, or no directory could be derived) and for NULL. Owned by the
 * runtime, valid until it is freed. */
ROPE_JIT_API const char* rope_jit_cache_root(const rope_jit_runtime* runtime);

/* Checks that the runtime can write its disk cache, creating the root and <root>/v1 (mode
 * 0700) when they are missing: both must be directories owned by this user that no one else
 * can write (no group or world write bit, sticky or not: others could plant kernels), every
 * directory above the root owned by this user or root and writable by others only with the
 * sticky bit, and writable.
 * ROPE_JIT_OK when so; ERROR_CACHE when not, or when the runtime has no disk cache, with the
 * reason in rope_jit_last_error(). A runtime whose cache fails this check still works: it
 * keeps kernels in memory and warns once. ERROR_INVALID_ARGUMENT for NULL. */
ROPE_JIT_API rope_jit_status rope_jit_cache_check(const rope_jit_runtime* runtime);

/* What a path found in the cache is. */
typedef enum rope_jit_cache_item_state {
    /* A valid entry that this library loads. */
    ROPE_JIT_CACHE_ITEM_OK = 0,
    /* A valid entry that this library never loads: built by another NVRTC version, in
     * another cache format (a whole "v<N>" directory is one item), or by another rope-jit
     * build whose templates or compile options differ. Dead weight after an upgrade. */
    ROPE_JIT_CACHE_ITEM_STALE = 1,
    /* Placed like an entry but fails a check (truncated, checksum, key echo, empty, not a
     * regular file, a stored spec that is not a JSON object of at most 16 levels...). A call
     * that needs it sets it aside with a warning and recompiles. */
    ROPE_JIT_CACHE_ITEM_DAMAGED = 2,
    /* A temp file: a write in progress, or one that a killed process left behind. */
    ROPE_JIT_CACHE_ITEM_TEMP = 3,
    /* A damaged entry that an earlier call renamed out of the way ("<entry>.bad-<pid>-<n>"). */
    ROPE_JIT_CACHE_ITEM_SET_ASIDE = 4,
    /* A file or directory named like part of the cache's layout but in the wrong place: an
     * entry in another key's prefix directory, a file in place of a layout directory, or a
     * directory that cannot be listed. (Names that are not the cache's are never reported.) */
    ROPE_JIT_CACHE_ITEM_STRAY = 5,
    /* An entry that is not trusted, and so never loaded: owned by a user other than the
     * caller and root, writable by others, or below a directory that another user owns or
     * that others can write (see "Security" in the README). */
    ROPE_JIT_CACHE_ITEM_UNTRUSTED = 6
} rope_jit_cache_item_state;

/* One item of the cache, as rope_jit_cache_walk reports it. Every string is NUL-terminated,
 * never NULL, and valid only during the visitor call that receives the item. */
typedef struct rope_jit_cache_item {
    size_t struct_size; /* sizeof(rope_jit_cache_item) of this library */
    rope_jit_cache_item_state state;
    const char* path;          /* the file or directory, starting with the cache root */
    const char* problem;       /* why it is not OK, one line; "" when OK */
    const char* key;           /* 64 hex chars, from the file name; "" when not entry-shaped */
    const char* nvrtc_version; /* "13.0", from the path; "" when not entry-shaped */
    const char*
        target; /* "sm_90" (wgmma attention: "sm_90a"), from the path; "" if not entry-shaped */
    const char* kind;       /* "cubin" or "ptx"; "" when not entry-shaped */
    const char* spec_json;  /* the kernel spec stored in the entry (OK and STALE); else "" */
    const char* spec;       /* that spec in a few words ("rope bf16 fwd D128 ..."); or "" */
    uint64_t bytes;         /* size on disk; a directory counts every file below it */
    uint64_t payload_bytes; /* the cubin or PTX inside an OK or STALE entry; else 0 */
    int64_t modified;       /* last modification, seconds since the Unix epoch */
    int64_t accessed;       /* the later of last access and modification (how recent the
                                * access time is depends on the file system's atime policy) */
} rope_jit_cache_item;

/* Called once per item; returns 0 to go on, anything else to stop the walk. */
typedef int (*rope_jit_cache_visitor)(const rope_jit_cache_item* item, void* user_data);

/* Calls visitor(item, user_data) for every item under the runtime's cache root, in path
 * order: the entries of the current format with their state judged against this library
 * (files of other NVRTC versions included), each other "v<N>" directory whose tree holds only
 * names of the cache layout as one STALE item, temp files, set-aside files and layout names
 * out of place inside those directories (a directory there that cannot be listed is a STRAY
 * item saying why). Names the cache never writes are not reported, nor directories holding
 * anything under names the cache gives files (an entry, temp or set-aside name: the cache
 * never writes such a directory; an empty one is reported by its name, an entry's as
 * DAMAGED), nor is the rest of the
 * root: the empty compile lock files of <root>/locks, which processes compiling into the
 * cache hold while they compile (never removed, so that all of them always lock the same
 * files), and anything that is not the cache's. Reads only; changes nothing. Without
 * NVRTC the NVRTC version and key of an entry cannot be judged, and valid entries are
 * reported OK. A missing root has no items (ROPE_JIT_OK). Fails with ERROR_INVALID_ARGUMENT
 * for a NULL runtime or visitor, ERROR_CACHE when the runtime has no disk cache or its root
 * is not a directory or cannot be listed, and when an entry or directory cannot be opened
 * for a reason of the moment (no file descriptor or memory to spare): then no item is
 * reported, rather than a good entry as damaged. */
ROPE_JIT_API rope_jit_status rope_jit_cache_walk(const rope_jit_runtime* runtime,
                                                 rope_jit_cache_visitor visitor, void* user_data);

/* Removes one item that rope_jit_cache_walk reported (its `path`): a file, or a directory
 * with everything in it (symbolic links are removed, never followed). Safe while other
 * processes use the cache: at worst one of them recompiles a kernel. An item that is already
 * gone is no error (rope_jit_cache_remove_counted tells what this call removed). Fails with
 * ERROR_INVALID_ARGUMENT for a path that is not provably the cache's (a name the cache does
 * not write at that depth of a "v<N>" directory of the cache root, a directory holding such
 * names, or a directory under a name the cache gives files, which the cache never writes,
 * holding anything) or has ".", ".." or a symbolic link on the way, and with ERROR_CACHE
 * when the root is not writable by this user (see rope_jit_cache_check), the runtime has no
 * disk cache, a directory to remove cannot be listed, or the removal fails. */
ROPE_JIT_API rope_jit_status rope_jit_cache_remove(const rope_jit_runtime* runtime,
                                                   const char* path);

/* rope_jit_cache_remove, telling what this call removed: *removed_entries (files, links and
 * directories) and *removed_bytes (the files' sizes), each optional (NULL). Both are 0 for an
 * item that was already gone, so processes pruning one cache at once count every removal
 * once between them. On failure they tell what the call removed before it failed (a
 * directory emptied in part), which is 0 for a refused path. */
ROPE_JIT_API rope_jit_status rope_jit_cache_remove_counted(const rope_jit_runtime* runtime,
                                                           const char* path,
                                                           uint64_t* removed_entries,
                                                           uint64_t* removed_bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROPE_JIT_H */
