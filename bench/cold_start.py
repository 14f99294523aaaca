"""Cold start: what a fresh process pays before its first RoPE and fused attention calls.

Each measurement runs in its own Python process (so NVRTC, the driver and the library load
afresh), on an empty cache directory unless it says "warm". The clock starts after torch has
created its CUDA context and the tensors exist, just before the first rope-jit call (runtime
creation included), and stops after a synchronize. Also times `rope-jit-cache prewarm
--preset` into an empty directory.

    python bench/cold_start.py --library build/librope_jit.so --cache-tool build/tools/rope-jit-cache \
        --json cold_start.json

Cases (Llama-3-8B shapes, bf16, fp32 half tables where tables are used):
  rope_first        first RoPE call (q and k, in place, B=1 S=2048 Hq=32 Hk=8 D=128)
  rope_next         a second RoPE spec in that process (interleaved pairs), and a third
                    (backward): the cost of a later spec once NVRTC is loaded
  rope_warm         first RoPE call of a fresh process whose cache holds the kernel
  attention_first   first fused forward, then first fused backward (B=1 S=1024 Hq=32 Hk=8)
  attention_warm    the same with the kernels in the cache
  prewarm_preset    rope-jit-cache prewarm --preset llama3-8b into an empty root (wall time)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
import torch
import rope_jit
case = sys.argv[1]
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
dev = "cuda"
out = {}
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3
if case in ("rope_first", "rope_warm"):
    q = torch.randn(1, 2048, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 8, 128, device=dev, dtype=torch.bfloat16)
    ang = torch.arange(2048, device=dev, dtype=torch.float32)[:, None] * torch.rand(64, device=dev)
    cos, sin = ang.cos(), ang.sin()
    out["first_ms"] = timed(lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd"))
    if case == "rope_first":
        out["next_interleaved_ms"] = timed(
            lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", style="interleaved"))
        out["next_backward_ms"] = timed(
            lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", backward=True))
    out["second_call_ms"] = timed(lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd"))
else:
    B, S, Hq, Hk, D = 1, 1024, 32, 8, 128
    q = torch.randn(B, Hq, S, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
    ang = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=dev)
    cos, sin = ang.cos(), ang.sin()
    o = torch.empty_like(q); lse = torch.empty(B, Hq, S, device=dev, dtype=torch.float32)
    do = torch.randn_like(q); dq = torch.empty_like(q); dk = torch.empty_like(k); dv = torch.empty_like(v)
    out["forward_ms"] = timed(lambda: rope_jit.attention(q, k, v, o, cos=cos, sin=sin, causal=True, lse=lse))
    out["backward_ms"] = timed(lambda: rope_jit.attention_backward(q, k, v, o, lse, do, dq, dk, dv, cos=cos,
                                                                   sin=sin, causal=True))
    out["forward_again_ms"] = timed(lambda: rope_jit.attention(q, k, v, o, cos=cos, sin=sin, causal=True, lse=lse))
out["stats"] = rope_jit.default_runtime().stats()
print(json.dumps(out))
"""


def child(case, cache_dir, library):
    env = dict(os.environ, ROPE_JIT_CACHE_DIR=cache_dir, ROPE_JIT_LIBRARY=library)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    result = subprocess.run([sys.executable, "-c", CHILD, case], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{case} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    parser.add_argument("--cache-tool", help="rope-jit-cache, for the preset prewarm")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case (median reported)")
    parser.add_argument("--json")
    args = parser.parse_args()
    library = os.path.abspath(args.library)
    results = {}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as rope_dir, tempfile.TemporaryDirectory() as attn_dir:
            for case, cache in (("rope_first", rope_dir), ("rope_warm", rope_dir),
                                ("attention_first", attn_dir), ("attention_warm", attn_dir)):
                results.setdefault(case, []).append(child(case, cache, library))
        if args.cache_tool:
            with tempfile.TemporaryDirectory() as root:
                t = time.perf_counter()
                run = subprocess.run([args.cache_tool, "prewarm", "--preset", args.preset, "--cache-dir", root],
                                     capture_output=True, text=True)
                wall = (time.perf_counter() - t) * 1e3
                results.setdefault("prewarm_preset", []).append(
                    {"wall_ms": wall, "rc": run.returncode, "tail": run.stdout[-400:] + run.stderr[-400:]})

    def median(case, key):
        values = sorted(r[key] for r in results.get(case, []) if key in r)
        return values[len(values) // 2] if values else None

    summary = {
        "rope_first_ms": median("rope_first", "first_ms"),
        "rope_next_interleaved_ms": median("rope_first", "next_interleaved_ms"),
        "rope_next_backward_ms": median("rope_first", "next_backward_ms"),
        "rope_warm_first_ms": median("rope_warm", "first_ms"),
        "attention_first_forward_ms": median("attention_first", "forward_ms"),
        "attention_first_backward_ms": median("attention_first", "backward_ms"),
        "attention_warm_forward_ms": median("attention_warm", "forward_ms"),
        "attention_warm_backward_ms": median("attention_warm", "backward_ms"),
        "attention_hot_forward_ms": median("attention_warm", "forward_again_ms"),
        "prewarm_preset_ms": median("prewarm_preset", "wall_ms"),
    }
    for key, value in summary.items():
        print(f"{key:32s} {value if value is None else round(value, 1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
