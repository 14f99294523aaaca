"""RoPE through rope-jit (C API on PyTorch tensors) against its peers doing the same rotation on
the same tensors, in one process, on the GPU: PyTorch eager and torch.compile out of place, and
with --in-place also Liger (issue 24's comparison).

    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/compare_torch.py \
        --json bench/results/h200_vs_torch.json
    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/compare_torch.py \
        --in-place --json bench/results/h200_in_place_vs_peers.json
    ... --device cpu   (a smoke run of this script: small shapes, no graphs, no Liger)

Every shape: q and k in [B, S, H, D] (bf16), HF-style full cos/sin tables [S, R] (bf16),
forward, half style over all of D, or (GPT-NeoX, GPT-J) partial rotary with the rest of each
head left as it is, GPT-J with interleaved pairs. Modes:
  out of place (default; DESIGN.md's shapes, other head_dims, partial rotary, decode):
    rope_jit       rope_jit.rope(..., q_out=, k_out=, layout="bshd")
    torch_compile  torch.compile(HF's apply_rotary_pos_emb formula, dynamic=False)
    torch_eager    the formula in eager PyTorch
  --in-place (issue 24's four shapes): q and k rotated in their own buffers
    rope_jit       rope_jit.rope(q, k, cos=, sin=, layout="bshd"): no outputs, so in place
    torch_compile  torch.compile of the formula followed by q.copy_(...), k.copy_(...): inductor
                   writes the rotation into q and k (how many kernels: see gpu ops below)
    liger          liger_kernel.transformers.rope.liger_rotary_pos_emb on the [B, H, S, D]
                   views, as HF models call it: it transposes them back to the [B, S, H, D]
                   buffers and rotates those in place (Triton; half style only; skipped with a
                   note when liger_kernel does not import)
    torch_eager    the formula, then copy_
Checks, before any timing: each implementation's result against fp32 math on the same bf16
inputs and tables (in place: q's and k's own buffers, so a result written elsewhere fails; out
of place: q and k must come back untouched). A mismatch stops the run.
Times, medians over --trials of CUDA-event timings, the trials taking turns between the
implementations and the copy of the same bytes (below), so that a drift of clocks favours none
(torch.compile and eager take turns only with each other: TIMED_APART says why); each trial
starts from the same random q and k and after 10 ms of its own untimed calls (time_ms):
  calls  back-to-back Python calls, as a training loop makes them (host overhead included: a
         call whose host side is slower than its kernel leaves the GPU waiting);
  graph  the GPU time of one call, from replays of a CUDA graph of --graph-calls calls, 20 ms
         of replays a trial.
Bytes are q and k read and written once plus the cos and sin rows read: the fewest a call must
touch (but for partial rotary in place, which need not touch the features it leaves alone).
Fractions: "of copy" is the bandwidth over that of a 2 GiB device-to-device copy timed in the
same process; "of 1GiB" over that of a 1 GiB copy (issue 24 states its fractions so); "of same"
is over a device copy of the same bytes (half read, half written, graph replay): what a kernel
this short can reach, launch, ramp and tail included. Speedups are a peer's time over
rope-jit's. rope_jit runs on the default Runtime, whose RoPE kernels are programmatic dependent
launches on sm_90 under CUDA 12.3 and later (in a graph of its own calls each kernel's launch
and set-up overlap the end of the one before); with --plain, rope_jit_plain is the same call on
a Runtime with plain launches. After every timing (the profiler stays attached to the process once
used), torch.profiler lists the GPU operations one call of each implementation launches.
bench/plot_results.py draws the PNG from the JSON.
"""

import argparse
import importlib.metadata
import json
import math
import statistics
import time

import torch

import rope_jit

