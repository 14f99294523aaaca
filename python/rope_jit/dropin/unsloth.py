"""Unsloth's RoPE kernels (unsloth.kernels.rope_embedding)."""

from ..torch_ops import apply_rope


def _table(table):
    # Unsloth squeezes cos/sin ([1, 1, S, D] -> [S, D]); flattening the leading dims does the
    # same and also keeps a single-token table 2-D.
    return table.reshape(-1, table.shape[-1])


def _indices(indices, batch, seq_len):
    if indices is None:
        return None
    # Unsloth reads rope_embedding_indices[b * S + s]: a flat [B*S] is the same as [B, S].
    if indices.dim() == 1 and indices.numel() == batch * seq_len and batch > 1:
        return indices.reshape(batch, seq_len)
    return indices


def fast_rope_embedding(Q, K, cos, sin, rope_embedding_indices=None):
    """Unsloth's fast_rope_embedding: half-style RoPE of Q [B, Hq, S, D] and K [B, Hk, S, D]
    with tables cos/sin [P, D] (or [P, D/2], or with leading 1-dims), token s of sequence b at
    row rope_embedding_indices[b, s] ([B, S], [B*S] or [S], int32 or int64) or at row s.
    Returns (Q, K) rotated, as new tensors in one fused launch when Hq is a multiple of Hk
    (two otherwise; Unsloth rotates contiguous inputs in place; the returned values are the
    same)."""
    positions = _indices(rope_embedding_indices, Q.shape[0], Q.shape[2])
    common = dict(positions=positions, rotary_dim=Q.shape[-1])
    cos, sin = _table(cos), _table(sin)
    if K.shape[1] > 0 and Q.shape[1] % K.shape[1] == 0:
        return apply_rope(Q, K, cos, sin, **common)
    return apply_rope(Q, None, cos, sin, **common), apply_rope(K, None, cos, sin, **common)


class Fast_RoPE_Embedding:
    """Unsloth's single-tensor autograd function: apply(Q, cos, sin) with Q [B, S, H, D]."""

    @staticmethod
    def apply(Q, cos, sin):
        return apply_rope(Q, None, _table(cos), _table(sin), layout="bshd", rotary_dim=Q.shape[-1])


class Fast_RoPE_Embedding_QK:
    """Unsloth's fused Q/K autograd function: apply(Q, K, cos, sin, rope_indices) with Q, K
    [B, H, S, D]."""

    @staticmethod
    def apply(Q, K, cos, sin, rope_indices=None):
        return fast_rope_embedding(Q, K, cos, sin, rope_indices)
