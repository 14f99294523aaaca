"""RoPE with autograd from PyTorch: rope-jit (apply_rope, and the HF drop-in) against PyTorch eager,
torch.compile and Liger, forward, backward and forward+backward, back to back and in CUDA graphs,
in one process on the same tensors (issue 21, point 5).

    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/compare_torch_autograd.py \
        --json bench/results/h200_autograd.json

Shapes (B, S, Hq, Hk, D), bf16, q and k stored [B, S, H, D] as a model's projections leave them,
HF full cos/sin tables, half style: DESIGN.md's four training shapes, and decode (B=64, S=1,
32/8 heads, D128) with per-sequence positions: rope-jit takes the [P, D] table and
seqlen_offsets [B]; the others take cos/sin gathered beforehand ([B, 1, D], not timed), as
HF models pass them. Implementations:
  rope_jit      rope_jit.apply_rope(q, k, cos, sin, layout="bshd") (decode: seqlen_offsets)
  rope_jit_hf   rope_jit.dropin.hf.apply_rotary_pos_emb on the [B, H, S, D] views
  eager         HF transformers' apply_rotary_pos_emb formula on the [B, H, S, D] views
  compile       torch.compile(eager formula, dynamic=False)
  liger         liger_kernel.transformers.rope.liger_rotary_pos_emb (when installed; in place)
  mul_floor     q * 1 and k * 1: no rotation, the same bytes; PyTorch's own host floor
Modes: fwd (outputs only), bwd (torch.autograd.grad of a recorded forward, retain_graph),
fwd_bwd (both). Times, in microseconds per call:
  back_to_back  many calls, one synchronize at the end (CUDA events): host cost shows
                whenever it exceeds the GPU time, as in a training loop;
  graph         replays of a CUDA graph of `--graph-calls` calls: GPU time alone.
Every implementation's outputs and gradients are checked against fp32 math first.
"""

import argparse
import json
import statistics
import time

import torch

import rope_jit
from rope_jit.dropin.hf import apply_rotary_pos_emb as rope_jit_hf

SHAPES = [
    (4, 4096, 32, 8, 128),
    (1, 32768, 32, 8, 128),
    (8, 2048, 16, 16, 64),
    (2, 4096, 16, 8, 256),
    (64, 1, 32, 8, 128),
]  # the last: decode
TABLE_ROWS = 4096  # decode's table: sequences at random positions below this
DEVICE = "cuda"


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_rope(q, k, cos, sin):
    # transformers' apply_rotary_pos_emb, unsqueeze_dim=1: q, k [B, H, S, D], cos/sin [B|1, S, D].
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def time_us(function, repeat, trials):
    """Median over `trials` of (CUDA-event time of `repeat` back-to-back calls) / repeat
    (wall time with --device cpu, a smoke run of this script)."""
    for _ in range(3):
        function()
    if DEVICE == "cpu":
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(repeat):
                function()
            times.append((time.perf_counter() - start) * 1e6 / repeat)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            function()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / repeat)
    return statistics.median(times)


def error_chain(error):
    """`error` and the exceptions it replaced: a failed capture raises at capture_end
    ("operation failed due to a previous error during capture"), which hides the error that
    invalidated it."""
    texts = []
    while error is not None and len(texts) < 4:
        texts.append(f"{type(error).__name__}: {error}"[:300])
        error = error.__cause__ or error.__context__
    return " <- ".join(texts)


def graph_us(function, calls, trials):
    """GPU time of one call: replays of a CUDA graph of `calls` calls; (None, reason) when the
    function cannot be captured.

    Warm-up and capture run on the bench's stream (a side stream, current since main() began):
    autograd runs each backward node on the stream its forward ran on, so tensors and graphs
    recorded outside the capture must come from the capture stream. Recorded on the legacy
    default stream, the first backward captured here touched that stream and invalidated the
    capture (cudaErrorStreamCaptureImplicit, reported as cudaErrorStreamCaptureInvalidated),
    and the failed capture_end left its own stream current for the rest of the run."""
    if DEVICE == "cpu":
        return None, "no CUDA graphs on the CPU"
    stream = torch.cuda.current_stream()
    try:
        for _ in range(3):
            function()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                function()
    except Exception as error:  # noqa: BLE001 (reported in the JSON; the other numbers stand)
        torch.cuda.synchronize()
        # A failed capture_end skips torch.cuda.graph's stream restore: make ours current again.
        torch.cuda.set_stream(stream)
        return None, error_chain(error)
    return time_us(graph.replay, 5, trials) / calls, None


