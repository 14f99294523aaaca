"""rope(): rope_jit_rope on any tensors (torch, numpy, cupy, jax...), without copies.

This is the framework-neutral entry point: it writes into the tensors you pass (in place, or
into q_out/k_out) and has no autograd. PyTorch users who want gradients and torch.compile use
rope_jit.torch_ops.apply_rope, which calls this underneath.
"""

import ctypes
import operator
import sys

from . import _cuda_context, _plans, _torch_writes
from . import _structs as s
from .runtime import _STYLES, Runtime, _choice, runtime_argument
from ._checks import c_double, c_int, c_ints
from .tensors import as_tensor, is_torch_tensor, torch_stream_of

# Each layout's rank and dimensions, as its error messages name them (the library reads the
# layout from the rank, with "bshd" passed as its [B, H, S, D] view).
_LAYOUT_RANKS = {"bhsd": (4, "[B, H, S, D]"), "bshd": (4, "[B, S, H, D]"), "thd": (3, "[T, H, D]")}
LAYOUTS = tuple(_LAYOUT_RANKS)


def resolve_stream(stream, tensors):
    """The CUstream (an int; 0 = legacy default) a call on `tensors` launches on.

    `stream` may be an int (a CUstream), an object with .cuda_stream (torch.cuda.Stream) or
    .ptr (cupy.cuda.Stream), or None: then PyTorch's current stream when a tensor is a CUDA
    torch tensor, CuPy's current stream for a CuPy array, else the legacy default stream."""
    if stream is not None:
        handle = stream
        for attribute in ("cuda_stream", "ptr"):
            if hasattr(stream, attribute):
                handle = getattr(stream, attribute)
                break
        try:  # (int() took "7" and 7.9, and named nothing for "x")
            handle = operator.index(handle)
        except TypeError:
            raise TypeError(f"stream: expected a CUstream (an int), a torch.cuda.Stream or a "
                            f"CuPy stream, got {stream!r}") from None
        if not 0 <= handle < (1 << 64):
            raise ValueError(f"stream: a CUstream is an address in [0, 2^64), got {handle}")
        return handle
    torch_stream = torch_stream_of(tensors)
    if torch_stream is not None:
        return torch_stream
    if "cupy" in sys.modules:
        for obj in tensors:
            if type(obj).__module__.startswith("cupy"):
                return int(sys.modules["cupy"].cuda.get_current_stream().ptr)
    return 0


def _supported_fields(library):
    """The fields of rope_jit_rope_args that the loaded library has (found once, then cached).
    Calls refuse the others: an older library would ignore them and compute something else."""
    return library.fields(s.RopeArgs, library.rope_jit_rope_args_init)


# The tensors laid out like q and k (the ones `layout` describes).
_HEAD_TENSORS = frozenset(
    ("q", "k", "q_out", "k_out", "q_saved", "k_saved", "q_norm_input", "k_norm_input", "v")
)
# The tensors the call writes whenever they are given (q and k only when they have no output).
_OUTPUT_TENSORS = frozenset(
    (
        "q_out",
        "k_out",
        "inv_freq_grad",
        "q_norm_weight_grad",
        "k_norm_weight_grad",
        "k_cache",
        "v_cache",
    )
)
# rope()'s tensor arguments, in the order they are converted (and errors reported).
_TENSOR_NAMES = (
    "q",
    "k",
    "q_out",
    "k_out",
    "cos",
    "sin",
    "inv_freq",
    "positions",
    "seqlen_offsets",
    "cu_seqlens",
    "xpos_scale",
    "inv_freq_grad",
    "q_saved",
    "k_saved",
    "q_norm_weight",
    "k_norm_weight",
    "q_norm_input",
    "k_norm_input",
    "q_norm_weight_grad",
    "k_norm_weight_grad",
    "v",
    "k_cache",
    "v_cache",
    "slot_mapping",
    "block_tables",
    "k_scale",
    "v_scale",
    "q_scale",
)
# kv_layout's names (rope_jit_kv_cache_layout): k_cache/v_cache [B, S_max, Hk, D],
# [num_blocks, block_size, Hk, D] or [num_blocks, Hk, block_size, D].
KV_LAYOUTS = {None: 0, "contiguous": 1, "nhd": 2, "hnd": 3}
# Where each one's DLTensor pointer lies in rope_jit_rope_args.
_POINTER_OFFSETS = {name: getattr(s.RopeArgs, name).offset for name in _TENSOR_NAMES}
# rope()'s torch hot path: every tensor argument is part of a plan's signature. Calls that
# give none of the tensors past xpos_scale (all but learned frequencies and QK-norm) are keyed
# on the first ones only: fewer absent slots to walk per call.
_ROPE_RECIPE = _plans.Recipe("rope", _TENSOR_NAMES, _TENSOR_NAMES)
_COMMON = _TENSOR_NAMES.index("xpos_scale") + 1
_ROPE_COMMON_RECIPE = _plans.Recipe("rope common", _TENSOR_NAMES, _TENSOR_NAMES[:_COMMON])
_ABSENT_TAIL = (None,) * (len(_TENSOR_NAMES) - _COMMON)


