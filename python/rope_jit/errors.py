"""Exceptions: one class per rope_jit_status, each carrying the library's own message.

Every C call that returns a status goes through `check`, so no failure passes silently. The
classes also derive from the closest Python built-in (ValueError for a bad argument, MemoryError
for out of memory...), so callers that catch the built-in keep working.
"""


class RopeJitError(RuntimeError):
    """A rope_jit call failed.

    Attributes:
        status: the rope_jit_status value (int).
        status_name: its enum name without prefix, e.g. "ERROR_INVALID_ARGUMENT".
        detail: the library's message for this failure (rope_jit_last_error), naming the
            argument that was wrong, or the NVRTC log of a failed compile.
        function: the C function that failed, e.g. "rope_jit_rope".
    """

    def __init__(self, function, status, status_name, detail):
        self.function = function
        self.status = status
        self.status_name = status_name
        self.detail = detail
        super().__init__(f"{function}: {status_name}: {detail}")


class InvalidArgumentError(RopeJitError, ValueError):
    """ROPE_JIT_ERROR_INVALID_ARGUMENT: an argument is wrong; the message names it."""


class UnsupportedError(RopeJitError, NotImplementedError):
    """ROPE_JIT_ERROR_UNSUPPORTED: a valid but unsupported combination of arguments."""


class BackendUnavailableError(RopeJitError):
    """ROPE_JIT_ERROR_BACKEND_UNAVAILABLE: the requested backend is not on this machine."""


class OutOfMemoryError(RopeJitError, MemoryError):
    """ROPE_JIT_ERROR_OUT_OF_MEMORY: out of host or device memory."""


class CompileError(RopeJitError):
    """ROPE_JIT_ERROR_COMPILE: NVRTC failed; the message holds its log and options."""


class CudaError(RopeJitError):
    """ROPE_JIT_ERROR_CUDA: a CUDA driver call failed."""


class CacheError(RopeJitError):
    """ROPE_JIT_ERROR_CACHE: the kernel cache could not be used."""


class InternalError(RopeJitError):
    """ROPE_JIT_ERROR_INTERNAL: a bug in rope-jit."""


class LibraryNotFoundError(OSError):
    """librope_jit.so could not be found or loaded; the message lists every place tried."""


# Status values are fixed by the ABI promise in rope_jit.h.
_CLASS_OF_STATUS = {
    1: InvalidArgumentError,
    2: UnsupportedError,
    3: BackendUnavailableError,
    4: OutOfMemoryError,
    5: CompileError,
    6: CudaError,
    7: CacheError,
    8: InternalError,
}


def error_for_status(function, status, status_name, detail):
    """The exception for a failed call (status != 0): the class of its status, or
    RopeJitError for a status this package does not know (a newer library)."""
    cls = _CLASS_OF_STATUS.get(status, RopeJitError)
    return cls(function, status, status_name, detail)