# (B, S, Hq, Hk, D, R, style)
OUT_OF_PLACE_SHAPES = [  # DESIGN.md's table, other head_dims, partial rotary, decode
    (4, 4096, 32, 8, 128, 128, "half"),
    (1, 32768, 32, 8, 128, 128, "half"),
    (8, 2048, 16, 16, 64, 64, "half"),
    (2, 4096, 16, 8, 256, 256, "half"),
    (4, 4096, 32, 8, 80, 80, "half"),
    (4, 4096, 32, 8, 96, 96, "half"),
    (8, 2048, 64, 64, 96, 24, "half"),  # GPT-NeoX-20B: rotary_pct 0.25
    (8, 2048, 16, 16, 256, 64, "interleaved"),  # GPT-J-6B: rotary_dim 64, rotate_every_two
    (64, 1, 32, 8, 128, 128, "half"),
]
IN_PLACE_SHAPES = [  # issue 24's "Done when"
    (4, 4096, 32, 8, 128, 128, "half"),
    (1, 32768, 32, 8, 128, 128, "half"),
    (8, 2048, 16, 16, 64, 64, "half"),
    (2, 4096, 16, 8, 256, 256, "half"),
]
STYLES = ("half", "interleaved")
# How results are named in the tables and the plot, in the order they are shown.
LABELS = {"rope_jit": "rope-jit", "rope_jit_plain": "rope-jit (plain launches)",
          "torch_compile": "torch.compile", "liger": "Liger", "torch_eager": "eager"}
OURS = ("rope_jit", "rope_jit_plain")  # rope-jit's own rows: the rest are its peers
# Against fp32 math: eager and Liger round q*cos and rotate(q)*sin to bf16 before adding (Liger
# computes in the tables' dtype), rope-jit and compile keep fp32 in between. Two bf16 roundings
# pass; a wrong pair, sign or row is off by O(1).
TOLERANCE = {"atol": 3e-2, "rtol": 2e-2}
BIG_COPY_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}  # the yardstick; the CPU one only smokes
# Issue 24 states its fractions of a 1 GiB copy: timed beside the yardstick and reported.
ISSUE_COPY_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}
# Each GPU trial: its function's own untimed calls for SOAK_MS first (time_ms says why), then
# graph replays for GRAPH_TRIAL_MS at least, so that what is left of the state the previous
# trial left is small against the trial.
SOAK_MS = 10.0
GRAPH_TRIAL_MS = 20.0
# Peers much slower than a copy: any RoPE trial right after one of torch.compile's runs 6-7%
# faster (rope-jit's and Liger's alike, a copy not), and still does after a 10 ms soak of its
# own calls (runs BS, BV: bench/liger_graph_probe.py; not the data q and k hold, run BT). Their
# trials therefore take turns only with each other, after those of rope-jit, Liger and the copy,
# which take turns among themselves and follow none of them.
TIMED_APART = ("torch_compile", "torch_eager")
DEVICE = "cuda"


