"""Modules written the way users write them (no strategy-specific attributes) and a consensus check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier.layers import full_state_dict

__all__ = ["BoringModel", "SameWeightsOnEveryRank", "UserClassifier", "UserGAN", "UserModule"]


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


class UserGAN(pl.LightningModule):
    """A GAN as Lightning's docs write one: two optimizers, manual optimization, the generator then the critic.

    Learns to generate 2-d points near the unit circle. ``steps`` counts every ``opt.step()``.
    """

    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake, g_loss = self.generator_step(real.shape[0], batch_idx, opt_g, self.manual_backward)
        d_loss = self.discriminator_step(real, fake, opt_d, self.manual_backward)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def generator_step(
        self, n: int, batch_idx: int, opt: Any, backward: Callable[[Tensor], None]
    ) -> tuple[Tensor, Tensor]:
        noise = torch.randn(n, 4, generator=torch.Generator().manual_seed(batch_idx))
        fake = self.generator(noise)
        loss = nn.functional.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(n, 1))
        opt.zero_grad()
        backward(loss)
        opt.step()
        return fake.detach(), loss.detach()

    def discriminator_step(self, real: Tensor, fake: Tensor, opt: Any, backward: Callable[[Tensor], None]) -> Tensor:
        bce = nn.functional.binary_cross_entropy_with_logits
        d_real, d_fake = self.discriminator(real), self.discriminator(fake)
        loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        opt.zero_grad()
        backward(loss)
        opt.step()
        return loss.detach()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        g = torch.optim.SGD(self.generator.parameters(), lr=self.lr, momentum=self.momentum)
        d = torch.optim.SGD(self.discriminator.parameters(), lr=self.lr, momentum=self.momentum)
        return g, d

    def train_dataloader(self) -> DataLoader:
        angle = torch.rand(128, generator=torch.Generator().manual_seed(0)) * 6.2832
        return DataLoader(TensorDataset(torch.stack([angle.cos(), angle.sin()], 1)), batch_size=8)


class SameWeightsOnEveryRank(Callback):
    """Fails the fit unless every rank holds the same whole (gathered) model in ``on_train_end``.

    A user's hook: it runs before the strategy's own ``on_train_end``, so it sees what every
    strategy promises to have finished right after the last optimizer step.

    Args:
        buffers: Compare the buffers too (BatchNorm statistics). Lightning's DDP broadcasts rank
            0's buffers at the start of each forward, so after the last training forward they differ
            there; its peers (``ddp_*``) are compared on parameters.
    """

    def __init__(self, buffers: bool = True) -> None:
        self.buffers = buffers

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = {name for name, _ in pl_module.named_parameters()}
        state = {k: v for k, v in full_state_dict(pl_module).items() if self.buffers or k in params}
        flat = torch.cat([t.detach().reshape(-1).double() for t in state.values()])
        gathered = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        for rank, other in enumerate(gathered):
            assert torch.equal(other, flat), f"rank {rank} ends with other weights than rank {trainer.global_rank}"
