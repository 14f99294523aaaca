"""The PyTorch hot path: rope_jit_rope_args built once per call signature, patched per call.

A call's signature is everything the argument struct holds except the data pointers, the
position offsets and the stream: which tensors are given, their shapes, strides, dtypes and
devices, the layout, rotary_dim, rotary_offset, style, direction and M-RoPE sections. The
first call of a signature builds its struct with every check (rope.build_args, the same code
as any other call) and copies it, with the DLTensors it points to, into one buffer; later
calls write the offsets, the stream and every tensor's data_ptr() into that buffer with one
struct.pack_into and call the library: no DLPack capsule, no ctypes object made, no
per-tensor conversion. The library checks every call's arguments as before (shapes are the
signature's, so only pointers can differ).

A Recipe says how a caller's tensors fill the struct: `signed` tensors are part of the
signature; `derived` ones only give their data pointer, because the caller made them from the
signed ones (the HF drop-in's sequence starts follow from q's shape and device), so reading
their shape again would only repeat the key; `views` give the library a view
of a signed tensor that starts at its address (a [1, S, R] cos table passed as its [S, R]
row), made once when the plan is built, never per call; `outputs` are tensors the plan itself
makes per call "like" a signed tensor (torch.empty_like's shape, strides, dtype and device,
through the allocator torch.compile's generated code calls, which skips the dispatcher).

The last plan a thread used is checked first, in C: a TensorGuards (TorchDynamo's own check of
a tensor's type, dispatch keys, dtype, device, sizes, strides and requires_grad) built on the
tensors that last came through it, where building and comparing a key costs a few tenths of a
microsecond per tensor. A call it refuses (another signature, a new layout of size-1 strides,
requires_grad changed) takes the key; a torch without these private functions takes the key
always, and makes outputs with torch.empty_like. A tensor given twice (q_out=q, k=q, cos is sin)
is guarded once, its repeats by identity (a TensorGuards refuses any call with repeats). The
allocator, self-tested at import on the CPU only, is dropped where it raises and empty_like
does not.

Plans live in the Runtime, per thread (an autograd worker thread and the main thread never
patch one buffer at once), at most MAX_PLANS per thread; a plan holds no tensor. A thread's
CUDA context is made current (_cuda_context) when it builds its first plan for a device.
"""

import ctypes
import operator
import struct
import sys
import threading

from . import _cuda_context, _torch_writes
from . import _structs as s
from ._checks import c_int

MAX_PLANS = 256

_POSITION_OFFSET = s.RopeArgs.position_offset.offset
_STREAM_OFFSET = s.RopeArgs.stream.offset
# The buffer's per-call fields, in the order they are packed (ascending offsets).
if not _POSITION_OFFSET + 8 == s.RopeArgs.q_position_offset.offset < _STREAM_OFFSET:
    raise ImportError("rope_jit: RopeArgs' offsets and stream are not in the expected order")
_DLTENSOR_SHAPE = s.DLTensor.shape.offset  # strides follow at + 8
if s.DLTensor.strides.offset != _DLTENSOR_SHAPE + 8 or s.DLTensor.data.offset != 0:
    raise ImportError("rope_jit: unexpected DLTensor mirror layout")
_POINTER_PAIR = struct.Struct("@PP")
_WORD = 8  # every per-call field is 8 bytes at an 8-aligned offset
if ctypes.sizeof(ctypes.c_void_p) != _WORD:
    raise ImportError("rope_jit: the torch hot path needs 64-bit pointers")

# The exact classes that take this path (subclasses such as FakeTensor take the general one).
TORCH_TENSOR_TYPES = ()
_raw_stream = None  # torch._C._cuda_getCurrentRawStream, or a fallback with its signature
_data_ptr = None  # torch.Tensor.data_ptr
_empty_like = None  # torch.empty_like
_deterministic = None  # torch.are_deterministic_algorithms_enabled (its C function)
_cuda_device = None  # torch._C._cuda_getDevice: the current CUDA device's index
# device type ("cpu", "cuda") -> allocator(shape, strides, dtype) on the current device, where
# torch has one (torch._C._dynamo.guards._empty_strided_*); without, outputs use empty_like.
_ALLOCATORS = {}
_new_guard = None  # tensors -> a TensorGuards(...).check, or None where torch has none