def parse_shapes(text):
    """'B,S,Hq,Hk,D[,R[,style]];...' -> [(B, S, Hq, Hk, D, R, style)] (R = D, style half)."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        fields = [field.strip() for field in item.split(",")]
        if not 5 <= len(fields) <= 7:
            raise argparse.ArgumentTypeError(f"{item!r}: expected B,S,Hq,Hk,D[,R[,style]]")
        try:
            numbers = [int(field) for field in fields[:6]]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: B,S,Hq,Hk,D,R must be integers") from None
        B, S, Hq, Hk, D = numbers[:5]
        R = numbers[5] if len(numbers) > 5 else D
        style = fields[6] if len(fields) > 6 else "half"
        if style not in STYLES:
            raise argparse.ArgumentTypeError(f"{item!r}: style must be one of {STYLES}")
        if min(B, S, Hq, Hk, D, R) < 1 or R > D or R % 2 or Hq % Hk:
            raise argparse.ArgumentTypeError(
                f"{item!r}: sizes must be positive, R even and <= D, Hq a multiple of Hk")
        shapes.append((B, S, Hq, Hk, D, R, style))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def bytes_moved(B, S, Hq, Hk, D, R, element_size=2):
    """The fewest bytes a call touches: q and k read and written once, the cos and sin rows
    ([S, R] each) read once."""
    return 2 * B * S * (Hq + Hk) * D * element_size + 2 * S * R * element_size


def shape_label(B, S, Hq, Hk, D, R, style):
    tail = "" if R == D and style == "half" else f" R{R} {style[:5]}"
    return f"{B},{S},{Hq},{Hk},{D}{tail}"


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def torch_rope(q, k, cos, sin):
    # HF transformers' apply_rotary_pos_emb on [B, S, H, D]: tables broadcast over heads.
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_rope_partial(q, k, cos, sin, rotary_dim, interleaved):
    # GPT-NeoX / GPT-J in HF: rotate the first rotary_dim features, pass the rest through.
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    turn = rotate_every_two if interleaved else rotate_half

    def one(x):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rot * cos + turn(rot) * sin, rest), dim=-1)

    return one(q), one(k)


def formula_for(D, R, style):
    """HF's formula for this shape: (q, k, cos, sin) -> (q_rotated, k_rotated)."""
    if R == D and style == "half":
        return torch_rope

    def formula(q, k, cos, sin):
        return torch_rope_partial(q, k, cos, sin, R, style == "interleaved")

    return formula


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fns, repeat, trials, soak_ms=SOAK_MS, min_trial_ms=0.0, before_trial=None):
    """{name: median over `trials` of (CUDA-event time of back-to-back calls of fns[name]) /
    calls} (wall time on the CPU). Trials take turns between the functions, so that a drift of
    clocks or temperature during the run does not favour whichever ran first. A trial times
    `repeat` calls, or as many as last min_trial_ms. Each trial on the GPU starts with
    before_trial (untimed, when given), then untimed calls of its own function for soak_ms (one
    at least, when above 0), so that a trial starts from its function's own state, not from
    the previous trial's (which a soak does not always reset: TIMED_APART)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    synchronize()
    timed_calls, soak_calls = {}, {}
    for name, fn in fns.items():
        ms = 0.0
        if DEVICE == "cuda" and (soak_ms > 0 or min_trial_ms > 0):
            ms = one_trial_ms(fn, 3) / 3  # the size of a call, to size the trials
        timed_calls[name] = max(repeat, math.ceil(min_trial_ms / ms) if ms > 0 else 0)
        soak_calls[name] = max(1, math.ceil(soak_ms / ms)) if ms > 0 else int(soak_ms > 0)
    times = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            if DEVICE == "cpu":
                start = time.perf_counter()
                for _ in range(repeat):
                    fn()
                times[name].append((time.perf_counter() - start) * 1e3 / repeat)
                continue
            if before_trial is not None:
                before_trial()
            for _ in range(soak_calls[name]):
                fn()
            times[name].append(one_trial_ms(fn, timed_calls[name]) / timed_calls[name])
    return {name: statistics.median(values) for name, values in times.items()}


def one_trial_ms(fn, calls):
    """CUDA-event time of `calls` back-to-back calls of fn."""
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def capture(fn, calls):
    """(a CUDA graph of `calls` calls of fn, None), or (None, why) when fn cannot be captured
    (its call timing stands)."""
    if DEVICE == "cpu":
        return None, "no CUDA graphs on the CPU"
    current = torch.cuda.current_stream()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # noqa: BLE001 (reported, not fatal)
        torch.cuda.synchronize()
        # A failed capture_end skips torch.cuda.graph's stream restore: make ours current again.
        torch.cuda.set_stream(current)
        return None, f"{type(error).__name__}: {error}"[:300]
    return graph, None


def time_graphs_ms(fns, calls, trials, before_trial=None):
    """({name: GPU time of one call, from replays of a CUDA graph of `calls` calls; None when it
    cannot be captured}, {name: why not}); before_trial as in time_ms."""
    graphs, errors = {}, {}
    for name, fn in fns.items():
        graphs[name], why = capture(fn, calls)
        if why:
            errors[name] = why
    replays = {name: graph.replay for name, graph in graphs.items() if graph is not None}
    times = {name: ms / calls for name, ms in time_ms(
        replays, 5, trials, min_trial_ms=GRAPH_TRIAL_MS, before_trial=before_trial).items()}
    return {name: times.get(name) for name in fns}, errors


def copy_gbps(trials, src=None, nbytes=None):
    """Device-to-device copy bandwidth, bytes read plus written (the yardstick): a copy of `src`,
    by default of `nbytes` (BIG_COPY_BYTES) constant bytes."""
    if src is None:
        src = torch.full((nbytes or BIG_COPY_BYTES[DEVICE],), 0x3C, dtype=torch.uint8,
                         device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms({"copy": lambda: dst.copy_(src)}, repeat=5, trials=trials)["copy"]
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def same_size_copy(nbytes, random=True):
    """A device copy of `nbytes / 2` random (else constant) bytes: nbytes read plus written.
    Random, as q and k are (run BT: as fast as a copy of constant bytes, which the 2 GiB
    yardstick copies)."""
    size = (nbytes // 2,)
    src = (torch.randint(0, 256, size, dtype=torch.uint8, device=DEVICE) if random else
           torch.full(size, 0x3C, dtype=torch.uint8, device=DEVICE))
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    return copy


def make_inputs(B, S, Hq, Hk, D, R, style):
    """q, k [B, S, H, D] and HF's full tables [S, R]: pair i at columns (i, i + R/2), or
    (2i, 2i+1) interleaved; all bf16."""
    q = torch.randn(B, S, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(B, S, Hk, D, device=DEVICE, dtype=torch.bfloat16)
    position = torch.arange(S, device=DEVICE, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, device=DEVICE, dtype=torch.float32) / R))
    angles = torch.outer(position, inv_freq)
    if style == "interleaved":
        emb = angles.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def implementations(in_place, q, k, cos, sin, R, style, plain=None):
    """({name: function() -> (q_result, k_result)}, {name: why it is skipped}). plain: a
    Runtime with plain launches, whose calls are timed as rope_jit_plain."""
    D = q.shape[-1]
    formula = formula_for(D, R, style)
    skipped = {}
    if not in_place:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        compiled = torch.compile(formula, dynamic=False)

        def ours():
            return rope_jit.rope(q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd",
                                 rotary_dim=R, style=style)

        runs = {"rope_jit": ours, "torch_compile": lambda: compiled(q, k, cos, sin),
                "torch_eager": lambda: formula(q, k, cos, sin)}
        return runs, skipped

    def rotate_in_place(q, k, cos, sin):
        # Functionalized by torch.compile into the rotation plus copies back into q and k,
        # which inductor lowers into kernels that store into the inputs.
        q_rotated, k_rotated = formula(q, k, cos, sin)
        q.copy_(q_rotated)
        k.copy_(k_rotated)

    compiled = torch.compile(rotate_in_place, dynamic=False)

    def ours():
        return rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", rotary_dim=R, style=style)

    def compiled_in_place():
        compiled(q, k, cos, sin)
        return q, k

    def eager_in_place():
        rotate_in_place(q, k, cos, sin)
        return q, k

    runs = {"rope_jit": ours}
    if plain is not None:
        def ours_plain():
            return rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", rotary_dim=R,
                                 style=style, runtime=plain)

        runs["rope_jit_plain"] = ours_plain
    runs["torch_compile"] = compiled_in_place
    liger = liger_rope()
    if isinstance(liger, str):
        skipped["liger"] = liger
    elif style != "half":
        skipped["liger"] = "Liger rotates half-style pairs only"
    else:
        # HF's call: [B, H, S, D] views of the projections' buffers and [1, S, R] tables (Liger
        # rotates the first R features: the width of its tables).
        q_view, k_view = q.transpose(1, 2), k.transpose(1, 2)
        cos_b, sin_b = cos[None], sin[None]

        def liger_in_place():
            liger(q_view, k_view, cos_b, sin_b)
            return q, k

        runs["liger"] = liger_in_place
    runs["torch_eager"] = eager_in_place
    return runs, skipped


def liger_rope():
    """Liger's HF-facing RoPE function, or a string saying why it cannot run here."""
    if DEVICE != "cuda":
        return "Liger's kernel is Triton: CUDA only"
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as error:  # noqa: BLE001 (ImportError, or a Triton it cannot use)
        return f"liger_kernel does not import: {type(error).__name__}: {error}"[:300]
    return liger_rotary_pos_emb


