"""GRAWA in a plain PyTorch loop on 2 CPU processes: the object the ``lgrawa`` strategy holds.

Run: ``python docs/examples/plain_loop.py``. Every 8 steps the replicas are pulled toward their
center weighted by inverse gradient norms (per parameter tensor); the ``with`` block ends with a
final round, so both ranks hold the same model.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hier.data import DigitsDataModule
from lightning_hier.sync import AveragingSync


def train(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial model on every rank
    data = DigitsDataModule(batch_size=32)
    data.setup("fit")
    whole = data.train_dataloader()  # the dataset and its collate function; each rank its own shard of it
    sampler = DistributedSampler(whole.dataset, world, rank, seed=0)
    loader = DataLoader(whole.dataset, batch_size=32, sampler=sampler, collate_fn=whole.collate_fn)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sync = AveragingSync.grawa(variant="layer", tau=8)
    with sync.attach(model, optimizer):
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    with torch.no_grad():
        val = data.val_dataloader()
        acc = sum(int((model(x).argmax(1) == y).sum()) for x, y in val) / len(val.dataset)
    print(f"rank {rank}: validation accuracy {acc:.3f}, {sync.algorithm.schedule.rounds} rounds")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(train, args=(2,), nprocs=2)
