"""Where a fresh process's first fused forward + backward spends its time when every kernel is
already in the disk cache (issue 19's "warm-cache cold start").

The parent fills a cache directory with one child, then runs --repeats children on it. Each
child times, after torch has made its CUDA context: loading the library, creating the default
runtime, the first forward, the first backward, and each again; the runtime's counters split
the first calls into disk lookups and module loads (rope_jit_stats). The last child also runs
the first forward and backward under cProfile (the Python side: calls into the library show
as ctypes functions). Needs a GPU.

    python3 bench/warm_start_profile.py --library build/librope_jit.so --shape 4,4096,32,8,128
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, io, json, os, pstats, sys, time
import torch
import rope_jit
from rope_jit import _library
profile = sys.argv[1] == "profile"
B, S, Hq, Hk, D = (int(x) for x in sys.argv[2].split(","))
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
dev = "cuda"
q = torch.randn(B, Hq, S, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
ang = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=dev)
cos, sin = ang.cos(), ang.sin()
o = torch.empty_like(q); lse = torch.empty(B, Hq, S, device=dev, dtype=torch.float32)
do = torch.randn_like(q)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
torch.cuda.synchronize()
out = {}
def timed(name, fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    out[name] = (time.perf_counter() - t) * 1e3
forward = lambda: rope_jit.attention(q, k, v, o, cos=cos, sin=sin, causal=True, lse=lse)
backward = lambda: rope_jit.attention_backward(q, k, v, o, lse, do, dq, dk, dv, cos=cos, sin=sin,
                                               causal=True)
profiler = cProfile.Profile() if profile else None
if profiler: profiler.enable()
timed("load_library_ms", _library.load)
timed("create_runtime_ms", rope_jit.default_runtime)
after_create = rope_jit.default_runtime().stats()
timed("first_forward_ms", forward)
after_forward = rope_jit.default_runtime().stats()
timed("first_backward_ms", backward)
if profiler: profiler.disable()
timed("forward_again_ms", forward)
timed("backward_again_ms", backward)
out["stats_after_create"] = after_create
out["stats_after_forward"] = after_forward
out["stats"] = rope_jit.default_runtime().stats()
if profiler:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    out["profile"] = text.getvalue()
print(json.dumps(out))
"""


def child(mode, shape, cache_dir, library):
    env = dict(os.environ, ROPE_JIT_CACHE_DIR=cache_dir, ROPE_JIT_LIBRARY=library)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    run = subprocess.run([sys.executable, "-c", CHILD, mode, shape], env=env, capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise SystemExit(f"child failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", required=True)
    parser.add_argument("--shape", default="4,4096,32,8,128", help="B,S,Hq,Hk,D")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write every child's numbers here")
    args = parser.parse_args()
    library = os.path.abspath(args.library)
    with tempfile.TemporaryDirectory() as cache:
        child("fill", args.shape, cache, library)
        runs = [child("time", args.shape, cache, library) for _ in range(args.repeats)]
        profiled = child("profile", args.shape, cache, library)
    keys = ("load_library_ms", "create_runtime_ms", "first_forward_ms", "first_backward_ms",
            "forward_again_ms", "backward_again_ms")
    print(f"shape {args.shape}, warm cache, {args.repeats} fresh processes (median, min, max):")
    for key in keys:
        values = [r[key] for r in runs]
        print(f"  {key:22s} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    for key in ("disk_lookup_ms", "module_load_ms"):
        for when in ("stats_after_create", "stats_after_forward", "stats"):
            values = [r[when][key] for r in runs]
            print(f"  {key} ({when}) {statistics.median(values):8.2f}")
    print(profiled["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "runs": runs, "profiled": profiled}, f, indent=1)


if __name__ == "__main__":
    main()
