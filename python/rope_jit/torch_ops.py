"""PyTorch integration: RoPE (and attention) as custom ops with autograd, for eager and
torch.compile.

The ops live in the `rope_jit` torch.library namespace:

  rope_jit::rope(x, ...) -> Tensor              one tensor (q or k), out of place
  rope_jit::rope_qk(q, k, ...) -> (Tensor, Tensor)  q and k in one launch (GQA/MQA)
  rope_jit::rope_(x!, ...)  and  rope_jit::rope_qk_(q!, k!, ...)   in place, no autograd
  rope_jit::attention(q, k, v, ...) -> (out, lse)   attention with rotary fused in

Each out-of-place op has a fake (meta) implementation, so torch.compile traces it without a
graph break, and an Autograd kernel that records the call in a torch.autograd.Function where
autograd differentiates it. RoPE's backward is the same op with `backward` flipped: the
library's backward kernel (the inverse rotation), itself differentiable (double backward); its
forward-mode derivative is the same rotation of the tangents. Gradients flow to q and k only,
never to the tables (cos, sin, inv_freq, xpos_scale): tables that require grad are refused
rather than silently given none (forward mode also takes the tangents of cos and sin).

Under torch.func transforms (grad, jvp, vmap, jacfwd, hessian...) apply_rope and attention
call those Functions from Python, as functorch needs; the ops called directly refuse to be
differentiated there (vmap alone runs them per sample).

The ops are defined with torch.library.Library (define / impl, register_fake, an Autograd
kernel): the dispatcher calls their Python kernels with no custom_op layer.
In eager mode apply_rope does not go through them at all: it calls the library through a plan
(_plans.py: the argument struct of a call signature built once, then only pointers patched)
inside one torch.autograd.Function (see "The eager hot path" below); torch.compile, export and
dispatch modes see the ops.

Kernels launch on PyTorch's current CUDA stream of the tensors' device and never synchronize;
CPU tensors run on the library's CPU reference.

Most users call apply_rope (below) or a drop-in from rope_jit.dropin.
"""

import contextlib
import functools
import inspect
import itertools

import torch

from . import _plans, _torch_writes
from . import _structs as _s
from . import errors as _errors
from . import tensors as _tensors
from .attention import attention as _call_attention
from .attention import attention_backward as _call_attention_backward
from .attention import has_attention as _has_attention
from .rope import _TENSOR_NAMES, LAYOUTS
from .rope import rope as _rope
from .runtime import default_runtime

_TABLE_NAMES = ("cos", "sin", "inv_freq", "xpos_scale")
# apply_rope's tables and positions, in the order of the ops' schema and of `tables` below.
_TABLE_FIELDS = (
    "cos", "sin", "inv_freq", "positions", "seqlen_offsets", "cu_seqlens", "xpos_scale"
)

# The ops are defined with torch.library.Library.define / impl: a call goes from the dispatcher
# straight to the Python kernel, where torch.library.custom_op adds its own Python layers
# (about 4 us a call more, measured on the H200 host). Fake kernels (torch.compile, export)
# and an Autograd kernel are registered for each out-of-place op.
_library = torch.library.Library("rope_jit", "DEF")
_TABLES_SCHEMA = (
    "Tensor? cos, Tensor? sin, Tensor? inv_freq, Tensor? positions, Tensor? seqlen_offsets, "
    "Tensor? cu_seqlens, Tensor? xpos_scale"
)


def _define(name, schema, kernel, fake):
    _library.define(f"{name}{schema}")
    _library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"rope_jit::{name}", _on_one_device(fake), lib=_library)
    return getattr(torch.ops.rope_jit, name).default


def _on_one_device(fake):
    """`fake`, refusing first tensors on several devices, as the kernels do: with one argument
    on meta and the rest on the CPU the dispatcher picks the fake kernel, which returned empty
    outputs or wrote nothing, without an error (atomicity audit, session 40)."""
    names = list(inspect.signature(fake).parameters)

    @functools.wraps(fake)
    def checked(*args, **kwargs):
        first = None
        for name, value in itertools.chain(zip(names, args), kwargs.items()):
            if not isinstance(value, torch.Tensor):
                continue
            if first is None:
                first = (name, value.device)
            elif value.device != first[1]:
                raise ValueError(f"{name}: on {value.device}, but {first[0]} is on {first[1]}; "
                                 "the tensors of a call share one device")
        return fake(*args, **kwargs)

    return checked


def _below_autograd(op, *arguments):
    """op's kernel without its Autograd kernel (below): what the Functions' forwards run, as
    the Autograd kernel would otherwise record the call again."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*arguments)


def _launch(
    q,
    k,
    q_out,
    k_out,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    _rope(
        q,
        k,
        q_out=q_out,
        k_out=k_out,
        cos=cos,
        sin=sin,
        inv_freq=inv_freq,
        positions=positions,
        seqlen_offsets=seqlen_offsets,
        cu_seqlens=cu_seqlens,
        xpos_scale=xpos_scale,
        position_offset=position_offset,
        q_position_offset=q_position_offset,
        rotary_dim=rotary_dim,
        rotary_offset=rotary_offset,
        style="interleaved" if interleaved else "half",
        backward=backward,
        # The ops take [B, H, S, D] (a bshd tensor comes as its transposed view) or packed
        # [T, H, D]: the rank tells them apart (3-D q was taken as bhsd and refused, so
        # layout "thd" failed under torch.compile and every transform).
        layout="thd" if q.dim() == 3 else "bhsd",
    )


# ------------------------------------------------------------------------------------------
# rope_jit::rope: one tensor
# ------------------------------------------------------------------------------------------


def _rope_kernel(
    x,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    """x rotated into a new tensor. x is [B, H, S, D] (any strides) or packed [T, H, D]; the
    other arguments are rope_jit.rope's. xpos_scale multiplies (as for q)."""
    out = torch.empty_like(x)
    _launch(
        x,
        None,
        out,
        None,
        cos,
        sin,
        inv_freq,
        positions,
        seqlen_offsets,
        cu_seqlens,
        xpos_scale,
        position_offset,
        0,
        rotary_dim,
        rotary_offset,
        interleaved,
        backward,
    )
    return out


