"""Training throughput over all data-parallel replicas, measured without validation time."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def _batch_size(batch: Any) -> int:
    if isinstance(batch, list | tuple) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    return 0


class SampleThroughput(Callback):
    """Logs ``throughput/samples_per_s`` (whole fit so far), ``time/epoch_s`` and ``progress/epochs``.

    Samples are counted on every rank and summed over the data-parallel replicas (ranks of one
    replica, e.g. pipeline stages, see the same samples and count once). Validation time is
    excluded from both numbers.

    Not Lightning's ``lightning.pytorch.callbacks.ThroughputMonitor`` (per-device rates and FLOPs
    from a user-supplied batch-size function): this one needs no arguments and reports the whole
    job's training rate, which is what the run summary and the sweep table compare.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.train_seconds = 0.0
        self._epoch_start = 0.0
        self._val_seconds = 0.0
        self._val_start = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.samples, self.train_seconds = 0, 0.0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        self._val_seconds = 0.0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += _batch_size(batch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the sanity check's time is dropped by the reset at the first epoch start
        self._val_seconds += time.perf_counter() - self._val_start

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch_s = time.perf_counter() - self._epoch_start - self._val_seconds
        self.train_seconds += epoch_s
        strategy = trainer.strategy
        total = torch.tensor(float(self.samples), device=pl_module.device)
        total = strategy.reduce(total, reduce_op="sum")
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        replicas = int(kwargs.get("num_replicas", trainer.world_size)) or 1
        samples = float(total) * replicas / max(1, trainer.world_size)
        # identical on every rank; "max" only satisfies Lightning's epoch-level sync check
        pl_module.log(
            "throughput/samples_per_s", samples / max(self.train_seconds, 1e-9), reduce_fx="max", sync_dist=True
        )
        pl_module.log("time/epoch_s", epoch_s, reduce_fx="max", sync_dist=True)
        # callback_metrics travel back to the main process under spawn/fork; the loop counters do not
        pl_module.log("progress/epochs", float(trainer.current_epoch + 1), reduce_fx="max", sync_dist=True)
