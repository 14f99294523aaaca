"""Draws the fraction of device copy bandwidth per shape for rope-jit, torch.compile and eager
from bench/compare_torch.py's JSON (needs matplotlib; run where it is installed).

    python3 bench/plot_results.py bench/results/h200_vs_torch.json bench/results/h200_vs_torch.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def draw(ax, shapes, key_of_fraction, title):
    labels = [f"{s['B']}x{s['S']}\n{s['Hq']}/{s['Hk']} D{s['D']}" +
              (f"\nR{s['rotary_dim']} {s['style'][:5]}" if s.get("rotary_dim", s["D"]) != s["D"] or
               s.get("style", "half") != "half" else "")
              for s in shapes]
    names = [("rope_jit", "rope-jit"), ("torch_compile", "torch.compile"), ("torch_eager", "PyTorch eager")]
    width = 0.27
    for i, (key, label) in enumerate(names):
        values = [s[key_of_fraction][key] or 0.0 for s in shapes]
        bars = ax.bar([x + (i - 1) * width for x in range(len(shapes))], values, width, label=label)
        if key == "rope_jit":
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(shapes)), labels, fontsize=7)
    ax.set_ylabel("fraction of device copy bandwidth")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def main(source, target):
    with open(source) as file:
        result = json.load(file)
    shapes = result["shapes"]
    with_graph = all("graph_fraction_of_copy" in s for s in shapes)
    fig, axes = plt.subplots(2 if with_graph else 1, 1, figsize=(12, 8.5 if with_graph else 4.5), squeeze=False)
    head = f"RoPE forward, bf16, [B,S,H,D], {result['device']} (copy {result['copy_gbps']:.0f} GB/s)"
    draw(axes[0][0], shapes, "fraction_of_copy", head + ": back-to-back Python calls")
    if with_graph:
        draw(axes[1][0], shapes, "graph_fraction_of_copy", "GPU time per call (CUDA graph replay, no host work)")
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
