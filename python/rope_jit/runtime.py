"""The rope_jit runtime: backend choice, kernel caches, CPU worker threads.

Most code never makes one: the ops use `default_runtime()`, created on first use with the
library's defaults (backend auto: CUDA when a GPU is present, and the CPU reference for host
tensors either way). Make a Runtime to force a backend, pick a cache directory, or count
kernel-cache hits.
"""

import collections.abc
import ctypes
import operator
import os
import sys
import threading
import time
import weakref

from . import _library
from . import _structs as s
from . import tensors
from ._checks import c_int, c_string

_BACKENDS = {"auto": s.BACKEND_AUTO, "cuda": s.BACKEND_CUDA, "cpu": s.BACKEND_CPU}
_BACKEND_NAMES = {s.BACKEND_CUDA: "cuda", s.BACKEND_CPU: "cpu", s.BACKEND_AUTO: "auto"}
_STYLES = {"half": s.STYLE_HALF, "interleaved": s.STYLE_INTERLEAVED,
           "proportional": s.STYLE_PROPORTIONAL}
_POSITION_MODES = {"implicit": s.POSITIONS_IMPLICIT, "indices": s.POSITIONS_INDICES,
                   "seqlen_offsets": s.POSITIONS_SEQLEN_OFFSETS}
_ANGLE_SOURCES = {"table_half": s.ANGLES_TABLE_HALF, "table_full": s.ANGLES_TABLE_FULL,
                  "inv_freq": s.ANGLES_INV_FREQ}


def _choice(value, table, name):
    """table[value] for a name, or value itself for one of the table's C values given as an
    integer (not a bool, not a float: 1.0 or True would pass as 1)."""
    if isinstance(value, str):
        if value in table:
            return table[value]
    elif not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is not None and number in table.values():
            return number
    raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")


