"""Small building blocks for tests that run real fits in forked ranks."""

from __future__ import annotations

from pathlib import Path
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


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from ``/proc``)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def flat_params(module: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class ParamRecorder(Callback):
    """Records the flattened parameters after every optimizer step (rank-local)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.params: list[Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.steps.append(trainer.global_step)
        self.params.append(flat_params(pl_module))


def assert_resumed_run_matches(
    full: list[dict], resumed: list[dict], after_step: int, until_step: int | None = None
) -> None:
    """Every rank's resumed run repeats the uninterrupted one bit for bit after ``after_step``.

    ``full`` and ``resumed`` hold, per rank, the ``steps`` and ``params`` of a :class:`ParamRecorder`;
    parameters are compared up to ``until_step`` (``None``: all).
    """
    for rank, (whole, part) in enumerate(zip(full, resumed, strict=True)):
        tail = {s: p for s, p in zip(whole["steps"], whole["params"], strict=True) if s > after_step}
        assert part["steps"] == sorted(tail), f"rank {rank} resumed at other steps"
        for s, p in zip(part["steps"], part["params"], strict=True):
            if until_step is None or s <= until_step:
                assert torch.equal(p, tail[s]), f"rank {rank} differs at step {s}"


def argument(strategy: Any, name: str) -> Any:
    """The value a strategy keeps for its constructor argument ``name``: on the strategy or one of its objects."""
    holders = [strategy, getattr(strategy, "sync", None), getattr(strategy, "allocation", None)]
    sync = holders[1]
    holders += [getattr(sync, "levels", None), getattr(sync, "norms", None)]
    for holder in holders:
        if holder is not None and hasattr(holder, name):
            return getattr(holder, name)
    raise AttributeError(f"{type(strategy).__name__} keeps no argument {name!r}")
