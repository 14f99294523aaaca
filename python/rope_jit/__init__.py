"""rope-jit for Python: rotary position embeddings through librope_jit's C API (ctypes).

    import rope_jit
    rope_jit.rope(q, k, cos=cos, sin=sin)          # any tensors: torch, numpy, cupy, jax...
    rope_jit.apply_rope(q, k, cos, sin)            # torch: autograd + torch.compile
    from rope_jit.dropin.hf import apply_rotary_pos_emb   # one-import switches from the peers

Modules:
    rope            rope(): the framework-neutral call, in place or into given outputs
    torch_ops       PyTorch custom ops (rope_jit::rope, rope_jit::rope_qk...) and apply_rope
    attention       the fused attention with rotary, when the library has it
    frequencies     inv_freq builders (HF rope types, rotary-embedding-torch) and cos/sin
                    tables, when the library has them
    dropin          drop-in replacements named like HF transformers, Unsloth, flash-attention
                    and rotary-embedding-torch functions
    runtime         Runtime (backend, cache, stats, prewarm) and default_runtime()
    tensors         the zero-copy DLPack bridge (as_tensor, from_pointer, reinterpret)
    errors          one exception class per rope_jit_status

The library is found through $ROPE_JIT_LIBRARY, this package's folder, or the system's library
path, on first use (see _library.py). Importing this package imports neither torch nor numpy.
"""

import importlib

from . import dropin, errors, frequencies  # (submodules named above: attributes at import)
from ._library import LIBRARY_ENV
from ._library import load as load_library
from .attention import attention, attention_backward, has_attention
from .errors import (BackendUnavailableError, CacheError, CompileError, CudaError, InternalError,
                     InvalidArgumentError, LibraryNotFoundError, OutOfMemoryError, RopeJitError,
                     UnsupportedError)
from .rope import rope
from .runtime import Runtime, default_runtime
from .tensors import TensorArg, as_tensor, from_pointer, reinterpret

__version__ = "0.1.0"


def library_version():
    """The loaded library's version string ("0.1.0")."""
    return load_library().rope_jit_version_string().decode()


def library_path():
    """What was loaded as librope_jit (a path, or a name the dynamic loader resolved)."""
    return load_library().path


def __getattr__(name):
    # The torch integration is imported on first use, so that `import rope_jit` needs no torch.
    if name in ("apply_rope", "torch_ops"):
        torch_ops = importlib.import_module(__name__ + ".torch_ops")
        # Kept as module attributes: later lookups (every rope_jit.apply_rope call) find them
        # directly instead of coming back here.
        globals().update(torch_ops=torch_ops, apply_rope=torch_ops.apply_rope)
        return torch_ops if name == "torch_ops" else torch_ops.apply_rope
    raise AttributeError(f"module 'rope_jit' has no attribute {name!r}")


__all__ = [
    "rope", "apply_rope", "attention", "attention_backward", "has_attention", "Runtime", "default_runtime",
    "TensorArg", "as_tensor", "from_pointer", "reinterpret", "library_version", "library_path", "load_library",
    "LIBRARY_ENV", "errors", "frequencies", "dropin", "RopeJitError", "InvalidArgumentError", "UnsupportedError",
    "BackendUnavailableError", "OutOfMemoryError", "CompileError", "CudaError", "CacheError", "InternalError",
    "LibraryNotFoundError",
]