def _rope_fake(
    x,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    return torch.empty_like(x)


rope_op = _define(
    "rope",
    f"(Tensor x, {_TABLES_SCHEMA}, SymInt position_offset, int rotary_dim, "
    "int rotary_offset, bool interleaved, bool backward) -> Tensor",
    _rope_kernel,
    _rope_fake,
)


def _rope_autograd(x, *arguments):
    """rope_jit::rope's Autograd kernel: _RopeTransformFunction (below) records the call where
    autograd differentiates it (see _records), else the kernel runs alone."""
    tables, (position_offset, *rest) = arguments[:7], arguments[7:]
    if not _records(x, None, tables):
        return _below_autograd(rope_op, x, *arguments)
    return _RopeTransformFunction.apply(x, None, *tables, position_offset, 0, *rest,
                                        _tables_vary(tables))


_library.impl("rope", _rope_autograd, "Autograd")


# ------------------------------------------------------------------------------------------
# rope_jit::rope_qk: q and k in one launch
# ------------------------------------------------------------------------------------------


def _rope_qk_kernel(
    q,
    k,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    """q and k rotated into new tensors by one kernel. k may have fewer heads (GQA/MQA) and,
    with implicit positions, another length (cached keys; see q_position_offset). xpos_scale
    multiplies q and divides k."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _launch(
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        inv_freq,
        positions,
        seqlen_offsets,
        cu_seqlens,
        xpos_scale,
        position_offset,
        q_position_offset,
        rotary_dim,
        rotary_offset,
        interleaved,
        backward,
    )
    return q_out, k_out


def _rope_qk_fake(
    q,
    k,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    return torch.empty_like(q), torch.empty_like(k)


rope_qk_op = _define(
    "rope_qk",
    f"(Tensor q, Tensor k, {_TABLES_SCHEMA}, SymInt position_offset, "
    "SymInt q_position_offset, int rotary_dim, int rotary_offset, bool interleaved, "
    "bool backward) -> (Tensor, Tensor)",
    _rope_qk_kernel,
    _rope_qk_fake,
)


def _rope_qk_autograd(q, k, *arguments):
    """rope_jit::rope_qk's Autograd kernel (see _rope_autograd)."""
    tables = arguments[:7]
    if not _records(q, k, tables):
        return _below_autograd(rope_qk_op, q, k, *arguments)
    return _RopeTransformFunction.apply(q, k, *arguments, _tables_vary(tables))


_library.impl("rope_qk", _rope_qk_autograd, "Autograd")


# ------------------------------------------------------------------------------------------
# In-place variants (inference: no autograd)
# ------------------------------------------------------------------------------------------


def _rope_inplace_kernel(
    x,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    """rope_jit::rope, written into x."""
    _launch(
        x,
        None,
        None,
        None,
        cos,
        sin,
        inv_freq,
        positions,
        seqlen_offsets,
        cu_seqlens,
        xpos_scale,
        position_offset,
        0,
        rotary_dim,
        rotary_offset,
        interleaved,
        backward,
    )


def _rope_inplace_fake(
    x,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    return None


rope_inplace_op = _define(
    "rope_",
    f"(Tensor(a!) x, {_TABLES_SCHEMA}, SymInt position_offset, int rotary_dim, "
    "int rotary_offset, bool interleaved, bool backward) -> ()",
    _rope_inplace_kernel,
    _rope_inplace_fake,
)


def _rope_inplace_autograd(x, *arguments):
    """rope_jit::rope_'s Autograd kernel: the in-place ops are not differentiable, and what
    autograd would have to record is refused here, where the tensors still show it (dual
    tensors, torch.func's wrappers, and under torch.compile too, where the kernel's own check
    never saw a tensor that requires grad)."""
    _refuse_in_place_differentiation((x,), arguments[:7])
    return _below_autograd(rope_inplace_op, x, *arguments)


_library.impl("rope_", _rope_inplace_autograd, "Autograd")


def _rope_qk_inplace_kernel(
    q,
    k,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    """rope_jit::rope_qk, written into q and k."""
    _launch(
        q,
        k,
        None,
        None,
        cos,
        sin,
        inv_freq,
        positions,
        seqlen_offsets,
        cu_seqlens,
        xpos_scale,
        position_offset,
        q_position_offset,
        rotary_dim,
        rotary_offset,
        interleaved,
        backward,
    )


def _rope_qk_inplace_fake(
    q,
    k,
    cos,
    sin,
    inv_freq,
    positions,
    seqlen_offsets,
    cu_seqlens,
    xpos_scale,
    position_offset,
    q_position_offset,
    rotary_dim,
    rotary_offset,
    interleaved,
    backward,
):
    return None


rope_qk_inplace_op = _define(
    "rope_qk_",
    f"(Tensor(a!) q, Tensor(b!) k, {_TABLES_SCHEMA}, SymInt position_offset, "
    "SymInt q_position_offset, int rotary_dim, int rotary_offset, "
    "bool interleaved, bool backward) -> ()",
    _rope_qk_inplace_kernel,
    _rope_qk_inplace_fake,
)


def _rope_qk_inplace_autograd(q, k, *arguments):
    """rope_jit::rope_qk_'s Autograd kernel (see _rope_inplace_autograd)."""
    _refuse_in_place_differentiation((q, k), arguments[:7])
    return _below_autograd(rope_qk_inplace_op, q, k, *arguments)


_library.impl("rope_qk_", _rope_qk_inplace_autograd, "Autograd")


def _refuse_in_place_differentiation(written, tables):
    """Raises where autograd would have to record an in-place op's write: a written tensor
    that requires grad in grad mode (as torch's in-place ops do), a table that requires grad,
    or any of them a dual tensor of the open forward-AD level (its tangent would not follow
    the write). apply_rope(..., inplace=True) records such calls."""
    cos, sin, inv_freq, _, _, _, xpos_scale = tables
    _refuse_table_grads({"cos": cos, "sin": sin, "inv_freq": inv_freq, "xpos_scale": xpos_scale})
    _torch_writes.check(written, ("q", "k"))
    if _forward_ad._current_level < 0:
        return
    names = ("q", "k")[:len(written)] + ("cos", "sin", "inv_freq", "xpos_scale")
    for name, tensor in zip(names, written + (cos, sin, inv_freq, xpos_scale)):
        if _is_dual(tensor):
            raise RuntimeError(
                f"{name}: is a dual tensor (forward-mode AD), and the in-place ops write where "
                "its tangent cannot follow: use rope_jit.apply_rope (inplace=True records the "
                "write, in forward mode too)")


# ------------------------------------------------------------------------------------------
# Autograd: reverse mode, forward mode, torch.func transforms
# ------------------------------------------------------------------------------------------
#
# The RoPE ops' Autograd kernels call _RopeTransformFunction wherever autograd differentiates
# a call; attention's call _AttentionFunction or, under a transform or a dual level,
# _AttentionTransformFunction. They declare what functorch needs (setup_context, a jvp, a
# generated vmap rule: vmap runs the ops per sample, torch's fallback). torch's
# register_autograd served reverse mode only: torch.func.grad refused it ("must override the
# setup_context staticmethod"), and torch.func.jvp and forward_ad dual tensors silently got a
# zero tangent (the ops' kernels saw the primal alone).


def _records(q, k, tables):
    """Whether autograd differentiates this call of a RoPE op (then _RopeTransformFunction
    records it): grad mode with q or k requiring grad, or a forward-AD dual level open (the
    Function takes zeros where an input has no tangent), outside torch.func. Refuses what
    rope-jit cannot differentiate: cos, sin, inv_freq or xpos_scale that require grad,
    inv_freq or xpos_scale that are dual tensors, and a differentiated call under torch.func
    (see _refuse_functorch_differentiation)."""
    cos, sin, inv_freq, _, _, _, xpos_scale = tables
    grad_mode = torch.is_grad_enabled()
    if grad_mode:  # (the dict only then: compiled graphs call this kernel with grad off)
        _refuse_table_grads(
            {"cos": cos, "sin": sin, "inv_freq": inv_freq, "xpos_scale": xpos_scale})
    duals = _forward_ad._current_level >= 0
    if duals:
        _refuse_varying_frequencies(inv_freq, xpos_scale, _is_dual)
    grads = grad_mode and (q.requires_grad or (k is not None and k.requires_grad))
    if _functorch_active():
        _refuse_functorch_differentiation(grads, duals, (q, k, cos, sin), "rope_jit.apply_rope")
        return False
    return grads or duals


def _refuse_functorch_differentiation(grads, duals, tensors, instead):
    """Raises where an op's Autograd kernel would differentiate a call under torch.func (grad
    mode with an input requiring grad, or a dual among `tensors`): it cannot reach a Function
    there ("could not find kernel for HigherOrderOperator custom_function_call"); `instead`
    names the function that works. At this level functorch has wrapped every tensor, so only
    requires_grad and the dual level's tangents say what varies."""
    if grads or (duals and any(map(_is_dual, tensors))):
        raise NotImplementedError(
            "the rope_jit ops called directly are not differentiable under torch.func "
            f"transforms (grad, jvp, jacrev...): call {instead}")


def _is_dual(tensor):
    """Whether `tensor` has a tangent at the open forward-AD level (one is open)."""
    return tensor is not None and _forward_ad.unpack_dual(tensor).tangent is not None


def _tables_vary(tables):
    """_RopeTransformFunction's last input: whether cos or sin carry a tangent (see its jvp)."""
    return _carries_tangent(tables[0]) or _carries_tangent(tables[1])


def _refuse_varying_frequencies(inv_freq, xpos_scale, varies):
    for name, table in (("inv_freq", inv_freq), ("xpos_scale", xpos_scale)):
        if varies(table):
            raise NotImplementedError(
                f"{name} varies under this transform (a tangent or gradient of it is "
                "asked for), but rope-jit differentiates with respect to q, k, cos and sin "
                f"only: use a plain PyTorch RoPE where {name} varies"
            )


class _RopeTransformFunction(torch.autograd.Function):
    """rope_jit::rope_qk (or rope_jit::rope where k is None), differentiated. Inputs: q, k,
    the 7 tables, the ops' 6 scalars, then `tables_vary` (whether cos or sin carry a tangent:
    see jvp). The rotation is linear in q and k: the tangent of the result is
    the same rotation of the tangents of q and k, the gradient the inverse rotation; both go
    through this Function again, so they compose (jacfwd, jacrev, hessian, grad of vmap)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, *arguments):
        arguments = arguments[:-1]  # (tables_vary is the jvp's)
        if k is None:  # (callers fold q_position_offset into position_offset: see apply_rope)
            tables, (position_offset, _, *rest) = arguments[:7], arguments[7:]
            return _below_autograd(rope_op, q, *tables, position_offset, *rest)
        return _below_autograd(rope_qk_op, q, k, *arguments)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # The jvp reads q and k, the backward only the tables: outside torch.func the backward
        # keeps no q and k alive (nor fails when they change in place after the call).
        # Under it both lists hold the same tensors: the generated vmap rule keeps one record
        # of their batch dimensions, and two lists of different lengths broke a backward
        # through a vmapped call (grad of vmap, jacrev of jacrev: review of session 38).
        ctx.save_for_forward(*inputs[:9])
        if _functorch_active():
            ctx.save_for_backward(*inputs[:9])
        else:
            ctx.save_for_backward(None, None, *inputs[2:9])
        ctx.params = inputs[9:15]
        ctx.tables_vary = inputs[15]

    @staticmethod
    def backward(ctx, *grads):
        grad_q, grad_k = grads[0], grads[1] if len(grads) > 1 else None
        *params, backward = ctx.params
        # (tables_vary again: the gradient's tangent takes the tables' part too, as in
        # forward-over-reverse with dual cos and sin, where False gave it none.)
        rotated = _RopeTransformFunction.apply(
            grad_q, grad_k, *ctx.saved_tensors[2:], *params, not backward, ctx.tables_vary
        )
        if grad_k is None:
            return (rotated, None) + (None,) * 14
        return tuple(rotated) + (None,) * 14

    @staticmethod
    def jvp(ctx, *tangents):
        # torch passes a tangent (zeros where none was given) for every floating-point tensor
        # input; which tables really vary was decided at the call (_carries_tangent): inv_freq
        # and xpos_scale were refused there, and cos and sin, where they vary, enter linearly:
        # their part of the tangent is the rotation by (dcos, dsin) less the rotation by zero
        # tables (which leaves the features outside the rotary span, as both calls copy them).
        # A full [P, R] table's tangent counts at the column the library reads for each pair.
        q, k, *tables = ctx.saved_tensors
        apply = _RopeTransformFunction.apply

        def tangent_of(primal, tangent):  # (a tangent of another dtype: the library's)
            if tangent is None:
                return torch.zeros_like(primal)
            return tangent if tangent.dtype == primal.dtype else tangent.to(primal.dtype)

        tangent_q = tangent_of(q, tangents[0])
        tangent_k = None if k is None else tangent_of(k, tangents[1])
        rotated = apply(tangent_q, tangent_k, *tables, *ctx.params, False)
        if not ctx.tables_vary:
            return rotated
        cos, sin, *rest = tables
        by_tangents = apply(q, k, tangent_of(cos, tangents[2]), tangent_of(sin, tangents[3]),
                            *rest, *ctx.params, False)
        by_zeros = apply(q, k, torch.zeros_like(cos), torch.zeros_like(sin), *rest, *ctx.params,
                         False)
        if k is None:
            return rotated + by_tangents - by_zeros
        return tuple(r + t - z for r, t, z in zip(rotated, by_tangents, by_zeros))


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_batched = torch._C._functorch.is_batchedtensor
_unwrapped = torch._C._functorch.get_unwrapped


def _carries_tangent(tensor):
    """Whether a table differs along some derivative direction of an active transform: a dual
    tensor of forward_ad's current level, or a functorch wrapper of grad, jvp (jacrev,
    jacfwd...) at any level (vmap's batched wrappers alone only batch it)."""
    if tensor is None:
        return False
    if _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(tensor).tangent is not None:
        return True
    if not _functorch_active():  # (the wrapper query costs 0.2 us; this one 50 ns)
        return False
    while _is_functorch_wrapped(tensor):
        if not _is_batched(tensor):
            return True
        tensor = _unwrapped(tensor)
    return False


# ------------------------------------------------------------------------------------------
# The eager hot path: straight to the library through a plan (see _plans.py)
# ------------------------------------------------------------------------------------------
#
# In eager mode apply_rope skips the dispatcher: with autograd it is one autograd.Function
# whose forward and backward call the library through a plan, else one plan call. Used only
# where the ops would do exactly the same: plain torch tensors, no torch.compile tracing, no
# TorchDispatchMode (FakeTensorMode, FlopCounterMode...) on the stack; elsewhere the ops run.


# apply_rope's tensors in a plan: q, k and the tables are signed; the outputs are made by the
# plan like q and k (torch.empty_like's shapes, strides, dtypes and devices; see
# _plans.Recipe). APPLY_RECIPE.in_place writes into q and k.
APPLY_RECIPE = _plans.Recipe(
    "apply_rope",
    _TENSOR_NAMES,
    signed=("q", "k") + _TABLE_FIELDS,
    outputs={"q_out": "q", "k_out": "k"},
)


# Where the ops' tables lie in a recipe's values (rope._TENSOR_NAMES order), and every slot
# _Call.rotate_by_function passes on (q, k and the outputs besides).
_TABLE_SLOTS = tuple(_TENSOR_NAMES.index(name) for name in _TABLE_FIELDS)
_FUNCTION_SLOTS = frozenset(_TABLE_SLOTS) | {_TENSOR_NAMES.index(name)
                                             for name in ("q", "k", "q_out", "k_out")}


class _Call:
    """What a forward resolved (recipe, tables, scalars, runtime), kept for its backward.

    `tables` are the recipe's signed tensors after q and k; `derived` its derived ones after
    the outputs (e.g. the HF drop-in's sequence starts); `params` = (layout, rotary_dim,
    rotary_offset, style)."""

    __slots__ = (
        "recipe",
        "tables",
        "derived",
        "params",
        "position_offset",
        "q_position_offset",
        "backward",
        "runtime",
    )

    def __init__(
        self, recipe, tables, derived, params, position_offset, q_position_offset, backward, runtime
    ):
        self.recipe, self.tables, self.derived, self.params = recipe, tables, derived, params
        self.position_offset, self.q_position_offset = position_offset, q_position_offset
        self.backward, self.runtime = backward, runtime

    def table_names(self):
        """The struct field names of the tables given (None ones left out), in their order."""
        return [_TENSOR_NAMES[slot] for slot, table in zip(self.recipe.signed[2:], self.tables)
                if table is not None]

    def rotate_by_function(self, q, k, backward):
        """q and k rotated as launch() would (into new tensors), through _RopeTransformFunction
        (differentiable, with torch.func too): for torch.func's tensors, which have no storage
        for the library to read, as in a backward vmapped by is_grads_batched or
        torch.autograd.functional.jacobian(vectorize=True) (it failed: "Cannot access data
        pointer of Tensor that doesn't have storage")."""
        values = self.recipe.values((q, k) + self.tables, self.derived + (None, None))
        if any(value is not None for slot, value in enumerate(values)
               if slot not in _FUNCTION_SLOTS):
            raise NotImplementedError(
                f"rope_jit: {self.recipe.name} has tensors the RoPE ops do not take")
        layout, rotary_dim, rotary_offset, style = self.params
        to_api = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
        rotated = _RopeTransformFunction.apply(
            to_api(q), None if k is None else to_api(k), *(values[slot] for slot in _TABLE_SLOTS),
            self.position_offset, self.q_position_offset, rotary_dim, rotary_offset,
            style == "interleaved", backward, False)
        return to_api(rotated) if k is None else (to_api(rotated[0]), to_api(rotated[1]))

    def inverse(self):
        """The same call in the other direction (the gradient's own graph)."""
        return _Call(
            self.recipe,
            self.tables,
            self.derived,
            self.params,
            self.position_offset,
            self.q_position_offset,
            not self.backward,
            self.runtime,
        )

    def launch(self, q, k, backward, inplace=False):
        """(q_out, k_out): q and k rotated (inversely with `backward`) into new tensors, or
        into q and k with `inplace` (then q_out and k_out are None)."""
        recipe = self.recipe.in_place if inplace else self.recipe
        signed = (q, k) + self.tables
        made = _plans.call(
            self.runtime,
            recipe,
            signed,
            self.derived,
            self.params + (backward, None, False, inplace),
            self.position_offset,
            self.q_position_offset,
        )
        if made is not None:
            return (None, None) if inplace else made
        if inplace:
            q_out = k_out = None
            derived = self.derived
        else:
            q_out = _empty_like(q)
            k_out = None if k is None else _empty_like(k)
            derived = self.derived + (q_out, k_out)
        layout, rotary_dim, rotary_offset, style = self.params
        values = recipe.values(signed, derived)
        given = zip(_TENSOR_NAMES[2:], values[2:])
        _rope(
            q,
            k,
            **{name: value for name, value in given if value is not None},
            position_offset=self.position_offset,
            q_position_offset=self.q_position_offset,
            rotary_dim=rotary_dim,
            rotary_offset=rotary_offset,
            style=style,
            backward=backward,
            layout=layout,
            runtime=self.runtime,
        )
        return q_out, k_out


def _versions(tables):
    """The version counters of the tables given (None for an inference tensor: it has none)."""
    try:
        return [table._version for table in tables if table is not None]
    except RuntimeError:
        return [None if table.is_inference() else table._version
                for table in tables if table is not None]


class _RopeFunction(torch.autograd.Function):
    """apply_rope's autograd in eager mode: forward and backward are one library call each
    (the backward through the same recipe and tables as its forward). Its backward is itself
    differentiable (double backward) through this Function."""

    @staticmethod
    def forward(ctx, q, k, call):
        ctx.call = call
        # The tables' versions (cos, sin, positions...): the backward reads them again, so an
        # in-place change in between must fail it as torch's saved tensors do (it silently
        # gave the gradient of other tables). Cheaper than save_for_backward on this path.
        ctx.table_versions = _versions(call.tables)
        q_out, k_out = call.launch(q, k, call.backward)
        if k is None:
            return q_out
        # Each output depends on its own input only: k_out needs no grad where k does not
        # (it had one, and a graph, beside a q that required grad: review, session 39).
        needs_q, needs_k = ctx.needs_input_grad[:2]
        if not (needs_q and needs_k):
            ctx.mark_non_differentiable(k_out if needs_q else q_out)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k=None):
        # Outputs that did not reach the loss come as zeros (materialize_grads), never None.
        call = ctx.call
        versions = _versions(call.tables)
        if versions != ctx.table_versions:
            names = [name for name, then, now
                     in zip(call.table_names(), ctx.table_versions, versions) if then != now]
            raise RuntimeError(
                f"rope_jit: {', '.join(names)} modified by an inplace operation after the forward "
                "that needs it for the gradient (versions "
                f"{ctx.table_versions} -> {versions}); rotate again after changing them")
        if not _has_storage(grad_q):  # a vmapped backward: tensors the library cannot read
            grads = call.rotate_by_function(grad_q, grad_k, not call.backward)
            return (grads, None, None) if grad_k is None else (grads[0], grads[1], None)
        if torch.is_grad_enabled():  # create_graph: the gradient's own graph
            grads = _RopeFunction.apply(grad_q, grad_k, call.inverse())
            return (grads, None, None) if grad_k is None else (grads[0], grads[1], None)
        grad_q, grad_k = call.launch(grad_q, grad_k, not call.backward)
        return grad_q, grad_k, None


_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
# Whether a torch.func transform (vmap, grad...) is active: its tensors have no storage the
# library could read (the eager paths failed with "Cannot access data pointer"); the ops run
# under it (vmap by torch's per-sample fallback).
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
if torch.__version__ < (2, 5):
    # Before torch 2.5, torch.compile cannot trace the query (fullgraph failed: "torch.* op
    # returned non-Tensor bool"); later releases take its value at trace time, as this does.
    # The mark is what torch 2.4's torch._dynamo.assume_constant_result sets, set here without
    # importing torch._dynamo, which doubled the package's import time (0.38 -> 0.82 s).
    def _functorch_active(query=_functorch_active):
        return query()

    _functorch_active._dynamo_marked_constant = True

# Whether a tensor has storage the library could read: not the batched gradients of a backward
# vmapped by autograd's is_grads_batched (torch's older vmap, which no transform query shows).
_has_storage = getattr(torch._C, "_has_storage", lambda tensor: True)
_is_fake = torch._subclasses.fake_tensor.is_fake
# The dual level of torch.autograd.forward_ad (-1: none): dual tensors are plain torch
# tensors, whose tangents the eager paths and the ops would drop; _RopeTransformFunction
# carries them.
_forward_ad = torch.autograd.forward_ad


def _transforms_active():
    """Whether a torch.func transform or a forward-AD dual level is active: then the
    Functions above run (the eager paths, which would drop tangents, test the same two
    conditions inline, as their hot paths cannot pay a call)."""
    return _functorch_active() or _forward_ad._current_level >= 0


# The exact tensor classes of the eager hot path (subclasses such as FakeTensor take the ops).
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)
# The plans' tensor types and stream function, set now: else the first call of a fast path
# that skips eager_path_applies (apply_rope's inference one, the HF drop-in's) finds no torch
# types yet and takes the general path once.
_plans.torch_types()
_runtime = default_runtime
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_empty_like = torch.empty_like
_apply_function = _RopeFunction.apply


def eager_path_applies(q, k, tables):
    """Whether a call on these tensors may skip the ops: eager mode (no torch.compile tracing,
    no TorchDispatchMode on the stack, no torch.func transform or forward-AD dual level) and
    plain torch tensors only."""
    if (
        _is_compiling()
        or _dispatch_stack_depth()
        or _functorch_active()
        or _forward_ad._current_level >= 0
    ):
        return False
    types = _plans.TORCH_TENSOR_TYPES or _plans.torch_types()
    if type(q) not in types or (k is not None and type(k) not in types):
        return False
    if q.is_meta:  # shapes only: the ops' fake kernels
        return False
    for table in tables:
        if table is not None and type(table) not in types:
            return False
    return True


_creation_meta = torch._C._autograd._get_creation_meta
_DEFAULT_CREATION = torch._C._autograd.CreationMeta.DEFAULT


def _copy_back(q, k, rotated):
    """apply_rope's in-place result under autograd: the rotation copied into q (and k). Both
    are checked first, as torch's copy_ checks each: a refusal of k after q was written left
    q rotated and k not (adversarial pass, session 37). While torch.compile traces, torch's
    copy_ refuses these itself, before anything runs (and its tracer of torch 2.11 cannot
    compare the views' creation kinds: run FR)."""
    for name, tensor in (("q", q), ("k", k)):
        if tensor is None or not tensor.requires_grad or _is_compiling():
            continue
        base = tensor._base
        creation = _creation_meta(tensor) if base is not None else _DEFAULT_CREATION
        if tensor.is_leaf or (base is not None and base.is_leaf and base.requires_grad):
            what = "a leaf tensor" if tensor.is_leaf else "a view of a leaf tensor"
        elif creation != _DEFAULT_CREATION:
            # (views of multi-output ops such as unbind, or made under no_grad)
            what = f"a view made as {creation.name}"
        else:
            continue
        raise RuntimeError(
            f"{name}: {what} that requires grad cannot be written in place (as torch's "
            "in-place ops refuse it): rotate out of place, or under torch.no_grad()"
        )
    # What else torch's copy_ refuses, also checked before either is written (a k refused
    # after q's copy left q rotated, with a copy node as its grad_fn; atomicity audit, session
    # 40), and the rule the library applies where it writes in place itself. Not while
    # torch.compile traces: its fake tensors have no memory to judge.
    if not _is_compiling():
        sources = (rotated,) if k is None else rotated
        for name, tensor, source in zip(("q", "k"), (q, k), sources):
            _refuse_copy_into(name, tensor, source)
        if k is not None and _same_view(q, k):
            raise ValueError("k: is the same memory as q; it would be rotated twice")
        if k is not None and _share_elements(_below_wrappers(q), _below_wrappers(k)):
            raise ValueError("q: shares memory with k; in place, q and k need elements of "
                             "their own (views of one buffer may interleave, as a fused qkv's, "
                             "but not touch the same elements)")
    if k is None:
        return q.copy_(rotated)
    return q.copy_(rotated[0]), k.copy_(rotated[1])


def _refuse_copy_into(name, tensor, source):
    """Raises, naming `name`, where torch's tensor.copy_(source) would refuse the write."""
    if _functorch_active() and (torch._C._functorch.maybe_get_level(source)
                                > torch._C._functorch.maybe_get_level(tensor)):
        raise RuntimeError(f"{name}: a tensor a torch.func transform (vmap, grad...) "
                           "captured from outside cannot be written in place with its "
                           "rotation, which that transform tracks: rotate out of place")
    plain = _below_wrappers(tensor)  # (the checks below need the memory)
    if plain.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name}: an inference tensor cannot be written in place outside "
                           "torch.inference_mode(): rotate out of place, or inside it")
    # The library's rule for a tensor it writes (torch's copy_ refuses only zero strides over
    # several indices, and lets overlapping ones such as as_strided's write an element twice).
    if not plain.is_contiguous() and not _distinct_elements(plain, name):
        raise RuntimeError(f"{name}: its strides may make several indices address the same "
                           "element, so it cannot be written in place: rotate out of place")


def _library_can_judge(tensor):
    """Whether the library's memory rules can judge `tensor`: it has memory of its own (not
    meta, fake, or a wrapper subclass, whose data pointer is 0) in at most 8 dims (vmap's
    memory has a batch dim a level too)."""
    return not (tensor.dim() > _s.MEMORY_QUERY_MAX_DIMS or tensor.is_meta or _is_fake(tensor)
                or not _has_storage(tensor) or tensor.data_ptr() == 0)


def _kept(answers, key, ask):
    """answers[key], asked of ask() the first time (a training loop asks the same each step);
    the table is emptied at 256 keys."""
    answer = answers.get(key)
    if answer is None:
        answer = ask()
        if len(answers) >= 256:
            answers.clear()
        answers[key] = answer
    return answer


def _library_answer(query, *named_tensors):
    """The library's memory query `query` ((tensor, name) pairs: tensors.shares_memory or
    has_distinct_elements) asked of those tensors, or None where it cannot answer: a library
    without the query, or one built before the queries took more than 4 dims (both say 0.1.0),
    which refuses the batched memory of vmap."""
    try:
        return query(*(_tensors.as_tensor(tensor, name) for tensor, name in named_tensors))
    except _errors.InvalidArgumentError:
        if any(tensor.dim() > 4 for tensor, _ in named_tensors):
            return None
        raise


_distinct_layouts = {}  # (shape, strides) -> _distinct_elements' answer


def _distinct_elements(tensor, name):
    """Whether no two indices of `tensor` (below any torch.func wrappers, not contiguous)
    address the same element, as the library judges each tensor it writes
    (rope_jit_tensor_has_distinct_elements); kept per layout, the only thing it depends on.
    Where the library cannot judge (tensors without memory, memory of over 8 dims under nested
    vmaps, a library too old to tell), batched memory of over 4 dims is judged by torch's
    answer for zero strides (asked only where a stride is 0: the query costs a microsecond),
    and the rest is judged distinct, as before the rule was asked here."""
    if _library_can_judge(tensor):
        answer = _kept(_distinct_layouts, (tensor.shape, tensor.stride()),
                       lambda: _library_answer(_tensors.has_distinct_elements, (tensor, name)))
        if answer is not None:
            return answer
    return not (tensor.dim() > 4 and 0 in tensor.stride()
                and torch._debug_has_internal_overlap(tensor) == 1)


def _below_wrappers(tensor):
    """The tensor under any torch.func wrappers (vmap's has the batch dim too)."""
    while _is_functorch_wrapped(tensor):
        tensor = _unwrapped(tensor)
    return tensor


def _same_view(a, b):
    """Whether a and b are one view of the same memory. Tensors without memory (meta, a
    dispatch mode's fake tensors, whose data pointers are all 0) are only themselves."""
    if a is b:
        return True
    if a.is_meta or b.is_meta or _is_fake(a) or _is_fake(b) or not _has_storage(a):
        return False
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.numel() > 0)


