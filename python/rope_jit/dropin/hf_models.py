"""Switches Hugging Face transformers models to rope-jit with one import:

    import rope_jit.dropin.hf_models      # before or after building the model

The modeling modules of the models listed in MODELS call a module-level
`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` (Llama, Mistral, Qwen2/3, Gemma...);
importing this module rebinds that name in each of them to rope_jit.dropin.hf's, which
computes the same rotation (half style, full or partial rotary, GQA in one launch) with the
library's kernels, differentiable and torch.compile-able. Modules already imported are
patched at once; the others when they are first imported (an import hook), so importing this
module imports no model code. unpatch() restores the originals and removes the hook; patch()
applies it again (or to other models).

Only models whose apply_rotary_pos_emb is the standard one are listed; a module's own function
is also tried on a small input before it is replaced, and kept, with a warning, where it
computes something else (Cohere's and GLM's interleaved pairs, GPT-J's other signature).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings

import torch

from .hf import _transformers_formula, apply_rotary_pos_emb

MODELS = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "granite",
    "olmo2",
    "phi3",
)

_originals = {}  # module name -> its own apply_rotary_pos_emb
_wanted = set()  # module names to patch when they are imported
_lock = threading.Lock()


def _module_name(model):
    return f"transformers.models.{model}.modeling_{model}"


def _is_standard(function):
    """Whether `function(q, k, cos, sin)` computes transformers' standard rotation (half-style
    pairs, [B, S, D] tables, heads in dim 1), on a small float64 CPU input (CPU whatever the
    default device: this runs inside model imports, under `with torch.device("meta")` too)."""
    try:
        generator = torch.Generator(device="cpu").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=generator, dtype=torch.float64, device="cpu")

        q, k = randn(1, 2, 3, 4), randn(1, 1, 3, 4)
        angles = torch.cat((randn(1, 3, 2),) * 2, -1)
        cos, sin = angles.cos(), angles.sin()
        with torch.no_grad():
            got = function(q, k, cos, sin)
            expected = _transformers_formula(q, k, cos, sin, 1)
            return (
                isinstance(got, tuple)
                and len(got) == 2
                and all(
                    isinstance(g, torch.Tensor) and g.shape == e.shape and torch.allclose(g, e)
                    for g, e in zip(got, expected)
                )
            )
    except Exception:  # noqa: BLE001 (another signature or semantics: not standard)
        return False


def _warn_not_standard(name):
    warnings.warn(
        f"rope_jit.dropin.hf_models: {name}'s apply_rotary_pos_emb is not transformers' "
        f"standard rotation (half-style pairs, q and k [B, H, S, D]); it is kept",
        stacklevel=3,
    )


def _patch_module(module):
    """Replaces module.apply_rotary_pos_emb by rope-jit's. Returns True when it is rope-jit's
    now, False when the module has none, None when its own is not the standard one (kept)."""
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if current is not apply_rotary_pos_emb:
        if not _is_standard(current):
            return None
        _originals.setdefault(module.__name__, current)
        module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a wanted module it asks the other finders, and wraps the
    loader's exec_module so the module is patched right after its code runs."""

    _finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _wanted or getattr(self._finding, "name", None) == fullname:
            return None
        self._finding.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            if module.__name__ in _wanted and _patch_module(module) is None:
                _warn_not_standard(module.__name__)

        spec.loader.exec_module = exec_module  # the loader was made for this spec alone
        return spec


_hook = _PatchOnImport()


def patch(models=MODELS):
    """Switches the modeling modules of `models`: those already imported now, the others as
    they are imported. A module whose apply_rotary_pos_emb is not the standard one keeps it,
    with a warning. Returns the names of the modules patched now."""
    patched = []
    with _lock:
        for model in models:
            name = _module_name(model)
            _wanted.add(name)
            module = sys.modules.get(name)
            if module is None:
                continue
            done = _patch_module(module)
            if done:
                patched.append(name)
            elif done is None:
                _warn_not_standard(name)
        if _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)
    return patched


def unpatch():
    """Puts every patched module's own apply_rotary_pos_emb back and stops patching imports."""
    with _lock:
        _wanted.clear()
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        for name, original in list(_originals.items()):
            module = sys.modules.get(name)
            if module is not None:
                module.apply_rotary_pos_emb = original
            del _originals[name]


def patched_modules():
    """The names of the modules whose apply_rotary_pos_emb is rope-jit's now."""
    return sorted(_originals)


patch()
