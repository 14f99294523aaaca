"""Torch tensors the library writes through their data pointers: checked before, marked after.

Autograd cannot see a write made through a pointer. PyTorch's own in-place ops refuse the
tensors they may not write, and count every write in the tensor's version counter, so that a
backward which saved the old values fails instead of computing with the new ones. The
library's writes into a caller's torch tensors (rope()'s outputs, q and k in place) do the
same: `check` before the call, `mark` once it succeeded. Tensors the package makes itself
(apply_rope's outputs) need neither. This module never imports torch: its callers have a
torch tensor in hand.
"""

import sys

_is_grad_enabled = None  # torch.is_grad_enabled, set on first use
_is_inference_mode_enabled = None
_increment_versions = None  # (tensors) -> None: one write counted in each


def _init():
    global _is_grad_enabled, _is_inference_mode_enabled, _increment_versions
    torch = sys.modules["torch"]
    _is_inference_mode_enabled = torch.is_inference_mode_enabled
    # torch >= 2.5 counts a list of tensors in one C call; before, the public function takes
    # one tensor.
    increment = torch._C._increment_version
    try:
        increment([torch.zeros(1)])
        _increment_versions = increment
    except TypeError:

        def _increment_versions(tensors):
            for tensor in tensors:
                torch.autograd.graph.increment_version(tensor)

    _is_grad_enabled = torch.is_grad_enabled  # last: once it is set, the rest is


def check(tensors, names):
    """Raises RuntimeError, as torch's in-place ops do, for a tensor of `tensors` (a list,
    named by `names`) that the call may not write: an inference tensor outside
    torch.inference_mode(), or one that requires grad while grad mode is on (the write would
    not be recorded: apply_rope records its own). Returns the tensors `mark` counts (all of
    them, but for inference tensors, which have no version counter)."""
    if _is_grad_enabled is None:
        _init()
    if _is_inference_mode_enabled():  # (grad mode is off, and any tensor may be written)
        return [tensor for tensor in tensors if not tensor.is_inference()]
    grad_mode = _is_grad_enabled()
    for tensor, name in zip(tensors, names):
        if tensor.is_inference():
            raise RuntimeError(
                f"{name}: an inference tensor (made under torch.inference_mode()) is "
                f"written outside inference mode, which torch does not allow"
            )
        if grad_mode and tensor.requires_grad:
            raise RuntimeError(
                f"{name}: requires grad, and this call writes it where autograd cannot record "
                f"the write: use rope_jit.apply_rope (differentiable), or write under "
                f"torch.no_grad()"
            )
    return tensors


def mark(counted):
    """Counts one write in the version counter of each tensor of `counted` (check's list), as
    a torch in-place op does."""
    if counted:
        _increment_versions(counted)