_shared_layouts = {}  # (k's distance from q, both views' layouts) -> _share_elements' answer


def _byte_range(tensor):
    """(first, last) byte address a non-empty tensor's view touches, or None when empty."""
    first = last = tensor.data_ptr()
    size = tensor.element_size()
    for extent, stride in zip(tensor.shape, tensor.stride()):
        if extent == 0:
            return None
        step = (extent - 1) * stride * size
        if step > 0:
            last += step
        else:
            first += step
    return first, last + size - 1


def _share_elements(q, k):
    """Whether q and k (below any torch.func wrappers), not one view, share an element, as
    the library judges what a call writes in place itself (rope_jit_tensors_share_memory):
    views of one buffer that only interleave pass. Asked only where their byte ranges meet
    (also across torch storages: a NumPy array's views brought in twice are two); the answer
    depends on their layouts and distance alone, so it is kept: a training loop asks the same
    each step. vmap's memory has a batch dim a level too: where that makes over 8 dims, more
    than the library takes, nothing is refused. A library too old to tell refuses nothing, as
    before it had the rule (nor one that takes 4 dims alone, under vmap)."""
    if not (_library_can_judge(q) and _library_can_judge(k)):
        return False
    q_range, k_range = _byte_range(q), _byte_range(k)
    if q_range is None or k_range is None or q_range[1] < k_range[0] or k_range[1] < q_range[0]:
        return False
    key = (k.data_ptr() - q.data_ptr(), q.shape, q.stride(), q.element_size(), k.shape,
           k.stride(), k.element_size())
    return _kept(_shared_layouts, key, lambda: _library_answer(
        _tensors.shares_memory, (q, "q"), (k, "k"))) is True