def liger_version():
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def check(name, fn, in_place, q, k, pristine, want, label):
    """Runs fn once on pristine q and k and compares its result with fp32 math; returns the
    largest absolute error. Raises AssertionError naming the implementation on a mismatch."""
    q.copy_(pristine[0])
    k.copy_(pristine[1])
    got = fn()
    if in_place:
        got = (q, k)  # the buffers themselves, whatever fn returned
    synchronize()
    errors = []
    for tensor, result, expected in (("q", got[0], want[0]), ("k", got[1], want[1])):
        try:
            torch.testing.assert_close(result.float(), expected, **TOLERANCE)
        except AssertionError as error:
            where = "in its own buffer " if in_place else ""
            raise AssertionError(f"{name} at {label}: {tensor} {where}differs from fp32 math: "
                                 f"{error}") from None
        errors.append((result.float() - expected).abs().max().item())
    if not in_place and not (torch.equal(q, pristine[0]) and torch.equal(k, pristine[1])):
        raise AssertionError(f"{name} at {label}: out of place, but q or k changed")
    return max(errors)


def fraction(nbytes, ms, gbps):
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9 / gbps


def ratio(numerator, denominator):
    return None if numerator is None or denominator is None else numerator / denominator


def measure_shape(shape, in_place, copy, issue_copy, options, plain=None):
    """One shape: checks, then times; returns (row, runs) where runs stay alive for the gpu ops
    pass at the end."""
    B, S, Hq, Hk, D, R, style = shape
    label = shape_label(*shape)
    q, k, cos, sin = make_inputs(*shape)
    pristine = (q.clone(), k.clone())
    want = formula_for(D, R, style)(q.float(), k.float(), cos.float(), sin.float())
    runs, skipped = implementations(in_place, q, k, cos, sin, R, style, plain)
    errors = {name: check(name, fn, in_place, q, k, pristine, want, label)
              for name, fn in runs.items()}
    nbytes = bytes_moved(B, S, Hq, Hk, D, R)
    # The copy of the same bytes is timed with the implementations, taking turns with them.
    timed = dict(runs, same_size_copy=same_size_copy(nbytes))

    def restore():  # every trial from the same random q and k (time_ms says why)
        q.copy_(pristine[0])
        k.copy_(pristine[1])

    times, graph_times, graph_errors = {}, {}, {}
    for apart in (False, True):  # TIMED_APART says why
        group = {name: fn for name, fn in timed.items() if (name in TIMED_APART) == apart}
        if not group:
            continue
        times.update(time_ms(group, options.repeat, options.trials, before_trial=restore))
        group_graphs, group_errors = time_graphs_ms(group, options.graph_calls, options.trials,
                                                    before_trial=restore)
        graph_times.update(group_graphs)
        graph_errors.update(group_errors)
    times = {name: times[name] for name in timed}  # the order of the tables
    graph_times = {name: graph_times[name] for name in timed}
    if DEVICE == "cuda":
        for name, why in graph_errors.items():
            print(f"  ({name}: no CUDA graph: {why})")
    same_calls, same_graph = times.pop("same_size_copy"), graph_times.pop("same_size_copy")
    same = same_graph if same_graph is not None else same_calls  # the limit, graph when we can
    peers = [name for name in runs if name not in OURS]
    row = {
        "in_place": in_place, "B": B, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "rotary_dim": R,
        "style": style, "dtype": "bfloat16", "layout": "bshd", "bytes": nbytes,
        "max_error_vs_fp32": errors, "skipped": skipped,
        "time_ms": times, "graph_time_ms": graph_times,
        "fraction_of_copy": {name: fraction(nbytes, ms, copy) for name, ms in times.items()},
        "graph_fraction_of_copy": {name: fraction(nbytes, ms, copy)
                                   for name, ms in graph_times.items()},
        "graph_fraction_of_issue_copy": {name: fraction(nbytes, ms, issue_copy)
                                         for name, ms in graph_times.items()},
        "same_size_copy_ms": same_calls, "same_size_copy_graph_ms": same_graph,
        "same_size_copy_fraction_of_copy": fraction(nbytes, same, copy),
        "fraction_of_same_size_copy": {name: ratio(same, graph_times[name] or times[name])
                                       for name in runs},
        "speedup_vs": {name: ratio(times[name], times["rope_jit"]) for name in peers},
        "graph_speedup_vs": {name: ratio(graph_times[name], graph_times["rope_jit"])
                             for name in peers},
    }
    if graph_errors and DEVICE == "cuda":
        row["graph_errors"] = graph_errors
    return row, runs


