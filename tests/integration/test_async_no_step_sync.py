"""Asynchronous strategies, and HPSGD inside a window, are not held in lock-step by Lightning's per-step
SIGTERM broadcast (under HPSGD it would wait behind the window's reduction in flight)."""

import os
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_hier import AsgdStrategy, AsyncDBSStrategy, GrawaStrategy, HPSGDStrategy
from lightning_hier.testing import run_workers
from tests.helpers import digits, digits_classifier, trainer

AHEAD = 3  # steps rank 0 must finish while rank 1 is still in its first batch
WAIT_S = 15.0  # generous: under lock-step rank 0 cannot finish even one more step, however long this is


class HoldFirstBatch(Callback):
    """Rank 1 holds its first batch until rank 0 has finished ``AHEAD`` steps (a file says so), or ``WAIT_S``."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag
        self.saw_rank0_ahead: bool | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int) -> None:
        if trainer.global_rank == 1 and self.saw_rank0_ahead is None:
            deadline = time.monotonic() + WAIT_S
            while not self.flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.saw_rank0_ahead = self.flag.exists()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_rank == 0 and trainer.global_step == AHEAD:
            self.flag.touch()


def _fit(name: str, flag: Path) -> bool | None:
    strategy: AsgdStrategy | AsyncDBSStrategy | GrawaStrategy | HPSGDStrategy
    if name == "hpsgd":  # the ranks meet at each window's end: 8 steps
        strategy = HPSGDStrategy(window=8, timeout=60)
    elif name == "asgd":
        strategy = AsgdStrategy(timeout=60)
    elif name == "mgrawa_async":  # a worker meets the server only after its own tau steps
        strategy = GrawaStrategy(variant="model", rounds="async", tau=8, timeout=60)
    else:  # its allocation's all-gathers (a designed meeting point) only after the test's steps
        strategy = AsyncDBSStrategy(rebalance_every=50, warmup_steps=0, timeout=60)
    hold = HoldFirstBatch(flag)
    trainer(strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), max_epochs=1, callbacks=[hold]).fit(
        digits_classifier(), digits(batch_size=8)
    )
    return hold.saw_rank0_ahead


@pytest.mark.parametrize("name", ["asgd", "dbs_async", "mgrawa_async", "hpsgd"])
def test_a_fast_worker_runs_ahead_of_a_held_one(tmp_path, name):
    assert run_workers(_fit, name, tmp_path / "ahead", devices=2, timeout=90)[1] is True
