"""One LightningModule for every classification experiment of this package."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_hier import _validate as v

OPTIMIZERS = ("sgd", "adamw")
SCHEDULERS = ("none", "cosine")


class Classifier(pl.LightningModule):
    """Cross-entropy classification of any network, with torchmetrics accuracy.

    Args:
        net: The network (e.g. :func:`~lightning_hier.models.mlp`); an ``nn.Sequential`` of
            blocks if a pipeline strategy should cut it.
        num_classes: Number of classes.
        optimizer: ``'sgd'`` or ``'adamw'``.
        lr: Learning rate.
        momentum: SGD momentum.
        nesterov: Nesterov momentum (SGD).
        weight_decay: Weight decay.
        scheduler: ``'none'`` or ``'cosine'`` (per step, over the whole fit, after warm-up).
        warmup_steps: Linear learning-rate warm-up steps.
        label_smoothing: Label smoothing of the loss.

    Logged: ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` (``test/...`` likewise).
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        scheduler: str = "none",
        warmup_steps: int = 0,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        v.check_int(owner, "num_classes", num_classes, minimum=2)
        v.check_choice(owner, "optimizer", optimizer, OPTIMIZERS)
        v.check_float(owner, "lr", lr, low=0.0, low_inclusive=False)
        v.check_float(owner, "momentum", momentum, 0.0, 1.0, high_inclusive=False)
        v.check_float(owner, "weight_decay", weight_decay, low=0.0)
        v.check_choice(owner, "scheduler", scheduler, SCHEDULERS)
        v.check_int(owner, "warmup_steps", warmup_steps, minimum=0)
        v.check_float(owner, "label_smoothing", label_smoothing, 0.0, 1.0, high_inclusive=False)
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss(self, logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits, y, label_smoothing=self.hparams["label_smoothing"])

    def pipeline_loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """The training loss a pipeline strategy computes on its last stage (it bypasses ``training_step``)."""
        return self._loss(logits, y)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self._loss(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(y))
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, metric: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        metric(logits, y)
        self.log(f"{stage}/loss", self._loss(logits, y), sync_dist=True, batch_size=len(y))
        self.log(f"{stage}/acc", metric, prog_bar=True, batch_size=len(y))

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp["optimizer"] == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(),
                lr=hp["lr"],
                momentum=hp["momentum"],
                nesterov=hp["nesterov"] and hp["momentum"] > 0,
                weight_decay=hp["weight_decay"],
            )
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
        if hp["scheduler"] == "none" and hp["warmup_steps"] == 0:
            return opt
        total = self._fit_steps() if hp["scheduler"] == "cosine" else 0  # a warm-up alone needs no length
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _Schedule(hp["scheduler"], hp["warmup_steps"], total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _fit_steps(self) -> int:
        """Optimizer steps of the whole fit, which the cosine spans.

        Raises:
            ValueError: The Trainer cannot tell (a training loader without a length and no
                ``max_steps``).
        """
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps) or steps < 1:  # Lightning gives max_steps (-1: unset) for a loader of no length
            raise ValueError(
                f"{type(self).__name__}: scheduler='cosine' spans the whole fit, but the Trainer cannot tell how many "
                f"steps it has (trainer.estimated_stepping_batches is {steps}: the training loader has no length, "
                "as with an IterableDataset, and no max_steps is set). Set Trainer(max_steps=...) or use "
                "scheduler='none' (a warm-up still works)."
            )
        return max(1, int(steps))


class _Schedule:
    """Warm-up then cosine (or constant) factor; a class, not a closure, so spawn can pickle it."""

    def __init__(self, kind: str, warmup: int, total: int) -> None:
        self.kind, self.warmup, self.total = kind, warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "cosine":
            progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
            return 0.5 * (1.0 + float(torch.cos(torch.tensor(progress * torch.pi))))
        return 1.0
