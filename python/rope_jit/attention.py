"""attention(): softmax attention with rotary embeddings fused in (rope_jit_attention).

The op arrived in a later version of the C API than rope_jit_rope; with a library that lacks
it, has_attention() is False and every call raises NotImplementedError saying so.
"""

import ctypes
import sys

from . import _cuda_context, _torch_writes
from . import _structs as s
from .rope import resolve_stream
from .runtime import _STYLES, _choice, runtime_argument
from ._checks import c_double, c_int
from .tensors import as_tensor, is_torch_tensor, torch_stream_of

_P = ctypes.POINTER

# The styles attention takes: not "proportional" (the header), which the message for a bad
# style listed, and the library then refused (adversarial pass, session 49).
_ATTENTION_STYLES = {name: _STYLES[name] for name in ("half", "interleaved")}


def _functions(library):
    """(forward, backward, args_init) C functions, or None when the library has no attention."""
    cached = getattr(library, "_attention_functions", False)
    if cached is not False:
        return cached
    init = library.optional("rope_jit_attention_args_init", None, [_P(s.AttentionArgs)])
    forward = library.optional("rope_jit_attention", ctypes.c_int, [ctypes.c_void_p, _P(s.AttentionArgs)])
    backward = library.optional("rope_jit_attention_backward", ctypes.c_int, [ctypes.c_void_p, _P(s.AttentionArgs)])
    functions = (forward, backward, init) if forward and backward and init else None
    library._attention_functions = functions
    return functions


def _workspace_size_function(library):
    """rope_jit_attention_workspace_size, or None for a library older than it (whose calls
    then allocate their own workspace)."""
    cached = getattr(library, "_attention_workspace_size", False)
    if cached is False:
        cached = library.optional(
            "rope_jit_attention_workspace_size",
            ctypes.c_int,
            [ctypes.c_void_p, _P(s.AttentionArgs), ctypes.c_int, _P(ctypes.c_size_t)],
        )
        library._attention_workspace_size = cached
    return cached


_WORKSPACE_ALIGNMENT = 256  # rope_jit_attention_args.workspace


def _torch_workspace(runtime, args, which, q, held):
    """Points args at a workspace from PyTorch's caching allocator on q's device, when the
    call's kernels need one (one query of the library; no host synchronization, and
    capturable in a CUDA graph, as any torch.empty). The tensor is allocated on PyTorch's
    current stream, the one the call launches on, so the allocator reuses it only after the
    call's kernels in stream order; `held` keeps it alive until the call returns. PyTorch's
    blocks are 512-byte aligned (the library asks for 256)."""
    size_function = _workspace_size_function(runtime.library)
    if size_function is None:
        return
    size = ctypes.c_size_t(0)
    status = runtime._call(size_function, ctypes.byref(args), int(which == "backward"),
                           ctypes.byref(size))
    # Arguments the query refuses, the call refuses too, with its own name in the error.
    if status != 0 or size.value == 0:
        return
    torch = sys.modules["torch"]
    try:
        workspace = q.new_empty((size.value,), dtype=torch.uint8)
    except torch.cuda.OutOfMemoryError:
        # No room in PyTorch's pool: the library allocates its own, or, without room there
        # either, runs the kernels that need none (slower, same results).
        return
    if workspace.data_ptr() % _WORKSPACE_ALIGNMENT != 0:  # an allocator of other alignment
        return
    held.append(workspace)
    args.workspace = workspace.data_ptr()
    args.workspace_bytes = size.value


def has_attention(runtime=None):
    """Whether the loaded library has the fused attention op."""
    runtime = runtime_argument(runtime)
    return _functions(runtime.library) is not None


