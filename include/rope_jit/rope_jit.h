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
 * Features outside [o, o+R) are copied unchanged. All arithmetic is fp32 (the CPU reference
 * computes on-the-fly angles in fp64).
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

#define ROPE_JIT_STATUS_MAP(X)                                                                 \
    X(OK, 0, "success")                                                                        \
    X(ERROR_INVALID_ARGUMENT, 1, "invalid argument")                                           \
    X(ERROR_UNSUPPORTED, 2, "valid but unsupported combination of arguments")                  \
    X(ERROR_BACKEND_UNAVAILABLE, 3, "the requested backend is not available on this machine")  \
    X(ERROR_OUT_OF_MEMORY, 4, "out of host or device memory")                                  \
    X(ERROR_COMPILE, 5, "kernel compilation failed")                                           \
    X(ERROR_CUDA, 6, "a CUDA driver call failed")                                              \
    X(ERROR_CACHE, 7, "the kernel cache could not be used")                                    \
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

/* Which two features of a head form a rotated pair (see "RoPE in brief" above). */
typedef enum rope_jit_style {
    ROPE_JIT_STYLE_HALF = 0,        /* (x[o+i], x[o+i+R/2]): GPT-NeoX, Llama, HF, Unsloth */
    ROPE_JIT_STYLE_INTERLEAVED = 1  /* (x[o+2i], x[o+2i+1]): GPT-J, rotary-embedding-torch */
} rope_jit_style;

/* ========================================================================================
 * Runtime configuration
 * ======================================================================================== */

typedef struct rope_jit_config {
    /* sizeof(rope_jit_config) as the caller compiled it. Set by rope_jit_config_init. */
    size_t struct_size;
    /* Where work runs. Default ROPE_JIT_BACKEND_AUTO. */
    rope_jit_backend_kind backend;
    /* Root of the on-disk kernel cache, or NULL for the default: $ROPE_JIT_CACHE_DIR, else
     * $XDG_CACHE_HOME/rope_jit, else ~/.cache/rope_jit. The string is copied. */
    const char* cache_dir;
    /* 1 (default): read and write the disk cache. 0: keep compiled kernels in memory only. */
    int disk_cache;
    /* Worker threads of the CPU reference; 0 (default) = the number of hardware threads. */
    int cpu_threads;
    /* 1: on the CUDA backend, check positions against the table size on the device before
     * every call (slower; for debugging). The CPU backend always checks. Default 0. */
    int debug_checks;
} rope_jit_config;

/* Fills *config with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_config_init(rope_jit_config* config);

/* ========================================================================================
 * RoPE arguments
 *
 * Tensors are DLPack DLTensors: data, device, dtype, shape and strides in elements (strides
 * NULL = C-contiguous); byte_offset is honoured. Nothing is copied, whatever the strides.
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
 *                   column 2i for STYLE_INTERLEAVED); float32, float16 or bfloat16
 *   xpos_scale      like cos (same shape)
 *   inv_freq        [R/2] float; angle of pair i at position p is p * inv_freq[i]
 *   positions       [S] or [B, S] ([T] when packed), int32 or int64
 *   seqlen_offsets  [B], int32 or int64
 *   cu_seqlens      [B+1], int32 or int64, cu_seqlens[0] = 0, non-decreasing,
 *                   cu_seqlens[B] = T
 *
 * The table row p of a token (batch b, index s in its sequence) is, in this order:
 *   1. positions[b, s] (positions[s] if positions is [S]; positions[t] when packed);
 *   2. else s + seqlen_offsets[b];
 *   3. else s + position_offset (+ q_position_offset for q only).
 * Every p must lie in [0, P) (or be >= 0 with inv_freq); otherwise the call fails with
 * ERROR_INVALID_ARGUMENT and writes nothing (checked fully on the CPU backend; on the CUDA
 * backend with rope_jit_config.debug_checks).
 *
 * dtypes: q, k, q_out and k_out share one dtype: float32, float16 or bfloat16.
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
     * may be the very same view as its input (in place); one that overlaps its input any
     * other way is rejected. */
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

    /* Added to the implicit position of every token of q and k. Default 0. */
    int64_t position_offset;
    /* Added, for q only, on top of position_offset to implicit positions: queries that follow
     * cached keys (q has the last Sq of Sk tokens: q_position_offset = Sk - Sq). Default 0. */
    int64_t q_position_offset;

    /* Number of rotated features R; 0 (default) = head_dim. Even, and
     * rotary_offset + rotary_dim <= head_dim. */
    int32_t rotary_dim;
    /* First rotated feature o. Default 0. */
    int32_t rotary_offset;
    /* Pair style. Default ROPE_JIT_STYLE_HALF. */
    rope_jit_style style;
    /* 1: apply the inverse rotation (the backward pass: q and k hold gradients). Default 0. */
    int backward;

    /* xPos scales, or NULL (default) for none: the rotated pair of table row p and pair i is
     * multiplied by xpos_scale[p, col(i)] for q and divided by it for k (also in backward). */
    const DLTensor* xpos_scale;

    /* The CUstream to launch on (CUDA backend); NULL = the legacy default stream. Ignored by
     * the CPU backend. The call never synchronizes it. */
    void* stream;
} rope_jit_rope_args;

