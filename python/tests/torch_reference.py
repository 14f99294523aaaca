"""Plain PyTorch RoPE, written from the golden README's formulas: the autograd oracle of the torch
tests. No rope_jit code is used here."""

import torch


def rotate_pairs(x, style):
    """(-x2, x1) in the positions of (x1, x2): the rotation by +90 degrees of every pair."""
    if style == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def full_table(table, rotary_dim, style):
    """A [P, R/2] or [P, R] table as [P, R], each pair's value at both of its features."""
    if table.shape[-1] == rotary_dim:
        return table
    return torch.cat((table, table), dim=-1) if style == "half" else table.repeat_interleave(2, dim=-1)


def rope_torch(x, cos, sin, rows, rotary_dim=None, rotary_offset=0, style="half", xpos=None, xpos_divides=False):
    """x [B, H, S, D] rotated at table rows `rows` ([S] or [B, S]), in float32 autograd ops.
    Returns float32."""
    rotary_dim = rotary_dim or x.shape[-1]
    x = x.float()
    cos = full_table(cos.float(), rotary_dim, style)[rows]
    sin = full_table(sin.float(), rotary_dim, style)[rows]
    if rows.dim() == 2:  # [B, S, R] -> [B, 1, S, R]
        cos, sin = cos[:, None], sin[:, None]
    left = x[..., :rotary_offset]
    middle = x[..., rotary_offset:rotary_offset + rotary_dim]
    right = x[..., rotary_offset + rotary_dim:]
    rotated = middle * cos + rotate_pairs(middle, style) * sin
    if xpos is not None:
        scale = full_table(xpos.float(), rotary_dim, style)[rows]
        if rows.dim() == 2:
            scale = scale[:, None]
        rotated = rotated / scale if xpos_divides else rotated * scale
    return torch.cat((left, rotated, right), dim=-1)


def hf_tables(positions, dim, theta=10000.0, dtype=torch.float32):
    """cos and sin [..., dim] as HF's LlamaRotaryEmbedding builds them (cat(freqs, freqs))."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
