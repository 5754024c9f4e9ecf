"""Every registered strategy, by name at default arguments, on modules this project did not write.

A user sets ``strategy="..."`` in an existing project: Lightning's own ``BoringModel`` (one
``nn.Linear`` in ``self.layer``, dict outputs) and a user-style classifier that keeps its network
in ``self.model`` must train under every name with the fork launcher, and every data-parallel
strategy must leave the same model on every rank by the time user ``on_train_end`` hooks run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hier  # noqa: F401  (registers the strategy names)

# every name a user can pass (the `_fork` variant of each is what runs here)
DATA_PARALLEL = (
    "localsgd",
    "easgd",
    "lsgd",
    "grawa",
    "mgrawa",
    "lgrawa",
    "hpsgd",
    "dbs",
    "ddp_post_local_sgd",
    "ddp_powersgd",
    "ddp_fp16",
)
MODEL_PARALLEL = ("decoupled", "grid2d")


class UserClassifier(pl.LightningModule):
    """A user's module: the network under ``self.model``, Nesterov SGD, its own DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 16, generator=g)
        return DataLoader(TensorDataset(x, (x[:, :4].argmax(1))), batch_size=8, shuffle=True)


class RanksAgree(Callback):
    """Writes, from rank 0's ``on_train_end``, whether every rank holds the same finite model."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        everyone = trainer.strategy.all_gather(flat)
        if trainer.is_global_zero:
            same = all(torch.equal(everyone[0], other) for other in everyone[1:])
            self.out.write_text(f"{same} {bool(flat.isfinite().all())} {trainer.global_step}")


def _fit(name: str, module: pl.LightningModule, tmp_path: Path) -> tuple[bool, bool, int]:
    out = tmp_path / "agree.txt"
    trainer = pl.Trainer(
        strategy=f"{name}_fork",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[RanksAgree(out)],
    )
    trainer.fit(module)
    same, finite, steps = out.read_text().split()
    return same == "True", finite == "True", int(steps)


@pytest.mark.parametrize("module_cls", [BoringModel, UserClassifier], ids=["BoringModel", "UserClassifier"])
@pytest.mark.parametrize("name", DATA_PARALLEL)
def test_data_parallel_strategy_trains_a_users_module_at_default_arguments(name, module_cls, tmp_path):
    same, finite, steps = _fit(name, module_cls(), tmp_path)
    assert steps > 0 and finite
    assert same, f"{name}: ranks differ in on_train_end"


@pytest.mark.parametrize("module_cls", [BoringModel, UserClassifier], ids=["BoringModel", "UserClassifier"])
@pytest.mark.parametrize("name", MODEL_PARALLEL)
def test_model_parallel_strategy_trains_a_users_module_at_default_arguments(name, module_cls, tmp_path):
    _, finite, steps = _fit(name, module_cls(), tmp_path)
    assert steps > 0 and finite