/* Fills *args with the defaults above (every tensor NULL) and sets struct_size. NULL is
 * ignored. */
ROPE_JIT_API void rope_jit_rope_args_init(rope_jit_rope_args* args);

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
    ROPE_JIT_POSITIONS_IMPLICIT = 0,       /* s + position_offset */
    ROPE_JIT_POSITIONS_INDICES = 1,        /* a positions tensor (HAS_ROPE_INDICES) */
    ROPE_JIT_POSITIONS_SEQLEN_OFFSETS = 2  /* s + seqlen_offsets[b] */
} rope_jit_position_mode;

/* Where the angles come from. */
typedef enum rope_jit_angle_source {
    ROPE_JIT_ANGLES_TABLE_HALF = 0,  /* cos/sin [P, R/2] */
    ROPE_JIT_ANGLES_TABLE_FULL = 1,  /* cos/sin [P, R] */
    ROPE_JIT_ANGLES_INV_FREQ = 2     /* computed from inv_freq [R/2] */
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
    /* First rotated feature. Default 0. */
    int32_t rotary_offset;
    /* Default ROPE_JIT_STYLE_HALF. */
    rope_jit_style style;
    /* 1: backward (inverse rotation). Default 0. */
    int backward;
    /* 1: q and k in one launch. Default 1. */
    int has_k;
    /* Hq / Hk with k. Default 1. */
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
} rope_jit_kernel_spec;

/* Fills *spec with the defaults above and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_kernel_spec_init(rope_jit_kernel_spec* spec);

/* Counters of one runtime since its creation. */
typedef struct rope_jit_stats {
    /* sizeof(rope_jit_stats) as the caller compiled it. Set by rope_jit_stats_init. */
    size_t struct_size;
    uint64_t memory_hits;  /* launches whose kernel was already loaded */
    uint64_t disk_hits;    /* kernels read from the disk cache instead of compiled */
    uint64_t compiles;     /* kernels compiled with NVRTC */
    double compile_ms;     /* total wall time of those compiles, milliseconds */
    uint64_t disk_writes;  /* cache entries written */
    uint64_t launches;     /* kernels launched */
} rope_jit_stats;

/* Zeroes *stats and sets struct_size. NULL is ignored. */
ROPE_JIT_API void rope_jit_stats_init(rope_jit_stats* stats);

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

/* Compiles the kernels of specs[0..n) for `target` ("sm_80", "sm_90"; NULL = the
 * architecture of CUDA device 0) and stores them in the runtime's disk cache, so that later
 * processes load them without compiling. Needs NVRTC, not a GPU: it works on any backend.
 * Specs already in the cache are not compiled again. Fails on the first bad spec
 * (ERROR_INVALID_ARGUMENT, naming its index) or compile error (ERROR_COMPILE, with the NVRTC
 * log); ERROR_BACKEND_UNAVAILABLE without NVRTC, or with target NULL and no GPU. */
ROPE_JIT_API rope_jit_status rope_jit_prewarm(rope_jit_runtime* runtime, const rope_jit_kernel_spec* specs,
                                              size_t n, const char* target);

/* Copies the runtime's counters into *stats (up to stats->struct_size bytes). */
ROPE_JIT_API rope_jit_status rope_jit_get_stats(const rope_jit_runtime* runtime, rope_jit_stats* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ROPE_JIT_H */
