"""Validation accuracy per epoch of several ``lightning_hier.train`` runs, as a table and one PNG.

Reads each run directory's ``logs/version_*/metrics.csv`` (Lightning's CSV logger). Used for
equal-epoch comparisons whose timing does not matter (e.g. a pipeline against plain backprop)::

    python -m benchmarks.epoch_curves recipes/decoupled/fdg_accuracy.png "plain backprop=runs/bp" "K=2=runs/k2"
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


def plot(curves: dict[str, list[float]], path: Path) -> None:
    """Write ``path``: one line per run, accuracy against epoch."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, acc in curves.items():
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
    ax.set(xlabel="epoch", ylabel="validation accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``OUT.png LABEL=RUN_DIR ...``: print a markdown table and write the plot."""
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    curves = {label: accuracy_by_epoch(Path(d)) for label, d in (a.rsplit("=", 1) for a in argv[1:])}
    epochs = max(len(c) for c in curves.values())
    print("| run | " + " | ".join(str(e + 1) for e in range(epochs)) + " |")
    print("|---" * (epochs + 1) + "|")
    for label, acc in curves.items():
        print(f"| {label} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    plot(curves, Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