def torch_types():
    """(torch.Tensor, torch.nn.Parameter) once torch is imported, else (). Set once."""
    global TORCH_TENSOR_TYPES, _raw_stream, _data_ptr, _empty_like, _deterministic, _cuda_device
    if TORCH_TENSOR_TYPES:
        return TORCH_TENSOR_TYPES
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return ()
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if _raw_stream is None:

        def _raw_stream(index):
            return torch.cuda.current_stream(index).cuda_stream

    _data_ptr = torch.Tensor.data_ptr
    _empty_like = torch.empty_like
    _deterministic = (
        getattr(torch._C, "_get_deterministic_algorithms", None)
        or torch.are_deterministic_algorithms_enabled
    )
    _cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    _find_torch_internals(torch)
    TORCH_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
    return TORCH_TENSOR_TYPES


def _find_torch_internals(torch):
    """Sets _new_guard and _ALLOCATORS from torch's private functions, each only after it
    passed a check of what this module relies on (any surprise: the public way instead)."""
    global _new_guard
    try:
        from torch._C._dynamo import guards
    except Exception:  # noqa: BLE001 (a torch without TorchDynamo's C module)
        return
    for device in ("cpu", "cuda"):
        allocate = getattr(guards, f"_empty_strided_{device}", None)
        if allocate is not None:
            _ALLOCATORS[device] = allocate
    try:
        made = _ALLOCATORS["cpu"]((2, 1, 3), (3, 9, 1), torch.float16)
        if (made.shape, made.stride(), made.dtype, made.device.type) != (
            (2, 1, 3), (3, 9, 1), torch.float16, "cpu"
        ):
            raise ValueError("unexpected tensor")
    except Exception:  # noqa: BLE001
        _ALLOCATORS.clear()

    def new_guard(tensors):
        return guards.TensorGuards(
            *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None
        ).check

    def zeros(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
        # Device and dtype named: this may run under `with torch.device("meta")`, during CUDA
        # graph capture with a CUDA default device, or after torch.set_default_dtype.
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)

    try:
        base = zeros(2, 3)
        check = new_guard((base, zeros(2, 3)))
        others = (
            zeros(3, 2).t(),  # strides
            zeros(2, 4)[:, :3],  # strides
            zeros(3, 2),  # shape
            zeros(2, 3, dtype=torch.float64),
            zeros(2, 3, device="meta"),  # another device type (dispatch keys)
            zeros(2, 3, requires_grad=True),
            torch.nn.Parameter(zeros(2, 3)),
        )
        if check(zeros(2, 3) + 1, zeros(2, 3)) is not True or any(
            check(base, other) is not False for other in others
        ):
            return
    except Exception:  # noqa: BLE001
        return
    _new_guard = new_guard


class Recipe:
    """How a caller's tensors fill rope_jit_rope_args (see the module docstring).

    `names` is rope._TENSOR_NAMES (the struct's tensor fields); `signed` and `derived` name
    the fields the caller's `signed` and `derived` tuples fill, in their order; `views` maps
    a signed field's name to a function giving the tensor the library sees for it, which must
    start at the given tensor's address (else the signature gets no plan); `check`, when
    given, is called as check(signed, head) when a signature's plan is built and returns
    whether the caller's own rules accept it (else the signature gets no plan and the call
    returns False): a caller whose rules depend only on what the key holds (shapes, strides,
    dtypes, devices, head) checks them once per signature instead of per call. Made once, at
    import: a plan's key holds the recipe itself."""

    __slots__ = ("name", "signed", "derived", "views", "size", "check", "outputs", "in_place")

    def __init__(self, name, names, signed, derived=(), views=None, check=None, outputs=None):
        slot = {field: index for index, field in enumerate(names)}
        self.name = name
        self.check = check
        self.signed = tuple(slot[field] for field in signed)
        # `outputs` maps a field to the signed field it is made like. In the struct they
        # follow the caller's derived tensors: Recipe.values takes them after those.
        outputs = outputs or {}
        self.derived = tuple(slot[field] for field in tuple(derived) + tuple(outputs))
        self.outputs = tuple(signed.index(like) for like in outputs.values())
        self.views = tuple((slot[field], view) for field, view in (views or {}).items())
        self.size = len(names)
        # The same call writing into its inputs: no outputs (its plans are its own).
        self.in_place = (
            Recipe(f"{name} in place", names, signed, derived, views, check) if outputs else self
        )

    def values(self, signed, derived):
        """The struct's tensors in field order (None where absent), views applied."""
        values = [None] * self.size
        for slot, value in zip(self.signed, signed):
            values[slot] = value
        for slot, value in zip(self.derived, derived):
            values[slot] = value
        for slot, view in self.views:
            if values[slot] is not None:
                values[slot] = view(values[slot])
        return values

    def __repr__(self):
        return f"Recipe({self.name})"


