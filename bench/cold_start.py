"""Cold start: what a fresh process pays before its first RoPE and fused attention calls.

Each measurement runs in its own Python process (so NVRTC, the driver and the library load
afresh), on an empty cache directory unless it says "warm". The clock starts after torch has
created its CUDA context and the tensors exist, just before the first rope-jit call (runtime
creation included), and stops after a synchronize. Also times `rope-jit-cache prewarm
--preset` into an empty directory. One run writes every number issue 22's "Done when" names,
and whether each is met, to one JSON file:

    python bench/cold_start.py --library build/librope_jit.so --cache-tool build/tools/rope-jit-cache \
        --repeats 5 --json cold_start.json

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
  prewarm_preset    rope-jit-cache prewarm --preset llama3-8b into an empty root (wall time,
                    and the tool's own report: per-kernel NVRTC time, the slowest kernel)
  prewarm_library   rope_jit_prewarm_json (the library, all cores) of that preset's kernels, as
                    the tool plans them (RoPE and attention; RoPE only without --cache-tool)
  rope_golden_specs each RoPE spec of the golden set (tests/golden, as rope_jit_prewarm specs)
                    compiled in one process, one at a time: the first (NVRTC's first use
                    included) and the median of the later ones, wall and NVRTC's own time

The last two need no GPU (CPU backend, target sm_90): `--cases prewarm_library,rope_golden_specs`
runs them on any machine with NVRTC. `--background off` sets ROPE_JIT_BACKGROUND_BUILDS=0
in the children (the numbers before background builds); `--also-background-off` adds the
rope_first, attention_first and rope_gap cases with it off to the same run, as
"<case>_background_off" (what compiling the backward beside the forward costs the first call,
and what it saves the first backward).

Medians are true medians (the mean of the two middle values for an even count), and every
run is kept. A host whose cores are busy with other work makes NVRTC slower: before each child
the parent times a fixed CPU-bound loop ("probe_ms", with the 1-minute load average), and
while it runs counts the cores the rest of the machine kept busy ("others_busy_cores", from
/proc/stat less the child's own CPU time); the "host" section records the cores this process may use and the cgroup's CPU quota, so a slow
window shows up next to the numbers it spoiled instead of passing for the library's cost.
"""

import argparse
import json
import os
import platform
import statistics
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
    B, S, Hq, Hk, D = (int(x) for x in os.environ.get("COLD_START_ATTENTION_SHAPE", "1,1024,32,8,128").split(","))
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
import json, os, statistics, sys, time
import rope_jit
case, manifest = sys.argv[1], sys.argv[3]
rt = rope_jit.Runtime(backend="cpu")
out = {}
if case == "prewarm_library":
    planned = json.loads(os.environ.get("COLD_START_PREWARM_SPECS", "null"))
    if planned:
        # The preset's kernels exactly as rope-jit-cache plans them (canonical spec JSON).
        out["kernels"] = len(planned)
        t = time.perf_counter(); rt.prewarm_json(planned, target="sm_90")
    else:
        # The llama3-8b preset's RoPE specs (bf16 q and k, bf16 full tables, forward and
        # backward, with and without int64 indices), without the tool to plan the rest.
        specs = [dict(head_dim=128, dtype="bfloat16", table_dtype="bfloat16", angles="table_full", has_k=1,
                      gqa_group=4, backward=b, positions=p) for b in (0, 1) for p in ("implicit", "indices")]
        out["kernels"] = len(specs)
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
    times, compile_times = [], []
    for spec in specs:
        before = rt.stats()
        t = time.perf_counter(); rt.prewarm([spec], target="sm_90"); ms = (time.perf_counter() - t) * 1e3
        after = rt.stats()
        if after["compiles"] > before["compiles"]:  # two cases may share a kernel: the second is a disk hit
            times.append(ms)
            # NVRTC's own time: wall minus this is the disk write (fsync) and specializing.
            compile_times.append(after["compile_ms"] - before["compile_ms"])
    out["specs"] = len(specs)
    out["first_ms"] = times[0]
    out["first_compile_ms"] = compile_times[0]
    out["later_median_ms"] = statistics.median(times[1:])
    out["later_median_compile_ms"] = statistics.median(compile_times[1:])
    out["later_ms"] = times[1:]
    out["later_compile_ms"] = compile_times[1:]
out["stats"] = rt.stats()
print(json.dumps(out))
"""

NO_GPU_CASES = ("prewarm_library", "rope_golden_specs")


def probe_ms():
    """A fixed CPU-bound loop (about 30-60 ms on an idle core): slower means the host is busy."""
    t = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i * i
    return (time.perf_counter() - t) * 1e3


def host_info():
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                info["cgroup_" + os.path.basename(path)] = f.read().strip()
        except OSError:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def conditions():
    """What the host was doing just before a child: the probe and the load average."""
    return {"probe_ms": probe_ms(), "load_1m": os.getloadavg()[0]}


def cpu_counters():
    """(busy, total) jiffies of every CPU this kernel shows, the children's CPU seconds, now."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy_total = (sum(fields[:8]) - idle, sum(fields[:8]))
    except (OSError, ValueError, IndexError):
        busy_total = None
    times = os.times()
    return busy_total, times.children_user + times.children_system, time.perf_counter()


