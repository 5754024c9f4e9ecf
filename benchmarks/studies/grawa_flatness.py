"""GRAWA's claims at CPU scale: accuracy, wall time, bytes and flatness at the end, sync and async rounds.

DDP, Local SGD, EASGD, LSGD, MGRAWA and LGRAWA (lock-step rounds) and MGRAWA / LGRAWA with
``rounds='async'`` train the same MLP on the 8x8 digits in the same two forked CPU ranks, one after
the other, without and with a straggler (rank 1 slowed by ``--factors``, the library's
``Straggler`` callback in sleep mode). Every averaging method uses the same ``tau``, so they send
the same bytes per epoch (DDP: ``tau`` times more). At the end, on rank 0, the consensus model's
flatness on fixed training batches (eval mode): Hutchinson's estimate of the Hessian trace and the
top Hessian eigenvalue by power iteration (:mod:`lightning_hier.algorithms.flatness`), as the
authors' shipped table reports. Two workloads: ``digits`` (the MLP on the 8x8 digits) and
``cifar10`` (the small CNN of the ``grawa_cnn`` benchmark on a CIFAR-10 subset, the released
script's optimizer with a warm-up).
Run from the repository root::

    python -m benchmarks.studies.grawa_flatness --epochs 6 --seeds 0 --factors 1 4
    python -m benchmarks.studies.grawa_flatness --workload cifar10 --train-size 4000 --epochs 3 \
        --seeds 0 --factors 1 --out rows-1x-s0.json       # one locked run per (factor, seed)
    python -m benchmarks.studies.grawa_flatness --tables rows-*.json   # the merged table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from benchmarks.studies._trainer import quiet_trainer
from lightning_hier import EasgdStrategy, GrawaStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.algorithms.flatness import hutchinson_trace, top_eigenvalue
from lightning_hier.callbacks import Straggler
from lightning_hier.data import CIFAR10DataModule, DigitsDataModule
from lightning_hier.data.arrays import Arrays
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.models import Classifier, mlp, small_cnn
from lightning_hier.testing import run_workers

METHODS = (
    "ddp",
    "localsgd",
    "easgd",
    "lsgd",
    "mgrawa",
    "lgrawa",
    "mgrawa_async",
    "lgrawa_async",
    "mgrawa_async_shared",
    "lgrawa_async_shared",
)
"""``*_async``: ``rounds='async'``; ``*_async_shared``: also ``sampler='shared'`` (a fast rank trains more)."""


class _Timeline(Callback):
    """Validation accuracy with the wall time since the start of fit and rank 0's bytes, at every validation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.points: list[tuple[float, float]] = []
        self.bytes: list[tuple[float, float]] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            acc = float(trainer.callback_metrics["val/acc"])
            self.points.append((time.perf_counter() - self.start, acc))
            self.bytes.append((_bytes_sent(trainer), acc))


def _bytes_sent(trainer: pl.Trainer) -> float:
    """Rank 0's payload bytes so far (DDP: P floats per step, counted; it keeps no account)."""
    stats = getattr(trainer.strategy, "comm_stats", None)
    if stats is not None:
        return float(stats.bytes)
    module = trainer.lightning_module
    return float(4 * sum(p.numel() for p in module.parameters()) * trainer.global_step)


def _strategy(method: str, tau: int) -> Any:
    common: dict[str, Any] = {"timeout": 120}
    if method == "ddp":
        return "ddp"
    if "grawa" in method:
        variant = "layer" if method.startswith("l") else "model"
        rounds = "async" if "_async" in method else "sync"
        sampler = "shared" if method.endswith("_shared") else "split"
        return GrawaStrategy(variant=variant, tau=tau, rounds=rounds, sampler=sampler, **common)
    cls = {"localsgd": LocalSGDStrategy, "easgd": EasgdStrategy, "lsgd": LsgdStrategy}[method]
    return cls(tau=tau, **common)


