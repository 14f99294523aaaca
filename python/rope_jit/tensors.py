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
}
_DTYPE_NAMES = {}
for _name, _code_bits in DTYPES.items():
    _DTYPE_NAMES.setdefault(_code_bits, _name)

_DEVICE_NAMES = {s.KDL_CPU: "cpu", s.KDL_CUDA: "cuda"}

# int64_t[ndim] array types by ndim (at least one element, so a 0-d tensor still has arrays).
_INDEX_ARRAYS = [ctypes.c_int64 * max(ndim, 1) for ndim in range(65)]


class TensorArg:
    """One tensor as the C API sees it. `struct` is the DLTensor; `pointer` points at it.

    The shape and stride arrays and `keepalive` (the producer object, a DLPack capsule...)
    live as long as this object, so it must outlive the C call that uses `pointer`.
    """

    __slots__ = ("struct", "pointer", "shape", "strides", "keepalive", "_shape_array", "_stride_array")

    def __init__(self, data, device_type, device_id, dtype, shape, strides, byte_offset=0, keepalive=()):
        # Kept lean: it runs for every tensor of every call.
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.strides = strides if type(strides) is tuple else tuple(strides)
        self.keepalive = keepalive
        array_type = _INDEX_ARRAYS[len(self.shape)]
        self._shape_array = array_type(*self.shape)
        self._stride_array = array_type(*self.strides)
        self.struct = s.DLTensor(data or None, s.DLDevice(device_type, device_id), len(self.shape),
                                 s.DLDataType(dtype[0], dtype[1], 1), self._shape_array, self._stride_array,
                                 byte_offset)
        self.pointer = ctypes.pointer(self.struct)

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
                         self.struct.byte_offset, self.keepalive)

    def with_dtype(self, dtype):
        """The same memory read as another dtype of the same size (see `reinterpret`)."""
        code_bits = DTYPES[dtype]
        return TensorArg(self.struct.data, *self.device, code_bits, self.shape, self.strides,
                         self.struct.byte_offset, self.keepalive)

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
    strides = contiguous_strides(shape) if strides is None else strides
    if len(strides) != len(shape):
        raise ValueError(f"strides: {len(strides)} values for {len(shape)} dimensions")
    return TensorArg(int(data), device_type, int(index or 0), DTYPES[dtype], shape, strides,
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
    """shape and strides with dims swap_dims = (a, b) exchanged; unchanged when None or when
    there are not enough dims (the caller reports that)."""
    if not swap_dims or len(shape) <= max(swap_dims):
        return shape, strides
    a, b = swap_dims
    shape, strides = list(shape), list(strides)
    shape[a], shape[b] = shape[b], shape[a]
    strides[a], strides[b] = strides[b], strides[a]
    return shape, strides


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
    }


_torch_dtype_map = None


def _from_torch(tensor, name, swap_dims=None):
    global _torch_dtype_map
    torch = sys.modules["torch"]
    if _torch_dtype_map is None:
        _torch_dtype_map = _torch_dtypes(torch)
    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: {tensor.layout} tensors are not supported (strided only)")
    dtype = _torch_dtype_map.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported")
    device = tensor.device
    if device.type == "cpu":
        device_type, device_id = s.KDL_CPU, 0
    elif device.type == "cuda" and not getattr(torch.version, "hip", None):
        device_type, device_id = s.KDL_CUDA, device.index or 0
    else:
        raise ValueError(f"{name}: tensors on {device} are not supported (CPU or CUDA only)")
    shape, strides = _swapped(tensor.shape, tensor.stride(), swap_dims)
    return TensorArg(tensor.data_ptr(), device_type, device_id, dtype, shape, strides, keepalive=(tensor,))


_numpy_dtype_codes = {}  # numpy dtype -> (code, bits): dtype.name is slow, and runs per tensor


def _numpy_dtype(dtype, name):
    code_bits = _numpy_dtype_codes.get(dtype)
    if code_bits is None:
        code_bits = _numpy_dtype_codes[dtype] = _numpy_dtype_uncached(dtype, name)
    return code_bits


