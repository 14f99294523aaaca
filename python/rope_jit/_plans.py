"""The PyTorch hot path: rope_jit_rope_args built once per call signature, patched per call.

A call's signature is everything the argument struct holds except the data pointers, the
position offsets and the stream: which tensors are given, their shapes, strides, dtypes and
devices, the layout, rotary_dim, rotary_offset, style, direction and M-RoPE sections. The
first call of a signature builds its struct with every check (rope.build_args, the same code
as any other call); later calls write the tensors' data_ptr() into the DLTensors it points
to, the offsets and the stream into the struct, and call the library: no DLPack capsule, no
ctypes object made, no per-tensor conversion. The library checks every call's arguments as
before (shapes are the signature's, so only pointers can differ).

Plans live in the Runtime, per thread (an autograd worker thread and the main thread never
patch one struct at once), at most MAX_PLANS per thread; a plan holds no tensor.
"""

import ctypes
import struct
import sys
import threading

from . import _cuda_context
from . import _structs as s
from ._checks import c_int

MAX_PLANS = 256

_OFFSETS_FIELD = struct.Struct("@qq")  # position_offset, q_position_offset (adjacent int64s)
_POSITION_OFFSET = s.RopeArgs.position_offset.offset
if s.RopeArgs.q_position_offset.offset != _POSITION_OFFSET + 8:
    raise ImportError(
        "rope_jit: position_offset and q_position_offset are not adjacent in RopeArgs"
    )
_STREAM_OFFSET = s.RopeArgs.stream.offset
_pack_pointer = s.POINTER_FIELD.pack_into
_pack_offsets = _OFFSETS_FIELD.pack_into
_checked_devices = _cuda_context.checked_devices

# The exact classes that take this path (subclasses such as FakeTensor take the general one).
TORCH_TENSOR_TYPES = ()
_raw_stream = None  # torch._C._cuda_getCurrentRawStream, or a fallback with its signature


def torch_types():
    """(torch.Tensor, torch.nn.Parameter) once torch is imported, else (). Set once."""
    global TORCH_TENSOR_TYPES, _raw_stream
    if TORCH_TENSOR_TYPES:
        return TORCH_TENSOR_TYPES
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return ()
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if _raw_stream is None:

        def _raw_stream(index):
            return torch.cuda.current_stream(index).cuda_stream

    TORCH_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
    return TORCH_TENSOR_TYPES


class Plan:
    """One signature's argument struct and the DLTensors it points to."""

    __slots__ = ("args", "args_ref", "data_structs", "held", "cuda_device")

    def __init__(self, args, held, data_structs, cuda_device):
        self.args = args
        self.args_ref = ctypes.byref(args)
        self.held = held  # TensorArgs (their keepalive dropped) and the sections array
        self.data_structs = (
            data_structs  # per tensor slot: its DLTensor (data at offset 0), or None
        )
        self.cuda_device = cuda_device  # the CUDA device index, or -1 for host tensors


def _plans_of(runtime):
    local = runtime.__dict__.get("_plans")
    if local is None:
        local = runtime.__dict__.setdefault("_plans", threading.local())
    plans = getattr(local, "plans", None)
    if plans is None:
        plans = local.plans = {}
    return plans


def _signature(values, head):
    """The part of the key that comes from the tensors; raises AttributeError / TypeError /
    RuntimeError for objects that are not plain strided torch tensors (the caller then takes
    the general path, which names the problem)."""
    key = [head]
    for slot, value in enumerate(values):
        if value is not None:
            if type(value) not in TORCH_TENSOR_TYPES:
                raise TypeError("not a torch tensor")
            key.append(
                (slot, value.shape, value.stride(), value.dtype, value.get_device(), value.is_cpu)
            )
    return tuple(key)


def call(
    runtime,
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
    stream,
):
    """rope_jit_rope on `values` (torch tensors in rope._TENSOR_NAMES order, None where absent)
    through a plan. Returns False, having done nothing, when the call is not one for this path
    (a tensor that is not a plain torch tensor, an explicit stream); rope() then takes the
    general one."""
    if stream is not None or type(rotary_dim) is not int or type(rotary_offset) is not int:
        return False  # (a float rotary_dim would find an int's plan: the general path refuses it)
    try:
        mrope_key = (
            None if mrope_sections is None else (tuple(mrope_sections), bool(mrope_interleaved))
        )
        key = _signature(
            values, (layout, rotary_dim, rotary_offset, style, bool(backward), mrope_key)
        )
    except (TypeError, AttributeError, RuntimeError):
        return False
    plans = _plans_of(runtime)
    plan = plans.get(key)
    if plan is None:
        plan = _build(
            runtime,
            values,
            layout,
            rotary_dim,
            rotary_offset,
            style,
            backward,
            mrope_sections,
            mrope_interleaved,
        )
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    run(runtime, plan, values, position_offset, q_position_offset)
    return True


def _build(
    runtime,
    values,
    layout,
    rotary_dim,
    rotary_offset,
    style,
    backward,
    mrope_sections,
    mrope_interleaved,
):
    from .rope import build_args  # rope imports this module

    library = runtime.library
    args, held = build_args(
        library,
        values,
        layout,
        0,
        0,
        rotary_dim,
        rotary_offset,
        style,
        backward,
        mrope_sections,
        mrope_interleaved,
        0,
    )
    data_structs = []
    tensor_args = iter(item for item in held if hasattr(item, "keepalive"))
    cuda_device = -1
    for value in values:
        if value is None:
            data_structs.append(None)
            continue
        tensor = next(tensor_args)
        tensor.keepalive = ()  # a plan must not keep the first call's tensors alive
        data_structs.append(tensor.struct)
        if cuda_device < 0 and value.is_cuda:
            cuda_device = value.get_device()
    return Plan(args, held, data_structs, cuda_device)


def run(runtime, plan, values, position_offset, q_position_offset):
    """Patches `plan` with the tensors' data pointers, the offsets and the stream (PyTorch's
    current one on the plan's device), then calls the library."""
    for value, dl_tensor in zip(values, plan.data_structs):
        if dl_tensor is not None:
            _pack_pointer(dl_tensor, 0, value.data_ptr())
    args = plan.args
    try:
        _pack_offsets(args, _POSITION_OFFSET, position_offset, q_position_offset)
    except struct.error:
        c_int(position_offset, "position_offset", 64)  # raises the error that names it
        c_int(q_position_offset, "q_position_offset", 64)
        raise
    device = plan.cuda_device
    if device >= 0:
        checked = _checked_devices()
        if checked is None or device not in checked:
            _cuda_context.ensure_current(device)
        _pack_pointer(args, _STREAM_OFFSET, _raw_stream(device))
    library = runtime.library
    status = library.rope_jit_rope(runtime.handle, plan.args_ref)
    if status:
        library.check("rope_jit_rope", status)