class Plan:
    """One signature's argument struct and DLTensors, in one buffer."""

    __slots__ = (
        "buffer", "args", "args_ref", "pack", "values", "cuda_device", "held", "function",
        "recipe", "head", "outputs", "allocate", "take", "absent", "nones", "guard",
        "armed_outputs", "other_devices", "key", "written", "written_names",
    )

    def __init__(self, buffer, args, pack, values, cuda_device, held, function):
        self.buffer = buffer
        self.function = function  # the library's rope_jit_rope (_unconverted_rope)
        self.args = args  # a RopeArgs over buffer's first bytes
        self.args_ref = ctypes.byref(args)
        # pack(buffer, _POSITION_OFFSET, *values) writes a call's values: [position_offset,
        # q_position_offset, gap, stream, gap, pointer, gap, pointer, ...], gaps constant.
        self.pack = pack
        self.values = values
        self.cuda_device = cuda_device  # the CUDA device index, or -1 for host tensors
        self.held = held  # what the struct points to outside the buffer (M-RoPE sections)
        self.recipe = self.head = None  # set by _build: what the last-plan check compares
        self.key = None  # the key (a list) it was built for
        # Per recipe output: (its source's place in `signed`, shape, strides or None to take
        # the source's own, dtype), None where the source is absent; `allocate` makes one
        # (None: torch.empty_like of the source).
        self.outputs = ()
        self.allocate = None
        self.other_devices = False  # whether the current CUDA device may not be the tensors'
        self.take = self.absent = self.nones = self.guard = None  # see arm()
        self.armed_outputs = ()
        # The caller's signed tensors the call writes: a function taking them out of a call's
        # `signed` (None where it writes none of them), and their names; checked and marked
        # by _torch_writes (the plan's own outputs need neither).
        self.written = None
        self.written_names = ()

    def arm(self, signed):
        """Points the last-plan check at these signed tensors: `take` (a function taking the
        present ones out of a call's `signed`), `absent` (one taking the absent ones, which
        must be None: `nones`), a guard of the present ones (None without torch's); and the
        outputs' exact (shape, strides, dtype) for them (a tensor the guard accepts has the
        same strides, so a call it serves reads none)."""
        present = [index for index, value in enumerate(signed) if value is not None]
        absent = [index for index, value in enumerate(signed) if value is None]
        self.take = (
            operator.itemgetter(*present)
            if len(present) > 1
            else lambda values, index=present[0]: (values[index],)
        )
        # (itemgetter of one index gives the item itself: twice gives a tuple.)
        self.absent = None
        if absent:
            self.absent = operator.itemgetter(*(absent * 2 if len(absent) == 1 else absent))
        self.nones = (None,) * max(len(absent), 2)
        armed = []
        for output in self.outputs:
            if output is not None and output[2] is None:
                source, shape, _, dtype = output
                output = (source, shape, signed[source].stride(), dtype)
            armed.append(output)
        self.armed_outputs = tuple(armed)
        self.guard = None
        if _new_guard is not None:
            try:
                tensors = self.take(signed)
                distinct = len({id(value) for value in tensors}) == len(tensors)
                self.guard = (_new_guard if distinct else _aliased_guard)(tensors)
            except Exception:  # noqa: BLE001 (a tensor TensorGuards does not take: key only)
                self.guard = None


