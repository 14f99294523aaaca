"""Draws the fraction of device copy bandwidth per shape for rope-jit, torch.compile and eager
from bench/compare_torch.py's JSON (needs matplotlib; run where it is installed).

    python3 bench/plot_results.py bench/results/h200_vs_torch.json bench/results/h200_vs_torch.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(source, target):
    with open(source) as file:
        result = json.load(file)
    shapes = result["shapes"]
    labels = [f"{s['B']}x{s['S']}\n{s['Hq']}/{s['Hk']} D{s['D']}" for s in shapes]
    names = [("rope_jit", "rope-jit"), ("torch_compile", "torch.compile"), ("torch_eager", "PyTorch eager")]
    width = 0.27
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (key, label) in enumerate(names):
        values = [s["fraction_of_copy"][key] for s in shapes]
        bars = ax.bar([x + (i - 1) * width for x in range(len(shapes))], values, width, label=label)
        if key == "rope_jit":
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(shapes)), labels, fontsize=8)
    ax.set_ylabel("fraction of device copy bandwidth")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"RoPE forward, bf16, [B,S,H,D], {result['device']} (copy {result['copy_gbps']:.0f} GB/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
