"""A 2-process fit where rank 1 raises or hangs at its third batch.

``tests/distributed/test_failures.py`` imports :func:`fit` and runs it under the fork/spawn
launchers (the popen launcher's failures are the fault cells of ``tests/faults``).
"""

import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import LocalSGDStrategy


class Failing(pl.LightningModule):
    """A linear model whose rank 1 raises (``mode='raise'``) or hangs (``'hang'``) at batch 2."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.lin = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2 and self.mode != "none":
            if self.mode == "raise":
                raise ValueError("rank one broke")
            time.sleep(3600)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(mode: str, samples: int = 64, **strategy_kwargs) -> int:
    """Fit :class:`Failing` on 2 CPU ranks with Local SGD (tau=1); returns the global step."""
    data = DataLoader(TensorDataset(torch.randn(samples, 4), torch.randint(0, 2, (samples,))), batch_size=4)
    trainer = pl.Trainer(
        strategy=LocalSGDStrategy(tau=1, **strategy_kwargs),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Failing(mode), data)
    return trainer.global_step