def us(ms):
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def number(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def speedup(value):
    return "-" if value is None else f"x{value:.3f}"


def print_shape(row):
    label = shape_label(row["B"], row["S"], row["Hq"], row["Hk"], row["D"], row["rotary_dim"],
                        row["style"])
    print(f"{label}: {row['bytes'] / 1e6:.1f} MB; a copy of the same bytes "
          f"{us(row['same_size_copy_graph_ms'] or row['same_size_copy_ms'])} us = "
          f"{number(row['same_size_copy_fraction_of_copy'])} of copy")
    print(f"  {'':<21} {'graph us':>9} {'of copy':>8} {'of 1GiB':>8} {'of same':>8} "
          f"{'calls us':>9} {'of copy':>8} {'max err':>8}   rope-jit faster by (graph / calls)")
    for name, ms in row["time_ms"].items():
        versus = "" if name in OURS else (
            f"   {speedup(row['graph_speedup_vs'][name])} / {speedup(row['speedup_vs'][name])}")
        print(f"  {name:<21} {us(row['graph_time_ms'][name]):>9} "
              f"{number(row['graph_fraction_of_copy'][name]):>8} "
              f"{number(row['graph_fraction_of_issue_copy'][name]):>8} "
              f"{number(row['fraction_of_same_size_copy'][name]):>8} {us(ms):>9} "
              f"{number(row['fraction_of_copy'][name]):>8} "
              f"{number(row['max_error_vs_fp32'][name], 4):>8}{versus}")
    for name, why in row["skipped"].items():
        print(f"  {name:<21} skipped: {why}")


def summary(rows):
    """A markdown table as issue 24 quotes it: GPU time (graph replay, else calls) and its
    fraction of copy per implementation, the same-size copy, and whether rope-jit is fastest."""
    names = [name for name in LABELS if any(name in row["time_ms"] for row in rows)]
    lines = ["| B,S,Hq,Hk,D | " + " | ".join(LABELS[name] for name in names)
             + " | copy of the same bytes | rope-jit fastest |",
             "|---" * (len(names) + 3) + "|"]
    for row in rows:
        cells, best_peer = [], None
        for name in names:
            ms = row["graph_time_ms"].get(name) or row["time_ms"].get(name)
            if ms is None:
                cells.append("-")
                continue
            fractions = row["graph_fraction_of_copy"] if row["graph_time_ms"].get(name) else \
                row["fraction_of_copy"]
            cells.append(f"{us(ms)} us ({number(fractions[name], 2)})")
            if name not in OURS:
                best_peer = ms if best_peer is None else min(best_peer, ms)
        ours = row["graph_time_ms"].get("rope_jit") or row["time_ms"]["rope_jit"]
        same = row["same_size_copy_graph_ms"] or row["same_size_copy_ms"]
        fastest = "-" if best_peer is None else \
            f"{'yes' if ours < best_peer else 'no'} (x{best_peer / ours:.3f})"
        label = shape_label(row["B"], row["S"], row["Hq"], row["Hk"], row["D"],
                            row["rotary_dim"], row["style"])
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | {us(same)} us ({number(row['same_size_copy_fraction_of_copy'], 2)}) | "
                     f"{fastest} |")
    return "\n".join(lines)