def _aliased_guard(tensors):
    """The guard of `tensors` where one object comes twice or more (q_out=q, k=q, cos is sin),
    whose calls a TensorGuards of them all refuses, every one (it checks that its tensors are
    distinct objects): a TensorGuards of each object once, and each repeat the same object
    as its first place's."""
    first = {}
    for place, value in enumerate(tensors):
        first.setdefault(id(value), place)
    unique = sorted(first.values())
    repeats = [place for place, value in enumerate(tensors) if first[id(value)] != place]
    originals = [first[id(tensors[place])] for place in repeats]
    # (itemgetter of one index gives the item itself: twice gives a tuple.)
    again = operator.itemgetter(*(repeats * 2 if len(repeats) == 1 else repeats))
    same = operator.itemgetter(*(originals * 2 if len(originals) == 1 else originals))
    take = (
        operator.itemgetter(*unique)
        if len(unique) > 1
        else lambda values, index=unique[0]: (values[index],)
    )
    check = _new_guard(take(tensors))
    is_ = operator.is_

    def guard(*values):
        return all(map(is_, again(values), same(values))) and check(*take(values))

    return guard


class _Refused:
    """The plan of a signature that gets none (see _NO_PLAN); never the last-plan check's."""

    __slots__ = ()
    recipe = None


# A signature whose views do not start at their tensor's address, or that its recipe's check
# refuses: the general path serves it.
_NO_PLAN = _Refused()


def _unconverted_rope(library):
    """library's rope_jit_rope as a second function object without argtypes (made once per
    library): a plan passes it the runtime's handle (a ctypes.c_void_p) and a byref() of its
    struct, objects ctypes forwards as they are, which halves the cost of the foreign call
    (about 270 -> 140 ns: no per-argument from_param conversion). Never given a Python int,
    which ctypes would pass as a 32-bit C int."""
    function = library.__dict__.get("_plans_rope")
    if function is None:
        function = library.cdll["rope_jit_rope"]  # a new object: the checked one keeps its types
        function.restype = ctypes.c_int
        function.argtypes = None
        library._plans_rope = function
    return function


def _thread_state(runtime):
    """This thread's plans of `runtime`: a threading.local with `plans` (key -> Plan), the
    last call's key (a list) and plan, which a run of calls of one signature (a model's
    layers, a decode loop) finds by its guard, and `other_plan`, the one used before it (q
    and k rotated by separate calls alternate between two plans)."""
    local = runtime.__dict__.get("_plans")
    if local is None:
        local = runtime.__dict__.setdefault("_plans", threading.local())
    if not hasattr(local, "plans"):
        local.plans = {}
        local.last_key = local.last_plan = local.other_plan = None
    return local


def _plans_of(runtime):
    """This thread's plans of `runtime` (key -> Plan, or _NO_PLAN)."""
    return _thread_state(runtime).plans


