"""Tensors to DLTensors without copying: PyTorch, NumPy, and anything that speaks DLPack.

`as_tensor(obj)` returns a TensorArg: a ctypes DLTensor describing obj's memory (data pointer,
device, dtype, shape, strides in elements), plus references that keep that memory alive while
the C call runs. Three paths, fastest first:

  * torch.Tensor: the DLTensor is filled from data_ptr(), shape, stride(), dtype and device.
    No capsule, and no stream synchronization (tensor.__dlpack__(stream=...) may insert one).
  * numpy.ndarray: from __array_interface__ (byte strides converted to elements). This also
    takes read-only arrays (used as inputs) and ml_dtypes' bfloat16 arrays, which NumPy's own
    __dlpack__ refuses.
  * anything else with __dlpack__ / __dlpack_device__ (CuPy, JAX, TensorFlow...): the DLPack
    capsule. Its DLManagedTensor is read, the capsule is kept alive for the call and left
    unconsumed, so its destructor (not this package) calls the producer's deleter afterwards.

Nothing is ever copied: when a layout cannot be described (byte strides that are not whole
elements, an unsupported device), the call fails with a message naming the argument.
"""

import ctypes
import operator
import struct
import sys

from . import _structs as s

# name -> DLDataType (code, bits). "bool" follows DLPack 0.6's convention (one-byte unsigned).
DTYPES = {
    "float32": (s.KDL_FLOAT, 32),
    "float16": (s.KDL_FLOAT, 16),
    "bfloat16": (s.KDL_BFLOAT, 16),
    "float64": (s.KDL_FLOAT, 64),
    "int32": (s.KDL_INT, 32),
    "int64": (s.KDL_INT, 64),
    "int16": (s.KDL_INT, 16),
    "int8": (s.KDL_INT, 8),
    "uint8": (s.KDL_UINT, 8),
    "uint16": (s.KDL_UINT, 16),
    "bool": (s.KDL_UINT, 8),
    "float8_e4m3fn": (s.KDL_FLOAT8_E4M3FN, 8),
}
_DTYPE_NAMES = {}
for _name, _code_bits in DTYPES.items():
    _DTYPE_NAMES.setdefault(_code_bits, _name)

_DEVICE_NAMES = {s.KDL_CPU: "cpu", s.KDL_CUDA: "cuda"}

# ------------------------------------------------------------------------------------------
# One ctypes object per tensor
# ------------------------------------------------------------------------------------------
#
# A TensorArg is built for every tensor of every call, so its DLTensor is made the cheapest
# way ctypes allows: one object, a DLTensor with its shape and strides arrays appended, filled
# by one struct.pack_into (0.9 us a tensor, where separate shape and stride arrays, a DLTensor
# built from its fields and a ctypes.pointer took 3: ctypes fills those one value at a time).

# DLTensor's fields as struct packs them natively: data, device (type, id), ndim, dtype (code,
# bits, lanes), shape, strides, byte_offset. The shape and stride values follow.
_DLTENSOR_FORMAT = "@PiiiBBHPPQ"
if struct.calcsize(_DLTENSOR_FORMAT) != ctypes.sizeof(s.DLTensor):
    raise ImportError("rope_jit: the DLTensor packing format does not match the ctypes mirror")


def _new_storage_layout(ndim):
    """(ctype, pack_into, shape_offset, strides_offset): a DLTensor class for `ndim` dims with
    its shape and strides arrays appended, the packer that fills one in a call, and where the
    arrays lie in it. Made on first use of each ndim."""
    length = max(ndim, 1)  # at least one element, so a 0-d tensor still points at an array

    class DLTensorWithIndices(s.DLTensor):
        _fields_ = [("shape_values", ctypes.c_int64 * length), ("stride_values", ctypes.c_int64 * length)]

    shape_offset = DLTensorWithIndices.shape_values.offset
    strides_offset = DLTensorWithIndices.stride_values.offset
    if shape_offset != ctypes.sizeof(s.DLTensor) or strides_offset != shape_offset + 8 * length:
        raise RuntimeError("rope_jit: unexpected padding after the DLTensor mirror")
    packer = struct.Struct(f"{_DLTENSOR_FORMAT}{ndim}q{length - ndim}x{ndim}q")
    layout = (DLTensorWithIndices, packer.pack_into, shape_offset, strides_offset)
    # Two threads may both make one: either is correct, and setdefault keeps one.
    return _storage_layouts.setdefault(ndim, layout)


