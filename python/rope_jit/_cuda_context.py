"""A thread's CUDA context, left as PyTorch expects it.

A thread that has not yet made a CUDA runtime call has no current context (PyTorch's autograd
device threads start so). The next cuBLAS call on such a thread warns "Attempting to run
cuBLAS, but there was no current CUDA context!" unless something made one current. The library
now leaves the launch context current on a thread that had none (cuda/cuda_driver.cpp,
ContextScope); older libraries pushed it for the call and popped it after. So, once per thread
and device, before its first launch there, this makes the device's primary context current on
the thread when none is, as the CUDA runtime's first call would, whatever library version is
loaded. Costs one thread-local lookup per call after the first.
"""

import ctypes
import threading

_state = threading.local()
_driver = None
_driver_lock = threading.Lock()


def _load_driver():
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
            except OSError:
                driver = False
            else:
                for name, argtypes in (
                    ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
                    ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                    ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
                    ("cuCtxSetCurrent", [ctypes.c_void_p]),
                ):
                    function = getattr(driver, name)
                    function.restype = ctypes.c_int
                    function.argtypes = argtypes
            _driver = driver
    return _driver


def ensure_current(device):
    """Makes CUDA device `device`'s primary context current on this thread unless the thread
    already has a current context. Once per thread and device; never raises (the library
    reports CUDA errors itself)."""
    done = getattr(_state, "devices", None)
    if done is None:
        done = _state.devices = set()
    done.add(device)
    driver = _driver if _driver is not None else _load_driver()
    if not driver:
        return
    current = ctypes.c_void_p()
    if driver.cuCtxGetCurrent(ctypes.byref(current)) != 0 or current.value:
        return
    handle = ctypes.c_int()
    context = ctypes.c_void_p()
    if driver.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return
    # The primary context stays retained (PyTorch's runtime holds it for the process anyway).
    if driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value) == 0:
        driver.cuCtxSetCurrent(context)


def checked_devices():
    """The devices this thread has been through ensure_current for (for the per-call test)."""
    return getattr(_state, "devices", None)
