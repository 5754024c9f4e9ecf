"""Run summaries of the entry point and the table that compares the jobs of a sweep.

A run of ``python -m lightning_hier.train`` ends by writing :class:`Summary` into its output
directory (``summary.json`` for programs, ``summary.txt`` for people). After a multirun,
:func:`sweep_table` reads every job's ``summary.json`` and lays them out side by side; the
entry point prints the table and saves it as ``summary.md`` and ``summary.csv`` in the sweep
directory. Plain Python: the Hydra side (which directory, which overrides) lives in
:mod:`lightning_hier.train`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"


@dataclass
class Summary:
    """What a run reports at the end.

    Attributes:
        strategy: The strategy option (``conf/strategy`` name) or class name.
        world_size: Processes in the job.
        num_nodes: Nodes of the job.
        epochs: Epochs trained.
        val_acc: Last validation accuracy (None when nothing was validated).
        samples_per_s: Training samples per second over all replicas (None when not measured).
        seconds: Wall time of ``fit`` including process start-up.
        output_dir: The run's output directory.
        overrides: The command-line overrides of this run (a sweep job's own included).
    """

    strategy: str
    world_size: int
    num_nodes: int
    epochs: int
    val_acc: float | None
    samples_per_s: float | None
    seconds: float
    output_dir: str
    overrides: list[str] = field(default_factory=list)

    def format(self) -> str:
        acc = "n/a" if self.val_acc is None else f"{self.val_acc:.4f}"
        sps = "n/a" if self.samples_per_s is None else f"{self.samples_per_s:,.0f}"
        rows = [
            ("strategy", self.strategy),
            (
                "world size",
                f"{self.world_size} ({self.num_nodes} node(s) x {self.world_size // self.num_nodes} processes)",
            ),
            ("epochs", str(self.epochs)),
            ("val accuracy", acc),
            ("samples/s", f"{sps} (training only, all replicas)"),
            ("time", f"{self.seconds:.1f} s (fit, including start-up)"),
            ("output dir", self.output_dir),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k:<{width}}  {v}" for k, v in rows]
        bar = "-" * max(len(line) for line in lines)
        return "\n".join([bar, "  lightning-hier run summary", bar, *lines, bar])

    def write(self, directory: str | Path) -> None:
        """Write ``summary.json`` and ``summary.txt`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / SUMMARY_JSON).write_text(json.dumps(asdict(self), indent=2) + "\n")
        (out / SUMMARY_TXT).write_text(self.format() + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Summary:
        """Load a ``summary.json`` written by :meth:`write`."""
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class SweepTable:
    """The jobs of a sweep side by side.

    Attributes:
        common: Overrides every job shares (shown once, above the table).
        header: Column names.
        rows: One row per job, in job order.
    """

    common: list[str]
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = []
        if self.common:
            lines += ["common overrides: " + " ".join(f"`{o}`" for o in self.common), ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "---|" * len(self.header))
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(self.header)
        writer.writerows(self.rows)
        return buffer.getvalue()


def _job_arguments(overrides: Sequence[str], common: set[str]) -> str:
    # the strategy choice has its own column; strategy.* arguments and other swept keys stay
    own = [o for o in overrides if o not in common and not o.startswith("strategy=")]
    return " ".join(own) or "-"


def sweep_table(summaries: Sequence[Summary]) -> SweepTable:
    """Compare the jobs of a sweep: strategy, their own arguments, accuracy, samples/s, time.

    An override every job shares goes into :attr:`SweepTable.common`; the ``arguments``
    column keeps what differs between jobs (besides the strategy itself), so a sweep over
    ``strategy.tau=2,4`` shows ``strategy.tau=2`` and ``strategy.tau=4``.
    """
    sets = [set(s.overrides) for s in summaries]
    common = set.intersection(*sets) if sets else set()
    ordered_common = [o for o in (summaries[0].overrides if summaries else []) if o in common]
    header = ["job", "strategy", "arguments", "val acc", "samples/s", "time (s)", "output dir"]
    rows = [
        [
            str(i),
            s.strategy,
            _job_arguments(s.overrides, common),
            "n/a" if s.val_acc is None else f"{s.val_acc:.4f}",
            "n/a" if s.samples_per_s is None else f"{s.samples_per_s:.0f}",
            f"{s.seconds:.1f}",
            Path(s.output_dir).name,
        ]
        for i, s in enumerate(summaries)
    ]
    # the strategy choice has its own column, even when every job shares it
    return SweepTable([o for o in ordered_common if not o.startswith("strategy=")], header, rows)


def collect_sweep(sweep_dir: str | Path) -> list[Summary]:
    """Every job's summary under ``sweep_dir``, in job-number order (jobs without one are skipped)."""

    def job_number(path: Path) -> tuple[int, str]:
        head = path.parent.name.split("_", 1)[0]
        return (int(head) if head.isdigit() else 1 << 30, path.parent.name)

    return [Summary.read(p) for p in sorted(Path(sweep_dir).glob(f"*/{SUMMARY_JSON}"), key=job_number)]


def write_sweep_table(sweep_dir: str | Path) -> SweepTable | None:
    """Write ``summary.md`` and ``summary.csv`` for the sweep in ``sweep_dir``; None when no job finished."""
    summaries = collect_sweep(sweep_dir)
    if not summaries:
        return None
    table = sweep_table(summaries)
    out = Path(sweep_dir)
    (out / "summary.md").write_text(table.markdown() + "\n")
    (out / "summary.csv").write_text(table.csv())
    return table
