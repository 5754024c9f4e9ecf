"""Modules written the way users write them (no strategy-specific attributes) and a consensus check."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_hier.layers import full_state_dict

__all__ = ["BoringModel", "SameWeightsOnEveryRank", "UserModule"]


class UserModule(pl.LightningModule):
    """The network in ``self.model``, no ``forward``, a bare-tensor batch, the loss in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.model(batch), torch.zeros(batch.shape[0], 2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)


class SameWeightsOnEveryRank(Callback):
    """Fails the fit unless every rank holds the same whole (gathered) model when fit ends."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        flat = torch.cat([t.detach().reshape(-1).double() for t in full_state_dict(pl_module).values()])
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        for rank, other in enumerate(gathered):
            assert torch.equal(other, flat), f"rank {rank} ends with other weights than rank {trainer.global_rank}"