def run_eager(call, q, k, inplace, records_grad):
    """apply_rope's eager result for a resolved call: one library call (in place or into new
    tensors), or, when autograd records it, one _RopeFunction node (then, in place, copied)."""
    if inplace and not records_grad:
        call.launch(q, k, call.backward, inplace=True)
        return q if k is None else (q, k)
    if records_grad:
        rotated = _apply_function(q, k, call)
    else:
        q_out, k_out = call.launch(q, k, call.backward)
        rotated = q_out if k is None else (q_out, k_out)
    if not inplace:
        return rotated
    return _copy_back(q, k, rotated)


# ------------------------------------------------------------------------------------------
# apply_rope: the function to call
# ------------------------------------------------------------------------------------------


def _refuse_non_tensors(tensors):
    """Raises a TypeError naming the first of `tensors` (name -> value) that is neither a
    torch tensor nor None."""
    for name, tensor in tensors.items():
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got "
                            f"{type(tensor).__name__}")


def _refuse_table_grads(tables, differentiated="q and k", instead="RoPE"):
    if not torch.is_grad_enabled():
        return
    for name, table in tables.items():
        if table is not None and table.requires_grad:
            raise NotImplementedError(
                f"{name} requires grad, but rope-jit computes gradients for {differentiated} "
                f"only: pass {name}.detach(), or use a plain PyTorch {instead} where {name} "
                "must be learned"
            )


