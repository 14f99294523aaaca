"""rotary-embedding-torch (lucidrains): RotaryEmbedding, apply_rotary_emb, and its fused
flash_attn_with_rotary.

The frequencies and angles are computed exactly as rotary-embedding-torch computes them (in
PyTorch, in the same dtypes), so the tables are bit for bit the peer's; the rotation itself runs
in rope-jit's kernel (interleaved pairs, fp32 arithmetic). Two cases fall back to the same
formula in plain PyTorch, so that results and gradients stay right:
  * frequencies that need a gradient (learned_freq=True while autograd records), since the
    kernel's backward gives gradients for the rotated tensors only;
  * broadcasts the kernel cannot express (freqs varying along a batch axis, a scalar scale
    other than 1, float64 tensors, an odd feature dimension...).
The kernel reads one angle and one xPos scale per interleaved pair, from the pair's first
column (as the library reads full tables). rotary-embedding-torch's own frequencies and scales
repeat each value for its pair, so nothing changes for them; frequencies or a scale given to
apply_rotary_emb whose two columns of a pair differ are rotated by the first column's (the
formula, for float64, by each its own).
"""

import contextlib
from math import pi

import torch
from torch import nn

from ..torch_ops import _carries_tangent, _has_storage, _is_fake, apply_rope
from ..torch_ops import attention as _fused_attention

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cuda_autocast_off():
    """torch.autocast("cuda", enabled=False), as the original's decorators, entered only while
    CUDA autocast is on, the one time it changes anything (torch 2.4's export failed on the
    context: "Node.meta _enter_autocast is missing val field")."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", enabled=False)
    return contextlib.nullcontext()


def exists(value):
    return value is not None


def default(value, fallback):
    return value if value is not None else fallback


def broadcast(tensors, dim=-1):
    """rotary-embedding-torch's broadcast: broadcast the tensors together, then concatenate."""
    return torch.cat(torch.broadcast_tensors(*tensors), dim=dim)


# The name the package exports (rotary_embedding_torch/__init__.py): broadcat.
broadcat = broadcast


def rotate_half(x):
    """The interleaved rotate_half: pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    pairs = x.unflatten(-1, (-1, 2))
    first, second = pairs.unbind(dim=-1)
    return torch.stack((-second, first), dim=-1).flatten(-2)


def _rotate_in_torch(freqs, t, start_index, scale):
    """The plain PyTorch rotation (the fallback): rotary-embedding-torch's formula."""
    end_index = start_index + freqs.shape[-1]
    left, middle, right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    middle = middle * freqs.cos() * scale + rotate_half(middle) * freqs.sin() * scale
    return torch.cat((left, middle, right), dim=-1).type(t.dtype)


def _normalized_dim(dim, ndim):
    return dim - ndim if dim >= 0 else dim


def _kernel_view(t, seq_dim):
    """t as the kernel takes it: (view, layout) with view [B, H, S, D] ("bhsd", seq_dim -2) or
    [B, S, H, D] ("bshd", seq_dim -3), leading dims merged into B (a view when the strides
    allow, else a copy). None for any other seq_dim."""
    seq_dim = _normalized_dim(seq_dim, t.ndim)
    if seq_dim == -2:
        if t.ndim == 2:
            return t[None, None], "bhsd"
        if t.ndim == 3:
            return t.unsqueeze(1), "bhsd"
    elif seq_dim == -3:
        if t.ndim == 3:
            return t.unsqueeze(0), "bshd"
    else:
        return None
    return (t if t.ndim == 4 else t.reshape(-1, *t.shape[-3:])), ("bhsd" if seq_dim == -2 else "bshd")


def _rotate(t, cos, sin, start_index, seq_dim, xpos=None, position_offset=0):
    """t rotated by the kernel with tables cos/sin/xpos ([rows, R] float), row s + offset for
    token s along seq_dim; same shape and dtype as t."""
    view, layout = _kernel_view(t, seq_dim)
    out = apply_rope(view, None, cos, sin, rotary_dim=cos.shape[-1], rotary_offset=start_index,
                     style="interleaved", layout=layout, xpos_scale=xpos, position_offset=position_offset)
    return out.reshape(t.shape)


