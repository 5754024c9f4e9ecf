"""A 2-process fit (popen launcher: this script is re-run for rank 1) where rank 1 fails.

usage: python failing_fit.py raise|hang TIMEOUT_S
"""

import os
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_hier


class Failing(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.lin = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            if self.mode == "raise":
                raise ValueError("rank one broke")
            time.sleep(3600)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    mode, timeout = sys.argv[1], float(sys.argv[2])
    print(f"PID {os.getpid()} LOCAL_RANK {os.environ.get('LOCAL_RANK', '0')}", flush=True)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=4)
    strategy = lightning_hier.LocalSGDStrategy(tau=1, timeout=timeout)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Failing(mode), data)