def apply_rope(
    q,
    k=None,
    cos=None,
    sin=None,
    *,
    inv_freq=None,
    positions=None,
    seqlen_offsets=None,
    cu_seqlens=None,
    position_offset=0,
    q_position_offset=0,
    rotary_dim=0,
    rotary_offset=0,
    style="half",
    layout="bhsd",
    xpos_scale=None,
    inplace=False,
    backward=False,
):
    """Rotary position embeddings for torch tensors, differentiable and torch.compile-able.

    Arguments are rope_jit.rope's (see there for shapes and position rules), with torch tensors:
    q [B, Hq, S, D] ("bhsd"), [B, S, Hq, D] ("bshd") or [T, Hq, D] ("thd"); k likewise with Hk
    heads (Hq a multiple of Hk) or None; cos/sin [P, R/2] or [P, R], or inv_freq [R/2].

    inplace=False (default) returns new tensors; inplace=True writes into q and k and returns
    them (when autograd records the call, through an out-of-place rotation and copy_, which
    autograd can differentiate).

    Returns the rotated q when k is None, else (q, k). Gradients flow to q and k through the
    library's backward kernel; tables must not require grad. torch.func transforms (grad, jvp,
    vmap, jacfwd, hessian...) and forward_ad dual tensors work too (forward mode also takes
    the tangents of cos and sin).

    In eager mode the call goes to the library directly (an argument struct built once per
    signature, see _plans.py; one autograd.Function when gradients are recorded); under
    torch.compile, export or a dispatch mode it is the rope_jit:: ops.
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"style: expected 'half' or 'interleaved', got {style!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    tables = (cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, xpos_scale)
    grad_mode = _is_grad_enabled()
    try:
        if grad_mode and (
            (cos is not None and cos.requires_grad)
            or (sin is not None and sin.requires_grad)
            or (inv_freq is not None and inv_freq.requires_grad)
            or (xpos_scale is not None and xpos_scale.requires_grad)
        ):
            _refuse_table_grads(
                {"cos": cos, "sin": sin, "inv_freq": inv_freq, "xpos_scale": xpos_scale}
            )
        records_grad = grad_mode and (q.requires_grad or (k is not None and k.requires_grad))
    except AttributeError:  # (a list or a NumPy array for a tensor; the hot path pays nothing)
        _refuse_non_tensors({"q": q, "k": k, "cos": cos, "sin": sin, "inv_freq": inv_freq,
                             "xpos_scale": xpos_scale})
        raise
    if (
        not inplace
        and not records_grad
        and not _is_compiling()
        and not _dispatch_stack_depth()
        and not _functorch_active()
        and _forward_ad._current_level < 0
    ):
        # The eager forward without autograd (inference, decode): one plan call, which makes
        # the outputs, no _Call. q, k and the tables are checked by the plan's key (plain torch
        # tensors only); anything else takes the code below, which decides as before.
        made = _plans.call(
            _runtime(),
            APPLY_RECIPE,
            (q, k) + tables,
            (),
            (layout, rotary_dim, rotary_offset, style, bool(backward), None, False, False),
            # without k, q's own offset simply adds to the common one
            position_offset + q_position_offset if k is None else position_offset,
            0 if k is None else q_position_offset,
        )
        if made is not None:
            return made[0] if k is None else made

    if eager_path_applies(q, k, tables):
        if k is None:  # without k, q's own offset simply adds to the common one
            position_offset, q_position_offset = position_offset + q_position_offset, 0
        call = _Call(
            APPLY_RECIPE,
            tables,
            (),
            (layout, rotary_dim, rotary_offset, style),
            position_offset,
            q_position_offset,
            bool(backward),
            default_runtime(),
        )
        return run_eager(call, q, k, inplace, records_grad)

    interleaved = style == "interleaved"

    def to_api(name, tensor):
        # The C API takes [B, H, S, D] in that logical order: a bshd tensor goes as its
        # transposed view (no copy).
        if layout != "bshd":
            return tensor
        if tensor.dim() != 4:
            raise ValueError(
                f"{name}: layout bshd needs 4 dimensions [B, S, H, D], got {list(tensor.shape)}"
            )
        return tensor.transpose(1, 2)

    from_api = (
        (lambda tensor: tensor.transpose(1, 2)) if layout == "bshd" else (lambda tensor: tensor)
    )
    q_api = to_api("q", q)
    k_api = None if k is None else to_api("k", k)
    transformed = _transforms_active()

    if transformed:  # (refused before the in-place copies below are made)
        _refuse_varying_frequencies(inv_freq, xpos_scale, _carries_tangent)
    if inplace:
        if records_grad or transformed:
            # (Under a transform, the rotation of copies: the Function saves its inputs, which
            # the copy back then changes.)
            rotated = apply_rope(
                q.clone() if transformed else q,
                None if k is None else k.clone() if transformed else k,
                cos,
                sin,
                inv_freq=inv_freq,
                positions=positions,
                seqlen_offsets=seqlen_offsets,
                cu_seqlens=cu_seqlens,
                position_offset=position_offset,
                q_position_offset=q_position_offset,
                rotary_dim=rotary_dim,
                rotary_offset=rotary_offset,
                style=style,
                layout=layout,
                xpos_scale=xpos_scale,
                backward=backward,
            )
            return _copy_back(q, k, rotated)

    if k is None:  # without k, q's own offset simply adds to the common one
        position_offset, q_position_offset = position_offset + q_position_offset, 0
    # The ops' scalars; rope_jit::rope and rope_ (one tensor) take no q_position_offset.
    scalars = (position_offset, q_position_offset, rotary_dim, rotary_offset, interleaved, backward)
    one_tensor_scalars = scalars[:1] + scalars[2:]
    if inplace:
        if k is None:
            rope_inplace_op(q_api, *tables, *one_tensor_scalars)
            return q
        rope_qk_inplace_op(q_api, k_api, *tables, *scalars)
        return q, k
    if transformed:  # (at the Python level: functorch has no dispatcher path to a Function)
        rotated = _RopeTransformFunction.apply(q_api, k_api, *tables, *scalars,
                                               _tables_vary(tables))
        return from_api(rotated) if k is None else (from_api(rotated[0]), from_api(rotated[1]))
    if k is None:
        return from_api(rope_op(q_api, *tables, *one_tensor_scalars))
    q_out, k_out = rope_qk_op(q_api, k_api, *tables, *scalars)
    return from_api(q_out), from_api(k_out)


# ------------------------------------------------------------------------------------------
# rope_jit::attention: attention with rotary fused in (when the library has it)
# ------------------------------------------------------------------------------------------


def _attention_kernel(
    q, k, v, cos, sin, pos_mask, attn_mask, causal, scale, rotary_dim, interleaved
):
    """(out, lse): rope_jit.attention into new tensors; lse [B, Hq, Sq] float32. (On CUDA the
    kernels' workspace, where they need one, is a torch.empty too: rope_jit.attention's
    _torch_workspace.)"""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _call_attention(
        q,
        k,
        v,
        out,
        cos=cos,
        sin=sin,
        pos_mask=pos_mask,
        attn_mask=attn_mask,
        causal=causal,
        scale=scale,
        rotary_dim=rotary_dim,
        style="interleaved" if interleaved else "half",
        lse=lse,
    )
    return out, lse


def _attention_fake(q, k, v, cos, sin, pos_mask, attn_mask, causal, scale, rotary_dim, interleaved):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


_ATTENTION_SCHEMA = (
    "Tensor? cos, Tensor? sin, Tensor? pos_mask, Tensor? attn_mask, bool causal, float scale, "
    "int rotary_dim, bool interleaved"
)
attention_op = _define(
    "attention",
    f"(Tensor q, Tensor k, Tensor v, {_ATTENTION_SCHEMA}) -> (Tensor, Tensor)",
    _attention_kernel,
    _attention_fake,
)


def _attention_backward_kernel(
    dout, q, k, v, out, lse, cos, sin, pos_mask, attn_mask, causal, scale, rotary_dim, interleaved
):
    """(dq, dk, dv) of rope_jit::attention, by the library's backward kernel; bitwise
    reproducible when torch.use_deterministic_algorithms(True) is in effect (the library's
    `deterministic` option), else the fastest kernels (on sm_90 dq is accumulated with atomic
    adds)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call_attention_backward(
        q,
        k,
        v,
        out,
        lse,
        dout,
        dq,
        dk,
        dv,
        cos=cos,
        sin=sin,
        pos_mask=pos_mask,
        attn_mask=attn_mask,
        causal=causal,
        scale=scale,
        rotary_dim=rotary_dim,
        style="interleaved" if interleaved else "half",
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return dq, dk, dv


def _attention_backward_fake(
    dout, q, k, v, out, lse, cos, sin, pos_mask, attn_mask, causal, scale, rotary_dim, interleaved
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


attention_backward_op = _define(
    "attention_backward",
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_ATTENTION_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)",
    _attention_backward_kernel,
    _attention_backward_fake,
)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, cos, sin, pos_mask, attn_mask, causal, scale, rotary_dim, interleaved = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cos, sin, pos_mask, attn_mask)
    ctx.params = (causal, scale, rotary_dim, interleaved)
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, grad_out, grad_lse):
    # lse is marked non-differentiable: its gradient is ignored (attention() gives callers an
    # lse that carries it: _LseGradientFunction).
    q, k, v, out, lse, cos, sin, pos_mask, attn_mask = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 11
    # create_graph=True in eager mode (not while torch.compile traces): the library's backward
    # has no backward of its own, and torch's fallback for such an op gave a second derivative
    # of zero (with a warning only). The gradients are computed without a graph and get a node
    # that raises if they are differentiated, as torch.autograd.function.once_differentiable's.
    create_graph = (
        torch.is_grad_enabled() and type(grad_out) is torch.Tensor and not _dispatch_stack_depth()
    )
    with torch.no_grad() if create_graph else contextlib.nullcontext():
        dq, dk, dv = attention_backward_op(
            grad_out, q, k, v, out, lse, cos, sin, pos_mask, attn_mask, *ctx.params
        )
    sources = [t for t in (grad_out, q, k, v) if t.requires_grad]
    # Batched gradients (is_grads_batched: torch's older vmap, tensors without storage) get
    # no such node (it detaches, which has no batching rule there): made without a graph, they
    # raise as tensors that do not require grad where differentiated.
    if create_graph and sources and _has_storage(grad_out):
        # The node's inputs include what the gradients depend on, so that differentiating
        # them reaches it (and raises) instead of finding them unconnected.
        raises = torch._C._functions.DelayedError(
            b"rope_jit.attention: its gradient is not differentiable (no double backward)",
            3 + len(sources),
        )
        dq, dk, dv = raises(*[t.detach().requires_grad_() for t in (dq, dk, dv)], *sources)[:3]
    return (dq, dk, dv) + (None,) * 8


