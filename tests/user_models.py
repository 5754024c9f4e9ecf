"""Modules written the way users write them (no strategy-specific attributes) and a consensus check."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier.layers import full_state_dict

__all__ = ["BoringModel", "SameWeightsOnEveryRank", "UserClassifier", "UserModule"]


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


class UserClassifier(pl.LightningModule):
    """A classifier with its network under ``self.model``, ``(x, y)`` batches, Nesterov SGD, logging."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(96, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8, shuffle=True)


class SameWeightsOnEveryRank(Callback):
    """Fails the fit unless every rank holds the same whole (gathered) model in ``on_train_end``.

    A user's hook: it runs before the strategy's own ``on_train_end``, so it sees what every
    strategy promises to have finished right after the last optimizer step.
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flat = torch.cat([t.detach().reshape(-1).double() for t in full_state_dict(pl_module).values()])
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        for rank, other in enumerate(gathered):
            assert torch.equal(other, flat), f"rank {rank} ends with other weights than rank {trainer.global_rank}"
