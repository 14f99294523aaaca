"""Finding and loading librope_jit.so, and the ctypes prototypes of its C API.

The library is looked up, in this order:
  1. $ROPE_JIT_LIBRARY: the path of the library file, or of a folder that holds it. When it is
     set, nothing else is tried: a wrong path is an error, never a silent fallback.
  2. this package's folder (a library copied next to __init__.py, e.g. by a wheel build);
  3. the system: ctypes.util.find_library("rope_jit"), then the dynamic loader's own search
     (LD_LIBRARY_PATH, ld.so.cache, /usr/lib...) for librope_jit.so.0 and librope_jit.so.

Loading happens on first use, not at import, so `import rope_jit` works without the library
(and says where it looked when a call needs it).

Symbols that later versions of the library add (the attention op, the frequency builders) are
optional: `Library.optional(name)` is None when the loaded library does not export them.
"""

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

from . import _structs as s
from .errors import LibraryNotFoundError, error_for_status

LIBRARY_ENV = "ROPE_JIT_LIBRARY"
_SONAMES = ("librope_jit.so.0", "librope_jit.so")

_P = ctypes.POINTER
_status = ctypes.c_int

# name -> (restype, argtypes) of every function this package requires.
_REQUIRED = {
    "rope_jit_version_number": (ctypes.c_uint, []),
    "rope_jit_version_string": (ctypes.c_char_p, []),
    "rope_jit_status_name": (ctypes.c_char_p, [_status]),
    "rope_jit_status_message": (ctypes.c_char_p, [_status]),
    "rope_jit_last_error": (ctypes.c_char_p, []),
    "rope_jit_config_init": (None, [_P(s.Config)]),
    "rope_jit_rope_args_init": (None, [_P(s.RopeArgs)]),
    "rope_jit_kernel_spec_init": (None, [_P(s.KernelSpec)]),
    "rope_jit_stats_init": (None, [_P(s.Stats)]),
    "rope_jit_runtime_create": (_status, [_P(s.Config), _P(ctypes.c_void_p)]),
    "rope_jit_runtime_free": (None, [ctypes.c_void_p]),
    "rope_jit_backend": (ctypes.c_int, [ctypes.c_void_p]),
    "rope_jit_rope": (_status, [ctypes.c_void_p, _P(s.RopeArgs)]),
    "rope_jit_prewarm": (_status, [ctypes.c_void_p, _P(s.KernelSpec), ctypes.c_size_t, ctypes.c_char_p]),
    "rope_jit_get_stats": (_status, [ctypes.c_void_p, _P(s.Stats)]),
}