class _AttentionFunction(torch.autograd.Function):
    """rope_jit::attention, differentiated in reverse mode outside torch.func."""

    @staticmethod
    def forward(*inputs):
        return _below_autograd(attention_op, *inputs)

    setup_context = staticmethod(_attention_setup_context)
    backward = staticmethod(_attention_backward)


def _attention_autograd(q, k, v, cos, sin, pos_mask, attn_mask, *scalars):
    """rope_jit::attention's Autograd kernel: a Function records the call where autograd
    differentiates it, else the kernel runs alone."""
    inputs = (q, k, v, cos, sin, pos_mask, attn_mask, *scalars)
    _refuse_attention_table_grads(cos, sin, attn_mask)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    duals = _forward_ad._current_level >= 0
    if _functorch_active():
        _refuse_functorch_differentiation(
            grads, duals, (q, k, v, cos, sin),
            "rope_jit.torch_ops.attention, which is differentiable in reverse mode there "
            "(attention has no forward-mode derivative)")
    elif duals:
        return _AttentionTransformFunction.apply(*inputs)  # (its jvp raises)
    elif grads:
        return _AttentionFunction.apply(*inputs)
    return _below_autograd(attention_op, *inputs)


def _refuse_attention_table_grads(cos, sin, attn_mask):
    # (A float mask that requires grad got none, silently: adversarial pass, session 37.)
    _refuse_table_grads({"cos": cos, "sin": sin, "attn_mask": attn_mask}, "q, k and v",
                        "attention")