_storage_layouts = {}  # ndim -> _new_storage_layout(ndim)
_addressof = ctypes.addressof  # a module global: one attribute lookup less per tensor


class TensorArg:
    """One tensor as the C API sees it. `struct` is the DLTensor (its shape and strides arrays
    live in the same object); `address` is where it lies, for filling arg structs;
    `pointer` is a new POINTER(DLTensor) to it.

    `struct` and `keepalive` (the producer object, a DLPack capsule...) live as long as this
    object, so it must outlive the C call that uses `address` or `pointer`. `readonly` marks
    memory the producer does not allow to be written (a read-only NumPy array): as_tensor
    refuses it as an output, also through with_dtype and with_dims_swapped views.
    """

    __slots__ = ("struct", "address", "shape", "strides", "keepalive", "readonly")

    def __init__(self, data, device_type, device_id, dtype, shape, strides, byte_offset=0, keepalive=(),
                 readonly=False):
        # Kept lean: it runs for every tensor of every call.
        self.shape = shape = shape if type(shape) is tuple else tuple(shape)
        self.strides = strides = strides if type(strides) is tuple else tuple(strides)
        self.keepalive = keepalive
        self.readonly = readonly
        ndim = len(shape)
        ctype, pack_into, shape_offset, strides_offset = (_storage_layouts.get(ndim)
                                                          or _new_storage_layout(ndim))
        self.struct = tensor = ctype()
        self.address = address = _addressof(tensor)
        pack_into(tensor, 0, data or 0, device_type, device_id, ndim, dtype[0], dtype[1], 1,
                  address + shape_offset, address + strides_offset, byte_offset, *shape, *strides)

    @property
    def pointer(self):
        """A POINTER(DLTensor) to `struct` (for a ctypes field or argument of that type)."""
        return s.DLTensorPointer(self.struct)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def device(self):
        """(device_type, device_id) as DLPack numbers: (1, 0) for the CPU, (2, n) for cuda:n."""
        return (self.struct.device.device_type, self.struct.device.device_id)

    @property
    def dtype(self):
        """The dtype's name ("float32", "bfloat16"...), or "code:bits" for one not in DTYPES."""
        code_bits = (self.struct.dtype.code, self.struct.dtype.bits)
        return _DTYPE_NAMES.get(code_bits, f"{code_bits[0]}:{code_bits[1]}")

    @property
    def data(self):
        return self.struct.data or 0

    def with_dims_swapped(self, a, b):
        """The same memory with dims a and b exchanged (a view: a [B,S,H,D] buffer as its
        [B,H,S,D] transpose)."""
        shape, strides = list(self.shape), list(self.strides)
        shape[a], shape[b] = shape[b], shape[a]
        strides[a], strides[b] = strides[b], strides[a]
        code_bits = (self.struct.dtype.code, self.struct.dtype.bits)
        return TensorArg(self.struct.data, *self.device, code_bits, shape, strides,
                         self.struct.byte_offset, self.keepalive, self.readonly)

    def with_dtype(self, dtype):
        """The same memory read as another dtype of the same size (see `reinterpret`)."""
        code_bits = DTYPES[dtype]
        return TensorArg(self.struct.data, *self.device, code_bits, self.shape, self.strides,
                         self.struct.byte_offset, self.keepalive, self.readonly)

    def __repr__(self):
        device = _DEVICE_NAMES.get(self.device[0], str(self.device[0]))
        return (f"TensorArg({self.dtype}, shape={list(self.shape)}, strides={list(self.strides)}, "
                f"device={device}:{self.device[1]})")


