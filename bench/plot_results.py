"""Draws the fraction of device copy bandwidth per shape for rope-jit and its peers (torch.compile,
Liger, eager: whichever the run has) from bench/compare_torch.py's JSON, out of place or in place
(needs matplotlib; run where it is installed).

    python3 bench/plot_results.py bench/results/h200_vs_torch.json bench/results/h200_vs_torch.png

Two panels when the JSON has graph times: back-to-back calls, then GPU time from CUDA-graph
replay with, per shape, the fraction a device copy of the same bytes reaches (the limit at that
kernel length; newer JSON only).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Keys of the JSON, the legend's names, in the order bars are drawn.
NAMES = [("rope_jit", "rope-jit"), ("rope_jit_plain", "rope-jit (plain launches)"),
         ("torch_compile", "torch.compile"), ("liger", "Liger"), ("torch_eager", "PyTorch eager")]


def label_of(s):
    label = f"{s['B']}x{s['S']}\n{s['Hq']}/{s['Hk']} D{s['D']}"
    if s.get("rotary_dim", s["D"]) != s["D"] or s.get("style", "half") != "half":
        label += f"\nR{s['rotary_dim']} {s['style'][:5]}"
    return label


def draw(ax, shapes, key_of_fraction, title, with_limit):
    names = [(key, label) for key, label in NAMES if any(key in s[key_of_fraction] for s in shapes)]
    width = 0.8 / len(names)
    for i, (key, label) in enumerate(names):
        # A skipped implementation (Liger without its package) or a failed capture: no bar.
        values = [s[key_of_fraction].get(key) or 0.0 for s in shapes]
        offsets = [x + (i - (len(names) - 1) / 2) * width for x in range(len(shapes))]
        bars = ax.bar(offsets, values, width, label=label)
        if key == "rope_jit":
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    if with_limit:
        limits = [s.get("same_size_copy_fraction_of_copy") for s in shapes]
        points = [(x, value) for x, value in enumerate(limits) if value is not None]
        if points:
            ax.scatter([x for x, _ in points], [v for _, v in points], marker="_", s=900,
                       color="black", linewidths=1.5, label="copy of the same bytes", zorder=3)
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(shapes)), [label_of(s) for s in shapes], fontsize=7)
    ax.set_ylabel("fraction of device copy bandwidth")
    ax.set_ylim(0, 1.1)
    ax.set_title(title, fontsize=10)
    # Beside the axes: inside, it hid the last bars.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=0.4)


def main(source, target):
    with open(source) as file:
        result = json.load(file)
    shapes = result["shapes"]
    with_graph = all("graph_fraction_of_copy" in s for s in shapes)
    in_place = result.get("in_place", False)
    fig, axes = plt.subplots(2 if with_graph else 1, 1, figsize=(12, 8.5 if with_graph else 4.5),
                             squeeze=False)
    head = (f"RoPE forward {'in place' if in_place else 'out of place'}, bf16, [B,S,H,D], "
            f"{result['device']} (copy {result['copy_gbps']:.0f} GB/s)")
    draw(axes[0][0], shapes, "fraction_of_copy", head + ": back-to-back Python calls", False)
    if with_graph:
        draw(axes[1][0], shapes, "graph_fraction_of_copy",
             "GPU time per call (CUDA graph replay, no host work)", True)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
