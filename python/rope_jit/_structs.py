"""ctypes mirrors of the C structs in include/rope_jit/rope_jit.h and <dlpack/dlpack.h> (0.6).

Each class lists its fields in the header's order with the header's C types; the header is the
source of truth. The tests check every mirror's size against the struct_size that the library's
own _init function writes, so a drifted mirror fails loudly instead of corrupting a call.
"""

import ctypes
import struct

# ------------------------------------------------------------------------------------------
# DLPack 0.6
# ------------------------------------------------------------------------------------------

KDL_CPU = 1
KDL_CUDA = 2

KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4
# DLPack 0.8 added kDLBool; producers that know it (recent PyTorch) export bool with it. The
# library is built against 0.6, whose convention for bool is one-byte unsigned integers.
KDL_BOOL = 6
# DLPack 1.1's float8 e4m3fn (ROPE_JIT_DLPACK_FLOAT8_E4M3FN): FP8 KV caches and q_out.
KDL_FLOAT8_E4M3FN = 10


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements; NULL = C-contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    # The deleter is kept as a plain pointer: this package never calls it (the capsule's
    # destructor does, see tensors.py).
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    # DLPack 1.0's capsule ("dltensor_versioned"): the same tensor after a version and flags
    # (bit 0: read-only memory).
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


DLPACK_FLAG_READ_ONLY = 1
DLPACK_MAJOR_VERSION = 1

DLTensorPointer = ctypes.POINTER(DLTensor)

# Writes an address (an int) into a pointer field of a ctypes struct in place:
# POINTER_FIELD.pack_into(args, RopeArgs.q.offset, tensor.address). A fifth of the cost of
# making a ctypes pointer object and assigning it (per tensor, per call). The field keeps no
# reference to the pointee: the caller keeps it alive until the C call returns.
POINTER_FIELD = struct.Struct("@P")

# ------------------------------------------------------------------------------------------
# rope_jit.h
# ------------------------------------------------------------------------------------------

# rope_jit_backend_kind
BACKEND_AUTO = 0
BACKEND_CUDA = 1
BACKEND_CPU = 2

# rope_jit_programmatic_launch
PROGRAMMATIC_AUTO = -1
PROGRAMMATIC_OFF = 0
PROGRAMMATIC_ON = 1

# rope_jit_style
STYLE_HALF = 0
STYLE_INTERLEAVED = 1
STYLE_PROPORTIONAL = 2

# rope_jit_position_mode
POSITIONS_IMPLICIT = 0
POSITIONS_INDICES = 1
POSITIONS_SEQLEN_OFFSETS = 2

# rope_jit_angle_source
ANGLES_TABLE_HALF = 0
ANGLES_TABLE_FULL = 1
ANGLES_INV_FREQ = 2

# C enums are ints on every ABI this package runs on.
_enum = ctypes.c_int


class Config(ctypes.Structure):
    """rope_jit_config."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", _enum),
        ("cache_dir", ctypes.c_char_p),
        ("disk_cache", ctypes.c_int),
        ("cpu_threads", ctypes.c_int),
        ("debug_checks", ctypes.c_int),
        ("cache_max_bytes", ctypes.c_int64),
        ("background_builds", ctypes.c_int),
        ("programmatic_launch", ctypes.c_int),
    ]
    # Fields that took what older libraries left as the struct's tail padding: sizeof did not
    # grow, so struct_size cannot tell such a library. Its init leaves them 0, while a library
    # that has them writes a default that is not 0 (programmatic_launch: AUTO, -1).
    padding_fields = ("programmatic_launch",)


class RopeArgs(ctypes.Structure):
    """rope_jit_rope_args."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", DLTensorPointer),
        ("k", DLTensorPointer),
        ("q_out", DLTensorPointer),
        ("k_out", DLTensorPointer),
        ("cos", DLTensorPointer),
        ("sin", DLTensorPointer),
        ("inv_freq", DLTensorPointer),
        ("positions", DLTensorPointer),
        ("seqlen_offsets", DLTensorPointer),
        ("cu_seqlens", DLTensorPointer),
        ("position_offset", ctypes.c_int64),
        ("q_position_offset", ctypes.c_int64),
        ("rotary_dim", ctypes.c_int32),
        ("rotary_offset", ctypes.c_int32),
        ("style", _enum),
        ("backward", ctypes.c_int),
        ("xpos_scale", DLTensorPointer),
        ("stream", ctypes.c_void_p),
        # Multi-section positions (M-RoPE, axial).
        ("mrope_sections", ctypes.POINTER(ctypes.c_int32)),
        ("num_mrope_sections", ctypes.c_int32),
        ("mrope_interleaved", ctypes.c_int),
        # Learned frequencies: d(loss)/d(inv_freq) in the backward.
        ("inv_freq_grad", DLTensorPointer),
        ("q_saved", DLTensorPointer),
        ("k_saved", DLTensorPointer),
        # QK-norm: RMSNorm of each head before the rotation.
        ("q_norm_weight", DLTensorPointer),
        ("k_norm_weight", DLTensorPointer),
        ("norm_eps", ctypes.c_double),
        ("norm_unit_offset", ctypes.c_int),
        ("q_norm_input", DLTensorPointer),
        ("k_norm_input", DLTensorPointer),
        ("q_norm_weight_grad", DLTensorPointer),
        ("k_norm_weight_grad", DLTensorPointer),
        ("kv_layout", ctypes.c_int),
        ("v", DLTensorPointer),
        ("k_cache", DLTensorPointer),
        ("v_cache", DLTensorPointer),
        ("slot_mapping", DLTensorPointer),
        ("block_tables", DLTensorPointer),
        ("k_scale", DLTensorPointer),
        ("v_scale", DLTensorPointer),
        ("q_scale", DLTensorPointer),
    ]