def contiguous_strides(shape):
    """C-contiguous strides, in elements, of `shape`."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def from_pointer(data, shape, dtype, strides=None, device="cpu", keepalive=None):
    """A TensorArg for raw memory: `data` an address (int), `shape` a sequence, `dtype` a name
    from DTYPES, `strides` in elements (None = C-contiguous), `device` "cpu", "cuda" or
    "cuda:N". The caller keeps the memory alive (pass its owner as `keepalive` to tie it to
    the TensorArg)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    device_type = s.KDL_CPU if kind == "cpu" else s.KDL_CUDA
    device_index = int(index) if index.isdecimal() else -1 if index else 0
    if not 0 <= device_index < (1 << 31) or (kind == "cpu" and index):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N' (N a device index), "
                         f"got {device!r}")
    # An address: a Python int of the address space (a float was truncated, a negative one
    # wrapped to a wild address that crashed the process).
    address = operator.index(data)
    if not 0 <= address < (1 << 64):
        raise ValueError(f"data: an address must be in [0, 2^64), got {address}")
    # Python ints (a TypeError for anything else, as before): struct packs them.
    shape = tuple(operator.index(extent) for extent in shape)
    strides = contiguous_strides(shape) if strides is None else tuple(operator.index(step) for step in strides)
    if len(strides) != len(shape):
        raise ValueError(f"strides: {len(strides)} values for {len(shape)} dimensions")
    # DLPack's int64 fields (a contiguous stride past them comes from extents that are).
    for name, values in (("shape", shape), ("strides", strides)):
        if any(not -(1 << 63) <= value < (1 << 63) for value in values):
            raise ValueError(f"{name}: {list(values)} does not fit DLPack's int64 fields")
    return TensorArg(address, device_type, device_index, DTYPES[dtype], shape, strides,
                     keepalive=(keepalive,))


def reinterpret(obj, dtype):
    """obj's memory read as `dtype` (same element size), without a copy. For frameworks with
    no bfloat16 type: reinterpret(numpy_uint16_array, "bfloat16") passes bf16 data whose raw
    bits the array holds. Writes through the result land in obj."""
    tensor = as_tensor(obj, "tensor")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if DTYPES[dtype][1] != tensor.struct.dtype.bits:
        raise ValueError(f"dtype: {dtype} has {DTYPES[dtype][1]} bits, the tensor's elements have "
                         f"{tensor.struct.dtype.bits}")
    return tensor.with_dtype(dtype)


# ------------------------------------------------------------------------------------------
# The three paths
# ------------------------------------------------------------------------------------------

def _swapped(shape, strides, swap_dims):
    """shape and strides with dims swap_dims = (a, b) exchanged, as tuples; unchanged when None
    or when there are not enough dims (the caller reports that)."""
    if not swap_dims:
        return shape, strides
    a, b = swap_dims
    if len(shape) <= a or len(shape) <= b:
        return shape, strides
    shape, strides = list(shape), list(strides)
    shape[a], shape[b] = shape[b], shape[a]
    strides[a], strides[b] = strides[b], strides[a]
    return tuple(shape), tuple(strides)


def _module_of(obj):
    return type(obj).__module__.partition(".")[0]


def _torch_dtypes(torch):
    return {
        torch.float32: DTYPES["float32"],
        torch.float16: DTYPES["float16"],
        torch.bfloat16: DTYPES["bfloat16"],
        torch.float64: DTYPES["float64"],
        torch.int32: DTYPES["int32"],
        torch.int64: DTYPES["int64"],
        torch.int16: DTYPES["int16"],
        torch.int8: DTYPES["int8"],
        torch.uint8: DTYPES["uint8"],
        torch.bool: DTYPES["bool"],
        # FP8 KV caches and q_out (torch >= 2.1).
        **(
            {torch.float8_e4m3fn: DTYPES["float8_e4m3fn"]}
            if hasattr(torch, "float8_e4m3fn")
            else {}
        ),
    }


# What the torch path looks up once, on its first torch tensor (this package never imports
# torch itself): the dtype table, torch.strided, and whether torch is a ROCm build, whose
# "cuda" tensors are HIP memory that the library cannot use.
_torch_dtype_map = None
_torch_strided = None
_torch_is_hip = False


def _init_torch(torch):
    global _torch_dtype_map, _torch_strided, _torch_is_hip
    _torch_strided = torch.strided
    _torch_is_hip = bool(getattr(torch.version, "hip", None))
    _torch_dtype_map = _torch_dtypes(torch)  # last: once it is set, the rest is


