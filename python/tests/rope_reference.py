"""An independent NumPy RoPE, written from the golden README's formulas (tests/golden/README.md,
"op = rope"), in float64. It shares no code with rope_jit: it is what the tests compare the
library against.

Tokens are handled as one flat list: x is [N, H, D] (N tokens) and rows[N] is each token's
table row. The helpers below flatten each layout into that form and back.
"""

import numpy as np


def table_columns(table_width, rotary_dim, style):
    """The column of each pair i in a [P, R/2] (half) or [P, R] (full) table."""
    pairs = np.arange(rotary_dim // 2)
    if table_width == rotary_dim // 2:
        return pairs
    assert table_width == rotary_dim, (table_width, rotary_dim)
    return pairs if style == "half" else 2 * pairs


def pair_features(rotary_dim, rotary_offset, style):
    """(first, second) feature index of every pair."""
    pairs = np.arange(rotary_dim // 2)
    if style == "half":
        return rotary_offset + pairs, rotary_offset + pairs + rotary_dim // 2
    return rotary_offset + 2 * pairs, rotary_offset + 2 * pairs + 1


def rotate_tokens(x, rows, cos, sin, rotary_dim, rotary_offset=0, style="half", backward=False, xpos=None,
                  xpos_divides=False):
    """x [N, H, D] rotated token by token: y1 = x1 c - x2 s, y2 = x2 c + x1 s at table row
    rows[n]; s negated for backward; times xpos (or divided by it for k)."""
    x = np.asarray(x, dtype=np.float64)
    columns = table_columns(cos.shape[1], rotary_dim, style)
    first, second = pair_features(rotary_dim, rotary_offset, style)
    c = np.asarray(cos, np.float64)[rows][:, columns][:, None, :]
    s = np.asarray(sin, np.float64)[rows][:, columns][:, None, :]
    if backward:
        s = -s
    x1, x2 = x[..., first], x[..., second]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    if xpos is not None:
        scale = np.asarray(xpos, np.float64)[rows][:, columns][:, None, :]
        if xpos_divides:
            y1, y2 = y1 / scale, y2 / scale
        else:
            y1, y2 = y1 * scale, y2 * scale
    out = x.copy()
    out[..., first] = y1
    out[..., second] = y2
    return out


def angle_tables(inv_freq, rows):
    """cos and sin [rows, R/2] of angle p * inv_freq[i], in float64 (for the inv_freq path)."""
    angles = np.arange(rows, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.cos(angles), np.sin(angles)


def token_rows(batch, seq_len, positions=None, seqlen_offsets=None, offset=0):
    """[B, S] table rows by the README's rules: positions[b, s] (or positions[s]), else
    s + seqlen_offsets[b], else s + offset."""
    s = np.arange(seq_len)[None, :].repeat(batch, axis=0)
    if positions is not None:
        positions = np.asarray(positions)
        return np.broadcast_to(positions if positions.ndim == 2 else positions[None, :], (batch, seq_len))
    if seqlen_offsets is not None:
        return s + np.asarray(seqlen_offsets)[:, None]
    return s + offset


def packed_rows(cu_seqlens, positions=None, seqlen_offsets=None, offset=0):
    """[T] rows of packed tokens: s restarts at 0 in every sequence."""
    cu_seqlens = np.asarray(cu_seqlens)
    total = int(cu_seqlens[-1])
    rows = np.zeros(total, dtype=np.int64)
    for b in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        s = np.arange(end - start)
        if positions is not None:
            rows[start:end] = np.asarray(positions)[start:end]
        elif seqlen_offsets is not None:
            rows[start:end] = s + int(np.asarray(seqlen_offsets)[b])
        else:
            rows[start:end] = s + offset
    return rows


def to_tokens(x, layout):
    """x in `layout` as [N, H, D] tokens (a copy), and a function that puts tokens back."""
    x = np.asarray(x)
    if layout == "thd":
        return x.reshape(x.shape), lambda tokens: tokens.reshape(x.shape)
    if layout == "bshd":
        b, s, h, d = x.shape
        return x.reshape(b * s, h, d), lambda tokens: tokens.reshape(b, s, h, d)
    b, h, s, d = x.shape
    tokens = x.transpose(0, 2, 1, 3).reshape(b * s, h, d)
    return tokens, lambda t: t.reshape(b, s, h, d).transpose(0, 2, 1, 3)


def rope_reference(x, layout, cos, sin, rows_bs, **kwargs):
    """x ([B,H,S,D], [B,S,H,D] or [T,H,D]) rotated, rows_bs [B, S] (or [T]) table rows."""
    tokens, back = to_tokens(x, layout)
    return back(rotate_tokens(tokens, np.asarray(rows_bs).reshape(-1), cos, sin, **kwargs))


# ------------------------------------------------------------------------------------------
# bfloat16 in NumPy: raw bits in uint16 arrays
# ------------------------------------------------------------------------------------------

def bf16_bits_to_float(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(values):
    """Round to nearest even, as every framework converts float32 to bfloat16."""
    bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)
