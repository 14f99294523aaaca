"""HF transformers' apply_rotary_pos_emb (Llama, Mistral, Qwen2, Gemma... modeling files)."""

import torch

from .. import _plans, torch_ops
from ..rope import _TENSOR_NAMES
from ..runtime import default_runtime
from ..torch_ops import apply_rope


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotates q and k as transformers' `q * cos + rotate_half(q) * sin` (half style) does.

    Args:
        q: [B, Hq, S, D] with unsqueeze_dim=1 (the default), or [B, S, Hq, D] with
            unsqueeze_dim=2. k: the same with Hk heads (Hq a multiple of Hk for one fused
            launch; otherwise q and k are rotated by two launches).
        cos, sin: [B, S, R] as the model's rotary embedding returns them (R = D, or R < D
            for partial rotary as GLM/Phi do: the first R features rotate, the rest pass
            through), [1, S, R] or [S, R]; or, with position_ids, a [P, R] table that
            transformers < 4.38 gathered by position_ids [B, S].
        position_ids: ignored unless cos is a 2-D table, or the [1, 1, P, R] cache that
            transformers 4.31-4.35 passed (as in transformers >= 4.38, where it is
            deprecated); a negative id counts from the table's end, as in transformers'
            cos[position_ids]. An int here is taken as unsqueeze_dim, so that the newer signature
            apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) works positionally as well.

    Returns (q_embed, k_embed), new tensors in the dtype transformers gives: q's, or cos's
    where it is wider (then transformers' formula runs: the models pass cos in q's dtype).

    Calls the library cannot serve as transformers would run transformers' own formula
    instead (_transformers_formula, see _library_serves): cos/sin that require grad
    (transformers differentiates them), dtypes other than float32/float16/bfloat16, q and k
    (or cos and sin) of different dtypes, cos wider than q, an odd head_dim, k with another
    sequence length than q, cos/sin that are not one row a token (transformers broadcasts
    [B, 1, R] over the tokens and a q of batch 1 over cos's batch, or raises), k without
    heads, q or k not 4-D, another unsqueeze_dim. The library reads the first half of a full
    [.., R] table for both halves, as every rotary embedding of transformers builds it
    (cat(freqs, freqs)).
    """
    if (
        position_ids is not None  # (first: the models' calls pass none)
        and isinstance(position_ids, int)
        and not isinstance(position_ids, bool)
    ):
        position_ids, unsqueeze_dim = None, position_ids
    if position_ids is not None and getattr(cos, "dim", lambda: 2)() == 4:
        # transformers 4.31-4.35 passed its cache, [1, 1, P, R], and squeezed it to [P, R].
        cos, sin = cos.squeeze(1).squeeze(0), sin.squeeze(1).squeeze(0)
    if position_ids is not None and getattr(cos, "dim", lambda: 2)() != 2:
        position_ids = None  # (used only to gather rows of a 2-D table, as documented)
    if position_ids is None:
        rotated = _eager(q, k, cos, sin, unsqueeze_dim)
        if rotated is not None:
            return rotated
        if not _library_serves(q, k, cos, sin, unsqueeze_dim):
            return _transformers_formula(q, k, cos, sin, unsqueeze_dim)
    elif not _library_serves(q, k, cos, sin, unsqueeze_dim):
        # transformers < 4.38 (cos a [P, R] table here): its rows gathered by position_ids,
        # then its formula.
        return _transformers_formula(q, k, cos[position_ids], sin[position_ids], unsqueeze_dim)
    if unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(
            f"unsqueeze_dim: expected 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}"
        )
    layout = "bhsd" if unsqueeze_dim in (1, -3) else "bshd"
    seq_len = q.shape[2] if layout == "bhsd" else q.shape[1]
    batch = q.shape[0]
    positions = seqlen_offsets = None
    if cos.dim() == 2:
        # A [P, R] table: rows by position_ids when given (old transformers), else row s.
        # Their models pass [1, S] for any batch (one row of positions, broadcast).
        table_cos, table_sin = cos, sin
        positions = position_ids
        if positions is not None and positions.dim() == 2 and positions.shape[0] == 1:
            positions = positions[0]
        if positions is not None and positions.dtype in _INDEX_DTYPES:
            # transformers gathered the rows with cos[position_ids], where an id in [-P, 0)
            # counts from the table's end (-1 the last row); below -P it fails, there with an
            # IndexError, here with the library's error naming the id as given.
            rows = table_cos.shape[0]
            positions = torch.where((positions < 0) & (positions >= -rows), positions + rows,
                                    positions)
    elif cos.dim() == 3:
        if cos.shape[1] != seq_len or sin.shape != cos.shape or cos.shape[0] not in (1, batch):
            # Not one row a token: transformers broadcasts (cos [B, 1, R] over the tokens, a
            # batch of 1 over cos's batch) or raises; its formula does the same.
            return _transformers_formula(q, k, cos, sin, unsqueeze_dim)
        if cos.shape[0] == 1 or (cos.stride(0) == 0 and sin.stride(0) == 0):
            # One row per token, shared by the batch (cos and sin both: a cos expanded over
            # the batch beside a sin per sequence gave every sequence sequence 0's sin).
            table_cos, table_sin = cos[0], sin[0]
        else:
            # One table per sequence: stacked into [B*S, R], sequence b starting at row b*S.
            table_cos, table_sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
            seqlen_offsets = _sequence_starts(batch, seq_len, q.device)
    else:
        raise ValueError(
            f"cos: expected [B, S, R], [S, R] or a [P, R] table, got shape {list(cos.shape)}"
        )
    rotary_dim = table_cos.shape[-1]
    heads_q = q.shape[1] if layout == "bhsd" else q.shape[2]
    heads_k = k.shape[1] if layout == "bhsd" else k.shape[2]
    common = dict(
        positions=positions, seqlen_offsets=seqlen_offsets, rotary_dim=rotary_dim, layout=layout
    )
    if heads_q % heads_k == 0:
        return apply_rope(q, k, table_cos, table_sin, **common)
    return apply_rope(q, None, table_cos, table_sin, **common), apply_rope(
        k, None, table_cos, table_sin, **common
    )


_LIBRARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)  # (the library's; transformers refuses int8/16)


def _library_serves(q, k, cos, sin, unsqueeze_dim):
    """Whether the library computes this call (cos/sin without position_ids) as transformers
    does; else _transformers_formula runs (see apply_rotary_pos_emb)."""
    if unsqueeze_dim not in _GEOMETRY or q.dim() != 4 or k.dim() != 4:
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    # Under a torch.func transform or forward_ad, tables that vary along a derivative
    # direction too: transformers' formula differentiates every column of a full table, the
    # library reads one a pair (review of session 38).
    if torch_ops._carries_tangent(cos) or torch_ops._carries_tangent(sin):
        return False
    if any(t.dtype not in _LIBRARY_DTYPES for t in (q, k, cos, sin)):
        return False
    if q.dtype != k.dtype or cos.dtype != sin.dtype:
        return False
    # transformers' results take the wider dtype of q and cos (q bf16 and cos float32 give
    # float32); the library writes q's.
    if cos.dtype is not q.dtype and torch.promote_types(q.dtype, cos.dtype) != q.dtype:
        return False  # (the identity first: promote_types costs 0.4 us)
    _, seq_dim = _GEOMETRY[unsqueeze_dim]
    heads_dim = 3 - seq_dim
    return (
        q.shape[-1] % 2 == 0
        and k.shape[seq_dim] == q.shape[seq_dim]
        and k.shape[heads_dim] > 0  # (GQA groups divide by it)
    )


def _transformers_formula(q, k, cos, sin, unsqueeze_dim):
    """transformers' own apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, the first R
    features of a wider head rotated (R = cos's last extent), the rest passed through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]

    def rotate(x):
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        first, second = rotated[..., : rotary_dim // 2], rotated[..., rotary_dim // 2 :]
        result = rotated * cos + torch.cat((-second, first), dim=-1) * sin
        return torch.cat((result, passed), dim=-1) if passed.shape[-1] else result

    return rotate(q), rotate(k)


# The eager hot path of the models' own calls (cos/sin [B|1, S, R], no position_ids): the
# plan's key holds cos and sin as the model passes them, and the library reads them through
# views made once, when the plan is built (cos[0], or the [B*S, R] rows); the sequence starts
# are derived from q, and the plan makes the outputs like q and k (_plans.Recipe). Same
# results as apply_rotary_pos_emb's general code, which every other call takes.
def _first(table):
    return table[0]


def _rows(table):
    return table.reshape(-1, table.shape[-1])


def _accepts(signed, head):
    """Whether the eager path's recipes serve q, k, cos, sin (the key's shapes, strides and
    dtypes; checked once per signature, when its plan is built): what _library_serves takes,
    Hq a multiple of Hk, cos and sin alike, [1|B, S, R]; else the general code, which checks
    them (per-sequence starts past the tables could not be checked on the device) or runs
    transformers' formula."""
    q, k, cos, sin = signed
    if not _library_serves(q, k, cos, sin, 1 if head[0] == "bhsd" else 2):
        return False
    seq_dim, head_dim = (2, 1) if head[0] == "bhsd" else (1, 2)
    q_shape, k_shape, cos_shape = q.shape, k.shape, cos.shape
    if len(cos_shape) != 3:
        return False
    if sin.shape != cos_shape or sin.stride() != cos.stride():
        return False
    if cos_shape[0] != 1 and cos_shape[0] != q_shape[0]:
        return False
    return cos_shape[1] == q_shape[seq_dim] and q_shape[head_dim] % k_shape[head_dim] == 0


_SHARED = _plans.Recipe(
    "hf shared cos/sin",
    _TENSOR_NAMES,
    signed=("q", "k", "cos", "sin"),
    outputs={"q_out": "q", "k_out": "k"},
    views={"cos": _first, "sin": _first},
    check=_accepts,
)
_PER_SEQUENCE = _plans.Recipe(
    "hf cos/sin per sequence",
    _TENSOR_NAMES,
    signed=("q", "k", "cos", "sin"),
    derived=("seqlen_offsets",),
    outputs={"q_out": "q", "k_out": "k"},
    views={"cos": _rows, "sin": _rows},
    check=_accepts,
)
_NO_TABLES = ()
# unsqueeze_dim -> (layout, the sequence dimension of q).
_GEOMETRY = {1: ("bhsd", 2), -3: ("bhsd", 2), 2: ("bshd", 1), -2: ("bshd", 1)}
_EAGER_TYPES = torch_ops._EAGER_TYPES
# torch_ops' per-call tests, bound here once (a module attribute lookup each saved per call).
_is_compiling = torch_ops._is_compiling
_dispatch_stack_depth = torch_ops._dispatch_stack_depth
_functorch_active = torch_ops._functorch_active
_forward_ad = torch_ops._forward_ad
_is_grad_enabled = torch_ops._is_grad_enabled


def _eager(q, k, cos, sin, unsqueeze_dim):
    """apply_rotary_pos_emb's result straight through a plan, or None when the general code
    must run (tracing, a dispatch mode, a torch.func transform or forward-AD dual level, other
    shapes, tables that require grad, bad input: there, errors are raised as before). The
    shape rules are the recipes' check, run once per signature; per call only what the plan's
    key cannot hold is tested."""
    try:
        layout, seq_dim = _GEOMETRY[unsqueeze_dim]
    except (KeyError, TypeError):
        return None
    if (
        k is None
        or type(q) not in _EAGER_TYPES
        or type(k) not in _EAGER_TYPES
        or type(cos) not in _EAGER_TYPES
        or type(sin) not in _EAGER_TYPES
        or _is_compiling()
        or _dispatch_stack_depth()
        or _functorch_active()
        or _forward_ad._current_level >= 0
    ):
        return None
    cos_shape = cos.shape
    if len(cos_shape) != 3:
        return None
    grad_mode = _is_grad_enabled()
    if grad_mode and (cos.requires_grad or sin.requires_grad):
        return None
    # (A contiguous cos with more than one row has stride(0) > 0: is_contiguous() costs a third
    # of stride(0), which parses its argument.)
    if cos_shape[0] == 1 or (not cos.is_contiguous() and cos.stride(0) == 0):
        recipe, derived = _SHARED, _NO_TABLES
    else:
        recipe = _PER_SEQUENCE
        q_shape = q.shape
        if len(q_shape) != 4:
            return None
        key = (q_shape[0], q_shape[seq_dim], q.device)
        starts = _starts.get(key)  # (not compiling here: the cache serves)
        derived = (starts if starts is not None else _sequence_starts(*key),)
    if grad_mode and (q.requires_grad or k.requires_grad):
        # Autograd: one _RopeFunction node. Checked here, before the node exists (its
        # launch would otherwise fall back to the general rope() with the views).
        if not _accepts((q, k, cos, sin), (layout,)):
            return None
        call = torch_ops._Call(
            recipe,
            (cos, sin),
            derived,
            (layout, cos_shape[-1], 0, "half"),
            0,
            0,
            False,
            default_runtime(),
        )
        return torch_ops.run_eager(call, q, k, False, True)
    # Inference: one plan call, which makes the outputs (the head is _Call.launch's forward
    # one, so both share plans).
    return _plans.call(
        default_runtime(),
        recipe,
        (q, k, cos, sin),
        derived,
        (layout, cos_shape[-1], 0, "half", False, None, False, False),
        0,
        0,
    )


def apply_rotary_transformers(q, k, cos, sin, unsqueeze_dim=1):
    """The entry transformers' kernel mapping ("rotary_pos_emb", layer_name
    "apply_rotary_transformers") calls: apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)."""
    rotated = _eager(q, k, cos, sin, unsqueeze_dim)
    if rotated is not None:
        return rotated
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


# (batch, seq_len, device) -> arange(batch) * seq_len, int64: the start row of each sequence
# in the stacked [B*S, R] tables. Made once per shape (a decode step would otherwise allocate
# and fill it on every call, in every layer); never written, so sharing it is safe, also in a
# CUDA graph (it is made outside of any capture, on first use). Bounded: decode shapes are few.
_starts = {}


def _sequence_starts(batch, seq_len, device):
    if torch.compiler.is_compiling():  # traced into the graph: no Python-side cache
        return torch.arange(batch, device=device, dtype=torch.int64) * seq_len
    key = (batch, seq_len, device)
    starts = _starts.get(key)
    if starts is None:
        starts = torch.arange(batch, device=device, dtype=torch.int64) * seq_len
        capturing = (
            torch.cuda.is_available()
            and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        )
        # Kept only outside a capture (graph memory) and outside torch.func transforms (made
        # under one, it is a wrapper of the transform's level, without storage once it ends:
        # later calls failed with "Cannot access data pointer"), and never evicted: a graph
        # captured earlier may read a kept tensor. Past the bound, a fresh one per call.
        if not capturing and not _functorch_active() and len(_starts) < 64:
            _starts[key] = starts
    return starts


def rotate_half(x):
    """transformers' rotate_half, for code that imports it alongside apply_rotary_pos_emb."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
