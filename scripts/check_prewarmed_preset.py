#!/usr/bin/env python3
"""Runs what a PyTorch Llama-3-8B layer calls, on the GPU, from a kernel cache prewarmed on a
machine without a GPU, and checks that no kernel was compiled.

    rope-jit-cache prewarm --preset llama3-8b --target sm_90 --cache-dir DIR   # no GPU needed
    check_prewarmed_preset.py DIR

In one fresh process whose default runtime reads DIR (ROPE_JIT_CACHE_DIR, set before rope_jit
is imported), with Llama-3-8B's shapes (bf16, B 2, S 512, 32 q heads, 8 kv heads, head_dim
128, theta 500000):
  1. apply_rope out of place, forward and backward (autograd), [B, S, H, D] tensors, with
     implicit positions and with int64 position ids [B, S] into a [P, 128] table;
  2. the HF drop-in apply_rotary_pos_emb, forward and backward, with the [B, S, 128] cos/sin
     a transformers Llama computes (one table per sequence), and with a batch-shared [1, S, 128];
  3. rope_jit.rope in place (the preset's in-place specs);
  4. the fused attention: rope_jit.torch_ops.attention (causal, lse) forward and backward with
     half [P, 64] and full [P, 128] tables, and rope_jit.attention without lse.
Each result is checked against float32 PyTorch (rotation, then SDPA); the runtime's counters
are printed. Exit status 0 when every result matches and the runtime compiled nothing.
Needs torch with a GPU and $ROPE_JIT_LIBRARY (or an installed package).
"""

