"""Where a pipeline stage's step goes, against single-process backprop (issue 19).

On an emulated cluster (:mod:`benchmarks.netns`) one invocation runs the ``decoupled_cnn``
workload's (or ``--workload``'s) single-process run (one rank) and its pipeline runs (two ranks, one core each), each
for a few hundred images, with a :class:`StepProfile` callback on every rank. The callback times,
per training step (median over the steps after a warm-up):

- ``step``: from one batch's start to the next one's (what samples/s sees);
- ``lightning``: the part outside ``on_train_batch_start`` ... ``on_train_batch_end`` (the loop,
  the data loader, logging and callbacks);
- single process: ``forward`` (up to ``on_before_backward``), ``backward`` (to ``on_after_backward``,
  DDP's hook included) and ``update`` (``on_before_optimizer_step`` to the batch's end);
- pipeline stage: ``forward``, ``backward`` (delayed backward; on the last stage the loss's backward),
  ``update`` (gradients to the optimizer step), ``recv wait`` (taking a posted receive: blocked on
  the neighbour), ``send wait`` (completing an earlier send before its link is written again) and
  ``post`` (packing a parcel into the link's buffer and posting it).

The stage's methods are timed by wrapping them on the live objects (nothing global is patched).
Also reported: ``torch.get_num_threads()`` in each rank. Needs root; it is a timing::

    flock -x /work/bench.lock python -m benchmarks.studies.stage_profile --images 2560 --name prof

Namespaces are ``lhb-<pid>-<name>-*`` and removed at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

MARK = "[stage-profile] "
WARMUP = 3  # first steps left out (buffers grow, the pipeline fills)


class StepProfile(Callback):
    """Per-step durations by part (milliseconds), printed as one JSON line at the end of the fit."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = defaultdict(list)
        self._open: dict[str, float] = {}
        self._step_parts: dict[str, float] = defaultdict(float)
        self._batch_start: float | None = None
        self._batch_end: float | None = None
        self._cpu_start = self._cpu_end = 0.0
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = 0.0
        self._pipeline = False  # a pipeline stage: its training step is timed by its wrapped methods
        self.starts: list[float] = []  # each batch's start, seconds after the fit's
        self._val_start_s: float | None = None  # the first validation after training began
        self.calls: list[tuple[str, float, float]] = []  # each wrapped call: part, start, end (fit seconds)

    def _add(self, part: str, seconds: float) -> None:
        self._step_parts[part] += seconds * 1e3

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self._add(part, end - start)
                self.calls.append((part, start - self._t0, end - self._t0))

        return wrapper

    def _wrap(self, obj: Any, name: str, part: str) -> None:
        setattr(obj, name, self._timed(part, getattr(obj, name)))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = time.perf_counter()
        pipe = getattr(trainer.strategy, "pipeline", None)
        if pipe is None:
            return
        self._pipeline = True
        for name in ("forward_now", "forward_delayed"):
            self._wrap(pipe.runner, name, "forward")
        self._wrap(pipe.runner, "backward_delayed", "backward")
        self._wrap(pipe, "_apply", "update")
        for mail in pipe.mailboxes:
            self._wrap(mail, "post", "post")
            self._wrap(mail, "_complete_sends", "send wait")
        for inbox in pipe._inboxes.values():
            self._wrap(inbox, "settle", "recv wait")
        if pipe.last:  # its backward runs inside _forward_last: the rest of it, after forward and update
            self._wrap(pipe, "_forward_last", "forward_last")

    def _mark(self, name: str) -> None:
        self._open[name] = time.perf_counter()

    def _since(self, name: str) -> float:
        return time.perf_counter() - self._open.pop(name, time.perf_counter())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.starts.append(now - self._t0)
        if self._batch_start is not None and self._batch_end is not None:
            self._add("lightning", now - self._batch_end)
            self._add("step", now - self._batch_start)
            # the main thread's CPU time: far below the wall time where it waited (or lost its core)
            self._add("lightning cpu", cpu - self._cpu_end)
            self._add("step cpu", cpu - self._cpu_start)
            self._close_step()
        self._batch_start, self._cpu_start = now, cpu
        if not self._pipeline:
            self._mark("forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._add("forward", self._since("forward"))
        self._mark("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._add("backward", self._since("backward"))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._pipeline:
            self._mark("update")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if "update" in self._open:
            self._add("update", self._since("update"))
        self._batch_end, self._cpu_end = time.perf_counter(), time.thread_time()

    def _folded(self) -> dict[str, float]:
        """The open step's parts; on the last stage its backward is what ``_forward_last`` spent beyond
        its forward and update (it runs forward, loss, backward and update at once)."""
        parts = dict(self._step_parts)
        if "forward_last" in parts:
            parts["backward"] = parts.get("backward", 0.0) + parts.pop("forward_last") - parts["forward"]
            parts["backward"] -= parts.get("update", 0.0)
        return parts

    def _close_step(self) -> None:
        for part, ms in self._folded().items():
            self.parts[part].append(ms)
        self._step_parts = defaultdict(float)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start_s is None and self.starts:
            self._val_start_s = time.perf_counter() - self._t0

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        medians = {part: statistics.median(ms[WARMUP:] or ms) for part, ms in self.parts.items()}
        usage, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - self._t0
        # the process's CPU time (every thread: gloo's too) as a share of the fit's wall time
        cpu = {
            "user": (usage.ru_utime - self._usage.ru_utime) / wall,
            "sys": (usage.ru_stime - self._usage.ru_stime) / wall,
        }
        info = {
            "rank": trainer.global_rank,
            "steps": len(self.parts.get("step", [])),
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "median_ms": medians,
            # the fit's edges, which the medians leave out: its start to the first batch, every batch's
            # start, the last batch's end and the fit's end (seconds after the fit's start)
            "starts_s": self.starts,
            "last_end_s": (self._batch_end or self._t0) - self._t0,
            "wall_s": wall,
            "val_start_s": self._val_start_s,
            "last_ms": self._folded(),  # the last batch's parts (its drain included), never closed
            "calls": self.calls,
            "cpu_share": cpu,
        }
        print(MARK + json.dumps(info), flush=True)


class PythonProfile(StepProfile):
    """:class:`StepProfile` plus ``cProfile`` of the rank's main thread during the fit (its top
    functions by cumulative time go to the rank's log; the overhead inflates the Python-heavy parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.profiler = cProfile.Profile()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.profiler.enable()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.disable()
        super().on_train_end(trainer, pl_module)
        pstats.Stats(self.profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(40)


def factory(ranks: list[int], factor: float) -> StepProfile:
    """The worker's callback hook (``spec["delay"]``): every rank gets a profile; the arguments are unused."""
    return StepProfile()


def python_factory(ranks: list[int], factor: float) -> StepProfile:
    """As :func:`factory`, with ``cProfile`` (``--cprofile``)."""
    return PythonProfile()


def profile_runs(args: argparse.Namespace) -> list[tuple[str, list[dict[str, Any]]]]:
    """Run the single-process run and each pipeline variant; return each run's rank profiles."""
    from benchmarks import run as bench
    from benchmarks.launch import run_job
    from benchmarks.netns import EmulatedCluster, Link
    from benchmarks.scenarios import SCENARIOS, WORKLOADS, one_process_reference

    w = WORKLOADS[args.workload]
    one = one_process_reference(w.name)
    assert one is not None
    wanted = [one] + [sc for sc in SCENARIOS if sc.workload == w.name and sc.label in args.runs]
    opts = argparse.Namespace(quick=False, epochs=1, extra=[f"data.train_size={args.images}", *args.set])
    data = bench.data_overrides(argparse.Namespace(synthetic=False, data_root=args.data_root))
    bench.prepare_data(data)
    hook = "python_factory" if args.cprofile else "factory"
    out = []
    link = Link(args.link or w.link)
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, link, tag=f"{os.getpid()}-{args.name}") as c:
        for i, sc in enumerate(wanted):
            spec: dict[str, Any] = {
                "searchpath": str(w.searchpath),
                "overrides": bench.run_overrides(opts, w, sc, data),
            }
            spec["delay"] = {"ranks": [], "factor": 1.0, "callback": f"benchmarks.studies.stage_profile:{hook}"}
            run_dir = Path(tmp) / sc.label
            run_job(c, spec, run_dir, 29470 + i, 600.0, ranks=sc.ranks)
            logs = [(run_dir / f"rank{r}.log").read_text() for r in range(sc.ranks or c.ranks)]
            out.append((sc.label, [_profile(log) for log in logs]))
            if args.cprofile:
                for r, log in enumerate(logs):
                    print(f"--- {sc.label} rank {r} ---\n{log[log.find('Ordered by') :][:6000]}")
    return out


def _profile(log: str) -> dict[str, Any]:
    line = next(line for line in log.splitlines() if line.startswith(MARK))
    return dict(json.loads(line[len(MARK) :]))


PARTS = ("step", "forward", "backward", "update", "recv wait", "send wait", "post", "lightning")
CPU_PARTS = ("step cpu", "lightning cpu")


def table(results: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """Markdown: one row per rank of each run, median milliseconds per step by part, the main
    thread's CPU milliseconds of the step and of Lightning's part, and the rank's (all threads')
    user and system CPU time as a share of its fit's wall time."""
    lines = [
        "| run | rank | threads | "
        + " | ".join(PARTS)
        + " | rest | "
        + " | ".join(CPU_PARTS)
        + " | user CPU | sys CPU |",
        "|---" * (len(PARTS) + len(CPU_PARTS) + 6) + "|",
    ]
    for label, ranks in results:
        for p in ranks:
            ms = p["median_ms"]
            known = sum(ms.get(k, 0.0) for k in PARTS[1:])
            cpu_cells = " | ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in CPU_PARTS)
            cells = " | ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in PARTS)
            cpu = p["cpu_share"]
            lines.append(
                f"| {label} | {p['rank']} | {p['threads']} | {cells} | {ms.get('step', 0.0) - known:.1f} | {cpu_cells} "
                f"| {cpu['user']:.0%} | {cpu['sys']:.0%} |"
            )
    return "\n".join(lines)


def edges(results: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """Markdown: where each rank's fit went outside its steady steps (milliseconds): from the fit's start
    to the first batch, the first :data:`WARMUP` steps, the median of the rest, the last batch (its
    drain included, and its parts), from its end to the first validation and from there to the fit's end."""
    lines = [
        "| run | rank | to first batch | first steps | median step | last batch | its parts | to validation "
        "| validation to fit end | fit |"
    ]
    lines.append("|---" * 10 + "|")
    for label, ranks in results:
        for p in ranks:
            starts, end, wall = p["starts_s"], p["last_end_s"], p["wall_s"]
            steps = [1e3 * (b - a) for a, b in itertools.pairwise(starts)]
            first = ", ".join(f"{ms:.0f}" for ms in steps[:WARMUP])
            rest = statistics.median(steps[WARMUP:] or steps or [0.0])
            val = p["val_start_s"] if p["val_start_s"] is not None else wall
            parts = ", ".join(f"{k} {ms:.0f}" for k, ms in sorted(p["last_ms"].items()) if "cpu" not in k)
            lines.append(
                f"| {label} | {p['rank']} | {1e3 * starts[0]:.0f} | {first} | {rest:.0f} "
                f"| {1e3 * (end - starts[-1]):.0f} | {parts} | {1e3 * (val - end):.0f} | {1e3 * (wall - val):.0f} "
                f"| {1e3 * wall:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.stage_profile", description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2560, help="training images (one epoch; global batch 256)")
    p.add_argument("--workload", default="decoupled_cnn", help="a workload with a single-process run")
    p.add_argument("--runs", nargs="+", default=["decoupled"], help="labels of the workload's scenarios to profile")
    p.add_argument("--set", nargs="*", default=[], help="extra Hydra overrides of every run")
    p.add_argument("--data-root", type=Path, help="CIFAR-10 (default: shared/datasets/cifar10-jpeg.tar.gz)")
    p.add_argument("--cprofile", action="store_true", help="also cProfile each rank's main thread (to the logs)")
    p.add_argument("--name", default="prof", help="label in the namespaces' names")
    p.add_argument("--link", default=None, help="tc rate of the links (default: the workload's), e.g. 100mbit")
    args = p.parse_args(argv)
    results = profile_runs(args)
    print(table(results))
    print(edges(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
