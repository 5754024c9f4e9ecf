"""Every predicted run of several benchmark invocations in one table, with the count within a tolerance.

``python -m benchmarks.tally RESULTS.json ...`` prints one row per run that the simulator predicts
(workload, link, ranks, run, samples/s and bytes per epoch measured, predicted and the error, and
the share of the run and of its calibration run spent queued for the cores), then how many of
them came within ``--tolerance`` (15 %) on samples/s and on bytes. Rows come in the order of the
files given; the file's name (its invocation) is the ``source`` column. With ``--latest`` the files
are taken in the order of their invocations' dates (``meta.date``) and a cell measured again later
is counted once, at its newest measurement.

The simulator's accuracy over the current measurements (``benchmarks/results/simulator/``)::

    python -m benchmarks.tally --latest benchmarks/results/simulator/*.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.predicted import NO_COMM, predict_run, predicted_bytes


@dataclass(frozen=True)
class Cell:
    """One predicted run: what was measured and what was predicted."""

    source: str
    workload: str
    link: str
    ranks: int
    label: str
    rate: float
    predicted_rate: float
    bytes: float
    predicted_bytes: float
    queued: float | None
    calibration_queued: float | None

    @property
    def key(self) -> tuple[str, str, int, str]:
        """What makes two rows the same cell, whichever invocation measured them."""
        return self.workload, self.link, self.ranks, self.label

    @property
    def rate_error(self) -> float:
        return (self.predicted_rate - self.rate) / self.rate

    @property
    def bytes_error(self) -> float:
        return (self.predicted_bytes - self.bytes) / self.bytes


def cells(source: str, results: dict[str, Any]) -> list[Cell]:
    """The predicted runs of one ``results.json`` (the calibration runs and unmodelled runs left out)."""
    out = []
    for name, result in results["workloads"].items():
        world = int(result.get("meta", results["meta"]).get("ranks", 2))
        reference = result["runs"].get(NO_COMM, {})
        for label, run in result["runs"].items():
            p = None if label == NO_COMM else predict_run(label, run, result, world)
            if p is None:
                continue
            wire, _ = predicted_bytes(p, run, result)
            out.append(
                Cell(
                    source, name, str(result.get("link")), world, label, float(run["samples_per_s"]),
                    p.samples_per_s, float(run["bytes_per_epoch"]), wire, run.get("queued_share"),
                    reference.get("queued_share"),
                )
            )  # fmt: skip
    return out


def latest(rows: list[Cell]) -> list[Cell]:
    """One row per cell (workload, link, ranks, run): the one from the last file that measured it.

    A cell measured again in a later invocation replaces the earlier measurement in place, so the
    tally of files given oldest first counts every cell once, at its newest measurement.
    """
    newest = {c.key: c for c in rows}
    return [c for c in rows if newest[c.key] is c]


def by_date(documents: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``(source, results)`` pairs in the order of their invocations' dates (stable for equal dates)."""
    return sorted(documents, key=lambda item: str(item[1]["meta"]["date"]))


def latest_cells(paths: list[Path]) -> list[Cell]:
    """Every cell of the ``results.json`` files at ``paths`` once, at its newest measurement."""
    documents = by_date([(path.stem, json.loads(path.read_text())) for path in paths])
    return latest([c for source, results in documents for c in cells(source, results)])


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def tally_table(rows: list[Cell], tolerance: float = 0.15) -> str:
    """Markdown: one row per cell, then the counts within ``tolerance``."""
    lines = [
        "| workload | link | ranks | run | source | samples/s | predicted | error | MB/epoch/rank | predicted | error "
        "| queued: run / calibration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        lines.append(
            f"| {c.workload} | {c.link} | {c.ranks} | {c.label} | {c.source} | {c.rate:.0f} | {c.predicted_rate:.0f} "
            f"| {100 * c.rate_error:+.0f}% | {c.bytes / 1e6:.1f} | {c.predicted_bytes / 1e6:.1f} "
            f"| {100 * c.bytes_error:+.0f}% | {_share(c.queued)} / {_share(c.calibration_queued)} |"
        )
    rates = sum(abs(c.rate_error) <= tolerance for c in rows)
    nbytes = sum(abs(c.bytes_error) <= tolerance for c in rows)
    lines += [
        "",
        f"Within {100 * tolerance:.0f} %: samples/s {rates} of {len(rows)}, bytes per epoch {nbytes} of {len(rows)}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tally", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="results.json files (one per invocation)")
    parser.add_argument("--tolerance", type=float, default=0.15, help="relative error counted as a hit")
    parser.add_argument(
        "--latest", action="store_true", help="count each cell once, at its newest measurement (by the files' dates)"
    )
    args = parser.parse_args(argv)
    if args.latest:
        rows = latest_cells(args.results)
    else:
        rows = [c for path in args.results for c in cells(path.stem, json.loads(path.read_text()))]
    print(tally_table(rows, args.tolerance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