def _numpy_dtype_uncached(dtype, name):
    if dtype.name == "bfloat16":  # ml_dtypes
        return DTYPES["bfloat16"]
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big"):
        raise ValueError(f"{name}: big-endian arrays are not supported")
    if dtype.name in DTYPES:
        return DTYPES[dtype.name]
    raise ValueError(f"{name}: dtype {dtype} is not supported")


def _from_numpy(array, name, writable, swap_dims=None):
    interface = array.__array_interface__
    address, readonly = interface["data"]
    if writable and readonly:
        raise ValueError(f"{name}: the array is read-only, and it is written to")
    itemsize = array.dtype.itemsize
    strides = []
    for axis, stride in enumerate(array.strides):
        if stride % itemsize != 0:
            raise ValueError(f"{name}: stride {stride} bytes of axis {axis} is not a whole number of "
                             f"{itemsize}-byte elements")
        strides.append(stride // itemsize)
    shape, strides = _swapped(array.shape, strides, swap_dims)
    return TensorArg(address, s.KDL_CPU, 0, _numpy_dtype(array.dtype, name), shape, strides, keepalive=(array,))


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj, name, stream, swap_dims=None):
    device_type, device_id = obj.__dlpack_device__()
    device_type, device_id = int(device_type), int(device_id)
    if device_type not in (s.KDL_CPU, s.KDL_CUDA):
        raise ValueError(f"{name}: DLPack device type {device_type} is not supported (CPU or CUDA only)")
    if device_type == s.KDL_CUDA:
        # The producer makes the data ready on the stream the consumer will use; per the
        # array API, 1 means the legacy default stream (0 is not allowed for CUDA).
        try:
            capsule = obj.__dlpack__(stream=int(stream) if stream else 1)
        except TypeError:
            capsule = obj.__dlpack__()
    else:
        capsule = obj.__dlpack__()
    address = _capsule_get_pointer(capsule, b"dltensor")
    managed = s.DLManagedTensor.from_address(address)
    tensor = managed.dl_tensor
    ndim = tensor.ndim
    shape = [tensor.shape[i] for i in range(ndim)]
    strides = [tensor.strides[i] for i in range(ndim)] if tensor.strides else contiguous_strides(shape)
    code, bits = tensor.dtype.code, tensor.dtype.bits
    if tensor.dtype.lanes != 1:
        raise ValueError(f"{name}: vector dtypes (lanes={tensor.dtype.lanes}) are not supported")
    if code == s.KDL_BOOL:
        code, bits = DTYPES["bool"]
    # The capsule stays unconsumed ("dltensor"), so its destructor calls the deleter once the
    # TensorArg (which holds it) is gone: after the C call.
    shape, strides = _swapped(shape, strides, swap_dims)
    return TensorArg(tensor.data, tensor.device.device_type, tensor.device.device_id, (code, bits), shape,
                     strides, tensor.byte_offset, keepalive=(obj, capsule))


def is_torch_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_tensor(obj, name, writable=False, stream=None, swap_dims=None):
    """obj as a TensorArg (see the module docstring). `name` names the argument in messages;
    `writable` refuses read-only NumPy arrays; `stream` (an int CUstream, 0 or None for the
    default stream) is the stream a CUDA DLPack producer is told the call will use;
    `swap_dims` (a, b) describes the view with dims a and b exchanged (as with_dims_swapped,
    without building the TensorArg twice: this runs for every tensor of every call)."""
    if isinstance(obj, TensorArg):
        return obj.with_dims_swapped(*swap_dims) if swap_dims and obj.ndim > max(swap_dims) else obj
    if is_torch_tensor(obj):
        return _from_torch(obj, name, swap_dims)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return _from_numpy(obj, name, writable, swap_dims)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, name, stream, swap_dims)
    raise TypeError(f"{name}: expected a tensor (torch, numpy, or any object with __dlpack__), "
                    f"got {type(obj).__name__}")


def torch_stream_of(objs):
    """PyTorch's current CUDA stream (as an int) on the device of the first CUDA torch tensor in
    objs, or None when none is one."""
    for obj in objs:
        if is_torch_tensor(obj) and obj.is_cuda:
            torch = sys.modules["torch"]
            return torch.cuda.current_stream(obj.device).cuda_stream
    return None
