"""Causal scaled_dot_product_attention over grouped-query heads on every torch the examples
support: SDPA's enable_gqa came in torch 2.5; before it, k's and v's heads are repeated."""

import torch
import torch.nn.functional as F

# Whether scaled_dot_product_attention takes enable_gqa (torch 2.5 and later).
SDPA_HAS_GQA = torch.__version__ >= (2, 5)


def causal_sdpa(q, k, v):
    """Causal SDPA of [B, H, S, D] q over k and v, which may have fewer heads (grouped-query
    attention)."""
    if not SDPA_HAS_GQA:
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
