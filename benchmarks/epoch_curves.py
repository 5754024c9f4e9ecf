"""Validation accuracy per epoch of several ``lightning_hier.train`` runs, as a table and one PNG.

Reads each run directory's ``logs/version_*/metrics.csv`` (Lightning's CSV logger). Used for
equal-epoch comparisons whose timing does not matter (e.g. a pipeline against plain backprop)::

    python -m benchmarks.epoch_curves recipes/decoupled/fdg_accuracy.png "plain backprop=runs/bp" "K=2=runs/k2"

A label may name several run directories, comma-separated (one per seed): its row is then the
mean per epoch with the lowest and highest seed in brackets, and its line in the plot a band
between them, over the epochs every one of its runs reached.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def accuracy_by_epoch(run_dir: Path) -> list[float]:
    """``val/acc`` after each epoch of the run in ``run_dir`` (its latest logger version)."""
    versions = sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not versions:
        raise FileNotFoundError(f"epoch_curves: no logs/version_*/metrics.csv under {run_dir}.")
    with versions[-1].open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/acc")]
    return [float(r["val/acc"]) for r in sorted(rows, key=lambda r: int(r["epoch"]))]


def seed_curves(dirs: list[Path]) -> list[list[float]]:
    """Each run's curve, cut to the epochs all of them reached (one run per seed)."""
    curves = [accuracy_by_epoch(d) for d in dirs]
    epochs = min(len(c) for c in curves)
    return [c[:epochs] for c in curves]


def epoch_stats(curves: list[list[float]]) -> list[tuple[float, float, float]]:
    """Per epoch, ``(mean, lowest, highest)`` over ``curves`` (of equal length, one per seed)."""
    return [(sum(col) / len(col), min(col), max(col)) for col in zip(*curves, strict=True)]


def plot(runs: dict[str, list[list[float]]], path: Path) -> None:
    """Write ``path``: one line per label (the mean of its seeds; a band from the lowest to the highest)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curves in runs.items():
        epochs = range(1, len(curves[0]) + 1)
        mean, lo, hi = zip(*epoch_stats(curves), strict=True)
        name = label if len(curves) == 1 else f"{label} ({len(curves)} seeds)"
        line = ax.plot(epochs, mean, marker="o", label=name)
        if len(curves) > 1:
            ax.fill_between(epochs, lo, hi, color=line[0].get_color(), alpha=0.15)
    ax.set(xlabel="epoch", ylabel="validation accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``OUT.png LABEL=RUN_DIR[,RUN_DIR...] ...``: print a markdown table and write the plot."""
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    runs = {
        label: seed_curves([Path(d) for d in dirs.split(",")]) for label, dirs in (a.rsplit("=", 1) for a in argv[1:])
    }
    epochs = max(len(c[0]) for c in runs.values())
    print("| run | " + " | ".join(str(e + 1) for e in range(epochs)) + " |")
    print("|---" * (epochs + 1) + "|")
    for label, curves in runs.items():
        cells = (
            f"{m:.3f}" if len(curves) == 1 else f"{m:.3f} ({lo:.3f}-{hi:.3f})" for m, lo, hi in epoch_stats(curves)
        )
        print(f"| {label} | " + " | ".join(cells) + " |")
    plot(runs, Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