_library.impl("attention", _attention_autograd, "Autograd")


class _AttentionGradientFunction(torch.autograd.Function):
    """(dq, dk, dv) by the library's backward kernel, under torch.func: a node whose own
    derivative raises (there is no double backward; torch.func.grad differentiates with
    create_graph, where the eager path's DelayedError wrapper cannot be built)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return attention_backward_op(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "rope_jit.attention: its gradient is not differentiable (no double backward)"
        )

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "rope_jit.attention: its gradient has no forward-mode derivative"
        )


class _AttentionTransformFunction(torch.autograd.Function):
    """rope_jit::attention for torch.func (grad, vjp, vmap: the ops per sample) and
    forward-mode AD, which _AttentionFunction cannot serve (no setup_context of functorch's
    kind; its backward's DelayedError node cannot be built there). There is no forward-mode
    derivative (no such kernel): a tangent of q, k or v raises instead of coming out zero."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return _below_autograd(attention_op, *inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _attention_setup_context(ctx, inputs, output)
        if _vmap_takes_unmaterialized_grads():
            ctx.set_materialize_grads(False)  # (an lse no loss uses: None, no extra launch)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cos, sin, pos_mask, attn_mask = ctx.saved_tensors
        dq = dk = dv = None
        if grad_out is not None:
            dq, dk, dv = _AttentionGradientFunction.apply(grad_out, *ctx.saved_tensors, *ctx.params)
        if grad_lse is not None and _vmap_takes_unmaterialized_grads():
            # Under vmap, whose generated rule drops lse's non-differentiable mark, and where
            # q reads requires_grad False, so that attention() gives no _LseGradientFunction
            # (a gradient through a vmapped lse came out zero; review, session 49).
            lse_dq, lse_dk = _lse_share(grad_lse, lse, q, k, v, cos, sin, pos_mask, attn_mask,
                                        ctx.params)
            dq = lse_dq if dq is None else dq + lse_dq
            dk = lse_dk if dk is None else dk + lse_dk
        return dq, dk, dv, *(None,) * 8

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "rope_jit.attention has no forward-mode derivative (torch.func.jvp, jacfwd, "
            "forward_ad): use reverse mode (torch.func.grad, vjp, jacrev)"
        )


