"""Small building blocks for tests that run real fits in forked ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_hier.data import DigitsDataModule
from lightning_hier.models import Classifier, mlp


def trainer(**overrides: Any) -> pl.Trainer:
    """A quiet CPU Trainer with 2 processes; keyword arguments override the defaults."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def digits_classifier(
    hidden: tuple[int, ...] = (32,), dropout: float = 0.0, lr: float = 0.1, **optim: Any
) -> Classifier:
    """An MLP classifier for the 8x8 digits."""
    return Classifier(mlp((1, 8, 8), 10, hidden=hidden, dropout=dropout), 10, lr=lr, **optim)


def digits(batch_size: int = 32, **kwargs: Any) -> DigitsDataModule:
    return DigitsDataModule(batch_size=batch_size, **kwargs)


def flat_params(module: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def assert_resumed_run_continues(full: list[dict], resumed: list[dict], after_step: int) -> None:
    """Each rank's resumed run records, step for step, the same parameters as the uninterrupted run.

    ``full`` and ``resumed`` hold one ``{"steps": [...], "params": [...]}`` per rank (a
    :class:`ParamRecorder`'s lists); the resumed run started from the checkpoint at ``after_step``.
    """
    for rank, (a, b) in enumerate(zip(full, resumed, strict=True)):
        tail = {s: p for s, p in zip(a["steps"], a["params"], strict=True) if s > after_step}
        assert b["steps"] == sorted(tail), f"rank {rank} resumed at the wrong step"
        for s, p in zip(b["steps"], b["params"], strict=True):
            assert torch.equal(p, tail[s]), f"rank {rank} differs at step {s}"


class ParamRecorder(Callback):
    """Records the flattened parameters after every optimizer step (rank-local)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.params: list[Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.steps.append(trainer.global_step)
        self.params.append(flat_params(pl_module))