def _from_torch(tensor, name, swap_dims=None):
    if _torch_dtype_map is None:
        _init_torch(sys.modules["torch"])
    if tensor.layout != _torch_strided:
        raise ValueError(f"{name}: {tensor.layout} tensors are not supported (strided only)")
    dtype = _torch_dtype_map.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported")
    if tensor.is_neg():  # a lazy negation (x.conj().imag...): its memory holds -tensor
        raise ValueError(f"{name}: the tensor has its negative bit set; pass {name}.resolve_neg()")
    # is_cuda, get_device() and is_cpu read the device without building a torch.device (as
    # tensor.device does on every access) and its type string: a few times cheaper.
    if tensor.is_cuda and not _torch_is_hip:
        device_type, device_id = s.KDL_CUDA, tensor.get_device()
    elif tensor.is_cpu:
        device_type, device_id = s.KDL_CPU, 0
    else:
        raise ValueError(f"{name}: tensors on {tensor.device} are not supported (CPU or CUDA only)")
    shape, strides = tensor.shape, tensor.stride()
    if swap_dims:
        shape, strides = _swapped(shape, strides, swap_dims)
    return TensorArg(tensor.data_ptr(), device_type, device_id, dtype, shape, strides, 0, (tensor,))


_numpy_dtype_codes = {}  # numpy dtype -> (code, bits): dtype.name is slow, and runs per tensor


def _numpy_dtype(dtype, name):
    code_bits = _numpy_dtype_codes.get(dtype)
    if code_bits is None:
        code_bits = _numpy_dtype_codes[dtype] = _numpy_dtype_uncached(dtype, name)
    return code_bits


def _numpy_dtype_uncached(dtype, name):
    # First: ml_dtypes' bfloat16 has a byte order too (one byte has none that matters).
    big_endian = dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")
    if big_endian and dtype.itemsize > 1:
        raise ValueError(f"{name}: big-endian arrays are not supported")
    if dtype.name in ("bfloat16", "float8_e4m3fn"):  # ml_dtypes
        return DTYPES[dtype.name]
    if dtype.name in DTYPES:
        return DTYPES[dtype.name]
    raise ValueError(f"{name}: dtype {dtype} is not supported")


def _from_numpy(array, name, writable, swap_dims=None):
    interface = array.__array_interface__
    address, readonly = interface["data"]
    if writable and readonly:
        raise ValueError(f"{name}: the array is read-only, and it is written to")
    itemsize = array.itemsize
    strides = []
    for axis, stride in enumerate(array.strides):
        if stride % itemsize != 0:
            raise ValueError(f"{name}: stride {stride} bytes of axis {axis} is not a whole number of "
                             f"{itemsize}-byte elements")
        strides.append(stride // itemsize)
    shape = array.shape
    if swap_dims:
        shape, strides = _swapped(shape, strides, swap_dims)
    return TensorArg(address, s.KDL_CPU, 0, _numpy_dtype(array.dtype, name), shape, strides, 0, (array,),
                     readonly)


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]


# The most dims a DLPack tensor may declare here: far above any tensor this package takes (the
# C API's checks name the real limits), low enough that a producer's garbage ndim is refused
# before its shape is read.
_DLPACK_MAX_DIMS = 64


def _dlpack_device(obj, name):
    """(device type, device id) from obj.__dlpack_device__(), or a ValueError naming `name`
    when the producer answers something else."""
    answer = obj.__dlpack_device__()
    try:
        device_type, device_id = answer
        return operator.index(device_type), operator.index(device_id)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: __dlpack_device__() returned {answer!r}, not a (device type, "
                         f"device id) pair of integers") from None


def _dlpack_managed(capsule, name):
    """The DLManagedTensor(Versioned) in a capsule from __dlpack__, or a ValueError naming
    `name` for anything else (another object, a capsule already consumed)."""
    if type(capsule).__name__ != "PyCapsule":
        raise ValueError(f"{name}: __dlpack__() returned {type(capsule).__name__}, not a DLPack "
                         f"capsule")
    capsule_name = _capsule_get_name(capsule)
    if capsule_name == b"dltensor_versioned":
        managed = s.DLManagedTensorVersioned.from_address(
            _capsule_get_pointer(capsule, b"dltensor_versioned"))
        if managed.version.major != s.DLPACK_MAJOR_VERSION:
            raise ValueError(f"{name}: DLPack version {managed.version.major}."
                             f"{managed.version.minor} is not supported")
        return managed, bool(managed.flags & s.DLPACK_FLAG_READ_ONLY)
    if capsule_name == b"dltensor":
        return s.DLManagedTensor.from_address(_capsule_get_pointer(capsule, b"dltensor")), False
    shown = capsule_name.decode(errors="replace") if capsule_name is not None else None
    raise ValueError(f"{name}: __dlpack__() returned a capsule named {shown!r}, not "
                     f"'dltensor' or 'dltensor_versioned' (a capsule is consumed once)")


