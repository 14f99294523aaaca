"""Drop-in replacements for the peers' RoPE functions: same names, same arguments, same results
(to rounding), computed by rope-jit. Switching is one import:

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
 -> from rope_jit.dropin.hf import apply_rotary_pos_emb

    from unsloth.kernels.rope_embedding import fast_rope_embedding
 -> from rope_jit.dropin.unsloth import fast_rope_embedding

    from flash_attn.layers.rotary import apply_rotary_emb
 -> from rope_jit.dropin.flash_attn import apply_rotary_emb

    from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb
 -> from rope_jit.dropin.rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb
    (flash_attn_with_rotary is there too)

Every function is differentiable with respect to q and k (the library's backward kernel) and
traces into torch.compile graphs without breaks. Where a peer writes in place, so does the
drop-in. The differences, each documented at its function: outputs keep the input dtype, and
arithmetic is fp32 throughout (the peers that compute in bf16/fp16 round more).
"""