def _kernel_can_take(freqs, t, scale):
    # (The library rotates heads of an even size; an odd one takes the formula, which passes
    # the features past the rotated ones through: adversarial pass, session 47.)
    if t.dtype not in _KERNEL_DTYPES or freqs.dtype != torch.float32 or t.shape[-1] % 2:
        return False
    if torch.is_grad_enabled() and (freqs.requires_grad or (torch.is_tensor(scale) and scale.requires_grad)):
        return False
    # Under a torch.func transform or forward_ad, freqs or scale that vary along a derivative
    # direction take the formula too (its derivative in every column: review of session 38).
    if _carries_tangent(freqs) or (torch.is_tensor(scale) and _carries_tangent(scale)):
        return False
    if torch.is_tensor(scale):
        return scale.dtype in _KERNEL_DTYPES
    return scale == 1 or scale == 1.0


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0, seq_dim=-2, freqs_seq_dim=None):
    """rotary-embedding-torch's apply_rotary_emb: rotates features [start_index, start_index +
    R) of t by the angles `freqs` (interleaved pairs; R = freqs.shape[-1]), scaled by `scale`
    (xPos), along seq_dim. freqs is [S, R] (or longer: the last S rows are used when it is 2-D
    or t is 3-D), [S, 1, R] for seq_dim=-3, or an axial grid [d0, d1, ..., R] matching t's
    trailing dims (get_axial_freqs). Returns a new tensor of t's dtype."""
    if freqs_seq_dim is None and (freqs.ndim == 2 or t.ndim == 3):
        freqs_seq_dim = 0
    if t.ndim == 3 or freqs_seq_dim is not None:
        seq_len = t.shape[seq_dim]
        index = [slice(None)] * freqs.ndim
        index[freqs_seq_dim] = slice(-seq_len, None)
        freqs = freqs[tuple(index)]
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1]:
        raise ValueError(f"feature dimension {t.shape[-1]} is not of sufficient size to rotate in all the "
                         f"positions {rot_dim}")
    if _kernel_can_take(freqs, t, scale):
        rotated = _apply_with_kernel(freqs, t, start_index, scale, seq_dim)
        if rotated is not None:
            return rotated
    with _cuda_autocast_off():
        return _rotate_in_torch(freqs, t, start_index, scale)


def _apply_with_kernel(freqs, t, start_index, scale, seq_dim):
    """apply_rotary_emb through the kernel, or None when the broadcast does not fit it."""
    seq_dim = _normalized_dim(seq_dim, t.ndim)
    squeezed = freqs
    while squeezed.dim() > 2 and squeezed.shape[0] == 1:
        squeezed = squeezed[0]
    if squeezed.dim() == 3 and squeezed.shape[1] == 1 and seq_dim == -3:
        # [S, 1, R]: one row per token, broadcast over the heads that follow the sequence.
        rows = squeezed.shape[0]
        if t.ndim < 3 or t.shape[-3] != rows:
            return None
        view_t = t
    else:
        # [S, R], or an axial grid [d0, d1, ..., R] matching t's trailing dims: one row per
        # token (grid cell, row-major).
        grid = tuple(squeezed.shape[:-1])
        if t.ndim < len(grid) + 1 or tuple(t.shape[-len(grid) - 1:-1]) != grid:
            return None
        if len(grid) == 1 and seq_dim != -2:
            return None
        rows = squeezed[..., 0].numel()
        view_t = t.reshape(*t.shape[:-len(grid) - 1], rows, t.shape[-1])
        seq_dim = -2
    table = squeezed.reshape(rows, squeezed.shape[-1])
    xpos = None
    if torch.is_tensor(scale):
        try:
            xpos = torch.broadcast_to(scale, freqs.shape)
        except RuntimeError:
            return None
        xpos = xpos.float().reshape(rows, table.shape[-1])
    rotated = _rotate(view_t, table.cos(), table.sin(), start_index, seq_dim, xpos)
    return rotated.reshape(t.shape)


def apply_learned_rotations(rotations, t, start_index=0, freq_ranges=None):
    """rotary-embedding-torch's apply_learned_rotations (learned angles: PyTorch fallback
    whenever they need a gradient)."""
    if exists(freq_ranges):
        rotations = torch.einsum("..., f -> ... f", rotations, freq_ranges)
        rotations = rotations.flatten(-2)
    rotations = rotations.repeat_interleave(2, dim=-1)
    return apply_rotary_emb(rotations, t, start_index=start_index)


