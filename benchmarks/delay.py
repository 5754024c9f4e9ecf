"""The benchmark's own delay-mode straggler, used until ``lightning_hier.callbacks.straggler`` exists.

It follows that callback's protocol (``Straggler(ranks=[...], factor=...)``, built on every rank,
slowing the listed ones), so either plugs into ``--straggler-mode delay``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class SleepStraggler(Callback):
    """Makes the listed ranks ``factor`` times slower by sleeping after each training batch.

    The sleep is ``(factor - 1)`` times the batch's compute, estimated as 3x its forward time
    (backward costs about two forwards). The forward is timed because, unlike the backward, it
    holds no gradient communication under DDP, so the delay does not grow with the network.

    Args:
        ranks: Global ranks to slow down (other ranks are untouched).
        factor: Slow-down factor (> 1).
        clock: Time source (tests inject a fake one).
        sleep: Sleep function (tests inject a fake one).
    """

    def __init__(
        self,
        ranks: list[int],
        factor: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if factor <= 1.0:
            raise ValueError(f"SleepStraggler: argument `factor` must be > 1, got {factor!r}.")
        self.ranks = list(ranks)
        self.factor = factor
        self.clock, self.sleep = clock, sleep
        self.slept_s = 0.0
        self._start: float | None = None
        self._forward_s = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._forward_s = 0.0
        self._start = self.clock() if trainer.global_rank in self.ranks else None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._start is not None:
            self._forward_s = self.clock() - self._start

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        delay = (self.factor - 1.0) * 3.0 * self._forward_s
        if delay > 0:
            self.sleep(delay)
            self.slept_s += delay
        self._start = None
