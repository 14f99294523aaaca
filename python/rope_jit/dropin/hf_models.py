"""Switches Hugging Face transformers models to rope-jit with one import:

    import rope_jit.dropin.hf_models      # before or after building the model

The modeling modules of the models listed in MODELS call a module-level
`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` (Llama, Mistral, Qwen2/3, Gemma...);
importing this module rebinds that name in each of them to rope_jit.dropin.hf's, which
computes the same rotation (half style, full or partial rotary, GQA in one launch) with the
library's kernels, differentiable and torch.compile-able. unpatch() restores the originals;
patch() applies it again (or to more models).

Only models whose apply_rotary_pos_emb is the standard one are listed; a model missing from
this transformers version is skipped.
"""

import importlib

from .hf import apply_rotary_pos_emb

MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
          "granite", "olmo2", "phi3")

_originals = {}  # module name -> its own apply_rotary_pos_emb


def patch(models=MODELS):
    """Rebinds apply_rotary_pos_emb in transformers.models.<m>.modeling_<m> for each m in
    `models` that this transformers has. Returns the names of the modules patched."""
    patched = []
    for model in models:
        name = f"transformers.models.{model}.modeling_{model}"
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "apply_rotary_pos_emb", None)
        if current is None:
            continue
        if current is not apply_rotary_pos_emb:
            _originals[name] = current
            module.apply_rotary_pos_emb = apply_rotary_pos_emb
        patched.append(name)
    return patched


def unpatch():
    """Puts every patched module's own apply_rotary_pos_emb back."""
    for name, original in list(_originals.items()):
        module = importlib.import_module(name)
        module.apply_rotary_pos_emb = original
        del _originals[name]


PATCHED = patch()