class Library:
    """A loaded librope_jit.so with its prototypes set."""

    def __init__(self, cdll, path):
        self.cdll = cdll
        self.path = path  # what was loaded (a path, or a soname the loader resolved)
        self.struct_sizes = {}  # mirror class name -> the library's sizeof, seen by new_struct
        self._templates = {}  # mirror class -> its defaults, as the library's init wrote them
        self._fields = {}  # mirror class -> frozenset of the fields this library's version has
        self.tensor_queries = {}  # tensors.py's yes-or-no queries: name -> function or None
        for name, (restype, argtypes) in _REQUIRED.items():
            try:
                function = getattr(cdll, name)
            except AttributeError:
                raise LibraryNotFoundError(
                    f"{path} does not export {name}: it is not librope_jit, or an older version"
                ) from None
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)

    def optional(self, name, restype=None, argtypes=None):
        """The C function `name` with the given prototype, or None when this library does not
        export it (an older version)."""
        try:
            function = getattr(self.cdll, name)
        except AttributeError:
            return None
        function.restype = restype
        function.argtypes = argtypes
        return function

    def new_struct(self, cls, init):
        """A `cls` filled with the library's defaults by the C function `init`
        (rope_jit_*_init), with struct_size = sizeof(cls).

        The init function writes the library's own struct size, which exceeds this package's
        mirror when the library is newer: it writes into a scratch buffer large enough for
        any version, and the mirror takes the bytes it has fields for. The defaults never
        change, so init runs once per struct type and later calls copy its result."""
        template = self._templates.get(cls)
        if template is None:
            scratch = (ctypes.c_char * 4096)()
            init(ctypes.cast(scratch, ctypes.POINTER(cls)))
            library_size = ctypes.c_size_t.from_buffer(scratch).value
            template = cls()
            ctypes.memmove(ctypes.byref(template), scratch, min(ctypes.sizeof(cls), library_size))
            template.struct_size = ctypes.sizeof(cls)
            self.struct_sizes[cls.__name__] = library_size
            self._templates[cls] = template
        return cls.from_buffer_copy(template)

    def fields(self, cls, init):
        """The names of the fields of struct `cls` that the loaded library's version has (an
        older library ignores fields past its own struct size, and those in what was its tail
        padding, which its init leaves 0: `cls.padding_fields`). Computed once per struct
        type: calls check their arguments against it every time."""
        fields = self._fields.get(cls)
        if fields is None:
            if cls not in self._templates:
                self.new_struct(cls, init)
            library_size = self.struct_sizes[cls.__name__]
            template = self._templates[cls]
            padding_fields = getattr(cls, "padding_fields", ())
            fields = frozenset(
                name for name, _ in cls._fields_
                if library_size >= getattr(cls, name).offset + getattr(cls, name).size
                and (name not in padding_fields or getattr(template, name) != 0))
            self._fields[cls] = fields
        return fields

    def too_old(self, field):
        """The error for an argument past this library's version of its struct: an older
        library would ignore the field and compute something else, so calls refuse it."""
        return NotImplementedError(f"{field}: the loaded librope_jit ({self.path}) is too old for it")

    def check(self, function_name, status):
        """Raises the exception of `status` (with the thread's rope_jit_last_error) unless it
        is ROPE_JIT_OK. Must run on the thread that made the call: messages are per thread."""
        if status == 0:
            return
        detail = self.rope_jit_last_error().decode("utf-8", "replace")
        name = self.rope_jit_status_name(status).decode("ascii", "replace")
        if not detail:
            detail = self.rope_jit_status_message(status).decode("utf-8", "replace")
        raise error_for_status(function_name, status, name, detail)


def _candidates():
    """(what to dlopen, where it came from) in search order."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        # Absolute: a relative name ("./librope_jit.so", "librope_jit.so") is the file in the
        # current folder, never one dlopen's own search finds elsewhere.
        path = Path(env).absolute()
        if path.is_dir():
            for soname in _SONAMES:
                if (path / soname).exists():
                    return [(str(path / soname), f"${LIBRARY_ENV} folder")]
            return [(str(path / _SONAMES[1]), f"${LIBRARY_ENV} folder")]
        return [(str(path), f"${LIBRARY_ENV}")]
    found = []
    package_dir = Path(__file__).resolve().parent
    for soname in _SONAMES:
        if (package_dir / soname).exists():
            found.append((str(package_dir / soname), "package folder"))
    system = ctypes.util.find_library("rope_jit")
    if system:
        found.append((system, "ctypes.util.find_library"))
    for soname in _SONAMES:
        found.append((soname, "dynamic loader search path"))
    return found


_lock = threading.Lock()
_library = None


def load():
    """The process's Library, loaded on first call. Raises LibraryNotFoundError listing every
    place tried when none works."""
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            failures = []
            for target, origin in _candidates():
                try:
                    cdll = ctypes.CDLL(target)
                except OSError as error:
                    failures.append(f"  {target} ({origin}): {error}")
                    continue
                _library = Library(cdll, target)
                break
            else:
                raise LibraryNotFoundError(
                    "librope_jit.so not found. Build it (cmake --build build) and set "
                    f"{LIBRARY_ENV}=/path/to/librope_jit.so, copy it into {Path(__file__).parent}, "
                    "or install it (cmake --install build). Tried:\n" + "\n".join(failures)
                )
    return _library
