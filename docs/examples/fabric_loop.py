"""HPSGD in a Lightning Fabric loop: the object the ``hpsgd`` strategy holds, attached to the optimizer.

Run: ``python docs/examples/fabric_loop.py`` (2 CPU processes; Fabric's ``ddp`` launcher re-runs
this script for the second one). Prints the validation accuracy every rank reached, which is the
same model on every rank once the ``with`` block has merged the last window.
"""

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_hier.data import DigitsDataModule
from lightning_hier.sync import HPSGDSync


def accuracy(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    with torch.no_grad():
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    return right / len(loader.dataset)


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    data = DigitsDataModule(batch_size=32)
    data.setup("fit")
    train = fabric.setup_dataloaders(data.train_dataloader())  # each rank its shard
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    # no fabric.setup(model): DDP's per-step gradient all-reduce is what HPSGD replaces
    with HPSGDSync(window=4).attach(model, optimizer) as binding:
        for _ in range(3):  # Fabric's loader sets the sampler's epoch at each pass
            for x, y in train:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()  # every 4 steps a window's change leaves, the previous one merges
                optimizer.zero_grad()
    # leaving the block merged the last windows: one model on every rank
    models = fabric.all_gather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert all(torch.equal(models[0], m) for m in models), "the ranks ended with different models"
    acc = accuracy(model, data.val_dataloader())
    fabric.print(f"validation accuracy {acc:.3f}, {binding.stats.bytes / 2**20:.1f} MiB sent per rank")


if __name__ == "__main__":
    main()
