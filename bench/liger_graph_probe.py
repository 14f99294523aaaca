"""In-place RoPE, rope-jit against Liger's Triton kernel in CUDA graphs: where bench/compare_torch.py
(Liger ahead by 3-8%) and timing each graph on its own (rope-jit ahead, session 14's run BO)
disagree, this times the same graphs of bench/compare_torch.py (its inputs, implementations,
capture and timing functions, imported) several ways in one process, and lists each kernel's
duration and the gaps between kernels from the profiler:

  round robin   compare_torch's timing: trials taking turns between every implementation and
                the copy of the same bytes
  alone         one graph's trials back to back
  pair          rope-jit's and Liger's graphs taking turns, both orders
  own pred.     round robin, each trial after one untimed replay of its own graph
                (compare_torch in run BS)
  soaked        each trial after 10 ms of its own untimed replays, 20 ms of replays timed
                (compare_torch since run BT)
  after P       trials of each graph right after a trial of P's: what the predecessor does
  graph N       graphs of N calls (10 is compare_torch's default)
  kernels       torch.profiler over three replays of each graph on its own: the median kernel
                duration and the median gap from one kernel's end to the next one's start

    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/liger_graph_probe.py

With --data it asks instead whether the data moved sets the speed: the 2 GiB yardstick copy of
constant, random and zero bytes, and each graph on fresh random inputs, zeros, and what 3000 of
its own calls left.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402  (the harness whose numbers this probes)

SHAPES = [(8, 2048, 16, 16, 64, 64, "half"), (4, 4096, 32, 8, 128, 128, "half")]
TRIALS = 11
ONE_CALL = 1e-6  # a soak of one call (time_ms runs one at least)


def per_call_us(graphs, calls, soak_ms=0.0, before_trial=None, min_trial_ms=0.0):
    """compare_torch's time_ms over graph replays (5 a trial or min_trial_ms, trials taking
    turns): us a call. soak_ms 0: each trial follows the previous function's trial (the order
    of compare_torch before run BS); ONE_CALL: after one untimed replay of its own (run BS);
    compare_torch's SOAK_MS since run BT."""
    replays = {name: graph.replay for name, graph in graphs.items()}
    return {name: ms * 1e3 / calls for name, ms in ct.time_ms(
        replays, 5, TRIALS, soak_ms, min_trial_ms, before_trial).items()}


