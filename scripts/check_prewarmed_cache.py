#!/usr/bin/env python3
"""Runs Llama-3-8B's RoPE calls on the GPU from a kernel cache prewarmed elsewhere, and checks
that no kernel was compiled.

    check_prewarmed_cache.py CACHE_DIR

CACHE_DIR holds `rope-jit-cache prewarm --preset llama3-8b --target sm_90` output, made on
a machine without a GPU. The script runs the preset's four calls (forward and backward, with
and without position ids: bf16 q [2, 512, 32, 128] and k [2, 512, 8, 128] in place, bf16 HF
cos/sin tables [4096, 128]) through the Python package, checks each result against the same
rotation in float32 PyTorch, and prints the runtime's counters. Exit status 0 when every
result matches and the runtime compiled nothing (every kernel came from CACHE_DIR).
Needs torch with a GPU and $ROPE_JIT_LIBRARY (or an installed package).
"""

import sys

import torch

import rope_jit


def reference(x, cos, sin, rows, backward):
    """HF's rotate_half rotation in float32 of x [B, S, H, D] at table rows [B, S]."""
    c = cos[rows].float().unsqueeze(2)
    s = sin[rows].float().unsqueeze(2)
    if backward:
        s = -s
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    runtime = rope_jit.Runtime(backend="cuda", cache_dir=argv[1])
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    B, S, Hq, Hk, D, P = 2, 512, 32, 8, 128, 4096
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(P, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    cos = angles.cos().to(torch.bfloat16).to(device)
    sin = angles.sin().to(torch.bfloat16).to(device)

    failures = 0
    for backward in (False, True):
        for with_positions in (False, True):
            q = torch.randn(B, S, Hq, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16)
            if with_positions:
                positions = torch.randint(0, P, (B, S), device=device, dtype=torch.int64)
            else:
                positions = None
            rows = positions if with_positions else torch.arange(S, device=device).expand(B, S)
            want_q = reference(q, cos, sin, rows, backward)
            want_k = reference(k, cos, sin, rows, backward)
            rope_jit.rope(q, k, cos=cos, sin=sin, positions=positions, backward=backward, layout="bshd",
                          runtime=runtime)
            torch.cuda.synchronize()
            error = max((q.float() - want_q).abs().max().item(), (k.float() - want_k).abs().max().item())
            ok = error <= 0.05  # one bf16 rounding of values up to ~5
            failures += not ok
            print(f"{'backward' if backward else 'forward '} {'positions [B, S]' if with_positions else 'implicit'}: "
                  f"max abs error vs float32 torch {error:.3g} {'ok' if ok else 'FAIL'}")

    stats = runtime.stats()
    print("runtime counters:", ", ".join(f"{name} {value}" for name, value in stats.items()))
    if stats["compiles"] != 0:
        print(f"FAIL: {stats['compiles']} kernel(s) compiled: the prewarmed cache was not used")
        failures += 1
    if stats["disk_hits"] != 4:
        print(f"FAIL: {stats['disk_hits']} kernels read from the prewarmed cache, expected the preset's 4")
        failures += 1
    if not failures:
        print("ok: the 4 llama3-8b kernels prewarmed on a machine without a GPU ran here with 0 compiles")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