def others_busy(before, after):
    """While a child ran: how many cores the rest of the machine kept busy (its CPU time
    subtracted), and the child's own CPU seconds. None where /proc/stat is unreadable."""
    (b0, child0, t0), (b1, child1, t1) = before, after
    child_cpu = child1 - child0
    out = {"child_cpu_s": round(child_cpu, 3)}
    if b0 and b1 and t1 > t0:
        hz = os.sysconf("SC_CLK_TCK")
        out["others_busy_cores"] = round(max(0.0, ((b1[0] - b0[0]) / hz - child_cpu) / (t1 - t0)), 2)
    return out


# --fresh-cuda-cache: each child and each tool run gets an empty CUDA_CACHE_PATH. On the H200
# machine, with libcuda present, NVRTC's optimizer and PTX-to-SASS results of a program it has
# seen before come back from the driver's compute cache (run EE, session 29: 4 and 0 ms where an
# unseen program takes 60-90 ms each), so that "an empty cache" of ours alone is a warm start.
FRESH_CUDA_CACHE = False


def nvidia_cache_env(scratch):
    """CUDA_CACHE_PATH under `scratch` where --fresh-cuda-cache asks for it."""
    if not FRESH_CUDA_CACHE:
        return {}
    path = os.path.join(scratch, "cuda_compute_cache")
    os.makedirs(path, exist_ok=True)
    return {"CUDA_CACHE_PATH": path}