def call(runtime, recipe, signed, derived, head, position_offset, q_position_offset):
    """rope_jit_rope through a plan. `signed` and `derived` are torch tensors (or None) as
    `recipe` lists them (`derived` without the recipe's outputs, which the plan makes); `head`
    is (layout, rotary_dim, rotary_offset, style, backward, mrope_sections (a tuple or None),
    mrope_interleaved) plus anything else the caller's signature needs (e.g. whether outputs
    are given): hashable, part of the key. Returns the outputs made (a tuple in the order of
    recipe's `outputs`, None where the source is absent; () for a recipe without outputs), or
    None, having done nothing, when the call is not one for this path (a tensor that is not a
    plain torch tensor, a rotary_dim that is not an int, a signature without a plan); the
    caller then takes the general one. Raises the general path's errors for bad arguments."""
    if type(head[1]) is not int or type(head[2]) is not int or type(head[3]) not in (str, int):
        # A float rotary_dim (or style 0.0) would find an int's plan (16.0 == 16, same hash):
        # the general path refuses it.
        return None
    try:
        state = runtime.__dict__["_plans"]
        last, other = state.last_plan, state.other_plan
    except (KeyError, AttributeError):
        state = _thread_state(runtime)
        last = other = None
    # The last two plans, checked in C (see the module docstring): the same recipe and head,
    # the same tensors absent, and a guard accepting the present ones (their exact types too).
    # Guards switched off (_new_guard None) trust no guard armed before either.
    pointers = None
    refused = ()  # the plans whose guards refused these tensors
    for plan in (last, other) if _new_guard is not None else ():
        if plan is None or plan.recipe is not recipe or plan.guard is None:
            continue
        absent = plan.absent
        try:
            # (A tuple comparison tests identity first: Nones compare without a call. Objects
            # that are not None where None belongs are not tensors: no torch tensor equals
            # None, and an object whose comparison raises (here or in the head: a tensor among
            # mrope_sections) takes the key, which gives the call to the general path.)
            if plan.head != head or (absent is not None and absent(signed) != plan.nones):
                continue
            present = plan.take(signed)
            if not plan.guard(*present):
                refused += (plan,)
                continue
        except (ValueError, TypeError, RuntimeError):
            break
        pointers = list(map(_data_ptr, present))
        for value in derived:
            if value is not None:
                pointers.append(value.data_ptr())
        if plan is other:
            state.last_plan, state.other_plan, state.last_key = other, last, other.key
        break
    if pointers is None:
        plan, pointers, made = _find(runtime, state, recipe, signed, derived, head, refused)
        if plan is None:
            return None
        if made is None:
            made = _make_outputs(plan, plan.outputs, signed, pointers) if plan.outputs else ()
    else:
        outputs = plan.armed_outputs  # (the guard accepted the tensors they were read from)
        made = _make_outputs(plan, outputs, signed, pointers) if outputs else ()
    written = plan.written
    if written is not None:
        written = written(signed)
        _torch_writes.check(written, plan.written_names)
    device = plan.cuda_device
    values = plan.values
    values[0] = position_offset
    values[1] = q_position_offset
    values[3] = _raw_stream(device) if device >= 0 else 0
    values[5::2] = pointers
    try:
        plan.pack(plan.buffer, _POSITION_OFFSET, *values)
    except struct.error:
        c_int(position_offset, "position_offset", 64)  # raises the error that names it
        c_int(q_position_offset, "q_position_offset", 64)
        raise
    # Runtime._call, written out on this hot path: counted in flight before the handle is read.
    calls = runtime._calls
    calls.append(None)
    try:
        handle = runtime._handle
        status = plan.function(handle if handle is not None else runtime.handle, plan.args_ref)
    finally:
        calls.pop()
    if status:
        runtime.library.check("rope_jit_rope", status)
    if written is not None:
        _torch_writes.mark(written)
    return made


def _find(runtime, state, recipe, signed, derived, head, refused):
    """(plan, pointers of the signed and derived tensors, built) by the call's key, the plan
    built when the key is new: then `built` holds the outputs the build made (as call returns
    them; their pointers follow in `pointers`), else it is None. (None, None, None) when the
    call is not one for this path (see call). `refused` are the plans whose guards refused
    these tensors."""
    types = TORCH_TENSOR_TYPES
    # The key: the recipe, head, and per signed tensor its (shape, strides, dtype, device)
    # (None where absent); one tuple per tensor compares and hashes faster than four entries.
    # A contiguous tensor's strides are True: is_contiguous() is cheaper than stride(), and
    # contiguous tensors of one shape differ at most in the strides of size-1 dimensions,
    # which address nothing (index 0 only), so the plan's strides serve them all.
    key = [recipe, head]
    append = key.append
    pointers = []
    add_pointer = pointers.append
    try:
        for value in signed:
            if value is None:
                append(None)
            elif type(value) in types:
                if value.is_meta or value.is_neg():
                    # Meta tensors take the ops (their fake kernels); a lazily negated view
                    # the general path, which refuses it (its memory holds -value).
                    return None, None, None
                append((value.shape, value.is_contiguous() or value.stride(), value.dtype,
                        value.device))
                add_pointer(value.data_ptr())
            else:
                return None, None, None
        for value in derived:
            if value is not None:
                add_pointer(value.data_ptr())
        if key == state.last_key:
            plan, frozen = state.last_plan, None
        else:
            frozen = tuple(key)
            plan = state.plans.get(frozen)
    except (TypeError, AttributeError, RuntimeError, ValueError):
        # Not plain strided torch tensors, an unhashable argument, or one whose comparison
        # raises (an array among mrope_sections): the general path names it.
        return None, None, None
    built = None
    if frozen is not None:
        if plan is None:
            plan, built = _build(runtime, recipe, signed, derived, head, key)
            if len(state.plans) >= MAX_PLANS:
                state.plans.clear()
            state.plans[frozen] = plan
            if plan is not _NO_PLAN:
                plan.key = key
                pointers += [output.data_ptr() for output in built if output is not None]
        if plan is not state.last_plan:
            state.other_plan = state.last_plan
        state.last_key, state.last_plan = key, plan
    if plan is _NO_PLAN:
        return None, None, None
    if _new_guard is not None and (plan.take is None or plan in refused):
        # A plan never armed (new, or built while guards were off), or one whose guard refused
        # these tensors although their key is its own (requires_grad changed, size-1 strides,
        # a Parameter, one tensor given twice or no longer): check these from now on.
        plan.arm(signed)
    return plan, pointers, built