def _written_names(values):
    """The names of the tensors a call on `values` (in _TENSOR_NAMES order, None where absent;
    a shorter tuple leaves the rest absent) writes: the outputs given, q and k when they have
    none (k not with a KV cache, which receives its rotation instead)."""
    values = tuple(values) + (None,) * (len(_TENSOR_NAMES) - len(values))
    q_out, k_out = values[2], values[3]
    k_cache = values[_TENSOR_NAMES.index("k_cache")]
    return frozenset(
        name
        for name, value in zip(_TENSOR_NAMES, values)
        if value is not None
        and (
            name in _OUTPUT_TENSORS
            or (name == "q" and q_out is None)
            or (name == "k" and k_out is None and k_cache is None)
        )
    )


def build_args(
    library,
    values,
    layout,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    style,
    backward,
    mrope_sections,
    mrope_interleaved,
    stream_handle,
    norm_eps=1e-6,
    norm_unit_offset=False,
    kv_layout=None,
):
    """(args, held): the rope_jit_rope_args of a call on `values` (the tensors in _TENSOR_NAMES
    order, None where absent; a shorter tuple leaves the names past its end absent, as the
    torch hot path's plans do), with every check of the Python side, and the objects
    (TensorArgs, the sections array) that must stay alive while the library reads args."""
    values = tuple(values) + (None,) * (len(_TENSOR_NAMES) - len(values))
    written_names = _written_names(values)
    args = library.new_struct(s.RopeArgs, library.rope_jit_rope_args_init)
    supported = _supported_fields(library)
    # A [B, S, H, D] buffer is passed as its [B, H, S, D] view (dims 1 and 2 exchanged).
    head_swap = (1, 2) if layout == "bshd" else None
    # (The library reads the layout from the rank: a 3-D q under "bhsd" would be taken as
    # packed tokens.)
    head_rank, head_dims = _LAYOUT_RANKS[layout]
    held = []  # every TensorArg (and the sections array) stays alive until the call returns
    for name, value in zip(_TENSOR_NAMES, values):
        if value is None:
            continue
        if name not in supported:
            raise library.too_old(name)
        written = name in written_names
        swap = head_swap if name in _HEAD_TENSORS else None
        tensor = as_tensor(value, name, writable=written, stream=stream_handle, swap_dims=swap)
        if name in _HEAD_TENSORS and len(tensor.shape) != head_rank:
            raise ValueError(
                f"{name}: layout {layout} needs {head_rank} dimensions {head_dims}, got shape "
                f"{list(tensor.shape)}"
            )
        held.append(tensor)
        s.POINTER_FIELD.pack_into(args, _POINTER_OFFSETS[name], tensor.address)
    args.position_offset = c_int(position_offset, "position_offset", 64)
    args.q_position_offset = c_int(q_position_offset, "q_position_offset", 64)
    args.rotary_dim = c_int(rotary_dim, "rotary_dim")
    args.rotary_offset = c_int(rotary_offset, "rotary_offset")
    args.style = _choice(style, _STYLES, "style")
    args.backward = 1 if backward else 0
    args.stream = stream_handle or None
    if mrope_sections is not None:
        if "mrope_sections" not in supported:
            raise library.too_old("mrope_sections")
        sections = c_ints(mrope_sections, "mrope_sections")
        if len(sections) > s.MAX_MROPE_SECTIONS:
            raise ValueError(
                f"mrope_sections: at most {s.MAX_MROPE_SECTIONS} sections, got {len(sections)}"
            )
        if sections:  # ([] is no sections, as rope_tables takes it: it failed here)
            array = (ctypes.c_int32 * len(sections))(*sections)
            held.append(array)
            args.mrope_sections = ctypes.cast(array, ctypes.POINTER(ctypes.c_int32))
            args.num_mrope_sections = len(sections)
            args.mrope_interleaved = 1 if mrope_interleaved else 0
    if values[_TENSOR_NAMES.index("q_norm_weight")] is not None:
        if isinstance(norm_eps, bool):
            raise TypeError(f"norm_eps: expected a number, got {norm_eps!r}")
        args.norm_eps = c_double(norm_eps, "norm_eps")  # NumPy scalars too
        args.norm_unit_offset = 1 if norm_unit_offset else 0
    if kv_layout is not None:
        if "kv_layout" not in supported:
            raise library.too_old("kv_layout")
        if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"kv_layout: expected one of {[n for n in KV_LAYOUTS if n]}, got {kv_layout!r}"
            )
        args.kv_layout = KV_LAYOUTS[kv_layout]

    return args, held