def child(case, cache_dir, library, gap_ms=0.0, background="on", extra_env=None):
    env = dict(os.environ, ROPE_JIT_CACHE_DIR=cache_dir, ROPE_JIT_LIBRARY=library)
    scratch = tempfile.TemporaryDirectory(prefix="cold_start_cuda_")  # removed on return
    env.update(nvidia_cache_env(scratch.name))
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    if background == "off":
        env["ROPE_JIT_BACKGROUND_BUILDS"] = "0"
    env.update(extra_env or {})
    manifest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "manifest.json")
    code = NO_GPU_CHILD if case in NO_GPU_CASES else CHILD
    host = conditions()
    before = cpu_counters()
    result = subprocess.run([sys.executable, "-c", code, case, str(gap_ms), manifest], env=env,
                            capture_output=True, text=True)
    host.update(others_busy(before, cpu_counters()))
    if result.returncode != 0:
        raise SystemExit(f"{case} failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["host"] = host
    return out


def plan_preset(cache_tool, preset):
    """The preset's kernels as the tool plans them for sm_90 (canonical spec JSON objects)."""
    with tempfile.TemporaryDirectory() as root:
        run = subprocess.run([cache_tool, "--cache-dir", root, "--json", "prewarm", "--dry-run", "--preset", preset,
                              "--target", "sm_90"], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"planning the preset failed:\n{run.stderr[-3000:]}")
    return [kernel["spec"] for kernel in json.loads(run.stdout)["kernels"]]


def prewarm_preset(cache_tool, preset):
    """`rope-jit-cache prewarm --preset` as a user types it (the local GPU's target), into an
    empty root: the wall time, and the tool's JSON report (per-kernel NVRTC time)."""
    host = conditions()
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, **nvidia_cache_env(root))
        # What comes before the first compile (loading the library and NVRTC, asking the GPU
        # for its target, planning): the same command with --dry-run.
        t = time.perf_counter()
        subprocess.run([cache_tool, "--cache-dir", root, "--json", "prewarm", "--dry-run", "--preset", preset],
                       capture_output=True, text=True, env=env)
        dry_run = (time.perf_counter() - t) * 1e3
        before = cpu_counters()
        t = time.perf_counter()
        run = subprocess.run([cache_tool, "--cache-dir", root, "--json", "prewarm", "--preset", preset],
                             capture_output=True, text=True, env=env)
        wall = (time.perf_counter() - t) * 1e3
        host.update(others_busy(before, cpu_counters()))
    out = {"wall_ms": wall, "dry_run_ms": dry_run, "rc": run.returncode, "host": host}
    try:
        report = json.loads(run.stdout)
        kernels = report["kernels"]
        slowest = max(kernels, key=lambda k: k["compile_ms"])
        out.update(tool_ms=report["seconds"] * 1e3, jobs=report["jobs"], kernels=len(kernels),
                   targets=report["targets"], compiled=report["compiled"], failed=report["failed"],
                   nvrtc_total_ms=report["compile_seconds"] * 1e3,
                   slowest_kernel_ms=slowest["compile_ms"], slowest_kernel=slowest["description"],
                   kernel_compile_ms={k["description"]: round(k["compile_ms"], 1) for k in kernels})
    except (ValueError, KeyError):
        out["tail"] = run.stdout[-400:] + run.stderr[-400:]
    return out


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# Issue 22's "Done when", each as (name, limit in ms, how the value is computed from the summary).
DONE_WHEN = [
    ("first RoPE call <= 100 ms", 100.0, lambda s: s["rope_first_ms"]),
    ("later RoPE specs (golden set, median) <= 50 ms", 50.0, lambda s: s["rope_golden_later_median_ms"]),
    ("first fused forward + backward <= 1000 ms", 1000.0,
     lambda s: None if s["attention_first_forward_ms"] is None or s["attention_first_backward_ms"] is None
     else s["attention_first_forward_ms"] + s["attention_first_backward_ms"]),
    ("first backward right after a forward <= warm backward + 50 ms", 50.0,
     lambda s: None if s["attention_first_backward_ms"] is None or s["attention_warm_backward_ms"] is None
     else s["attention_first_backward_ms"] - s["attention_warm_backward_ms"]),
    ("rope-jit-cache prewarm --preset <= 1500 ms", 1500.0, lambda s: s["prewarm_preset_ms"]),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    parser.add_argument("--cache-tool", help="rope-jit-cache, for the preset prewarm (and the library's kernel list)")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per case (median reported)")
    parser.add_argument("--json")
    parser.add_argument("--gap-ms", type=float, default=200.0,
                        help="what a model does between a forward and its backward (rope_gap: this; "
                             "attention_gap: the forward's own time plus this)")
    parser.add_argument("--background", choices=("on", "off"), default="on",
                        help="off: ROPE_JIT_BACKGROUND_BUILDS=0 in the children")
    parser.add_argument("--also-background-off", action="store_true",
                        help="also run rope_first, attention_first and rope_gap with background builds off")
    all_cases = ("rope_first", "rope_warm", "rope_gap", "attention_first", "attention_warm", "attention_gap",
                 "prewarm_preset", "prewarm_library", "rope_golden_specs")
    parser.add_argument("--cases", default=",".join(all_cases), help="comma-separated subset of: "
                        + ", ".join(all_cases))
    parser.add_argument("--attention-shapes", default="",
                        help="';'-separated B,S,Hq,Hk,D: attention_first and attention_warm again at each "
                             "(each its own kernels, e.g. issue 19's shapes; summary keys end in @shape)")
    parser.add_argument("--fresh-cuda-cache", action="store_true",
                        help="an empty CUDA_CACHE_PATH for each child and tool run (the driver's compute "
                             "cache also keeps NVRTC's optimizer and SASS results of programs seen before)")
    args = parser.parse_args()
    global FRESH_CUDA_CACHE
    FRESH_CUDA_CACHE = args.fresh_cuda_cache
    library = os.path.abspath(args.library)
    cases = args.cases.split(",")
    results = {}
    planned = None
    if args.cache_tool and "prewarm_library" in cases:
        planned = plan_preset(args.cache_tool, args.preset)
    library_env = {"COLD_START_PREWARM_SPECS": json.dumps(planned)} if planned else {}

    def run(case, cache, name=None, background=None, extra_env=None):
        results.setdefault(name or case, []).append(
            child(case, cache, library, args.gap_ms, background or args.background, extra_env))

    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as rope_dir, tempfile.TemporaryDirectory() as attn_dir:
            # Each "_warm" case reads what the case before it left in the same directory.
            for case, cache in (("rope_first", rope_dir), ("rope_warm", rope_dir),
                                ("attention_first", attn_dir), ("attention_warm", attn_dir)):
                if case in cases:
                    run(case, cache)
        for shape in filter(None, args.attention_shapes.split(";")):
            with tempfile.TemporaryDirectory() as cache:
                for case in ("attention_first", "attention_warm"):
                    run(case, cache, name=f"{case}@{shape}",
                        extra_env={"COLD_START_ATTENTION_SHAPE": shape})
        for case in ("rope_gap", "attention_gap", "prewarm_library", "rope_golden_specs"):
            if case in cases:
                with tempfile.TemporaryDirectory() as cache:
                    run(case, cache, extra_env=library_env if case == "prewarm_library" else None)
        if args.also_background_off:
            for case in ("rope_first", "attention_first", "rope_gap"):
                if case in cases:
                    with tempfile.TemporaryDirectory() as cache:
                        run(case, cache, name=case + "_background_off", background="off")
        if args.cache_tool and "prewarm_preset" in cases:
            results.setdefault("prewarm_preset", []).append(prewarm_preset(args.cache_tool, args.preset))

    def med(case, key):
        return median([r.get(key) for r in results.get(case, [])])

    summary = {
        "rope_first_ms": med("rope_first", "first_ms"),
        "rope_first_compile_ms": med("rope_first", "first_compile_ms"),
        # Without its backward compiling beside it (2 cores: 17% faster, see the notes).
        "rope_first_background_off_ms": med("rope_first_background_off", "first_ms"),
        "rope_next_interleaved_ms": med("rope_first", "next_interleaved_ms"),
        "rope_next_backward_ms": med("rope_first", "next_backward_ms"),
        "rope_warm_first_ms": med("rope_warm", "first_ms"),
        "attention_first_forward_ms": med("attention_first", "forward_ms"),
        "attention_first_backward_ms": med("attention_first", "backward_ms"),
        "attention_warm_forward_ms": med("attention_warm", "forward_ms"),
        "attention_warm_backward_ms": med("attention_warm", "backward_ms"),
        "attention_hot_forward_ms": med("attention_warm", "forward_again_ms"),
        "attention_hot_backward_ms": med("attention_warm", "backward_again_ms"),
        "attention_gap_forward_ms": med("attention_gap", "forward_ms"),
        "attention_gap_backward_ms": med("attention_gap", "backward_ms"),
        "attention_first_backward_background_off_ms": med("attention_first_background_off", "backward_ms"),
        "rope_gap_backward_ms": med("rope_gap", "backward_after_gap_ms"),
        "rope_gap_backward_background_off_ms": med("rope_gap_background_off", "backward_after_gap_ms"),
        "rope_hot_backward_ms": med("rope_gap", "backward_again_ms"),
        "prewarm_preset_ms": med("prewarm_preset", "wall_ms"),
        "prewarm_preset_tool_ms": med("prewarm_preset", "tool_ms"),
        "prewarm_preset_dry_run_ms": med("prewarm_preset", "dry_run_ms"),
        "prewarm_preset_slowest_kernel_ms": med("prewarm_preset", "slowest_kernel_ms"),
        "prewarm_preset_nvrtc_total_ms": med("prewarm_preset", "nvrtc_total_ms"),
        "prewarm_library_ms": med("prewarm_library", "wall_ms"),
        "prewarm_library_kernels": med("prewarm_library", "kernels"),
        "rope_golden_first_ms": med("rope_golden_specs", "first_ms"),
        "rope_golden_later_median_ms": med("rope_golden_specs", "later_median_ms"),
        "rope_golden_later_median_compile_ms": med("rope_golden_specs", "later_median_compile_ms"),
    }
    for shape in filter(None, args.attention_shapes.split(";")):
        for case in ("attention_first", "attention_warm"):
            summary[f"{case}_forward_plus_backward_ms@{shape}"] = median(
                [r["forward_ms"] + r["backward_ms"] for r in results[f"{case}@{shape}"]])
    # The spread of each case's numbers and of the host probe beside them: a repeat far from
    # the others with a slow probe was a busy host, not the library.
    spread = {}
    for case, runs in results.items():
        probes = [r["host"]["probe_ms"] for r in runs if "host" in r]
        spread[case] = {"probe_ms": [round(p, 1) for p in probes],
                        "load_1m": [round(r["host"]["load_1m"], 2) for r in runs if "host" in r],
                        "others_busy_cores": [r["host"].get("others_busy_cores") for r in runs if "host" in r]}
        for key in ("first_ms", "backward_ms", "forward_ms", "wall_ms", "later_median_ms",
                    "later_median_compile_ms", "backward_after_gap_ms"):
            values = [r[key] for r in runs if key in r]
            if values:
                spread[case][key] = [round(v, 1) for v in values]
    done_when = []
    shape_limits = []  # issue 19: a fresh process's first fused forward + backward at each shape
    for shape in filter(None, args.attention_shapes.split(";")):
        shape_limits += [(f"first fused forward + backward at {shape} <= 1500 ms", 1500.0,
                          lambda s, k=f"attention_first_forward_plus_backward_ms@{shape}": s[k]),
                         (f"warm-cache fused forward + backward at {shape} <= 20 ms", 20.0,
                          lambda s, k=f"attention_warm_forward_plus_backward_ms@{shape}": s[k])]
    for name, limit, value_of in DONE_WHEN + shape_limits:
        value = value_of(summary)
        done_when.append({"criterion": name, "value_ms": value, "limit_ms": limit,
                          "met": None if value is None else value <= limit})
    for key, value in summary.items():
        print(f"{key:44s} {value if value is None else round(value, 1)}")
    print()
    for item in done_when:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[item["met"]]
        value = item["value_ms"]
        print(f"{item['criterion']:64s} {'-' if value is None else round(value, 1):>8} ms  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "done_when": done_when, "host": host_info(),
                       "args": vars(args), "spread": spread, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