class _CifarSubset(CIFAR10DataModule):
    """CIFAR-10 validated on ``val_size`` test images (a fixed random subset of them)."""

    def __init__(self, val_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_size = val_size

    @override
    def load_arrays(self) -> Arrays:
        a = super().load_arrays()
        keep = torch.randperm(len(a.y_val), generator=torch.Generator().manual_seed(0))[: self.val_size]
        return dataclasses.replace(a, x_val=a.x_val[keep], y_val=a.y_val[keep])


def _workload(args: argparse.Namespace) -> tuple[ArrayDataModule, Classifier]:
    """The data and a fresh model of ``args.workload`` (seed the RNG first)."""
    if args.workload == "digits":
        return DigitsDataModule(batch_size=32), Classifier(mlp((1, 8, 8), 10, hidden=tuple(args.hidden)), 10, lr=0.1)
    dm = _CifarSubset(args.val_size, root=args.data_root, train_size=args.train_size, batch_size=args.batch_size)
    # the grawa_cifar10_cnn recipe's optimizer (the released script's, plus a warm-up)
    module = Classifier(
        small_cnn((3, 32, 32), 10),
        10,
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-4,
        scheduler=args.scheduler,
        warmup_steps=args.warmup,
    )
    return dm, module


def _flatness(module: Classifier, dm: ArrayDataModule, args: argparse.Namespace) -> tuple[float, float]:
    loader = dm.train_dataloader()
    # normalised as in validation (the trainer is not training, so no augmentation)
    data = [dm.on_after_batch_transfer(b, 0) for _, b in zip(range(args.flat_batches), loader, strict=False)]
    module.eval()
    params = [p for p in module.parameters() if p.requires_grad]

    def loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(module(x), y)

    trace = hutchinson_trace(params, loss, data, probes=args.probes, seed=0).trace
    eig = top_eigenvalue(params, loss, data, max_iterations=args.power_iterations, tol=1e-3, seed=0).eigenvalue
    return trace, eig


def _work(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for factor in args.factors:
        for seed in args.seeds:
            for method in args.methods:
                torch.manual_seed(seed)
                dm, module = _workload(args)
                timeline = _Timeline()
                callbacks: list[Callback] = [timeline]
                if factor > 1:
                    callbacks.append(Straggler(ranks=[1], factor=factor))
                strategy = _strategy(method, args.tau)
                trainer = quiet_trainer(
                    strategy=strategy,
                    devices=2,
                    max_epochs=args.epochs,
                    callbacks=callbacks,
                )
                start = time.perf_counter()
                trainer.fit(module, datamodule=dm)
                wall = time.perf_counter() - start
                acc = float(trainer.validate(module, datamodule=dm, verbose=False)[0]["val/acc"])
                sent = _bytes_sent(trainer)
                trace, eig = _flatness(module, dm, args) if trainer.is_global_zero else (0, 0)
                metrics = getattr(trainer.strategy, "last_metrics", {})
                rows.append(
                    {
                        "factor": factor,
                        "seed": seed,
                        "method": method,
                        "acc": acc,
                        "wall_s": wall,
                        "bytes": sent,
                        "timeline": timeline.points,
                        "bytes_timeline": timeline.bytes,
                        "trace": trace,
                        "eig": eig,
                        "staleness": metrics.get("ps/staleness_mean"),
                    }
                )
    return rows


def _acc_at(points: list[tuple[float, float]], t: float) -> float | None:
    """The last accuracy reached at or before ``t`` (seconds or bytes); ``None`` before the first point."""
    before = [acc for s, acc in points if s <= t * (1 + 1e-9)]
    return before[-1] if before else None


def _time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The wall time of the first validation at or above ``target``; ``None`` if none reached it."""
    return next((t for t, acc in points if acc >= target), None)


def _mean(values: list[Any], spec: str) -> str:
    present = [v for v in values if v is not None]
    return format(statistics.mean(present), spec) if present else "-"


def _table(rows: list[dict[str, Any]], target: float | None = None) -> str:
    """Markdown: one line per (straggler, method), means over the seeds; with ``target``, the time to it.

    The time to ``target`` is the mean over the seeds that reached it, with how many did (``n/N``).
    """
    methods = list(dict.fromkeys(r["method"] for r in rows))
    factors = sorted({r["factor"] for r in rows})
    extra = f" s to {target:g} |" if target is not None else ""
    lines = [
        "| straggler | method | seeds | acc (end) | acc at t* | acc at b* | wall s | MB sent (rank 0) | Hessian trace "
        f"| top eigenvalue | staleness |{extra}",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if extra else ""),
    ]
    for factor in factors:
        sel = [r for r in rows if r["factor"] == factor]
        present = [m for m in methods if any(r["method"] == m for r in sel)]
        t_star = min(statistics.mean(r["wall_s"] for r in sel if r["method"] == m) for m in present)
        b_star = min(statistics.mean(r["bytes"] for r in sel if r["method"] == m) for m in present)
        for m in present:
            rs = [r for r in sel if r["method"] == m]
            cells = [
                str(len(rs)),
                _mean([r["acc"] for r in rs], ".4f"),
                _mean([_acc_at(r["timeline"], t_star) for r in rs], ".4f"),
                _mean([_acc_at(r.get("bytes_timeline", []), b_star) for r in rs], ".4f"),
                _mean([r["wall_s"] for r in rs], ".1f"),
                _mean([r["bytes"] / 1e6 for r in rs], ".1f"),
                _mean([r["trace"] for r in rs], ".2f"),
                _mean([r["eig"] for r in rs], ".3f"),
                _mean([r["staleness"] for r in rs], ".2f"),
            ]
            if target is not None:
                reached = [t for r in rs if (t := _time_to(r["timeline"], target)) is not None]
                cells.append(f"{_mean(reached, '.1f')} ({len(reached)}/{len(rs)})")
            lines.append(f"| {factor:g}x | {m} | " + " | ".join(cells) + " |")
        lines.append(
            f"| {factor:g}x | t* = {t_star:.1f} s (fastest mean wall time), b* = {b_star / 1e6:.1f} MB "
            "(fewest mean bytes) | | | | | | | | | |" + (" |" if extra else "")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="digits", choices=("digits", "cifar10"))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--tau", type=int, default=8)
    parser.add_argument("--hidden", nargs="+", type=int, default=[256, 256], help="digits MLP widths")
    parser.add_argument("--data-root", default="../shared/datasets/cifar10-jpeg.tar.gz", help="cifar10 source")
    parser.add_argument("--train-size", type=int, default=4000, help="cifar10 training subset")
    parser.add_argument("--val-size", type=int, default=2000, help="cifar10 validation images (test subset)")
    parser.add_argument("--batch-size", type=int, default=64, help="cifar10 batch per rank")
    parser.add_argument("--warmup", type=int, default=20, help="cifar10 warm-up steps")
    parser.add_argument(
        "--scheduler",
        default="cosine",
        choices=("cosine", "none"),
        help="cifar10 learning rate after the warm-up: a cosine over the fit, or constant (needed by *_shared)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--factors", nargs="+", type=float, default=[1.0, 4.0])
    parser.add_argument("--flat-batches", type=int, default=8)
    parser.add_argument("--probes", type=int, default=32)
    parser.add_argument("--power-iterations", type=int, default=100)
    parser.add_argument("--out", help="also write the rows to this JSON file")
    parser.add_argument("--tables", nargs="+", help="print the table of these JSON files of rows; train nothing")
    parser.add_argument("--target", type=float, help="also the wall time to this validation accuracy")
    args = parser.parse_args()
    shared = [m for m in args.methods if m.endswith("_shared")]
    if shared and args.workload == "cifar10" and args.scheduler == "cosine":
        parser.error(
            f"--methods {' '.join(shared)}: with sampler='shared' the epoch has no length, so a cosine over the fit "
            "cannot be sized; add --scheduler none (every method then trains at a constant rate after the warm-up)."
        )
    if args.tables:
        rows = [r for path in args.tables for r in json.loads(Path(path).read_text())]
    else:
        rows = run_workers(_work, args, devices=2, timeout=3600)[0]
        if args.out:
            Path(args.out).write_text(json.dumps(rows))
    print(_table(rows, args.target))


if __name__ == "__main__":
    main()