def _call(which, tensors, causal, scale, rotary_dim, style, stream, runtime, deterministic=False):
    runtime = runtime_argument(runtime)
    library = runtime.library
    functions = _functions(library)
    if functions is None:
        raise NotImplementedError(
            f"the loaded librope_jit ({library.path}) has no rope_jit_attention: build a newer rope-jit")
    forward, backward, init = functions
    present = [value for value in tensors.values() if value is not None]
    # With torch CUDA tensors and no stream given: PyTorch's current stream, and a workspace
    # from PyTorch's allocator (already warm in such a process, unlike the driver's pool).
    torch_stream = torch_stream_of(present) if stream is None else None
    stream_handle = torch_stream if torch_stream is not None else resolve_stream(stream, present)
    args = library.new_struct(s.AttentionArgs, init)
    held = []
    torch_written = []  # (tensor, name): checked and counted as torch's in-place ops (see rope())
    for name, value in tensors.items():
        if value is None:
            continue
        written = name in ("out", "lse", "dq", "dk", "dv") and not (which == "backward" and name in ("out", "lse"))
        tensor = as_tensor(value, name, writable=written, stream=stream_handle)
        if written and is_torch_tensor(value):
            torch_written.append((value, name))
        held.append(tensor)
        s.POINTER_FIELD.pack_into(args, getattr(s.AttentionArgs, name).offset, tensor.address)
    args.causal = 1 if causal else 0
    args.scale = c_double(scale, "scale")
    args.rotary_dim = c_int(rotary_dim, "rotary_dim")
    args.style = _choice(style, _ATTENTION_STYLES, "style")
    args.deterministic = 1 if deterministic else 0
    args.stream = stream_handle or None
    device = held[0].struct.device if held else None
    if device is not None and device.device_type == s.KDL_CUDA:
        checked = _cuda_context.checked_devices()
        if checked is None or device.device_id not in checked:
            _cuda_context.ensure_current(device.device_id)  # see _cuda_context.py
    q = tensors["q"]
    if torch_stream is not None and getattr(q, "is_cuda", False) is True:
        _torch_workspace(runtime, args, which, q, held)
    function = forward if which == "forward" else backward
    written = _torch_writes.check_named(torch_written)
    library.check("rope_jit_attention" + ("" if which == "forward" else "_backward"),
                  runtime._call(function, ctypes.byref(args)))
    _torch_writes.mark(written)
    del held


def attention(q, k, v, out, *, cos=None, sin=None, pos_mask=None, attn_mask=None, causal=False, scale=0.0,
              rotary_dim=0, style="half", lse=None, stream=None, runtime=None):
    """Attention with q and k rotated as they are loaded, written into `out` (and `lse`).

    Shapes (any strides, nothing copied): q and out [B, Hq, Sq, D]; k, v [B, Hk, Sk, D] with Hq
    a multiple of Hk; cos/sin [P, R/2] or [P, R] (token s uses row s; None: no rotation);
    pos_mask [N] or [B, N] bool/uint8 (tokens without a position take part unrotated);
    attn_mask [B, Sk] or [B, Sq, Sk], bool (False = masked) or float (added to the scores);
    lse [B, Hq, Sq] float32 (optional output). causal is top-left aligned; scale 0 means
    1/sqrt(D); style "half" or "interleaved" (rotary-embedding-torch). On the GPU the work is
    enqueued on `stream` (default as in rope_jit.rope); with PyTorch CUDA tensors and no
    stream given, a workspace the kernels need (sm_90) comes from PyTorch's caching allocator.
    Raises NotImplementedError when the library has no attention op.
    """
    _call("forward", {"q": q, "k": k, "v": v, "out": out, "cos": cos, "sin": sin, "pos_mask": pos_mask,
                      "attn_mask": attn_mask, "lse": lse},
          causal, scale, rotary_dim, style, stream, runtime)
    return out


def attention_backward(q, k, v, out, lse, dout, dq, dk, dv, *, cos=None, sin=None, pos_mask=None,
                       attn_mask=None, causal=False, scale=0.0, rotary_dim=0, style="half", stream=None,
                       runtime=None, deterministic=False):
    """The gradients of attention(): from the forward's arguments, its out and lse, and dout
    (like out), writes dq, dk and dv (like q, k, v; overwritten), with respect to the unrotated
    q and k. No gradient for the masks or tables. deterministic=True asks for bitwise
    reproducible gradients (on sm_90 the default kernels accumulate dq with float32 atomic adds,
    whose order varies). Returns (dq, dk, dv)."""
    _call("backward", {"q": q, "k": k, "v": v, "out": out, "cos": cos, "sin": sin, "pos_mask": pos_mask,
                       "attn_mask": attn_mask, "lse": lse, "dout": dout, "dq": dq, "dk": dk, "dv": dv},
          causal, scale, rotary_dim, style, stream, runtime, deterministic)
    return dq, dk, dv