def implementations(q, k, cos_table, sin_table, cos_b, sin_b, offsets):
    """name -> function(q, k) -> (q_out, k_out), for q, k stored [B, S, H, D]."""
    compiled = torch.compile(eager_rope, dynamic=False)
    if offsets is None:

        def ours(q, k):
            return rope_jit.apply_rope(q, k, cos_table, sin_table, layout="bshd")

    else:

        def ours(q, k):
            return rope_jit.apply_rope(
                q, k, cos_table, sin_table, seqlen_offsets=offsets, layout="bshd"
            )

    # (function, whether its outputs are [B, H, S, D] views rather than [B, S, H, D])
    result = {
        "rope_jit": (ours, False),
        "rope_jit_hf": (
            lambda q, k: rope_jit_hf(q.transpose(1, 2), k.transpose(1, 2), cos_b, sin_b),
            True,
        ),
        "eager": (
            lambda q, k: eager_rope(q.transpose(1, 2), k.transpose(1, 2), cos_b, sin_b),
            True,
        ),
        "compile": (
            lambda q, k: compiled(q.transpose(1, 2), k.transpose(1, 2), cos_b, sin_b),
            True,
        ),
    }
    # Not RoPE: q * 1 and k * 1, the same bytes read and written by plain elementwise kernels.
    # Its back to back time over its graph time is PyTorch's own host cost of a forward and an
    # autograd backward at this shape, the floor under every implementation above.
    result["mul_floor"] = (lambda q, k: (q * 1.0, k * 1.0), False)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as error:
        print(f"  (Liger not available: {error})")
    else:
        result["liger"] = (
            lambda q, k: liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos_b, sin_b),
            True,
        )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeat", type=int, default=50, help="back-to-back calls per timing")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--graph-calls", type=int, default=10)
    parser.add_argument(
        "--shapes", help="B,S,Hq,Hk,D;... (default: the four training shapes and decode)"
    )
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of this script (no graphs, no Liger)"
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="torch.cuda.set_sync_debug_mode('warn'): a warning, with its stack, for every call "
        "through PyTorch that synchronizes with the GPU (to find one that serializes back to "
        "back timings)",
    )
    options = parser.parse_args()
    if options.sync_debug and options.device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    global DEVICE
    DEVICE = options.device
    shapes = (
        SHAPES
        if not options.shapes
        else [tuple(int(v) for v in s.split(",")) for s in options.shapes.split(";")]
    )

    torch.manual_seed(0)
    device, dtype = DEVICE, torch.bfloat16
    if device == "cuda":
        # Everything runs on one side stream, the one graphs are captured on (see graph_us).
        torch.cuda.set_stream(torch.cuda.Stream())
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = []
    print(f"{device_name}, torch {torch.__version__}; us per call: back to back / graph")
    for B, S, Hq, Hk, D in shapes:
        decode = S == 1
        q_leaf = torch.randn(B, S, Hq, D, device=device, dtype=dtype).requires_grad_(True)
        k_leaf = torch.randn(B, S, Hk, D, device=device, dtype=dtype).requires_grad_(True)
        rows_in_table = TABLE_ROWS if decode else S
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
        angles = torch.outer(
            torch.arange(rows_in_table, device=device, dtype=torch.float32), inv_freq
        )
        emb = torch.cat((angles, angles), dim=-1)
        cos_table, sin_table = emb.cos().to(dtype), emb.sin().to(dtype)
        if decode:
            offsets = torch.randint(0, rows_in_table, (B,), device=device, dtype=torch.int64)
            cos_b, sin_b = (
                cos_table[offsets][:, None, :],
                sin_table[offsets][:, None, :],
            )  # [B, 1, D]
        else:
            offsets = None
            cos_b, sin_b = cos_table[None], sin_table[None]  # [1, S, D]
        grad_q, grad_k = torch.randn_like(q_leaf), torch.randn_like(k_leaf)

        # fp32 math for checks: [B, S, H, D] outputs and gradients.
        q32, k32 = q_leaf.detach().float().requires_grad_(
            True
        ), k_leaf.detach().float().requires_grad_(True)
        want = eager_rope(q32.transpose(1, 2), k32.transpose(1, 2), cos_b.float(), sin_b.float())
        want_grads = torch.autograd.grad(
            want, (q32, k32), (grad_q.float().transpose(1, 2), grad_k.float().transpose(1, 2))
        )
        want = [w.transpose(1, 2) for w in want]

        row = {
            "B": B,
            "S": S,
            "Hq": Hq,
            "Hk": Hk,
            "D": D,
            "decode": decode,
            "dtype": "bfloat16",
            "results": {},
        }
        print(f"{B},{S},{Hq},{Hk},{D}{' (decode)' if decode else ''}")
        for name, (impl, bhsd) in implementations(
            q_leaf, k_leaf, cos_table, sin_table, cos_b, sin_b, offsets
        ).items():
            entry = row["results"][name] = {}

            def fresh():
                # Non-leaf q and k, as a model's projections give them (Liger rotates its input
                # in place, which autograd allows on non-leaves), each implementation its own.
                base_q = q_leaf.detach().clone().requires_grad_(True)
                base_k = k_leaf.detach().clone().requires_grad_(True)
                return base_q * 1, base_k * 1

            def to_bshd(tensor):
                return tensor.transpose(1, 2) if bhsd else tensor

            out_grads = (to_bshd(grad_q), to_bshd(grad_k))  # shaped like the outputs
            try:
                q_in, k_in = fresh()
                outs = impl(q_in, k_in)
                got_grads = torch.autograd.grad(outs, (q_in, k_in), out_grads)
                errors = [(to_bshd(g).float() - w).abs().max().item() for g, w in zip(outs, want)]
                errors += [
                    (g.float() - w).abs().max().item() for g, w in zip(got_grads, want_grads)
                ]
                # (the floor is no rotation: its error is not a result)
                entry["max_error_vs_fp32"] = float("nan") if name == "mul_floor" else max(errors)
            except Exception as error:  # noqa: BLE001
                entry["error"] = error_chain(error)
                print(f"  {name:<12} failed: {entry['error']}")
                continue

            q, k = fresh()
            recorded = impl(q, k)

            def forward():
                with torch.no_grad():
                    impl(q, k)

            def backward():
                torch.autograd.grad(recorded, (q, k), out_grads, retain_graph=True)

            def forward_backward():
                outs = impl(q, k)
                torch.autograd.grad(outs, (q, k), out_grads)

            for mode, function in (
                ("fwd", forward),
                ("bwd", backward),
                ("fwd_bwd", forward_backward),
            ):
                back_to_back = time_us(function, options.repeat, options.trials)
                in_graph, why = graph_us(function, options.graph_calls, options.trials)
                entry[mode] = {"back_to_back_us": back_to_back, "graph_us": in_graph}
                if why:
                    entry[mode]["graph_error"] = why
            fb = entry["fwd_bwd"]
            if fb["graph_us"]:
                fb["back_to_back_over_graph"] = fb["back_to_back_us"] / fb["graph_us"]
            text = "  ".join(
                f"{mode} {entry[mode]['back_to_back_us']:8.1f} / "
                f"{entry[mode]['graph_us'] or float('nan'):7.1f}"
                for mode in ("fwd", "bwd", "fwd_bwd")
            )
            print(f"  {name:<12} {text}   max err {entry['max_error_vs_fp32']:.3g}")
            for mode in ("fwd", "bwd", "fwd_bwd"):
                if DEVICE != "cpu" and entry[mode].get("graph_error"):  # why a graph time is nan
                    print(f"    {mode} graph: {entry[mode]['graph_error'][:160]}")
        rows.append(row)

    result = {
        "device": device_name,
        "torch": torch.__version__,
        "library": rope_jit.library_version(),
        "options": vars(options),
        "shapes": rows,
    }
    try:
        import liger_kernel

        result["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
    except ImportError:
        result["liger_kernel"] = None
    if options.json:
        with open(options.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