def gpu_ops(fn):
    """Names of the GPU operations (kernels, copies, memsets) one call of fn launches, from
    torch.profiler; None when the profiler cannot tell (or on the CPU)."""
    if DEVICE != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [event.name[:120] for event in prof.events()
                if event.device_type == torch.autograd.DeviceType.CUDA]
    except Exception as error:  # noqa: BLE001 (a diagnostic: the timings stand without it)
        print(f"  (no profile: {type(error).__name__}: {error})")
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for what is "
        "measured and how.", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--in-place", action="store_true",
                        help="rotate q and k in place, with Liger (issue 24's comparison)")
    parser.add_argument("--shapes", type=parse_shapes,
                        help="B,S,Hq,Hk,D[,R[,style]];... (default: the mode's shapes)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: the mode's first shape, fewer calls and trials")
    parser.add_argument("--repeat", type=int, default=20, help="back-to-back calls per timing")
    parser.add_argument("--trials", type=int, default=11, help="timings per median")
    parser.add_argument("--graph-calls", type=int, default=10, help="calls per CUDA graph")
    parser.add_argument("--plain", action="store_true",
                        help="in place: also time rope-jit's calls as plain launches "
                        "(rope_jit_plain: a Runtime with programmatic_launch=False)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of this script on the CPU backend (shapes cut "
                        "to B=1, S<=128 unless --shapes; no graphs, no Liger)")
    options = parser.parse_args(argv)
    if min(options.repeat, options.trials, options.graph_calls) < 1:
        parser.error("--repeat, --trials and --graph-calls must be at least 1")
    if options.quick:
        options.repeat, options.trials = min(options.repeat, 10), min(options.trials, 3)
        options.graph_calls = min(options.graph_calls, 5)
    return options


