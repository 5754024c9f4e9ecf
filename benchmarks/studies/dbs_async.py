"""DBS-SGD against ASGD and n-softsync with one straggler: staleness and accuracy at equal wall time.

Ji et al. (2019) claim DBS-SGD lowers the average staleness of asynchronous updates and reaches a
higher accuracy at equal speed-up than ASGD and n-softsync, on MNIST and CIFAR-10. For each
workload and slowdown factor this study fits ``dbs_async``, ``asgd``, ``softsync`` (``n=2`` of
3 ranks), ``dbs_async`` on the 2-softsync server (``dbs_async_n2``) and, as the synchronous
reference, Lightning's ``ddp`` (every step waits for the straggler) one after the other in the
same three forked CPU ranks (gloo), with rank 2 slowed:

- ``--straggler cgroup`` (default): every rank runs under its own cgroup CPU quota
  (:mod:`benchmarks.rank_quotas`), ``--share`` of a core (0.6) for ranks 0 and 1 and
  ``share / factor`` for rank 2, so that the quotas, not three ranks contending for two cores,
  set the speeds. Rank 0's quota covers the server's threads (they are threads of its process).
  DBS times compute with ``timer='wall'``: a quota stretches wall time, not CPU time.
- ``--straggler spin``: no quotas; :class:`~lightning_hier.callbacks.Straggler` in ``'spin'``
  mode burns ``factor - 1`` times rank 2's compute in CPU time, and DBS times compute with
  ``timer='cpu'`` (the training thread's CPU time in ``dbs_async``), which holds however loaded
  the machine is.

Each slowdown factor is one run of the three forked ranks (its own cgroups, removed at its end).

Rank 0 snapshots the server's model (and its own buffers) every few steps with the wall time
since the fit started; after all fits, each snapshot is evaluated on the validation set and each
strategy's accuracy is read at the wall time of the fastest fit of its group ("equal wall time").
Each fit's time to target is the first of ``CURVE_POINTS`` snapshots, evenly spread over its
wall time, whose accuracy reaches the workload's :data:`TARGETS` value (``--target``).
Run from the repository root::

    python -m benchmarks.studies.dbs_async --workloads mnist cifar10 --factors 2 4 [--straggler spin] [--sampler shared]

``--sampler shared``: every rank claims its batches from the server's shared queue, so a fast
rank takes more steps than the straggler (the papers' free-running workers); ``dbs_async``'s
server then sizes each claim from the speeds the workers report. Default ``split``: each rank its
own shard, every rank the same number of steps per epoch.

MNIST: the t10k file split 8000 / 2000 (only the test set is offline here); CIFAR-10: a fixed
5000-image training subset of ``cifar10-jpeg.tar.gz``, evaluated on the 10,000 test images.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import Tensor
from typing_extensions import override

from benchmarks.leftovers import exit_on_termination
from benchmarks.rank_quotas import RankQuotas, rank_quotas
from benchmarks.studies._dbs_async_report import print_rows, summary
from benchmarks.studies._trainer import quiet_trainer
from lightning_hier import AsgdStrategy, AsyncDBSStrategy, SoftsyncStrategy
from lightning_hier.algorithms.claim_sampler import SAMPLERS, ClaimQueue
from lightning_hier.callbacks import Straggler
from lightning_hier.data import CIFAR10DataModule, DigitsDataModule, MNISTDataModule
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.models import Classifier, mlp, small_cnn
from lightning_hier.sync import ServerSync, SpeedShares
from lightning_hier.testing import run_workers

RANKS, SLOW_RANK = 3, 2
# samples per rank and step (DBS: a global batch of 3 x BATCH): large enough that compute, not
# Lightning's and the server's fixed per-step costs, dominates a step (else DBS's measured speed
# of a rank falls as its batch shrinks, and the straggler's share runs down to one sample)
BATCH = 128
STRAGGLERS = ("cgroup", "spin")
SHARE = 0.6  # cores of a normal rank under --straggler cgroup: 0.6 + 0.6 + 0.6 / factor < 2 cores
# each factory takes the DBS timer (the clock that sees the straggler's slowdown) and the sampler
# a report of the speed rides on a claim under sampler='shared' (no all-gather): the study then measures
# every 2 of a worker's own steps; with 10, the straggler (15 steps on CIFAR-10 at 4x) reported only
# once, after 13 of its steps, so most of its steps ran at the equal split
PERIODS = {"split": (10, 3), "shared": (2, 1)}  # (rebalance_every, warmup_steps)
STRATEGIES: dict[str, Callable[[str, str], Strategy]] = {
    "dbs_async": lambda timer, sampler: AsyncDBSStrategy(
        rebalance_every=PERIODS[sampler][0], warmup_steps=PERIODS[sampler][1], timer=timer, timeout=120, sampler=sampler
    ),
    "asgd": lambda _, sampler: AsgdStrategy(timeout=120, sampler=sampler),
    "softsync_n2": lambda _, sampler: SoftsyncStrategy(n=2, timeout=120, sampler=sampler),
    # DBS's allocation on the 2-softsync server: against softsync_n2 at the same n (the mean staleness
    # per push is (W - 1) / ceil(W / n) whatever the shares; docs/algorithms.md section 7)
    "dbs_async_n2": lambda timer, sampler: AsyncDBSStrategy(
        n=2,
        rebalance_every=PERIODS[sampler][0],
        warmup_steps=PERIODS[sampler][1],
        timer=timer,
        timeout=120,
        sampler=sampler,
    ),
    # the synchronous reference: every step waits for the straggler (Lightning's sampler, whatever `sampler`)
    "ddp": lambda _, __: DDPStrategy(timeout=timedelta(seconds=120)),
}
# accuracy a fit must reach for its time to target (the validation set's), unless --target
TARGETS = {"digits": 0.5, "mnist": 0.9, "cifar10": 0.4}
CURVE_POINTS = 16  # snapshots evaluated per fit for its time to target, evenly spread over its wall time


class Snapshots(pl.Callback):
    """On rank 0: the model every ``every`` steps, with wall time since the training started.

    The server's parameters and rank 0's buffers under a parameter server, rank 0's module
    otherwise (DDP: every rank holds the same parameters). ``elapsed`` is the training's wall time
    (``on_train_start`` to ``on_train_end``, when the last snapshot is taken): each fit's time, on
    the snapshots' clock, so set-up before the training (process groups, the server's start) counts
    for no strategy.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.taken: list[tuple[float, list[Tensor]]] = []
        self.elapsed = 0.0
        self._t0 = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank != 0 or trainer.global_step % self.every:
            return
        sync = getattr(trainer.strategy, "sync", None)
        if isinstance(sync, ServerSync):
            assert sync.ps is not None and sync.ps.server is not None
            self._take(sync.ps.server.consensus()[0], pl_module)
        else:
            self._take(None, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.elapsed = time.perf_counter() - self._t0
        if trainer.global_rank == 0:  # the module holds the consensus model after fit
            self._take(None, pl_module, at=self.elapsed)

    def _take(self, flat: Tensor | None, pl_module: pl.LightningModule, at: float | None = None) -> None:
        """Keep ``flat`` parameters (None: the module's own) and the module's buffers, at time ``at`` (now)."""
        if flat is None:
            flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        when = time.perf_counter() - self._t0 if at is None else at
        self.taken.append((when, [flat, *(b.clone() for b in pl_module.buffers())]))


def _workloads(mnist_root: str, cifar_root: str) -> dict[str, dict[str, Any]]:
    return {
        "digits": {  # the smoke test's: 8x8 digits, built in, a few seconds a fit
            "data": lambda: DigitsDataModule(batch_size=16),
            "model": lambda: Classifier(mlp((1, 8, 8), 10, hidden=(32,)), 10, lr=0.05, momentum=0.0),
            "epochs": 1,
            "batch": 16,
        },
        "mnist": {
            "data": lambda: MNISTDataModule(root=mnist_root, split="test", batch_size=BATCH),
            "model": lambda: Classifier(mlp((1, 28, 28), 10, hidden=(512,)), 10, lr=0.05, momentum=0.0),
            "epochs": 4,
            "batch": BATCH,
        },
        "cifar10": {
            "data": lambda: CIFAR10DataModule(root=cifar_root, train_size=5000, augment=False, batch_size=BATCH),
            "model": lambda: Classifier(
                small_cnn((3, 32, 32), 10, channels=(16, 32), hidden=64), 10, lr=0.05, momentum=0.0
            ),
            "epochs": 3,
            "batch": BATCH,
        },
    }


def _fit(
    name: str, w: dict[str, Any], dm: ArrayDataModule, factor: float, seed: int, straggler: str, sampler: str
) -> dict[str, Any]:
    torch.manual_seed(seed)
    module: Classifier = w["model"]()
    # a quota slows the whole process (wall time); a spinning straggler burns CPU time
    spin = straggler == "spin"
    strategy, snaps = STRATEGIES[name]("cpu" if spin else "wall", sampler), Snapshots(every=2)
    slow = [Straggler(ranks=SLOW_RANK, factor=factor, mode="spin")] if spin else []
    trainer = quiet_trainer(
        strategy=strategy,
        devices=RANKS,
        max_epochs=w["epochs"],
        check_val_every_n_epoch=100,
        callbacks=[*slow, snaps],
    )
    trainer.fit(module, datamodule=dm)
    wall = snaps.elapsed
    sync, shares_of = getattr(strategy, "sync", None), getattr(strategy, "allocation", None)
    if not isinstance(sync, ServerSync):
        return _synchronous_row(name, wall, trainer.global_step) | {"snaps": snaps.taken, "module": module}
    assert sync.ps is not None
    stats = sync.ps.stats()
    history = shares_of.dbs.history if isinstance(shares_of, SpeedShares) and shares_of.dbs is not None else []
    last = history[-1] if history else {}
    sizes, speeds = last.get("sizes"), last.get("samples_per_s", [])
    server = sync.ps.server  # rank 0: each worker's pushes, and under sampler='shared' the server's split
    pushes = [server.core.stats.workers[r].pushes for r in range(RANKS)] if server is not None else []
    claims = server.core.claims if server is not None else None
    shares = claims.shares if isinstance(claims, ClaimQueue) else None
    if shares is not None:
        sizes, speeds = shares.sizes, shares.speeds
    staleness = _staleness(stats) if server is not None else {}  # the metrics are rank 0's
    row = {
        "strategy": name,
        "wall_s": wall,
        "staleness": staleness,
        "sizes": sizes,
        "speeds": [round(v) for v in speeds],
    }
    row["steps"] = trainer.global_step
    row["pushes"] = pushes
    return row | {"snaps": snaps.taken, "module": module}


def _synchronous_row(name: str, wall: float, steps: int) -> dict[str, Any]:
    """A synchronous fit's row: every gradient is computed on the current model (staleness 0), no pushes."""
    staleness: dict[str, Any] = {"staleness_mean": 0.0, "staleness_worker_mean": 0.0, "staleness_max": 0.0}
    staleness |= {"staleness_by_worker": [0.0] * RANKS, "iteration_s": [wall / steps] * RANKS}
    row = {"strategy": name, "wall_s": wall, "sizes": None, "speeds": [], "steps": steps, "pushes": []}
    return row | {"staleness": staleness}


def _staleness(stats: dict[str, float]) -> dict[str, Any]:
    """Both means of the staleness: over pushes (``ps/staleness_mean``) and over workers' means; the maximum."""
    return {
        "staleness_mean": stats["ps/staleness_mean"],
        "staleness_worker_mean": stats["ps/staleness_worker_mean"],
        "staleness_by_worker": [stats[f"ps/worker{r}/staleness_mean"] for r in range(RANKS)],
        "staleness_max": stats["ps/staleness_max"],
        # each worker's mean time from a reply to its next push: its compute, plus its waits outside the
        # server (the ranks meet at each epoch's end, where a fast rank waits for the straggler)
        "iteration_s": [stats[f"ps/worker{r}/iteration_s"] for r in range(RANKS)],
    }


def _accuracy(module: Classifier, state: list[Tensor], loader: Any) -> float:
    params, buffers = list(module.parameters()), list(module.buffers())
    with torch.no_grad():
        flat, offset = state[0], 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for b, s in zip(buffers, state[1:], strict=True):
            b.copy_(s)
        module.eval()
        correct = total = 0
        for x, y in loader:
            correct += int((module(x).argmax(dim=1) == y).sum())
            total += len(y)
    return correct / total


def _taken_by(snaps: list[tuple[float, list[Tensor]]], t: float) -> tuple[float, list[Tensor]]:
    """The last snapshot ``(time, state)`` taken by wall time ``t`` (the first one if none was)."""
    before = [s for s in snaps if s[0] <= t]
    return before[-1] if before else snaps[0]


def _time_to_target(module: Classifier, fit: dict[str, Any], val: Any, target: float) -> dict[str, Any]:
    """Accuracy at ``CURVE_POINTS`` times evenly over the fit; the first snapshot time reaching ``target``.

    The time is that of the evaluated snapshot (the last one taken by each point), so it is resolved
    to the points' spacing, ``wall / CURVE_POINTS``: a snapshot between two points is not evaluated.
    ``None`` if no point reaches the target. The last point, at the fit's wall time, is the
    snapshot taken at the end of the fit.
    """
    snaps, wall = fit["snaps"], fit["wall_s"]
    curve: list[tuple[float, float]] = []
    for i in range(1, CURVE_POINTS + 1):
        when, state = _taken_by(snaps, wall * i / CURVE_POINTS)
        if curve and curve[-1][0] == when:
            continue
        curve.append((when, _accuracy(module, state, val)))
    reached = next((when for when, acc in curve if acc >= target), None)
    return {"target": target, "time_to_target_s": reached, "curve": curve}


def _work(
    workloads: list[str],
    factors: list[float],
    seed: int,
    mnist_root: str,
    cifar_root: str,
    straggler: str = "spin",
    quotas: RankQuotas | None = None,
    sampler: str = "split",
    epochs: int | None = None,
    target: float | None = None,
) -> list[dict]:
    """One rank of the study: every workload and factor, each strategy fitted in turn; rows on rank 0.

    With ``quotas`` (``straggler='cgroup'``, one factor) the rank first moves into its cgroup,
    before Lightning or the server start any thread (``RANK`` is the harness's torchrun layout).
    ``sampler`` is the strategies' (``'shared'``: the ranks claim batches from the server's queue);
    ``epochs`` replaces every workload's own, ``target`` its :data:`TARGETS` accuracy.
    """
    if quotas is not None:
        quotas.join(int(os.environ["RANK"]))
    torch.set_num_threads(1)  # three ranks on two cores; the training thread's clock holds all compute
    rows: list[dict[str, Any]] = []
    for wname in workloads:
        w = _workloads(mnist_root, cifar_root)[wname]
        w["epochs"] = epochs or w["epochs"]
        dm = w["data"]()
        for factor in factors:
            fits = [_fit(name, w, dm, factor, seed, straggler, sampler) for name in STRATEGIES]
            if torch.distributed.get_rank() != 0:
                continue
            equal = min(f["wall_s"] for f in fits)
            dm.setup("validate")
            val = [dm.on_after_batch_transfer(b, 0) for b in dm.val_dataloader()]
            for f in fits:
                row = {"workload": wname, "factor": factor, "equal_wall_s": equal, "epochs": w["epochs"]}
                row |= {k: f[k] for k in ("strategy", "wall_s", "sizes", "speeds", "steps", "pushes")}
                row |= f["staleness"]
                row["acc_equal_wall"] = _accuracy(f["module"], _taken_by(f["snaps"], equal)[1], val)
                row |= _time_to_target(f["module"], f, val, target or TARGETS[wname])
                row["acc_end"] = row["curve"][-1][1]  # the end-of-fit snapshot, evaluated once
                rows.append(row)
    return rows


def _run(args: argparse.Namespace, factor: float) -> list[dict]:
    """The three ranks for one slowdown ``factor`` (under ``--straggler cgroup``: in their cgroups)."""
    common = (args.workloads, [factor], args.seed, args.mnist_root, args.cifar_root, args.straggler)
    options = (args.sampler, args.epochs, args.target)
    if args.straggler == "spin":
        return run_workers(_work, *common, None, *options, devices=RANKS, timeout=3000)[0]
    with rank_quotas(RANKS, args.share, SLOW_RANK, factor) as quotas:
        # the harness kills and reaps every rank before it returns or raises: the cgroups are empty
        rows = run_workers(_work, *common, quotas, *options, devices=RANKS, timeout=3000)[0]
        throttled = quotas.throttled_s()
        cores = quotas.shares
    for row in rows:
        row |= {"quota_cores": cores, "throttled_s": throttled}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mnist", "cifar10"], choices=("digits", "mnist", "cifar10"))
    parser.add_argument("--factors", nargs="+", type=float, default=[2.0, 4.0])
    parser.add_argument("--straggler", choices=STRAGGLERS, default="cgroup")
    parser.add_argument("--share", type=float, default=SHARE, help="cores of a normal rank under --straggler cgroup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sampler", choices=SAMPLERS, default="split", help="'shared': ranks claim batches from the server's queue"
    )
    parser.add_argument("--epochs", type=int, default=None, help="every workload's epochs (default: its own)")
    parser.add_argument("--target", type=float, default=None, help=f"accuracy for the time to target {TARGETS}")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--report", nargs="+", default=None, help="print the tables of these --out files; run nothing")
    parser.add_argument("--mnist-root", default="../shared/datasets/mnist")
    parser.add_argument("--cifar-root", default="../shared/datasets/cifar10-jpeg.tar.gz")
    args = parser.parse_args()
    if args.report:
        rows = [row for path in args.report for row in json.loads(Path(path).read_text())]
    else:
        exit_on_termination()  # a `timeout` or kill ends the ranks and removes the cgroups on its way out
        rows = [row | {"seed": args.seed, "sampler": args.sampler} for f in args.factors for row in _run(args, f)]
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    print_rows(rows)
    summary(rows, list(STRATEGIES))


if __name__ == "__main__":
    main()