def _make_outputs(plan, outputs, signed, pointers):
    """The recipe's outputs of this call (`outputs`: plan.outputs or plan.armed_outputs),
    their pointers added to `pointers`. torch.empty_like's where the allocator cannot stand in
    for it: another current CUDA device than the tensors', or deterministic algorithms
    (empty_like then fills)."""
    allocate = plan.allocate
    if allocate is not None and (
        _deterministic() or (plan.other_devices and _cuda_device() != plan.cuda_device)
    ):
        allocate = None
    made = []
    for output in outputs:
        if output is None:
            made.append(None)
            continue
        source, shape, strides, dtype = output
        if allocate is None:
            tensor = _empty_like(signed[source])
        else:
            try:
                tensor = allocate(
                    shape, signed[source].stride() if strides is None else strides, dtype
                )
            except Exception:  # noqa: BLE001 (see below)
                # A private function, self-tested at import on the CPU only: a torch that
                # changed it raises here. empty_like's error (out of memory) is the caller's;
                # where empty_like succeeds, the allocator was at fault: dropped.
                tensor = _empty_like(signed[source])
                _drop_allocator(plan, allocate)
                allocate = None
        made.append(tensor)
        pointers.append(tensor.data_ptr())
    return tuple(made)


def _drop_allocator(plan, allocate):
    """Outputs through empty_like from now on, where they came from `allocate`: this plan's,
    and every plan built later (a plan built before drops it at its own first failure)."""
    plan.allocate = None
    for device, known in list(_ALLOCATORS.items()):
        if known is allocate:
            _ALLOCATORS.pop(device, None)