# The most entries of RopeArgs.mrope_sections (ROPE_JIT_MAX_MROPE_SECTIONS).
MAX_MROPE_SECTIONS = 8
# The most dims of a tensor the memory queries take (ROPE_JIT_MEMORY_QUERY_MAX_DIMS).
MEMORY_QUERY_MAX_DIMS = 8
# The most inverse frequencies rope_jit_inv_freq computes (ROPE_JIT_MAX_FREQUENCIES): checked
# before the output array is made.
MAX_FREQUENCIES = 1 << 24


class KernelSpec(ctypes.Structure):
    """rope_jit_kernel_spec."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dtype", DLDataType),
        ("head_dim", ctypes.c_int32),
        ("rotary_dim", ctypes.c_int32),
        ("rotary_offset", ctypes.c_int32),
        ("style", _enum),
        ("backward", ctypes.c_int),
        ("has_k", ctypes.c_int),
        ("gqa_group", ctypes.c_int32),
        ("positions", _enum),
        ("index_dtype", DLDataType),
        ("packed", ctypes.c_int),
        ("angles", _enum),
        ("table_dtype", DLDataType),
        ("xpos", ctypes.c_int),
        ("in_place", ctypes.c_int),
        ("qk_norm", ctypes.c_int),
        ("norm_unit_offset", ctypes.c_int),
        ("norm_weight_dtype", DLDataType),
        ("norm_weight_grad", ctypes.c_int),
        ("kv_layout", ctypes.c_int),
        ("kv_block_tables", ctypes.c_int),
        ("kv_fp8", ctypes.c_int),
        ("v_head_dim", ctypes.c_int32),
        ("q_fp8", ctypes.c_int),
        ("dense_rows", ctypes.c_int),
    ]


class Stats(ctypes.Structure):
    """rope_jit_stats."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("memory_hits", ctypes.c_uint64),
        ("disk_hits", ctypes.c_uint64),
        ("compiles", ctypes.c_uint64),
        ("compile_ms", ctypes.c_double),
        ("disk_writes", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("background_builds", ctypes.c_uint64),
        ("background_failures", ctypes.c_uint64),
        ("background_dropped", ctypes.c_uint64),
        ("attention_workspace_fallbacks", ctypes.c_uint64),
        ("disk_lookup_ms", ctypes.c_double),
        ("module_load_ms", ctypes.c_double),
        ("disk_evictions", ctypes.c_uint64),
    ]


class AttentionArgs(ctypes.Structure):
    """rope_jit_attention_args (forward and backward)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", DLTensorPointer),
        ("k", DLTensorPointer),
        ("v", DLTensorPointer),
        ("out", DLTensorPointer),
        ("cos", DLTensorPointer),
        ("sin", DLTensorPointer),
        ("pos_mask", DLTensorPointer),
        ("attn_mask", DLTensorPointer),
        ("causal", ctypes.c_int),
        ("scale", ctypes.c_double),
        ("rotary_dim", ctypes.c_int32),
        ("style", _enum),
        ("lse", DLTensorPointer),
        ("stream", ctypes.c_void_p),
        ("dout", DLTensorPointer),
        ("dq", DLTensorPointer),
        ("dk", DLTensorPointer),
        ("dv", DLTensorPointer),
        ("deterministic", ctypes.c_int),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]


# rope_jit_rope_type
ROPE_TYPES = {"default": 0, "linear": 1, "dynamic": 2, "yarn": 3, "llama3": 4, "longrope": 5,
              "lang": 6, "pixel": 7, "constant": 8, "proportional": 9}


class FreqConfig(ctypes.Structure):
    """rope_jit_freq_config."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rope_type", _enum),
        ("rotary_dim", ctypes.c_int32),
        ("theta", ctypes.c_double),
        ("factor", ctypes.c_double),
        ("max_position_embeddings", ctypes.c_int64),
        ("original_max_position_embeddings", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("attention_factor", ctypes.c_double),
        ("beta_fast", ctypes.c_double),
        ("beta_slow", ctypes.c_double),
        ("mscale", ctypes.c_double),
        ("mscale_all_dim", ctypes.c_double),
        ("truncate", ctypes.c_int),
        ("low_freq_factor", ctypes.c_double),
        ("high_freq_factor", ctypes.c_double),
        ("short_factor", ctypes.POINTER(ctypes.c_float)),
        ("long_factor", ctypes.POINTER(ctypes.c_float)),
        ("theta_rescale_factor", ctypes.c_double),
        ("max_freq", ctypes.c_double),
        ("num_freqs", ctypes.c_int32),
        ("num_short_factor", ctypes.c_size_t),
        ("num_long_factor", ctypes.c_size_t),
        ("head_dim", ctypes.c_int32),
    ]


class TableConfig(ctypes.Structure):
    """rope_jit_table_config."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("inv_freq", ctypes.POINTER(ctypes.c_float)),
        ("num_freqs", ctypes.c_size_t),
        ("position_start", ctypes.c_double),
        ("positions", ctypes.POINTER(ctypes.c_double)),
        ("interpolate_factor", ctypes.c_double),
        ("attention_factor", ctypes.c_double),
        ("style", _enum),
        ("mrope_sections", ctypes.POINTER(ctypes.c_int32)),
        ("num_mrope_sections", ctypes.c_int32),
        ("mrope_interleaved", ctypes.c_int),
        ("float32_angles", ctypes.c_int),
        ("xpos_scale_base", ctypes.c_double),
        ("xpos_center", ctypes.c_double),
        ("num_positions", ctypes.c_size_t),
    ]