import os
import sys


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    # The ops use the default runtime: point it at the prewarmed cache before it exists.
    os.environ["ROPE_JIT_CACHE_DIR"] = argv[1]
    os.environ.pop("ROPE_JIT_CACHE_RO_DIRS", None)
    import torch
    import torch.nn.functional as F

    import rope_jit
    from rope_jit.dropin.hf import apply_rotary_pos_emb
    from rope_jit.torch_ops import apply_rope
    from rope_jit.torch_ops import attention as fused_attention

    runtime = rope_jit.default_runtime()
    if runtime.backend != "cuda":
        print("FAIL: no GPU backend", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    B, S, Hq, Hk, D, P = 2, 512, 32, 8, 128, 4096
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(P, dtype=torch.float64), inv_freq)
    full_angles = torch.cat((angles, angles), dim=-1)
    cos_full = full_angles.cos().to(torch.bfloat16).to(device)
    sin_full = full_angles.sin().to(torch.bfloat16).to(device)
    cos_half = angles.cos().to(torch.bfloat16).to(device)
    sin_half = angles.sin().to(torch.bfloat16).to(device)
    failures = 0

    def report(name, error, bound):
        nonlocal failures
        ok = error <= bound
        failures += not ok
        print(f"{name:<58} max abs error {error:.3g} {'ok' if ok else 'FAIL'}")

    def rotate(x, cos, sin):
        """HF's rotate_half rotation in float32; x [..., S, H, D] with cos/sin [..., S, 1, D]."""
        x = x.float()
        half = x.shape[-1] // 2
        return x * cos.float() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.float()

    def error(a, b):
        return (a.float() - b.float()).abs().max().item()

    # 1. apply_rope out of place, [B, S, H, D], forward and backward.
    for with_positions in (False, True):
        rows = (torch.randint(0, P, (B, S), device=device) if with_positions
                else torch.arange(S, device=device).expand(B, S))
        q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        q_out, k_out = apply_rope(q, k, cos_full, sin_full, positions=rows if with_positions else None,
                                  layout="bshd")
        grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
        torch.autograd.backward((q_out, k_out), (grad_q, grad_k))
        c, s = cos_full[rows].unsqueeze(2), sin_full[rows].unsqueeze(2)
        name = f"apply_rope out of place, {'position ids' if with_positions else 'implicit'}"
        report(name + ", forward", max(error(q_out, rotate(q, c, s)), error(k_out, rotate(k, c, s))), 0.05)
        report(name + ", backward", max(error(q.grad, rotate(grad_q, c, -s)), error(k.grad, rotate(grad_k, c, -s))),
               0.05)

    # 2. The HF drop-in, as a transformers Llama calls it: q, k [B, H, S, D] views of
    # [B, S, H, D] projections, cos/sin [B, S, D] from position_ids [B, S], or [1, S, D].
    for per_sequence in (True, False):
        position_ids = torch.arange(S, device=device).expand(B, S) + (torch.arange(B, device=device)[:, None] * 7
                                                                     if per_sequence else 0)
        cos = cos_full[position_ids] if per_sequence else cos_full[:S].unsqueeze(0)
        sin = sin_full[position_ids] if per_sequence else sin_full[:S].unsqueeze(0)
        q_proj = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k_proj = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        q_embed, k_embed = apply_rotary_pos_emb(q_proj.transpose(1, 2), k_proj.transpose(1, 2), cos, sin)
        grad_q, grad_k = torch.randn_like(q_embed), torch.randn_like(k_embed)
        torch.autograd.backward((q_embed, k_embed), (grad_q, grad_k))
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [B or 1, 1, S, D] against [B, H, S, D]
        name = f"HF apply_rotary_pos_emb, cos {'[B, S, D]' if per_sequence else '[1, S, D]'}"
        want_q = rotate(q_proj.transpose(1, 2), c, s)
        want_k = rotate(k_proj.transpose(1, 2), c, s)
        report(name + ", forward", max(error(q_embed, want_q), error(k_embed, want_k)), 0.05)
        report(name + ", backward",
               max(error(q_proj.grad.transpose(1, 2), rotate(grad_q, c, -s)),
                   error(k_proj.grad.transpose(1, 2), rotate(grad_k, c, -s))), 0.05)

    # 3. rope_jit.rope in place, implicit and with position ids.
    for with_positions in (False, True):
        rows = (torch.randint(0, P, (B, S), device=device) if with_positions
                else torch.arange(S, device=device).expand(B, S))
        q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16)
        c, s = cos_full[rows].unsqueeze(2), sin_full[rows].unsqueeze(2)
        want_q, want_k = rotate(q, c, s), rotate(k, c, s)
        rope_jit.rope(q, k, cos=cos_full, sin=sin_full, positions=rows if with_positions else None, layout="bshd")
        torch.cuda.synchronize()
        report(f"rope_jit.rope in place, {'position ids' if with_positions else 'implicit'}",
               max(error(q, want_q), error(k, want_k)), 0.05)

    # 4. Fused attention, causal, GQA 4, forward and backward, both table formats.
    def reference_attention(q, k, v, cos, sin):
        c, s = cos[:S].float().unsqueeze(0).unsqueeze(0), sin[:S].float().unsqueeze(0).unsqueeze(0)
        if c.shape[-1] == D // 2:
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        qr = rotate(q, c, s)
        kr = rotate(k, c, s).repeat_interleave(Hq // Hk, dim=1)
        return F.scaled_dot_product_attention(qr, kr, v.float().repeat_interleave(Hq // Hk, dim=1), is_causal=True)

    for name, cos, sin in (("half", cos_half, sin_half), ("full", cos_full, sin_full)):
        q = torch.randn(B, Hq, S, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, Hk, S, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, Hk, S, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = fused_attention(q, k, v, cos, sin, causal=True)
        grad = torch.randn_like(out)
        out.backward(grad)
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        want = reference_attention(qf, kf, vf, cos, sin)
        want.backward(grad.float())
        report(f"torch_ops.attention, {name} table, forward", error(out, want), 0.05)
        # Gradients grow with the sequence: their error relative to the largest one.
        relative = max(error(a, b) / b.abs().max().item() for a, b in ((q.grad, qf.grad), (k.grad, kf.grad),
                                                                        (v.grad, vf.grad)))
        report(f"torch_ops.attention, {name} table, backward (relative)", relative, 0.03)
        plain = torch.empty_like(q)
        rope_jit.attention(q.detach(), k.detach(), v.detach(), plain, cos=cos, sin=sin, causal=True)
        torch.cuda.synchronize()
        report(f"rope_jit.attention without lse, {name} table", error(plain, want), 0.05)

    stats = runtime.stats()
    print("runtime counters:", ", ".join(f"{name} {value}" for name, value in stats.items()))
    if stats["compiles"] != 0:
        print(f"FAIL: {stats['compiles']} kernel(s) compiled: the prewarmed cache did not cover these calls")
        failures += 1
    if stats["disk_hits"] == 0:
        print("FAIL: no kernel came from the prewarmed cache")
        failures += 1
    if not failures:
        print(f"ok: {stats['disk_hits']} kernels prewarmed without a GPU ran apply_rope, the HF drop-in, "
              "rope_jit.rope and fused attention forward and backward with 0 compiles")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
