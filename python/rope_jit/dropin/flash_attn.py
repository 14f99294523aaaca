"""flash-attention's rotary functions (flash_attn.layers.rotary)."""

import re

import torch

from ..errors import RopeJitError
from ..torch_ops import apply_rope


def _offsets(seqlen_offsets):
    # An int shifts every sequence; a [B] tensor shifts each its own way.
    if isinstance(seqlen_offsets, torch.Tensor):
        return 0, seqlen_offsets
    return int(seqlen_offsets), None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash-attention's apply_rotary_emb.

    x: [B, S, H, D], or [T, H, D] packed with cu_seqlens [B+1] (int32). cos, sin: half tables
    [seqlen_ro, R/2]; the first R features rotate, the rest pass through. interleaved: GPT-J
    pairs (2i, 2i+1) instead of NeoX pairs (i, i+R/2). inplace: write into x. seqlen_offsets:
    an int or a [B] tensor added to each sequence's positions (KV-cache decode). max_seqlen is
    accepted and unused (the library needs no bound). Returns the rotated tensor (x itself
    with inplace=True). A token whose position (offset included) lies past the tables is an
    error here, where flash-attention's kernel passes it through unrotated.
    """
    rotary_dim = 2 * cos.shape[-1]
    if x.shape[-1] % 2 == 1:
        # The library rotates heads of an even size: an odd head's first R features are
        # rotated as a head of their own and the rest passes through, as flash-attention's
        # kernel copies it (adversarial pass, session 47: refused, naming q).
        if rotary_dim > x.shape[-1]:
            raise ValueError(f"cos: rotary_dim {rotary_dim} (2 * cos.shape[-1]) exceeds x's "
                             f"head_dim {x.shape[-1]}")
        rotated = apply_rotary_emb(x[..., :rotary_dim], cos, sin, interleaved, inplace,
                                   seqlen_offsets, cu_seqlens, max_seqlen)
        return x if inplace else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    position_offset, offsets = _offsets(seqlen_offsets)
    return apply_rope(x, None, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                      position_offset=position_offset, rotary_dim=rotary_dim,
                      style="interleaved" if interleaved else "half",
                      layout="thd" if cu_seqlens is not None else "bshd", inplace=inplace)


# flash-attention's alias for backward compatibility.
apply_rotary_emb_func = apply_rotary_emb


def _qk_views(qkv, num_heads_q):
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv: expected [B, S, 3, H, D], got {list(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError("qkv: expected [B, S, 3, H, D], or [B, S, Hq + 2*Hk, D] with num_heads_q")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    # (Hk >= 0: num_heads_q 6 of 4 heads rotated all four, v's too, and -2 rotated two as q;
    # atomicity audit, session 40.)
    if not 0 <= num_heads_q <= qkv.shape[2] or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"qkv: {qkv.shape[2]} heads is not num_heads_q={num_heads_q} + 2 * Hk "
                         "with Hk >= 0")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def _naming_k_tables(error, given):
    """`error` of k's rotation in the words of the caller: that call passes k as q (the
    library's "q uses table rows"), and the tables given (cos_k, sin_k) as cos and sin."""
    def rename(text):
        for name in given:
            text = re.sub(rf"\b{name}\b", name + "_k", text)
        return re.sub(r"\bq uses\b", "k uses", text)

    if isinstance(error, RopeJitError):
        detail = rename(error.detail)
        return type(error)(error.function, error.status, error.status_name, detail)
    return type(error)(rename(str(error)))


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """flash-attention's apply_rotary_emb_qkv_: rotates the q and k parts of a packed qkv
    ([B, S, 3, H, D], or [B, S, Hq + 2*Hk, D] with num_heads_q) in place, in one launch (two
    when cos_k/sin_k differ from cos/sin, or Hq is not a multiple of Hk). Returns qkv."""
    q, k = _qk_views(qkv, num_heads_q)
    position_offset, offsets = _offsets(seqlen_offsets)
    common = dict(seqlen_offsets=offsets, position_offset=position_offset, rotary_dim=2 * cos.shape[-1],
                  style="interleaved" if interleaved else "half", layout="bshd", inplace=True)
    one_launch = k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0  # (one launch needs GQA groups)
    if one_launch and (cos_k is None or cos_k is cos) and (sin_k is None or sin_k is sin):
        apply_rope(q, k, cos, sin, **common)
    else:
        # k's rotation first, out of place: a refusal of its tables or offsets then comes
        # before q is written (it came after, q rotated and k not; atomicity audit, session 40).
        try:
            k_rotated = apply_rope(k, None, cos if cos_k is None else cos_k,
                                   sin if sin_k is None else sin_k, **dict(common, inplace=False))
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
            given = [name for name, table in (("cos", cos_k), ("sin", sin_k)) if table is not None]
            raise _naming_k_tables(error, given) from error
        apply_rope(q, None, cos, sin, **common)
        if k.is_inference() and not torch.is_inference_mode_enabled():
            # As the library writes q: torch's copy_ refuses an inference tensor outside
            # inference mode, but only after writing it (adversarial pass, session 49).
            with torch.inference_mode():
                k.copy_(k_rotated)
        else:
            k.copy_(k_rotated)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """flash-attention's apply_rotary_emb_kv_: rotates the k part of kv [B, S, 2, H, D] in
    place. Returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected [B, S, 2, H, D], got {list(kv.shape)}")
    position_offset, offsets = _offsets(seqlen_offsets)
    apply_rope(kv[:, :, 0], None, cos, sin, seqlen_offsets=offsets, position_offset=position_offset,
               rotary_dim=2 * cos.shape[-1], style="interleaved" if interleaved else "half", layout="bshd",
               inplace=True)
    return kv