def kernel_timeline(graph):
    """(median kernel us, median gap us between consecutive kernels) over three replays."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    spans = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                   if event.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return None, None
    durations = [end - start for start, end in spans]
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return statistics.median(durations), statistics.median(gaps) if gaps else None


def print_table(shape, nbytes, results):
    print(f"{ct.shape_label(*shape)}: {nbytes / 1e6:.1f} MB (us a call)")
    names = ("rope_jit", "liger", "same_size_copy", "torch_compile")
    print(f"  {'':34s}" + "".join(f"{name:>16s}" for name in names))
    for name in names:  # what one more call adds: (20 calls' time - 10 calls' time) / 10
        times = results.get(name, {})
        if "round robin, graph 10" in times and "round robin, graph 20" in times:
            times["round robin, slope 10 -> 20"] = (20 * times["round robin, graph 20"] -
                                                    10 * times["round robin, graph 10"]) / 10
    modes = list(dict.fromkeys(mode for name in names for mode in results.get(name, {})))
    for mode in modes:
        cells = [results.get(name, {}).get(mode) for name in names]
        print(f"  {mode:34s}" + "".join(
            f"{'-' if value is None else f'{value:.2f}':>16s}" for value in cells))
    sys.stdout.flush()


def data_effects(shape):
    """Whether the graphs' speed depends on the values in q and k: each graph timed alone on the
    random inputs restored before every trial, on zeros, and on what 3000 of its own calls left
    (in-place rotations by bf16 tables need not keep magnitudes); a copy of random bytes
    (compare_torch's since run BT) against one of constant bytes (its copy before)."""
    B, S, Hq, Hk, D, R, style = shape
    q, k, cos, sin = ct.make_inputs(*shape)
    q0, k0 = q.clone(), k.clone()
    runs, _ = ct.implementations(True, q, k, cos, sin, R, style)
    nbytes = ct.bytes_moved(B, S, Hq, Hk, D, R)
    runs["copy_random"] = ct.same_size_copy(nbytes)  # compare_torch's limit since run BT
    runs["copy_constant"] = ct.same_size_copy(nbytes, random=False)  # its limit before
    graphs = {name: ct.capture(runs[name], 10)[0]
              for name in ("rope_jit", "liger", "torch_compile", "copy_constant", "copy_random")}

    def restore():
        q.copy_(q0)
        k.copy_(k0)

    def stats():
        x = q.float()
        finite = torch.isfinite(x)
        return (f"mean |q| {x[finite].abs().mean().item():.3g}, zeros "
                f"{(x == 0).float().mean().item():.3f}, non-finite {(~finite).sum().item()}")

    print(f"{ct.shape_label(*shape)}: data effects (us a call, graph of 10, each alone)")
    for name, graph in graphs.items():
        timed = {name: graph}
        fresh = per_call_us(timed, 10, ONE_CALL, before_trial=restore)[name]
        q.zero_()
        k.zero_()
        zeros = per_call_us(timed, 10, ONE_CALL)[name]
        restore()
        for _ in range(300):
            graph.replay()
        evolved = per_call_us(timed, 10, ONE_CALL)[name]
        print(f"  {name:14s} fresh random {fresh:7.2f}  zeros {zeros:7.2f}  after 3000 own calls "
              f"{evolved:7.2f} ({stats()})")
        sys.stdout.flush()
        restore()


def yardstick_data():
    """The yardstick (compare_torch's and rope-jit-bench's 2 GiB copy of constant bytes) against
    the same copy of random bytes and of zeros: GB/s, read plus written, each timed alone."""
    nbytes = ct.BIG_COPY_BYTES["cuda"]
    sources = {"constant 0x3c": torch.full((nbytes,), 0x3C, dtype=torch.uint8, device="cuda"),
               "random": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"),
               "zeros": torch.zeros(nbytes, dtype=torch.uint8, device="cuda")}
    print("2 GiB device copy, GB/s (read + written), each alone:")
    for name, src in sources.items():
        print(f"  {name:14s} {ct.copy_gbps(TRIALS, src):8.1f}")
    sys.stdout.flush()


def main():
    ct.DEVICE = "cuda"
    torch.manual_seed(0)
    if "--data" in sys.argv:
        yardstick_data()
        for shape in SHAPES:
            data_effects(shape)
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, liger_kernel "
          f"{ct.liger_version()}")
    profiled = []
    for shape in SHAPES:
        B, S, Hq, Hk, D, R, style = shape
        inputs = ct.make_inputs(*shape)
        runs, skipped = ct.implementations(True, *inputs, R, style)
        if "liger" not in runs:
            print(f"{ct.shape_label(*shape)}: Liger skipped: {skipped}")
            continue
        nbytes = ct.bytes_moved(B, S, Hq, Hk, D, R)
        runs["same_size_copy"] = ct.same_size_copy(nbytes)
        results = {}
        for calls in (10, 20):
            graphs = {}
            for name, fn in runs.items():
                graph, why = ct.capture(fn, calls)
                if graph is None:
                    print(f"  {name}: no graph: {why}")
                else:
                    graphs[name] = graph
            ours_liger = {name: graphs[name] for name in ("rope_jit", "liger")}
            for name, us in per_call_us(graphs, calls).items():
                results.setdefault(name, {})[f"round robin, graph {calls}"] = us
            for name in ("rope_jit", "liger", "same_size_copy"):
                us = per_call_us({name: graphs[name]}, calls)[name]
                results[name][f"alone, graph {calls}"] = us
            for order in (("rope_jit", "liger"), ("liger", "rope_jit")):
                pair = {name: ours_liger[name] for name in order}
                for name, us in per_call_us(pair, calls).items():
                    results[name][f"pair {order[0]} first, graph {calls}"] = us
            for name, us in per_call_us(graphs, calls, ONE_CALL).items():
                results[name][f"round robin, own predecessor, {calls}"] = us
            for name, us in per_call_us(graphs, calls, ct.SOAK_MS,
                                        min_trial_ms=ct.GRAPH_TRIAL_MS).items():
                results[name][f"round robin, soaked (compare_torch), {calls}"] = us
            if calls == 10:
                # Each trial of X right after a trial of P, P's graph first in every turn.
                for before in ("torch_compile", "same_size_copy", "rope_jit", "liger"):
                    for name in ("rope_jit", "liger", "same_size_copy"):
                        if name != before:
                            pair = {before: graphs[before], name: graphs[name]}
                            results[name][f"after {before}, graph 10"] = per_call_us(
                                pair, calls)[name]
                            results[name][f"after {before}, soaked"] = per_call_us(
                                pair, calls, ct.SOAK_MS, min_trial_ms=ct.GRAPH_TRIAL_MS)[name]
                # The graphs replay the tensors they captured: keep them (and the runs' own
                # buffers) alive until the profiler has replayed the graphs.
                profiled.append((shape, inputs, runs, graphs))
        print_table(shape, nbytes, results)
    # Last, since the profiler stays attached to the process once used.
    for shape, _inputs, _runs, graphs in profiled:
        print(f"{ct.shape_label(*shape)}, graph 10: median kernel us, median gap us")
        for name in ("rope_jit", "liger", "same_size_copy"):
            try:
                kernel, gap = kernel_timeline(graphs[name])
                print(f"  {name:16s} " + ("no kernel events" if kernel is None else
                                          f"{kernel:8.2f}  {gap or 0:6.3f}"))
            except RuntimeError as error:  # a profiler fault must not hide the tables above
                print(f"  {name:16s} profiler failed: {error}")
                return
        sys.stdout.flush()


if __name__ == "__main__":
    main()