class RotaryEmbedding(nn.Module):
    """rotary-embedding-torch's RotaryEmbedding, with the same constructor, parameters
    (`freqs`, so checkpoints load) and methods; the rotations run in rope-jit's kernel."""

    def __init__(self, dim, custom_freqs=None, freqs_for="lang", theta=10000, max_freq=10, num_freqs=1,
                 learned_freq=False, use_xpos=False, xpos_scale_base=512, interpolate_factor=1.0,
                 theta_rescale_factor=1.0, seq_before_head_dim=False, cache_if_possible=True,
                 cache_max_seq_len=8192):
        super().__init__()
        # NTK-aware rescale of theta (rotary-embedding-torch's theta_rescale_factor).
        if dim > 2:
            theta *= theta_rescale_factor ** (dim / (dim - 2))
        self.freqs_for = freqs_for
        if exists(custom_freqs):
            freqs = custom_freqs
        elif freqs_for == "lang":
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        elif freqs_for == "pixel":
            freqs = torch.linspace(1.0, max_freq / 2, dim // 2) * pi
        elif freqs_for == "constant":
            freqs = torch.ones(num_freqs).float()
        else:
            raise ValueError(f"freqs_for: expected 'lang', 'pixel' or 'constant', got {freqs_for!r}")
        self.cache_if_possible = cache_if_possible
        self.cache_max_seq_len = cache_max_seq_len
        self.freqs = nn.Parameter(freqs, requires_grad=learned_freq)
        self.learned_freq = learned_freq
        self.register_buffer("dummy", torch.tensor(0), persistent=False)
        self.seq_before_head_dim = seq_before_head_dim
        self.default_seq_dim = -3 if seq_before_head_dim else -2
        if interpolate_factor < 1.0:
            raise ValueError("interpolation factor must be at least 1.0")
        self.interpolate_factor = interpolate_factor
        self.use_xpos = use_xpos
        # (seq_len, offset, device, dtype, frequencies' identity) -> (cos, sin, their storage)
        self._tables = {}
        self.apply_rotary_emb = staticmethod(apply_rotary_emb)
        if not use_xpos:
            return
        self.scale_base = xpos_scale_base
        self.register_buffer("scale", (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim), persistent=False)

    @property
    def device(self):
        return self.dummy.device

    def get_seq_pos(self, seq_len, device=None, dtype=None, offset=0):
        """Positions (offset + 0..seq_len-1) / interpolate_factor, in `dtype` (default the
        frequencies' dtype), as rotary-embedding-torch computes them."""
        device = default(device, self.device)
        dtype = default(dtype, self.freqs.dtype)
        return (torch.arange(seq_len, device=device, dtype=dtype) + offset) / self.interpolate_factor

    def forward(self, t, seq_len=None, offset=0):
        """The angles of positions t: [..., R], each frequency repeated for its pair."""
        with _cuda_autocast_off():
            freqs = t.type(self.freqs.dtype)[..., None] * self.freqs
            return freqs.repeat_interleave(2, dim=-1)

    def get_scale(self, t, seq_len=None, offset=0):
        """xPos scales of positions t: [len(t), R]."""
        assert self.use_xpos
        power = (t - len(t) // 2) / self.scale_base
        scale = self.scale ** power[:, None]
        return scale.repeat_interleave(2, dim=-1)

    def get_axial_freqs(self, *dims, offsets=None):
        """Angles over an N-D grid: [*dims, R * len(dims)], axis i taking R of them (pixel
        frequencies sample each axis over [-1, 1])."""
        if exists(offsets):
            offsets = offsets if torch.is_tensor(offsets) else torch.tensor(offsets)
            if len(offsets) != len(dims):
                raise ValueError("offsets must be the same length as dims")
        all_freqs = []
        for axis, extent in enumerate(dims):
            if self.freqs_for == "pixel":
                pos = torch.linspace(-1, 1, steps=extent, device=self.device)
            else:
                pos = torch.arange(extent, device=self.device)
            if exists(offsets):
                pos = pos + offsets[axis]
            freqs = self.forward(pos, seq_len=extent)
            index = [None] * len(dims)
            index[axis] = slice(None)
            all_freqs.append(freqs[(Ellipsis, *index, slice(None))])
        return torch.cat(torch.broadcast_tensors(*all_freqs), dim=-1)

    def _cos_sin(self, seq_len, offset, device, dtype):
        """cos and sin of the angles of positions offset..offset+seq_len-1 ([seq_len, R]
        float32), computed as rotary-embedding-torch does and kept for the next call."""
        # Kept only for frequencies with memory of their own (not while torch.compile or
        # export traces, nor for vmap's batched or a dispatch mode's fake tensors), keyed on
        # that memory too: a new tensor assigned, or set through .data, kept the old tables
        # (atomicity audit, session 40). The key names the storage itself (its C++ object),
        # and each entry holds that storage, so that no other gets its name while the entry
        # lasts: keyed on the data's address, a new storage at a freed one's address, with
        # version 0 again, matched an entry made for other frequencies (adversarial pass,
        # session 47). A write into the same storage that counts no version (through .data,
        # or by NumPy) is not seen, like rotary-embedding-torch's own cached_freqs.
        source = self.freqs
        keep = (self.cache_if_possible and not torch.compiler.is_compiling()
                and _has_storage(source) and not _is_fake(source))
        if keep:
            storage = source.untyped_storage()
            key = (seq_len, offset, device, dtype, id(source), storage._cdata, source.data_ptr(),
                   source._version, self.interpolate_factor)
            cached = self._tables.get(key)
            if cached is not None:
                return cached[:2]
        freqs = self.forward(self.get_seq_pos(seq_len, device=device, dtype=dtype, offset=offset), seq_len=seq_len)
        tables = (freqs.cos(), freqs.sin())
        if keep:
            if len(self._tables) >= 8:
                self._tables.clear()
            self._tables[key] = (*tables, storage)
        return tables

    def _uses_kernel(self, t):
        return (t.dtype in _KERNEL_DTYPES and self.freqs.dtype == torch.float32
                and t.shape[-1] % 2 == 0
                and not (torch.is_grad_enabled() and self.freqs.requires_grad))

    def rotate_queries_or_keys(self, t, seq_dim=None, offset=0, scale=None):
        """Rotates t (queries or keys) at positions offset, offset+1, ... along seq_dim
        (default: -2, or -3 with seq_before_head_dim). With use_xpos, pass scale (or use
        rotate_queries_and_keys)."""
        seq_dim = default(seq_dim, self.default_seq_dim)
        assert not self.use_xpos or exists(scale), (
            "you must use `.rotate_queries_and_keys` method instead and pass in both queries and keys, "
            "for length extrapolatable rotary embeddings")
        seq_len = t.shape[seq_dim]
        if self._uses_kernel(t) and not torch.is_tensor(scale) and default(scale, 1.0) == 1.0 \
                and _kernel_view(t, seq_dim) is not None:
            cos, sin = self._cos_sin(seq_len, offset, t.device, t.dtype)
            return _rotate(t, cos, sin, 0, seq_dim)
        freqs = self.forward(self.get_seq_pos(seq_len, device=t.device, dtype=t.dtype, offset=offset),
                             seq_len=seq_len, offset=offset)
        if _normalized_dim(seq_dim, t.ndim) == -3:
            freqs = freqs[:, None, :]
            if torch.is_tensor(scale):
                scale = scale[:, None, :] if scale.dim() == 2 else scale
        return apply_rotary_emb(freqs, t, scale=default(scale, 1.0), seq_dim=seq_dim)

    def rotate_queries_with_cached_keys(self, q, k, seq_dim=None, offset=0):
        """Rotates the last q_len of k_len positions (queries after cached keys) and all k_len
        keys: q at k_len - q_len + offset + s, k at s; one fused launch when possible."""
        dtype, device, seq_dim = q.dtype, q.device, default(seq_dim, self.default_seq_dim)
        q_len, k_len = q.shape[seq_dim], k.shape[seq_dim]
        if q_len > k_len:
            raise ValueError("query length must be less than or equal to key length")
        q_offset = k_len - q_len + offset
        if self.use_xpos:
            seq = self.get_seq_pos(k_len, dtype=dtype, device=device)
            q_scale = self.get_scale(seq[-q_len:]).type(dtype)
            k_scale = self.get_scale(seq).type(dtype)
            rotated_q = self.rotate_queries_or_keys(q, seq_dim=seq_dim, scale=q_scale, offset=q_offset)
            rotated_k = self.rotate_queries_or_keys(k, seq_dim=seq_dim, scale=k_scale ** -1)
            return rotated_q.type(q.dtype), rotated_k.type(k.dtype)
        views = _fusable_pair(q, k, seq_dim)
        # (The fused launch takes whole positions; a fractional offset, which the original
        # adds to float positions, takes rotate_queries_or_keys: it raised TypeError.)
        if (views is not None and isinstance(q_offset, int) and q_offset >= 0
                and self._uses_kernel(q) and k.dtype == q.dtype):
            (q_view, k_view), layout = views
            cos, sin = self._cos_sin(max(k_len, q_offset + q_len), 0, device, dtype)
            rotated_q, rotated_k = apply_rope(q_view, k_view, cos, sin, q_position_offset=q_offset,
                                              rotary_dim=cos.shape[-1], style="interleaved", layout=layout)
            return rotated_q.reshape(q.shape), rotated_k.reshape(k.shape)
        rotated_q = self.rotate_queries_or_keys(q, seq_dim=seq_dim, offset=q_offset)
        rotated_k = self.rotate_queries_or_keys(k, seq_dim=seq_dim)
        return rotated_q.type(q.dtype), rotated_k.type(k.dtype)

    def rotate_queries_and_keys(self, q, k, seq_dim=None):
        """xPos: rotates q and k at positions 0..S-1, q scaled up and k down (use_xpos=True)."""
        seq_dim = default(seq_dim, self.default_seq_dim)
        assert self.use_xpos
        dtype, seq_len = q.dtype, q.shape[seq_dim]
        seq = self.get_seq_pos(seq_len, dtype=dtype, device=q.device)
        freqs = self.forward(seq, seq_len=seq_len)
        scale = self.get_scale(seq, seq_len=seq_len).to(dtype)
        if _normalized_dim(seq_dim, q.ndim) == -3:
            freqs, scale = freqs[:, None, :], scale[:, None, :]
        rotated_q = apply_rotary_emb(freqs, q, scale=scale, seq_dim=seq_dim)
        rotated_k = apply_rotary_emb(freqs, k, scale=scale ** -1, seq_dim=seq_dim)
        return rotated_q.type(q.dtype), rotated_k.type(k.dtype)


def _fusable_pair(q, k, seq_dim):
    """((q_view, k_view), layout) when q and k can go through one launch: same rank and
    layout, same batch and head_dim, and Hq a multiple of Hk; else None."""
    q_view, k_view = _kernel_view(q, seq_dim), _kernel_view(k, seq_dim)
    if q_view is None or k_view is None or q.ndim != k.ndim or q_view[1] != k_view[1]:
        return None
    (q_view, layout), (k_view, _) = q_view, k_view
    head_axis = 1 if layout == "bhsd" else 2
    if q_view.shape[0] != k_view.shape[0] or q_view.shape[-1] != k_view.shape[-1] \
            or q_view.shape[head_axis] % k_view.shape[head_axis] != 0:
        return None
    return (q_view, k_view), layout


# ------------------------------------------------------------------------------------------
# flash_attn_with_rotary: attention with rotary fused in
# ------------------------------------------------------------------------------------------

def _attention_table(x, name):
    if x is None:
        return None
    while x.dim() > 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2:
        raise NotImplementedError(f"{name}: per-batch or per-head tables ({list(x.shape)}) are not supported; "
                                  "pass one [S, R] table")
    return x


def flash_attn_with_rotary(q, k, v, cos=None, sin=None, pos_mask=None, attn_mask=None, is_causal=True,
                           rotary_pos_emb=None, rotary_pos_emb_indices=None):
    """rotary-embedding-torch's flash_attn_with_rotary: softmax attention, scale 1/sqrt(D),
    whose q and k are rotated (interleaved pairs, the first R features) as they are loaded.

    q [B, Hq, S, D]; k, v [B, Hk, S, D] (Hq a multiple of Hk). Angles from cos/sin ([S, R], or
    [1, 1, S, R]) or from rotary_pos_emb ([S, R] angles); with rotary_pos_emb_indices only those
    tokens get positions (rotary_pos_emb rows, in order) and the others (CLS, registers) take
    part unrotated, as does pos_mask ([S] bool) with cos/sin. attn_mask: bool [B, Sk] or
    [B, Sq, Sk] (False = masked) or float (added). is_causal: top-left aligned. Differentiable
    with respect to q, k and v. Needs the library's attention op (NotImplementedError without).
    """
    if exists(rotary_pos_emb):
        rotary_pos_emb = rotary_pos_emb.to(q.device)
        if exists(rotary_pos_emb_indices):
            rotary_pos_emb = rotary_pos_emb.reshape(-1, rotary_pos_emb.shape[-1])
            # As the peer: angles padded with zeros (in q's dtype) where tokens have none.
            padded = torch.zeros((q.shape[2], rotary_pos_emb.shape[-1]), device=q.device, dtype=q.dtype)
            padded[rotary_pos_emb_indices] = rotary_pos_emb.to(q.dtype)
            rotary_pos_emb = padded
            pos_mask = torch.zeros(q.shape[2], device=q.device, dtype=torch.bool)
            pos_mask[rotary_pos_emb_indices] = True
        cos, sin = rotary_pos_emb.cos(), rotary_pos_emb.sin()
    if not (exists(cos) and exists(sin)):
        raise ValueError("either cos/sin or rotary_pos_emb must be provided")
    cos, sin = _attention_table(cos, "cos"), _attention_table(sin, "sin")
    return _fused_attention(q, k, v, cos, sin, pos_mask=pos_mask, attn_mask=attn_mask, causal=is_causal,
                            rotary_dim=cos.shape[-1], style="interleaved")


def get_flash_attention_fused(force_reference=False):
    """The peer's factory: flash_attn_with_rotary, or with force_reference=True the plain
    PyTorch reference_flash_attention (same arguments)."""
    if not force_reference:
        return flash_attn_with_rotary

    def reference(q, k, v, cos=None, sin=None, pos_mask=None, attn_mask=None, is_causal=True,
                  rotary_pos_emb=None, rotary_pos_emb_indices=None):
        if exists(rotary_pos_emb):
            if exists(rotary_pos_emb_indices):
                emb = rotary_pos_emb.reshape(-1, rotary_pos_emb.shape[-1])
                padded = torch.zeros((q.shape[2], emb.shape[-1]), device=q.device, dtype=q.dtype)
                padded[rotary_pos_emb_indices] = emb.to(q.dtype)
                rotary_pos_emb = padded
                pos_mask = torch.zeros(q.shape[2], device=q.device, dtype=torch.bool)
                pos_mask[rotary_pos_emb_indices] = True
            cos, sin = rotary_pos_emb.cos(), rotary_pos_emb.sin()
        if exists(attn_mask) and attn_mask.dtype == torch.bool:
            additive = torch.zeros_like(attn_mask, dtype=q.dtype)
            additive[~attn_mask] = float("-inf")
            attn_mask = additive
        if exists(attn_mask):
            attn_mask = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask[:, None]
        return reference_flash_attention(q, k, v, _attention_table(cos, "cos"), _attention_table(sin, "sin"),
                                         pos_mask, attn_mask, is_causal)

    return reference


def reference_flash_attention(q, k, v, cos=None, sin=None, pos_mask=None, attn_mask=None, is_causal=True):
    """Attention with rotary in plain PyTorch (the semantics flash_attn_with_rotary fuses):
    cos/sin [S, R] full interleaved tables, pos_mask [S] bool, attn_mask additive and
    broadcastable to [B, Hq, Sq, Sk], causal top-left aligned, scale 1/sqrt(D)."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q != heads_kv:
        k = k.repeat_interleave(heads_q // heads_kv, dim=1)
        v = v.repeat_interleave(heads_q // heads_kv, dim=1)
    sim = torch.einsum("bhid,bhjd->bhij", q, k)
    if exists(cos) and exists(sin):
        q_rot = _rotate_pair_table(q, cos, sin)
        k_rot = _rotate_pair_table(k, cos, sin)
        sim_rot = torch.einsum("bhid,bhjd->bhij", q_rot, k_rot)
        if exists(pos_mask):
            both = pos_mask[:, None] & pos_mask[None, :]
            sim = torch.where(both, sim_rot, sim)
        else:
            sim = sim_rot
    sim = sim * q.shape[-1] ** -0.5
    if exists(attn_mask):
        sim = sim + attn_mask
    if is_causal:
        causal = torch.ones((q.shape[2], k.shape[2]), device=q.device, dtype=torch.bool).tril()
        sim = torch.where(causal, sim, float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)


def _rotate_pair_table(x, cos, sin):
    rot_dim = cos.shape[-1]
    rotated = x[..., :rot_dim] * cos + rotate_half(x[..., :rot_dim]) * sin
    return torch.cat((rotated, x[..., rot_dim:]), dim=-1)