def rope(
    q,
    k=None,
    *,
    cos=None,
    sin=None,
    inv_freq=None,
    positions=None,
    seqlen_offsets=None,
    cu_seqlens=None,
    position_offset=0,
    q_position_offset=0,
    rotary_dim=0,
    rotary_offset=0,
    style="half",
    backward=False,
    xpos_scale=None,
    q_out=None,
    k_out=None,
    layout="bhsd",
    mrope_sections=None,
    mrope_interleaved=False,
    inv_freq_grad=None,
    q_saved=None,
    k_saved=None,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    norm_unit_offset=False,
    q_norm_input=None,
    k_norm_input=None,
    q_norm_weight_grad=None,
    k_norm_weight_grad=None,
    v=None,
    k_cache=None,
    v_cache=None,
    kv_layout=None,
    slot_mapping=None,
    block_tables=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    stream=None,
    runtime=None,
):
    """Applies rotary position embeddings to q (and k) with one rope_jit_rope call.

    Tensors may be anything as_tensor() takes (torch, numpy, or any DLPack producer) and are
    never copied; CPU tensors run on the CPU reference, CUDA tensors on the GPU.

    Args:
        q: queries, [B, Hq, S, D] (layout "bhsd"), [B, S, Hq, D] ("bshd") or [T, Hq, D]
            ("thd": packed, with cu_seqlens, or alone as one sequence). Any strides.
        k: keys with Hk heads (Hq a multiple of Hk), or None to rotate q alone.
        cos, sin: angle tables [P, R/2] or [P, R] (float32/float16/bfloat16, one dtype for
            both), both or neither.
        inv_freq: [R/2] inverse frequencies, used when cos and sin are None.
        positions: [S] or [B, S] ([T] packed) int32/int64 table rows of the tokens.
        seqlen_offsets: [B] int32/int64: token s of sequence b takes row s + seqlen_offsets[b].
        cu_seqlens: [B+1] int32/int64 sequence starts of packed ("thd") tensors.
        position_offset: added to implicit positions of q and k (default 0).
        q_position_offset: added for q only, on top (queries after cached keys).
        rotary_dim: rotated features R; 0 = head_dim. rotary_offset: the first one.
        style: "half" (NeoX/Llama pairs (i, i+R/2)), "interleaved" (GPT-J pairs (2i, 2i+1)) or
            "proportional" (Gemma-4 partial rotary: pairs (i, i+D/2) for i < R/2, the rest of
            each half unchanged; rotary_offset must be 0).
        backward: True applies the inverse rotation (q and k hold gradients).
        xpos_scale: xPos scales shaped like cos: q is multiplied, k divided.
        q_out, k_out: outputs shaped like q and k (same layout), or None to write in place.
        layout: "bhsd", "bshd" or "thd" (see q).
        mrope_sections: pairs per position axis (M-RoPE / axial RoPE), e.g. [16, 24, 24]; then
            positions has a leading axis [A, ...]. mrope_interleaved: Qwen3-VL's interleaved
            sections instead of contiguous ones.
        inv_freq_grad: [R/2] float32 output of d(loss)/d(inv_freq), with backward=True, angles
            from inv_freq, and q_saved/k_saved the forward's outputs (learned frequencies).
        q_norm_weight, k_norm_weight: [D] weights of an RMSNorm over each head before the
            rotation (QK-norm, as Qwen3, Gemma 3, OLMo 2): y = rope(x / sqrt(mean(x^2) +
            norm_eps) * w), or * (1 + w) with norm_unit_offset=True (Gemma). k_norm_weight is
            required with k. Backward: q and k hold dL/dy, the outputs get dL/dx, and
            q_norm_input/k_norm_input must be the forward's q and k before the norm;
            q_norm_weight_grad/k_norm_weight_grad ([D] float32, optional) receive dL/dw.
        kv_layout: "contiguous", "nhd" or "hnd" to write k (rotated) and v into a KV cache in
            the same launch (forward, inference); None (default): no cache. k is then only
            read (k_out must be None) and k_cache receives every token's rotated k:
            "contiguous" k_cache [B, S_max, Hk, D] at row seqlen_offsets[b] + s (or positions,
            or s + position_offset); "nhd" [num_blocks, block_size, Hk, D] and "hnd"
            [num_blocks, Hk, block_size, D] at slot_mapping[t] (vLLM: slot = block *
            block_size + offset, negative = skip the token) or through block_tables
            [B, max_blocks] (block = block_tables[b, pos // block_size]).
        v, v_cache: v shaped like k (same layout, any head_dim Dv) copied into v_cache (k_cache's
            layout with Dv). Both or neither.
        k_scale, v_scale, q_scale: float32 tensors of one element (on the tensors' device): FP8
            outputs (k_cache/v_cache, or q_out, of dtype float8_e4m3fn) store value / scale,
            rounded to nearest even and saturated to +-448 (NaN stays NaN). None = 1.
        stream: the CUDA stream to launch on; see resolve_stream for the default.
        runtime: a Runtime; None = default_runtime().

    Returns:
        (q_result, k_result): the tensors that hold the result, i.e. q_out or q, and k_out or k
        (None without k; k_cache with a KV cache). On the GPU the work is enqueued on `stream`,
        not finished.

    Raises:
        InvalidArgumentError (a ValueError) naming the argument for bad input; another
        RopeJitError subclass for other failures; TypeError for objects that are not tensors;
        RuntimeError, as torch's in-place ops, for a torch tensor it would write that requires
        grad while grad mode is on (torch tensors it writes count the write in their version
        counter, as in-place ops do).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if type(runtime) is not Runtime:  # (the check off the hot path: a Runtime is given, or None)
        runtime = runtime_argument(runtime)
    if (
        stream is None
        and mrope_sections is None
        and inv_freq_grad is None
        and q_saved is None
        and k_saved is None
        and q_norm_weight is None
        and k_norm_weight is None
        and q_norm_input is None
        and k_norm_input is None
        and q_norm_weight_grad is None
        and k_norm_weight_grad is None
        and kv_layout is None
        and v is None
        and k_cache is None
        and v_cache is None
        and slot_mapping is None
        and block_tables is None
        and k_scale is None
        and v_scale is None
        and q_scale is None
        and type(q) in (_plans.TORCH_TENSOR_TYPES or _plans.torch_types())
        and _plans.call(
            runtime,
            _ROPE_COMMON_RECIPE,
            (q, k, q_out, k_out, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens,
             xpos_scale),
            (),
            (layout, rotary_dim, rotary_offset, style, bool(backward), None, False),
            position_offset,
            q_position_offset,
        )
        is not None
    ):
        # The common PyTorch call (plain rotary, no M-RoPE, learned frequencies, QK-norm or KV
        # cache) through its plan, tested with plain comparisons before anything is built.
        return (
            q_out if q_out is not None else q,
            None if k is None else (k_out if k_out is not None else k),
        )
    values = (
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        inv_freq,
        positions,
        seqlen_offsets,
        cu_seqlens,
        xpos_scale,
        inv_freq_grad,
        q_saved,
        k_saved,
        q_norm_weight,
        k_norm_weight,
        q_norm_input,
        k_norm_input,
        q_norm_weight_grad,
        k_norm_weight_grad,
    )  # as _TENSOR_NAMES
    # KV cache and FP8 scale arguments (always in `values`, as in _TENSOR_NAMES; `kv` with
    # plain comparisons: this runs on every call).
    values += (v, k_cache, v_cache, slot_mapping, block_tables, k_scale, v_scale, q_scale)
    kv = (
        kv_layout is not None
        or v is not None
        or k_cache is not None
        or v_cache is not None
        or slot_mapping is not None
        or block_tables is not None
        or k_scale is not None
        or v_scale is not None
        or q_scale is not None
    )
    # PyTorch tensors take the planned path: the argument struct of this signature is built
    # once (below) and only the data pointers, offsets and stream change per call.
    # (QK-norm and KV cache calls take the general path: a plan's key holds neither norm_eps
    # nor kv_layout.)
    if (
        q_norm_weight is None
        and not kv
        and stream is None
        and type(q) in (_plans.TORCH_TENSOR_TYPES or _plans.torch_types())
    ):
        try:
            mrope = (
                (None, False)
                if mrope_sections is None
                else (tuple(mrope_sections), bool(mrope_interleaved))
            )
            # Sections of floats would find the plan of equal ints: the general path refuses them.
            if mrope[0] is not None and not all(hasattr(n, "__index__") for n in mrope[0]):
                mrope = None
        except (TypeError, AttributeError, RuntimeError):
            mrope = None  # the general path names the problem
        try:  # (a tuple of Nones against another: identity checks; NumPy's == can raise)
            common = values[_COMMON:] == _ABSENT_TAIL
        except (ValueError, TypeError, RuntimeError):
            common = False
        if mrope is not None and _plans.call(
            runtime,
            _ROPE_COMMON_RECIPE if common else _ROPE_RECIPE,
            values[:_COMMON] if common else values,
            (),
            (layout, rotary_dim, rotary_offset, style, bool(backward)) + mrope,
            position_offset,
            q_position_offset,
        ) is not None:
            return (
                q_out if q_out is not None else q,
                None if k is None else (k_out if k_out is not None else k),
            )
    library = runtime.library
    stream_handle = resolve_stream(stream, [value for value in values if value is not None])
    args, held = build_args(
        library,
        values,
        layout,
        position_offset,
        q_position_offset,
        rotary_dim,
        rotary_offset,
        style,
        backward,
        mrope_sections,
        mrope_interleaved,
        stream_handle,
        norm_eps=norm_eps,
        norm_unit_offset=norm_unit_offset,
        kv_layout=kv_layout,
    )
    device = held[0].struct.device if held else None
    if device is not None and device.device_type == s.KDL_CUDA:
        checked = _cuda_context.checked_devices()
        if checked is None or device.device_id not in checked:
            _cuda_context.ensure_current(device.device_id)
    # Torch tensors it writes: refused as torch's in-place ops would, and marked written.
    written_names = _written_names(values)
    written = _torch_writes.check_named([
        (value, name)
        for name, value in zip(_TENSOR_NAMES, values)
        if name in written_names and is_torch_tensor(value)
    ])
    status = runtime._call(library.rope_jit_rope, ctypes.byref(args))
    library.check("rope_jit_rope", status)
    _torch_writes.mark(written)
    del held
    return (
        q_out if q_out is not None else q,
        None if k is None else k_cache if k_cache is not None else k_out if k_out is not None else k,
    )


__all__ = ["rope", "resolve_stream", "LAYOUTS"]