@functools.lru_cache(maxsize=None)
def _vmap_takes_unmaterialized_grads():
    """Whether torch.func's generated vmap rule takes a backward's None gradients (a Function
    with set_materialize_grads(False)): torch 2.4's passed None on to _add_batch_dim, which
    raised. Where it cannot, _AttentionTransformFunction leaves grads materialized and lse's
    gradient through vmap is dropped, as before session 49 (else every backward under
    torch.func would run lse's share on zeros). Tried once, on two floats."""

    class Probe(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2, x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_a * 2 if grad_a is not None else None

    try:
        torch.func.grad(lambda x: torch.func.vmap(lambda y: Probe.apply(y)[0])(x).sum())(
            torch.ones(2)
        )
        return True
    except Exception:  # (TypeError on torch 2.4; whatever another version raises)
        return False


class _LseGradientFunction(torch.autograd.Function):
    """lse as attention() returns it, with its gradient (the op marks lse
    non-differentiable: a loss through it, a z-loss or a merge of attention over chunks of
    keys, got none from it, silently; adversarial pass, session 49).

    With g = dL/dlse, the scores' gradient gains P_ij g_i (d lse_i / d s_ij = P_ij). The
    library's backward gives dS_ij = P_ij (dout_i . v_j - dout_i . out_i) from the out it is
    handed; handed v' with every row e_0, out' = 0 and dout' = g e_0, that is P_ij g_i, and
    its dq and dk are lse's share (its dv is not: v has no share in lse). One more backward
    launch, only where lse's gradient is asked for. No jvp (torch.compile traces no Function
    that has one): forward-mode AD raises torch's own "jvp is not implemented"."""

    generate_vmap_rule = True

    @staticmethod
    def forward(lse, q, k, v, cos, sin, pos_mask, attn_mask, params):
        # A copy, not a view: callers write lse in place (nan_to_num_ of a masked row), which
        # torch refuses for a Function's view output (B * Hq * Sq floats).
        return lse.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        lse, q, k, v, cos, sin, pos_mask, attn_mask, params = inputs
        ctx.save_for_backward(lse, q, k, v, cos, sin, pos_mask, attn_mask)
        ctx.params = params

    @staticmethod
    def backward(ctx, grad_lse):
        dq, dk = _lse_share(grad_lse, *ctx.saved_tensors, ctx.params)
        return None, dq, dk, None, None, None, None, None, None


def _lse_share(grad_lse, lse, q, k, v, cos, sin, pos_mask, attn_mask, params):
    """(dq, dk) of lse's gradient grad_lse: the library's backward handed v rows e_0, out 0
    and dout grad_lse e_0 (_LseGradientFunction), as a node whose own derivative raises (no
    double backward; while torch.compile traces, the op itself, as _attention_backward's:
    torch 2.4's Dynamo handed that Function's forward its ctx). Out of place: under
    torch.func the tensors are wrapped, vmap batches them."""
    unit_rows = torch.nn.functional.pad(torch.ones_like(v[..., :1]), (0, v.shape[-1] - 1))
    dout = torch.nn.functional.pad(grad_lse[..., None].to(q.dtype), (0, v.shape[-1] - 1))
    out = torch.zeros_like(dout)
    backward = (
        attention_backward_op if torch.compiler.is_compiling() else _AttentionGradientFunction.apply
    )
    dq, dk, _ = backward(dout, q, k, unit_rows, out, lse, cos, sin, pos_mask, attn_mask, *params)
    return dq, dk


def attention(
    q,
    k,
    v,
    cos=None,
    sin=None,
    *,
    pos_mask=None,
    attn_mask=None,
    causal=False,
    scale=0.0,
    rotary_dim=0,
    style="half",
    return_lse=False,
):
    """Attention with rotary fused in, for torch tensors, differentiable (the library's
    backward kernel) and torch.compile-able. Arguments are rope_jit.attention's: q [B, Hq, Sq,
    D], k and v [B, Hk, Sk, D], cos/sin [P, R/2] or [P, R] or None, pos_mask, attn_mask, causal
    (top-left aligned), scale (0 = 1/sqrt(D)), style. Returns out [B, Hq, Sq, D], and lse
    [B, Hq, Sq] float32 with return_lse=True, which carries its gradient to q and k (one more
    backward launch where a loss uses it; eagerly, under torch.func and torch.compile; not
    through torch.func.vmap on torch 2.4). Raises NotImplementedError when the library has no
    attention op."""
    if style not in ("half", "interleaved"):
        raise ValueError(f"style: expected 'half' or 'interleaved', got {style!r}")
    # (Here too: under a transform the call below skips the op's Autograd kernel.)
    _refuse_attention_table_grads(cos, sin, attn_mask)
    if not torch.compiler.is_compiling() and not _has_attention():
        raise NotImplementedError(
            "rope_jit.attention: the loaded librope_jit has no rope_jit_attention"
        )
    # (Under a transform at the Python level: functorch has no dispatcher path to a Function.)
    function = _AttentionTransformFunction.apply if _transforms_active() else attention_op
    params = (bool(causal), float(scale), int(rotary_dim), style == "interleaved")
    out, lse = function(q, k, v, cos, sin, pos_mask, attn_mask, *params)
    if not return_lse:
        return out
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        lse = _LseGradientFunction.apply(lse, q, k, v, cos, sin, pos_mask, attn_mask, params)
    return out, lse
