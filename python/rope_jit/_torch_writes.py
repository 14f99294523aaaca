"""Torch tensors the library writes through their data pointers: checked before, marked after.

Autograd cannot see a write made through a pointer. PyTorch's own in-place ops refuse to write
a tensor that requires grad while grad mode is on (the write would go unrecorded), and count
every write in the tensor's version counter, so that a backward which saved the old values
fails instead of computing with the new ones. The library's writes into a caller's torch
tensors (rope()'s outputs, q and k in place) do the same: `check` before the call, `mark`
once it succeeded. Tensors the package makes itself (apply_rope's outputs) need neither.

Inference tensors have no version counter and can never be saved for a backward: they are
written and left uncounted, inside inference mode or out (where torch's own in-place ops
refuse them, for no gradient's sake). This runs on every such call, so it asks torch as little
as it can: the grad mode once, and each tensor's requires_grad only in grad mode.

This module never imports torch: its callers have a torch tensor in hand.
"""

import sys

_is_grad_enabled = None  # torch.is_grad_enabled, set on first use
_is_inference_mode_enabled = None
_increment_versions = None  # (tensors) -> None: one write counted in each


def _init():
    global _is_grad_enabled, _is_inference_mode_enabled, _increment_versions
    torch = sys.modules["torch"]
    _is_inference_mode_enabled = torch.is_inference_mode_enabled
    # torch >= 2.5 counts a sequence of tensors in one C call; before, the C call and the
    # public function take one tensor (torch 2.4's C call raises RuntimeError for a tuple).
    increment = torch._C._increment_version
    try:
        increment((torch.zeros(1),))
        _increment_versions = increment
    except (TypeError, RuntimeError):

        def _increment_versions(tensors):
            for tensor in tensors:
                torch.autograd.graph.increment_version(tensor)

    _is_grad_enabled = torch.is_grad_enabled  # last: once it is set, the rest is


def check(tensors, names):
    """Raises RuntimeError, as torch's in-place ops do, when grad mode is on and a tensor of
    `tensors` (named by `names`) requires grad: the call would write it where autograd cannot
    record the write (apply_rope records its own)."""
    if _is_grad_enabled is None:
        _init()
    if not _is_grad_enabled():
        return
    for tensor, name in zip(tensors, names):
        if tensor.requires_grad:
            raise RuntimeError(
                f"{name}: requires grad, and this call writes it where autograd cannot record "
                f"the write: use rope_jit.apply_rope (differentiable), or write under "
                f"torch.no_grad()"
            )


def check_named(named):
    """check() of (tensor, name) pairs, the torch tensors a call writes; returns the tensors,
    for mark() (() when there are none)."""
    if not named:
        return ()
    tensors, names = zip(*named)
    check(tensors, names)
    return tensors


def mark(tensors):
    """Counts one write in the version counter of each of `tensors` (a sequence, after a
    `check` of them), as a torch in-place op does; inference tensors have none."""
    if not tensors:
        return
    if _is_inference_mode_enabled():  # inference tensors are the rule here: ask each
        tensors = [tensor for tensor in tensors if not tensor.is_inference()]
        if not tensors:
            return
    try:
        _increment_versions(tensors)
    except RuntimeError:  # an inference tensor outside inference mode (counting may be twice)
        for tensor in tensors:
            if not tensor.is_inference():
                _increment_versions((tensor,))