def selected_shapes(options):
    shapes = options.shapes or (IN_PLACE_SHAPES if options.in_place else OUT_OF_PLACE_SHAPES)
    if options.quick and not options.shapes:
        shapes = shapes[:1]
    if options.device == "cpu" and not options.shapes:
        # The CPU reference and eager on 2 cores: the same heads, far fewer tokens.
        shapes = [(1, min(S, 128), Hq, Hk, D, R, style) for _, S, Hq, Hk, D, R, style in shapes]
    return shapes


def main(argv=None):
    options = parse_args(argv)
    global DEVICE
    DEVICE = options.device
    shapes = selected_shapes(options)
    # Dynamo keys its cache on the code object, shared by every shape of a run: past its
    # recompile limit (8) a shape would silently run eager under torch.compile's name.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, 2 * len(shapes)))

    torch.manual_seed(0)
    copy = copy_gbps(options.trials)
    issue_copy = copy_gbps(options.trials, nbytes=ISSUE_COPY_BYTES[DEVICE])
    plain = None
    if options.plain and options.in_place:
        plain = rope_jit.Runtime(programmatic_launch=False)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    mode = "in place" if options.in_place else "out of place"
    print(f"{device_name}, torch {torch.__version__}, liger_kernel {liger_version()}: "
          f"device copy {copy:.0f} GB/s ({BIG_COPY_BYTES[DEVICE] >> 20} MiB; "
          f"{ISSUE_COPY_BYTES[DEVICE] >> 20} MiB: {issue_copy:.0f} GB/s); "
          f"RoPE forward {mode}, bf16, [B,S,H,D]")
    rows, all_runs = [], []
    for shape in shapes:
        row, runs = measure_shape(shape, options.in_place, copy, issue_copy, options, plain)
        rows.append(row)
        all_runs.append(runs)
        print_shape(row)
    print("\nGPU time (CUDA graph replay; calls on the CPU) and fraction of copy:")
    print(summary(rows))

    # Last, since the profiler leaves its hooks in the process: what each call launches.
    if DEVICE == "cuda":
        print("\nGPU operations per call:")
    for row, runs in zip(rows, all_runs):
        ops = {name: gpu_ops(fn) for name, fn in runs.items()}
        row["gpu_ops"] = ops
        row["gpu_ops_per_call"] = {name: None if names is None else len(names)
                                   for name, names in ops.items()}
        if DEVICE == "cuda":
            label = shape_label(row["B"], row["S"], row["Hq"], row["Hk"], row["D"],
                                row["rotary_dim"], row["style"])
            counts = ", ".join(f"{name} {'-' if n is None else n}"
                               for name, n in row["gpu_ops_per_call"].items())
            print(f"  {label}: {counts}")

    result = {"device": device_name, "torch": torch.__version__, "copy_gbps": copy,
              "issue_copy_gbps": issue_copy, "issue_copy_bytes": ISSUE_COPY_BYTES[DEVICE],
              "library": rope_jit.library_version(), "liger_kernel": liger_version(),
              "in_place": options.in_place, "options": vars(options), "tolerance": TOLERANCE,
              "shapes": rows}
    if options.json:
        with open(options.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