def _from_dlpack(obj, name, writable, stream, swap_dims=None):
    device_type, device_id = _dlpack_device(obj, name)
    if device_type not in (s.KDL_CPU, s.KDL_CUDA):
        raise ValueError(f"{name}: DLPack device type {device_type} is not supported (CPU or CUDA only)")
    # DLPack 1.0 first (it says whether the memory is read-only, and producers such as NumPy
    # export read-only memory only that way), then the older protocol for older producers.
    # The producer makes CUDA data ready on the stream the consumer will use; per the array
    # API, 1 means the legacy default stream (0 is not allowed for CUDA).
    asks = [{"max_version": (s.DLPACK_MAJOR_VERSION, 0)}, {}]
    if device_type == s.KDL_CUDA:
        asks = [dict(ask, stream=int(stream) if stream else 1) for ask in asks] + [{}]
    for index, ask in enumerate(asks):
        try:
            capsule = obj.__dlpack__(**ask)
            break
        # (Producers refuse an argument they do not take in different ways: array-api-strict
        # 2.0 raises NotImplementedError for max_version.)
        except (TypeError, BufferError, NotImplementedError):
            if index == len(asks) - 1:
                raise
    managed, readonly = _dlpack_managed(capsule, name)
    if writable and readonly:
        raise ValueError(f"{name}: the tensor's memory is read-only, and it is written to")
    tensor = managed.dl_tensor
    ndim = tensor.ndim
    if not 0 <= ndim <= _DLPACK_MAX_DIMS or (ndim > 0 and not tensor.shape):
        raise ValueError(f"{name}: the DLPack tensor declares {ndim} dims"
                         f"{'' if tensor.shape else ' and no shape'}; 0 to {_DLPACK_MAX_DIMS} dims "
                         f"with a shape are read")
    shape = [tensor.shape[i] for i in range(ndim)]
    strides = [tensor.strides[i] for i in range(ndim)] if tensor.strides else contiguous_strides(shape)
    code, bits = tensor.dtype.code, tensor.dtype.bits
    if tensor.dtype.lanes != 1:
        raise ValueError(f"{name}: vector dtypes (lanes={tensor.dtype.lanes}) are not supported")
    if code == s.KDL_BOOL:
        code, bits = DTYPES["bool"]
    # The capsule stays unconsumed (its name unchanged), so its destructor calls the deleter
    # once the TensorArg (which holds it) is gone: after the C call.
    shape, strides = _swapped(shape, strides, swap_dims)
    return TensorArg(tensor.data, tensor.device.device_type, tensor.device.device_id, (code, bits), shape,
                     strides, tensor.byte_offset, keepalive=(obj, capsule), readonly=readonly)


# The exact classes of torch and NumPy tensors, once those modules are imported (by the
# caller: this package imports neither). as_tensor tests them first with `type(obj) is`, one
# identity test for the common case; subclasses (nn.Parameter, np.matrix...) take the general
# path, whose isinstance chain is the contract.
_torch_tensor_class = None
_numpy_array_class = None


def _torch_tensor():
    """torch.Tensor, or None while torch is not imported."""
    global _torch_tensor_class
    if _torch_tensor_class is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            _torch_tensor_class = torch.Tensor
    return _torch_tensor_class


def _numpy_array():
    """numpy.ndarray, or None while NumPy is not imported."""
    global _numpy_array_class
    if _numpy_array_class is None:
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            _numpy_array_class = numpy.ndarray
    return _numpy_array_class


def is_torch_tensor(obj):
    tensor_class = _torch_tensor()
    return tensor_class is not None and isinstance(obj, tensor_class)


