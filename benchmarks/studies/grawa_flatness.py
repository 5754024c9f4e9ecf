"""GRAWA's claims at CPU scale: accuracy, wall time, bytes and flatness at the end, sync and async rounds.

DDP, Local SGD, EASGD, LSGD, MGRAWA and LGRAWA (lock-step rounds) and MGRAWA / LGRAWA with
``rounds='async'`` train the same MLP on the 8x8 digits in the same two forked CPU ranks, one after
the other, without and with a straggler (rank 1 slowed by ``--factors``, the library's
``Straggler`` callback in sleep mode). Every averaging method uses the same ``tau``, so they send
the same bytes per epoch (DDP: ``tau`` times more). At the end, on rank 0, the consensus model's
flatness on fixed training batches (eval mode): Hutchinson's estimate of the Hessian trace and the
top Hessian eigenvalue by power iteration (:mod:`lightning_hier.algorithms.flatness`), as the
authors' shipped table reports. Run from the repository root::

    python -m benchmarks.studies.grawa_flatness --epochs 6 --seeds 0 --factors 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from benchmarks.studies._trainer import quiet_trainer
from lightning_hier import EasgdStrategy, GrawaStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.algorithms.flatness import hutchinson_trace, top_eigenvalue
from lightning_hier.callbacks import Straggler
from lightning_hier.data import DigitsDataModule
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers

METHODS = ("ddp", "localsgd", "easgd", "lsgd", "mgrawa", "lgrawa", "mgrawa_async", "lgrawa_async")


class _Timeline(Callback):
    """Validation accuracy with the wall time since the start of fit, at every validation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.points: list[tuple[float, float]] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.points.append((time.perf_counter() - self.start, float(trainer.callback_metrics["val/acc"])))


def _strategy(method: str, tau: int) -> Any:
    common: dict[str, Any] = {"timeout": 120}
    if method == "ddp":
        return "ddp"
    if method.endswith("grawa") or method.endswith("_async"):
        variant = "layer" if method.startswith("l") else "model"
        rounds = "async" if method.endswith("_async") else "sync"
        return GrawaStrategy(variant=variant, tau=tau, rounds=rounds, **common)
    cls = {"localsgd": LocalSGDStrategy, "easgd": EasgdStrategy, "lsgd": LsgdStrategy}[method]
    return cls(tau=tau, **common)


def _flatness(module: Classifier, dm: DigitsDataModule, batches: int, probes: int) -> tuple[float, float]:
    loader = dm.train_dataloader()
    data = [b for _, b in zip(range(batches), loader, strict=False)]
    module.eval()
    params = [p for p in module.parameters() if p.requires_grad]

    def loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(module(x), y)

    trace = hutchinson_trace(params, loss, data, probes=probes, seed=0).trace
    eig = top_eigenvalue(params, loss, data, max_iterations=100, tol=1e-3, seed=0).eigenvalue
    return trace, eig


def _work(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    dm = DigitsDataModule(batch_size=32)
    for factor in args.factors:
        for seed in args.seeds:
            for method in args.methods:
                torch.manual_seed(seed)
                module = Classifier(mlp((1, 8, 8), 10, hidden=tuple(args.hidden)), 10, lr=0.1)
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
                steps = trainer.global_step
                params = sum(p.numel() for p in module.parameters())
                sent = 4 * params * steps if method == "ddp" else trainer.strategy.comm_stats.bytes  # type: ignore[attr-defined]
                trace, eig = _flatness(module, dm, args.flat_batches, args.probes) if trainer.is_global_zero else (0, 0)
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
                        "trace": trace,
                        "eig": eig,
                        "staleness": metrics.get("ps/staleness_mean"),
                    }
                )
    return rows


def _acc_at(points: list[tuple[float, float]], t: float) -> float | None:
    before = [acc for s, acc in points if s <= t]
    return before[-1] if before else None


def _mean(values: list[Any], spec: str) -> str:
    present = [v for v in values if v is not None]
    return format(statistics.mean(present), spec) if present else "-"


def _table(rows: list[dict[str, Any]], methods: list[str], factors: list[float]) -> str:
    lines = [
        "| straggler | method | acc (end) | acc at t* | wall s | MB sent (rank 0) | Hessian trace | top eigenvalue "
        "| staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for factor in factors:
        sel = [r for r in rows if r["factor"] == factor]
        t_star = min(statistics.mean(r["wall_s"] for r in sel if r["method"] == m) for m in methods)
        for m in methods:
            rs = [r for r in sel if r["method"] == m]
            cells = [
                _mean([r["acc"] for r in rs], ".4f"),
                _mean([_acc_at(r["timeline"], t_star) for r in rs], ".4f"),
                _mean([r["wall_s"] for r in rs], ".1f"),
                _mean([r["bytes"] / 1e6 for r in rs], ".1f"),
                _mean([r["trace"] for r in rs], ".2f"),
                _mean([r["eig"] for r in rs], ".3f"),
                _mean([r["staleness"] for r in rs], ".2f"),
            ]
            lines.append(f"| {factor:g}x | {m} | " + " | ".join(cells) + " |")
        lines.append(f"| {factor:g}x | t* = {t_star:.1f} s (fastest mean wall time) | | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--tau", type=int, default=8)
    parser.add_argument("--hidden", nargs="+", type=int, default=[256, 256])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--factors", nargs="+", type=float, default=[1.0, 4.0])
    parser.add_argument("--flat-batches", type=int, default=8)
    parser.add_argument("--probes", type=int, default=32)
    args = parser.parse_args()
    rows = run_workers(_work, args, devices=2, timeout=3600)[0]
    print(_table(rows, args.methods, args.factors))


if __name__ == "__main__":
    main()
