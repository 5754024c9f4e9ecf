"""PNG plots of one workload: validation accuracy against training time, and throughput bars."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.scenarios import BASELINE, NO_COMM, Workload


def plot_workload(workload: Workload, result: dict[str, Any], path: Path) -> Path:
    """Write ``path``: accuracy vs training time (left) and samples/s with the ratio to DDP (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = {k: r for k, r in result["runs"].items() if "error" not in r}
    fig, (acc_ax, bar_ax) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for label, run in runs.items():
        points = run["timeline"]
        style = {"linestyle": "--", "color": "black"} if label == BASELINE else {}
        if label == NO_COMM:
            style = {"linestyle": ":", "color": "grey"}
        acc_ax.plot([p["train_s"] for p in points], [p["val_acc"] for p in points], marker="o", label=label, **style)
    acc_ax.axhline(workload.target_acc, color="grey", linewidth=0.8, linestyle=":")
    acc_ax.set(xlabel="training time (s, validation excluded)", ylabel="validation accuracy", title=workload.name)
    acc_ax.legend(fontsize=8)
    acc_ax.grid(alpha=0.3)

    labels = list(runs)
    values = [runs[k]["samples_per_s"] for k in labels]
    colors = ["black" if k == BASELINE else "grey" if k == NO_COMM else f"C{i}" for i, k in enumerate(labels)]
    bars = bar_ax.bar(range(len(labels)), values, color=colors)
    base = runs.get(BASELINE, {}).get("samples_per_s", math.nan)
    for bar, value in zip(bars, values, strict=True):
        if base and not math.isnan(base):
            bar_ax.annotate(
                f"{value / base:.2f}x", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8
            )
    bar_ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    bar_ax.set(ylabel="samples/s (all ranks)", title=f"throughput, {result.get('link', workload.link)} links")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