def _build(runtime, recipe, signed, derived, head, key):
    """(plan, outputs) of this call's signature (every check of the general path runs here):
    the plan, or _NO_PLAN when a view does not start at its tensor's address or the recipe's
    check refuses the signature; the recipe's outputs made for this call (None where the
    source is absent; () for _NO_PLAN). `key` is the call's key."""
    # (rope imports this module: imported here, on first use)
    from .rope import _POINTER_OFFSETS, _TENSOR_NAMES, _written_names, build_args

    if recipe.check is not None and not recipe.check(signed, head):
        return _NO_PLAN, ()
    # The recipe's outputs as the reference makes them: the plan's DLTensors describe these,
    # and its later outputs repeat their shapes, strides and dtypes.
    outputs = tuple(
        None if signed[source] is None else _empty_like(signed[source])
        for source in recipe.outputs
    )
    derived = tuple(derived) + outputs
    values = recipe.values(signed, derived)
    for slot, _ in recipe.views:
        original = signed[recipe.signed.index(slot)]
        if original is not None and values[slot].data_ptr() != original.data_ptr():
            return _NO_PLAN, ()  # a copy, not a view: its address changes every call
    layout, rotary_dim, rotary_offset, style, backward, mrope_sections, mrope_interleaved = head[:7]
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
    # The TensorArgs, in field order, and the order the call passes pointers in.
    tensor_args = iter(item for item in held if hasattr(item, "keepalive"))
    by_slot = {slot: next(tensor_args) for slot, value in enumerate(values) if value is not None}
    order = [slot for slot, value in zip(recipe.signed, signed) if value is not None]
    order += [slot for slot, value in zip(recipe.derived, derived) if value is not None]

    # One buffer: the struct, then each DLTensor (with its shape and strides) in call order.
    args_size = ctypes.sizeof(args)
    places, end = [], (args_size + _WORD - 1) // _WORD * _WORD
    for slot in order:
        places.append(end)
        end += (ctypes.sizeof(by_slot[slot].struct) + _WORD - 1) // _WORD * _WORD
    buffer = (ctypes.c_uint64 * (end // _WORD))()
    base = ctypes.addressof(buffer)
    ctypes.memmove(base, ctypes.addressof(args), args_size)
    for slot, place in zip(order, places):
        tensor = by_slot[slot]
        size = ctypes.sizeof(tensor.struct)
        ctypes.memmove(base + place, tensor.address, size)
        # The shape and strides arrays live inside the DLTensor object: point at the copies.
        relocated = [
            pointer - tensor.address + base + place
            if tensor.address <= pointer < tensor.address + size
            else pointer
            for pointer in _POINTER_PAIR.unpack_from(buffer, place + _DLTENSOR_SHAPE)
        ]
        _POINTER_PAIR.pack_into(buffer, place + _DLTENSOR_SHAPE, *relocated)
        s.POINTER_FIELD.pack_into(buffer, _POINTER_OFFSETS[_TENSOR_NAMES[slot]], base + place)
    # What a call writes, in buffer order: the offsets, the stream, each DLTensor's data. One
    # pack_into writes them all; struct would zero the bytes between them ("x" padding), so
    # those go in as "s" fields holding the buffer's own bytes (constant once built).
    fields = [(_POSITION_OFFSET + 8, "q"), (_STREAM_OFFSET, "P")]
    fields += [(place, "P") for place in places]
    contents = bytes(buffer)
    pack_format, template, at = "@q", [0], _POSITION_OFFSET + _WORD
    for offset, code in fields:
        if offset > at:
            pack_format += f"{offset - at}s"
            template.append(contents[at:offset])
        pack_format += code
        template.append(0)
        at = offset + _WORD
    packer = struct.Struct(pack_format)
    if packer.size != at - _POSITION_OFFSET:
        raise RuntimeError("rope_jit: unexpected padding in a plan's pack format")
    # Where the call's values go in the template: offsets, stream, pointers (every other one,
    # a gap between each two).
    if len(template) != 4 + 2 * len(places) or not all(
        type(gap) is bytes for gap in template[2::2]
    ):
        raise RuntimeError("rope_jit: unexpected gaps in a plan's pack format")

    cuda_device = -1
    for tensor in by_slot.values():
        if tensor.struct.device.device_type == s.KDL_CUDA:
            cuda_device = tensor.struct.device.device_id
            break
    if cuda_device >= 0:
        # Plans are per thread: this thread's context is checked once, before its first launch.
        checked = _cuda_context.checked_devices()
        if checked is None or cuda_device not in checked:
            _cuda_context.ensure_current(cuda_device)
    outside = [item for item in held if not hasattr(item, "keepalive")]
    args_view = s.RopeArgs.from_buffer(buffer)
    plan = Plan(
        buffer, args_view, packer.pack_into, template, cuda_device, outside,
        _unconverted_rope(library),
    )
    plan.recipe, plan.head = recipe, head
    written_names = _written_names(values)
    places = [
        place
        for place, slot in enumerate(recipe.signed)
        if signed[place] is not None and _TENSOR_NAMES[slot] in written_names
    ]
    if places:  # (itemgetter of one index gives the item itself, not a tuple)
        plan.written = (
            operator.itemgetter(*places)
            if len(places) > 1
            else lambda values, index=places[0]: (values[index],)
        )
        plan.written_names = tuple(_TENSOR_NAMES[recipe.signed[place]] for place in places)
    # empty_like's strides depend only on the source's sizes and strides, which the key holds,
    # except a contiguous source's (True in the key): then they are its own strides, read per
    # call (strides of size-1 dimensions may differ between calls).
    plan.outputs = tuple(
        None
        if output is None
        else (source, tuple(output.shape), None if key[2 + source][1] is True else output.stride(),
              output.dtype)
        for source, output in zip(recipe.outputs, outputs)
    )
    made = [output for output in outputs if output is not None]
    if made:
        plan.allocate = _ALLOCATORS.get(made[0].device.type)
        # With one visible GPU the current device is the tensors': no need to ask per call.
        plan.other_devices = cuda_device >= 0 and sys.modules["torch"].cuda.device_count() > 1
    return plan, outputs