def as_tensor(obj, name, writable=False, stream=None, swap_dims=None):
    """obj as a TensorArg (see the module docstring). `name` names the argument in messages;
    `writable` refuses read-only memory (NumPy's flag, DLPack 1.0's); `stream` (an int
    CUstream, 0 or None for the default stream) is the stream a CUDA DLPack producer is told
    the call will use;
    `swap_dims` (a, b) describes the view with dims a and b exchanged (as with_dims_swapped,
    without building the TensorArg twice: this runs for every tensor of every call)."""
    # Neither class is None here once its module is imported; before that, `type(obj) is None`
    # is simply false.
    obj_class = type(obj)
    if obj_class is _torch_tensor_class:
        return _from_torch(obj, name, swap_dims)
    if obj_class is _numpy_array_class:
        return _from_numpy(obj, name, writable, swap_dims)
    if isinstance(obj, TensorArg):
        if writable and obj.readonly:
            raise ValueError(f"{name}: the tensor's memory is read-only, and it is written to")
        return obj.with_dims_swapped(*swap_dims) if swap_dims and obj.ndim > max(swap_dims) else obj
    if is_torch_tensor(obj):
        return _from_torch(obj, name, swap_dims)
    numpy_array = _numpy_array()
    if numpy_array is not None and isinstance(obj, numpy_array):
        return _from_numpy(obj, name, writable, swap_dims)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, name, writable, stream, swap_dims)
    raise TypeError(f"{name}: expected a tensor (torch, numpy, or any object with __dlpack__), "
                    f"got {type(obj).__name__}")


def shares_memory(a, b):
    """Whether some byte of an element of TensorArg a is a byte of an element of b: the rule
    the library applies to what a call writes (rope_jit_tensors_share_memory), exact for views
    that interleave in one buffer (q and k of a fused qkv share nothing). Reads no memory.
    None where the library is too old to have the function."""
    return _tensor_query("rope_jit_tensors_share_memory", a, b)


def has_distinct_elements(a):
    """Whether no two indices of TensorArg a address the same element, as the library judges
    each tensor a call writes (rope_jit_tensor_has_distinct_elements). Reads no memory. None
    where the library is too old to have the function."""
    return _tensor_query("rope_jit_tensor_has_distinct_elements", a)


def _tensor_query(name, *tensors):
    """The library's yes-or-no query `name`(tensors' DLTensors..., int* answer), or None where
    the loaded library lacks it (bound once per library)."""
    from . import _library  # (here: this module is also used without the library)

    library = _library.load()
    query = library.tensor_queries.get(name, False)
    if query is False:
        query = library.optional(
            name, ctypes.c_int,
            [s.DLTensorPointer] * len(tensors) + [ctypes.POINTER(ctypes.c_int)])
        library.tensor_queries[name] = query
    if query is None:
        return None
    answer = ctypes.c_int(0)
    library.check(name, query(*(tensor.pointer for tensor in tensors), ctypes.byref(answer)))
    return answer.value != 0


def torch_stream_of(objs):
    """PyTorch's current CUDA stream (as an int) on the device of the first CUDA torch tensor in
    objs, or None when none is one."""
    tensor_class = _torch_tensor()
    if tensor_class is None:
        return None
    for obj in objs:
        if isinstance(obj, tensor_class) and obj.is_cuda:
            return _torch_current_stream(obj)
    return None


_NOT_LOOKED_UP = object()
_torch_raw_stream = _NOT_LOOKED_UP  # torch._C._cuda_getCurrentRawStream, or None without it


def _torch_current_stream(tensor):
    """torch.cuda.current_stream(tensor.device).cuda_stream, for a CUDA tensor.

    torch._C._cuda_getCurrentRawStream(index) returns that same cudaStream_t (both read
    at::cuda::getCurrentCUDAStream(index)) without building a torch.cuda.Stream, in a tenth
    of the time; TorchInductor's generated code calls it for every launch. It is private, so
    a torch without it gets the public call."""
    global _torch_raw_stream
    if _torch_raw_stream is _NOT_LOOKED_UP:
        _torch_raw_stream = getattr(sys.modules["torch"]._C, "_cuda_getCurrentRawStream", None)
    if _torch_raw_stream is not None:
        return _torch_raw_stream(tensor.get_device())
    return sys.modules["torch"].cuda.current_stream(tensor.device).cuda_stream
