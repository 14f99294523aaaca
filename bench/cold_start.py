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
  rope_gap          first RoPE forward, then (after --gap-ms, as a model's layers would take)
                    its backward: the backward compiled in the background meanwhile
  attention_first   first fused forward, then first fused backward (B=1 S=1024 Hq=32 Hk=8)
                    right after it (no gap: what is left of the background build is waited for)
  attention_gap     the same with a gap of the forward's own time plus --gap-ms before the
                    backward (a model runs its other layers in between)
  attention_warm    the same with the kernels in the cache
  prewarm_preset    rope-jit-cache prewarm --preset llama3-8b into an empty root (wall time)
  prewarm_library   rope_jit_prewarm (the library, all cores) of that preset's RoPE specs
  rope_golden_specs each RoPE spec of the golden set (tests/golden, as rope_jit_prewarm specs)
                    compiled in one process, one at a time: the first (NVRTC's first use
                    included) and the median of the later ones

The last two need no GPU (CPU backend, target sm_90): `--cases prewarm_library,rope_golden_specs`
runs them on any machine with NVRTC. `--background off` sets ROPE_JIT_BACKGROUND_BUILDS=0
in the children (the numbers before background builds).
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
gap_ms = float(sys.argv[2])
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
dev = "cuda"
out = {}
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3
if case == "rope_gap":
    q = torch.randn(1, 2048, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 8, 128, device=dev, dtype=torch.bfloat16)
    ang = torch.arange(2048, device=dev, dtype=torch.float32)[:, None] * torch.rand(64, device=dev)
    cos, sin = ang.cos(), ang.sin()
    out["first_ms"] = timed(lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd"))
    time.sleep(gap_ms / 1e3)
    out["backward_after_gap_ms"] = timed(
        lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", backward=True))
    out["backward_again_ms"] = timed(
        lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", backward=True))
elif case in ("rope_first", "rope_warm"):
    q = torch.randn(1, 2048, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 8, 128, device=dev, dtype=torch.bfloat16)
    ang = torch.arange(2048, device=dev, dtype=torch.float32)[:, None] * torch.rand(64, device=dev)
    cos, sin = ang.cos(), ang.sin()
    out["first_ms"] = timed(lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd"))
    # NVRTC's own share of the first call (compile_ms counts compile_cuda alone: not the disk
    # write, the module load or the launch); read before a background build can add to it.
    out["first_compile_ms"] = rope_jit.default_runtime().stats()["compile_ms"]
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
    if case == "attention_gap":
        out["gap_ms"] = out["forward_ms"] + gap_ms
        time.sleep(out["gap_ms"] / 1e3)
    out["backward_ms"] = timed(lambda: rope_jit.attention_backward(q, k, v, o, lse, do, dq, dk, dv, cos=cos,
                                                                   sin=sin, causal=True))
    out["forward_again_ms"] = timed(lambda: rope_jit.attention(q, k, v, o, cos=cos, sin=sin, causal=True, lse=lse))
    out["backward_again_ms"] = timed(lambda: rope_jit.attention_backward(q, k, v, o, lse, do, dq, dk, dv, cos=cos,
                                                                         sin=sin, causal=True))
out["stats"] = rope_jit.default_runtime().stats()
print(json.dumps(out))
"""

# Children that need NVRTC but no GPU: the CPU backend compiles for sm_90 with rope_jit_prewarm.
NO_GPU_CHILD = r"""
import json, os, sys, time
import rope_jit
case, manifest = sys.argv[1], sys.argv[3]
rt = rope_jit.Runtime(backend="cpu")
out = {}
if case == "prewarm_library":
    # The llama3-8b preset's RoPE specs (as rope-jit-cache's preset: bf16 q and k, bf16 full
    # tables, forward and backward, with and without int64 indices).
    specs = [dict(head_dim=128, dtype="bfloat16", table_dtype="bfloat16", angles="table_full", has_k=1,
                  gqa_group=4, backward=b, positions=p) for b in (0, 1) for p in ("implicit", "indices")]
    t = time.perf_counter(); rt.prewarm(specs, target="sm_90")
    out["wall_ms"] = (time.perf_counter() - t) * 1e3
else:
    # Each golden RoPE case's kernel spec, read from its parameters and input shapes.
    specs, seen = [], set()
    for c in json.load(open(manifest))["cases"]:
        if c["op"] != "rope":
            continue
        p, inputs = c["params"], c["inputs"]
        q = inputs["q"]["shape"]
        heads = (lambda shape: shape[1] if p["layout"] == "bhsd" else shape[-2])
        spec = dict(head_dim=p["head_dim"], rotary_dim=p["rotary_dim"], rotary_offset=p["rotary_offset"],
                    style=p["style"], backward=int(p["backward"]), dtype=p["dtype"],
                    angles="table_full" if p["table"] == "full" else "table_half",
                    table_dtype=inputs["cos"]["dtype"] if "cos" in inputs else "float32",
                    packed=int(p["layout"] == "thd"), xpos=int(bool(p.get("xpos"))))
        if "k" in inputs:
            spec.update(has_k=1, gqa_group=heads(q) // heads(inputs["k"]["shape"]))
        if "positions" in inputs:
            spec.update(positions="indices", index_dtype=inputs["positions"]["dtype"])
        elif "seqlen_offsets" in inputs:
            spec.update(positions="seqlen_offsets", index_dtype=inputs["seqlen_offsets"]["dtype"])
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    times = []
    for spec in specs:
        compiles = rt.stats()["compiles"]
        t = time.perf_counter(); rt.prewarm([spec], target="sm_90"); ms = (time.perf_counter() - t) * 1e3
        if rt.stats()["compiles"] > compiles:  # two cases may share a kernel: the second is a disk hit
            times.append(ms)
    out["specs"] = len(specs)
    out["first_ms"] = times[0]
    later = sorted(times[1:])
    out["later_median_ms"] = later[len(later) // 2]
    out["later_ms"] = times[1:]
out["stats"] = rt.stats()
print(json.dumps(out))
"""

NO_GPU_CASES = ("prewarm_library", "rope_golden_specs")


def child(case, cache_dir, library, gap_ms=0.0, background="on"):
    env = dict(os.environ, ROPE_JIT_CACHE_DIR=cache_dir, ROPE_JIT_LIBRARY=library)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    if background == "off":
        env["ROPE_JIT_BACKGROUND_BUILDS"] = "0"
    manifest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "manifest.json")
    code = NO_GPU_CHILD if case in NO_GPU_CASES else CHILD
    result = subprocess.run([sys.executable, "-c", code, case, str(gap_ms), manifest], env=env,
                            capture_output=True, text=True)
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
    parser.add_argument("--gap-ms", type=float, default=200.0,
                        help="what a model does between a forward and its backward (rope_gap: this; "
                             "attention_gap: the forward's own time plus this)")
    parser.add_argument("--background", choices=("on", "off"), default="on",
                        help="off: ROPE_JIT_BACKGROUND_BUILDS=0 in the children")
    all_cases = ("rope_first", "rope_warm", "rope_gap", "attention_first", "attention_warm", "attention_gap",
                 "prewarm_preset", "prewarm_library", "rope_golden_specs")
    parser.add_argument("--cases", default=",".join(all_cases), help="comma-separated subset of: "
                        + ", ".join(all_cases))
    args = parser.parse_args()
    library = os.path.abspath(args.library)
    cases = args.cases.split(",")
    results = {}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as rope_dir, tempfile.TemporaryDirectory() as attn_dir:
            # Each "_warm" case reads what the case before it left in the same directory.
            for case, cache in (("rope_first", rope_dir), ("rope_warm", rope_dir),
                                ("attention_first", attn_dir), ("attention_warm", attn_dir)):
                if case in cases:
                    results.setdefault(case, []).append(child(case, cache, library, args.gap_ms, args.background))
        for case in ("rope_gap", "attention_gap", "prewarm_library", "rope_golden_specs"):
            if case in cases:
                with tempfile.TemporaryDirectory() as cache:
                    results.setdefault(case, []).append(child(case, cache, library, args.gap_ms, args.background))
        if args.cache_tool and "prewarm_preset" in cases:
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
        "rope_first_compile_ms": median("rope_first", "first_compile_ms"),
        "rope_next_interleaved_ms": median("rope_first", "next_interleaved_ms"),
        "rope_next_backward_ms": median("rope_first", "next_backward_ms"),
        "rope_warm_first_ms": median("rope_warm", "first_ms"),
        "attention_first_forward_ms": median("attention_first", "forward_ms"),
        "attention_first_backward_ms": median("attention_first", "backward_ms"),
        "attention_warm_forward_ms": median("attention_warm", "forward_ms"),
        "attention_warm_backward_ms": median("attention_warm", "backward_ms"),
        "attention_hot_forward_ms": median("attention_warm", "forward_again_ms"),
        "attention_hot_backward_ms": median("attention_warm", "backward_again_ms"),
        "attention_gap_forward_ms": median("attention_gap", "forward_ms"),
        "attention_gap_backward_ms": median("attention_gap", "backward_ms"),
        "rope_gap_backward_ms": median("rope_gap", "backward_after_gap_ms"),
        "rope_hot_backward_ms": median("rope_gap", "backward_again_ms"),
        "prewarm_preset_ms": median("prewarm_preset", "wall_ms"),
        "prewarm_library_ms": median("prewarm_library", "wall_ms"),
        "rope_golden_first_ms": median("rope_golden_specs", "first_ms"),
        "rope_golden_later_median_ms": median("rope_golden_specs", "later_median_ms"),
    }
    for key, value in summary.items():
        print(f"{key:32s} {value if value is None else round(value, 1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