class Runtime:
    """A rope_jit_runtime (rope_jit_runtime_create / rope_jit_runtime_free).

    Args:
        backend: "auto" (default), "cuda" (fails with BackendUnavailableError without a GPU)
            or "cpu".
        cache_dir: root of the on-disk kernel cache; None = $ROPE_JIT_CACHE_DIR, else
            $XDG_CACHE_HOME/rope_jit, else ~/.cache/rope_jit.
        disk_cache: False keeps compiled kernels in memory only.
        cpu_threads: worker threads of the CPU reference; 0 = one per hardware thread.
        debug_checks: True checks positions against the table on the GPU (slower).
        background_builds: True (default) compiles a compiled forward's backward kernels in
            the background (rope_jit_config.background_builds).
        programmatic_launch: whether the RoPE kernels are programmatic dependent launches
            (rope_jit_config.programmatic_launch): a call's launch and set-up overlap the end
            of the kernel before it on the stream; same results. None (default): the
            library's choice, programmatic on sm_90 and later GPUs under CUDA 12.3 and later
            drivers; True: wherever the GPU and driver take them (sm_90, CUDA 12.0); False:
            plain launches. The environment variable ROPE_JIT_PROGRAMMATIC_LAUNCH (1 or 0)
            overrides it for every runtime, the default one included. True raises
            NotImplementedError with a library from before the field.

    Usable from any number of threads. Free it with close() (or a with block); it is also
    freed when garbage-collected. close() waits for the calls other threads have in flight on
    it; calls that start after it raise ValueError.
    """

    def __init__(self, backend="auto", cache_dir=None, disk_cache=True, cpu_threads=0, debug_checks=False,
                 background_builds=True, programmatic_launch=None):
        self._library = _library.load()
        config = self._library.new_struct(s.Config, self._library.rope_jit_config_init)
        config.backend = _choice(backend, _BACKENDS, "backend")
        config.cache_dir = None if cache_dir is None else c_string(cache_dir, "cache_dir")
        config.disk_cache = 1 if disk_cache else 0
        config.cpu_threads = c_int(cpu_threads, "cpu_threads")
        config.debug_checks = 1 if debug_checks else 0
        config.background_builds = 1 if background_builds else 0
        if programmatic_launch is not None and not isinstance(programmatic_launch, bool):
            raise TypeError(f"programmatic_launch: expected None, True or False, got "
                            f"{programmatic_launch!r}")
        if programmatic_launch is not None:
            supported = self._library.fields(s.Config, self._library.rope_jit_config_init)
            if "programmatic_launch" in supported:
                config.programmatic_launch = (s.PROGRAMMATIC_ON if programmatic_launch
                                              else s.PROGRAMMATIC_OFF)
            elif programmatic_launch:
                raise self._library.too_old("programmatic_launch")
        handle = ctypes.c_void_p()
        self._handle = None
        # One entry per call in flight (list.append and pop are atomic under the GIL: the
        # cheapest count there is on the hot path); close() waits for it to empty.
        self._calls = []
        self._close_lock = threading.Lock()
        status = self._library.rope_jit_runtime_create(ctypes.byref(config), ctypes.byref(handle))
        self._library.check("rope_jit_runtime_create", status)
        self._handle = handle
        _runtimes.add(self)

    def _call(self, function, *args):
        """function(handle, *args) on this runtime's handle, counted in flight for close().
        Counted before the handle is read: a close() that has not seen this call has already
        cleared the handle, and the call raises instead of using a freed runtime."""
        calls = self._calls
        calls.append(None)
        try:
            handle = self._handle
            if handle is None:
                raise ValueError("runtime: already closed")
            return function(handle, *args)
        finally:
            calls.pop()

    @property
    def handle(self):
        """The rope_jit_runtime* (a ctypes.c_void_p). Raises ValueError once closed."""
        if self._handle is None:
            raise ValueError("runtime: already closed")
        return self._handle

    @property
    def library(self):
        return self._library

    @property
    def backend(self):
        """Where device work runs: "cuda" or "cpu"."""
        return _BACKEND_NAMES[self._call(self._library.rope_jit_backend)]

    def stats(self):
        """The kernel-cache counters since creation, as a dict: memory_hits, disk_hits,
        compiles, compile_ms, disk_writes, launches, background_builds, background_failures,
        background_dropped, attention_workspace_fallbacks, disk_lookup_ms, module_load_ms,
        disk_evictions (entries the cache's size limit removed after this runtime's writes).
        Only the counters the loaded library has: an older one does not fill the later ones."""
        stats = self._library.new_struct(s.Stats, self._library.rope_jit_stats_init)
        status = self._call(self._library.rope_jit_get_stats, ctypes.byref(stats))
        self._library.check("rope_jit_get_stats", status)
        known = self._library.fields(s.Stats, self._library.rope_jit_stats_init)
        return {name: getattr(stats, name) for name, _ in s.Stats._fields_
                if name != "struct_size" and name in known}

    def prewarm(self, specs, target=None):
        """Compiles the kernels of `specs` for `target` ("sm_90"...; None = GPU 0's) into the
        disk cache, so later processes load them without compiling. Needs NVRTC, not a GPU.

        Each spec is a dict of rope_jit_kernel_spec fields; unnamed fields keep the library's
        defaults: head_dim (required), dtype ("float32", "float16", "bfloat16"), rotary_dim,
        rotary_offset, style ("half"/"interleaved"/"proportional"), backward, has_k, gqa_group,
        positions ("implicit", "indices", "seqlen_offsets"), index_dtype ("int32"/"int64"), packed,
        angles ("table_half", "table_full", "inv_freq"), table_dtype, xpos, in_place, qk_norm,
        norm_unit_offset, norm_weight_dtype, norm_weight_grad, dense_rows (1 for the
        kernel of calls on dense rows in prefill: C-contiguous [B, H, S, D] q and k, as rope()
        with layout="bhsd" makes them, or C-contiguous [B, S, H, D] 16-bit ones rotated whole;
        0, the default, for decode and strided layouts: prewarm both for a model's prefill and
        decode).
        """
        # (A lone dict or string would be iterated as its keys or characters.)
        if isinstance(specs, (collections.abc.Mapping, str, bytes)) or not hasattr(
                specs, "__iter__"):
            raise TypeError(f"specs: expected a list of dicts of rope_jit_kernel_spec fields (one "
                            f"spec too), got {type(specs).__name__}")
        specs = list(specs)
        if not specs:
            return
        array = (s.KernelSpec * max(len(specs), 1))()
        for index, spec in enumerate(specs):
            if not isinstance(spec, collections.abc.Mapping):
                raise TypeError(f"specs[{index}]: expected a dict of rope_jit_kernel_spec fields, "
                                f"got {type(spec).__name__} {spec!r}")
            array[index] = self._library.new_struct(s.KernelSpec, self._library.rope_jit_kernel_spec_init)
            for key, value in spec.items():
                field = f"specs[{index}].{key}"
                if key in ("dtype", "index_dtype", "table_dtype", "norm_weight_dtype"):
                    if value not in tensors.DTYPES:
                        raise ValueError(f"{field}: expected one of {sorted(tensors.DTYPES)}, got {value!r}")
                    value = s.DLDataType(*tensors.DTYPES[value], 1)
                elif key == "style":
                    value = _choice(value, _STYLES, field)
                elif key == "positions":
                    value = _choice(value, _POSITION_MODES, field)
                elif key == "angles":
                    value = _choice(value, _ANGLE_SOURCES, field)
                elif key in dict(s.KernelSpec._fields_) and key != "struct_size":
                    value = c_int(value, field)  # every other field is an int32_t or an int
                else:
                    raise ValueError(f"{field}: not a field of rope_jit_kernel_spec")
                setattr(array[index], key, value)
        target = None if target is None else c_string(target, "target")
        if self._library.struct_sizes[s.KernelSpec.__name__] == ctypes.sizeof(s.KernelSpec):
            status = self._call(self._library.rope_jit_prewarm, array, len(specs), target)
            self._library.check("rope_jit_prewarm", status)
            return
        # The library indexes the array with its own struct size: pass one spec at a time.
        for index in range(len(specs)):
            status = self._call(self._library.rope_jit_prewarm, ctypes.byref(array[index]), 1,
                                target)
            self._library.check(f"rope_jit_prewarm (specs[{index}])", status)

    def prewarm_json(self, specs, target=None):
        """Compiles into the disk cache the kernels of `specs`: one dict or a list of dicts in
        the library's JSON spec vocabulary (rope_jit_prewarm_json in rope_jit.h; what
        `rope-jit-cache list --json` prints as spec_json), for RoPE ({"head_dim": 128,
        "dtype": "bfloat16", "direction": "backward", "in_place_q": False, ...}) and attention
        ({"op": "attention", "head_dim": 128, "causal": True, "direction": "backward", ...}:
        the kernels such a call runs on `target`). `target` as for prewarm()."""
        import json
        function = self._library.optional("rope_jit_prewarm_json", ctypes.c_int,
                                          [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p])
        if function is None:
            raise NotImplementedError("the loaded librope_jit has no rope_jit_prewarm_json: build a newer rope-jit")
        try:
            text = json.dumps(specs)  # escapes any NUL in a string, so the text has none
        except (TypeError, ValueError) as error:  # (ValueError: a list that holds itself)
            raise TypeError(f"specs: not JSON ({error})") from None
        target = None if target is None else c_string(target, "target")
        self._library.check("rope_jit_prewarm_json", self._call(function, text.encode(), target))

    def close(self):
        """Frees the runtime once the calls other threads have in flight on it have returned;
        calls after it raise ValueError. Closing twice is a no-op. Raises RuntimeError when
        called inside a call on this runtime on the same thread (from a signal handler or a
        finalizer), which could never return while close() waited for it."""
        if self._handle is None:
            return
        with self._close_lock:
            handle = self._handle
            if handle is None:
                return
            if self._calls and self._in_a_call_on_this_thread():
                raise RuntimeError(
                    "runtime: close() called inside a call on it on the same thread (a signal "
                    "handler or a finalizer); close it after that call returns"
                )
            self._handle = None  # (before the wait: no call starts on it from now on)
            while self._calls:
                time.sleep(0.0002)
            self._library.rope_jit_runtime_free(handle)

    def _in_a_call_on_this_thread(self):
        """Whether this thread's stack holds a library call on this runtime (Runtime._call or
        the plans' hot path): asked only by close(), so the calls pay nothing for it."""
        from . import _plans

        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if (code is Runtime._call.__code__ and frame.f_locals.get("self") is self) or (
                code is _plans.call.__code__ and frame.f_locals.get("runtime") is self
            ):
                return True
            frame = frame.f_back
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __repr__(self):
        if self._handle is None:
            return "Runtime(closed)"
        return f"Runtime(backend={self.backend!r})"


# Every live Runtime, for the fork handler below.
_runtimes = weakref.WeakSet()


def _forget_calls_in_child():
    # The threads whose calls a forked child inherited in its runtimes' counts do not exist
    # in it: those calls never return there, and close() must not wait for them.
    for runtime in list(_runtimes):
        runtime._calls.clear()
        runtime._close_lock = threading.Lock()  # a close() waiting in another thread held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_calls_in_child)

_default_lock = threading.Lock()
_default = None


def runtime_argument(runtime):
    """A call's `runtime` argument: a Runtime, or None for default_runtime() (anything else
    failed later, as an AttributeError that named nothing)."""
    if runtime is None:
        return default_runtime()
    if not isinstance(runtime, Runtime) and not hasattr(runtime, "library"):  # (or its like)
        raise TypeError(f"runtime: expected a rope_jit.Runtime or None, got {runtime!r}")
    return runtime


def default_runtime():
    """The process-wide Runtime the ops use when given none, created on first use with the
    library's defaults (backend auto)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Runtime()
    return _default
