"""Issue 24's "Done when" points, each with its number, from one run's JSON of the peers'
comparison (`bench/compare_torch.py --in-place`) and of rope-jit-bench (its issue 24 cases):

  - the four in-place shapes: rope-jit faster than torch.compile and Liger (CUDA-graph GPU
    time); >= 0.95 of copy at the two Llama shapes (head_dim 128), >= 0.93 at D64 and D256,
    with what a copy of the same bytes reaches beside each;
  - rope-jit-bench: D64, D80, D96, interleaved pairs and [B,H,S,D] buffers >= 0.92; D64
    [B,H,S,D] interleaved and every out-of-place partial rotary case >= 0.88.

Fractions are of the 2 GiB copy both tools time in their own process (the peers' JSON also
has the 1 GiB copy the issue names: shown beside). The issue asks for one H200 run: the device
each JSON names is printed, and a point on another GPU is not a pass.

Usage: python3 bench/issue24_check.py PEERS_JSON BENCH_JSON; exit status 0 when every point
holds on an H200, 1 otherwise."""

import json
import sys

# rope-jit-bench's case for each of the issue's named cases, and the bar.
BENCH_POINTS = [
    ("D64", "D64 MHA", 0.92),
    ("D80", "D80 MHA", 0.92),
    ("D96", "D96 MHA", 0.92),
    ("interleaved pairs", "llama3-8b interleaved", 0.92),
    ("[B,H,S,D] buffers", "llama3-8b prefill bhsd", 0.92),
    ("D64 [B,H,S,D] interleaved", "D64 bhsd interleaved", 0.88),
]
PARTIAL_OUT_OF_PLACE_BAR = 0.88
PEERS = ("torch_compile", "liger")


def peer_points(peers):
    """[(label, value, bar or None, holds)] for the in-place comparison."""
    points = []
    for row in peers["shapes"]:
        label = f"{row['B']},{row['S']},{row['Hq']},{row['Hk']},{row['D']}"
        graph = row["graph_time_ms"]
        ours = graph.get("rope_jit")
        for peer in PEERS:
            theirs = graph.get(peer)
            speedup = None if ours is None or theirs is None else theirs / ours
            points.append((f"{label}: faster than {peer} (its time over ours)", speedup, 1.0,
                           speedup is not None and speedup > 1.0))
        bar = 0.95 if row["D"] == 128 else 0.93
        fraction = row["graph_fraction_of_copy"].get("rope_jit")
        issue = row.get("graph_fraction_of_issue_copy", {}).get("rope_jit")
        note = (f"of 1 GiB {issue:.3f}; " if issue is not None else "") + \
            f"same-size copy {row['same_size_copy_fraction_of_copy']:.3f}"
        points.append((f"{label}: of copy ({note})", fraction, bar,
                       fraction is not None and fraction >= bar))
    return points


def bench_points(bench):
    """[(label, value, bar, holds)] for rope-jit-bench's cases; a case missing is a miss."""
    cases = {case["name"]: case for case in bench["cases"]}
    points = []
    for label, name, bar in BENCH_POINTS:
        fraction = cases[name]["fraction_of_copy"] if name in cases else None
        points.append((f"{label} ({name})", fraction, bar,
                       fraction is not None and fraction >= bar))
    partial = [case for case in bench["cases"]
               if not case["in_place"] and case["rotary_dim"] < case["D"]]
    for case in partial:
        fraction = case["fraction_of_copy"]
        points.append((f"partial out of place: {case['name']}", fraction,
                       PARTIAL_OUT_OF_PLACE_BAR, fraction >= PARTIAL_OUT_OF_PLACE_BAR))
    if not partial:
        points.append(("partial out of place: no case in the run", None,
                       PARTIAL_OUT_OF_PLACE_BAR, False))
    return points


def check(peers, bench):
    """(lines to print, whether every point holds on an H200)."""
    devices = {peers["device"], bench["device"]}
    on_h200 = all("H200" in device for device in devices)
    lines = [f"devices: {', '.join(sorted(devices))}" + ("" if on_h200 else
                                                          " (not an H200: no point passes)")]
    points = peer_points(peers) + bench_points(bench)
    for label, value, bar, holds in points:
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"{'held' if holds else 'MISSED':<7} {shown:>6} (bar {bar:.2f})  {label}")
    held = sum(1 for point in points if point[3])
    everything = on_h200 and held == len(points)
    lines.append(f"{held} of {len(points)} points held" +
                 ("" if on_h200 else "; not on an H200") +
                 (": issue 24 done" if everything else ""))
    return lines, everything


def main(argv):
    if len(argv) != 3:
        print("usage: python3 bench/issue24_check.py PEERS_JSON BENCH_JSON", file=sys.stderr)
        return 2
    with open(argv[1]) as file:
        peers = json.load(file)
    with open(argv[2]) as file:
        bench = json.load(file)
    lines, everything = check(peers, bench)
    print("\n".join(lines))
    return 0 if everything else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
