"""GRAWA's probe study: accuracy at equal epochs with probe='fresh', 'batch' and 'step', side by side.

Every fit runs in the same two forked CPU ranks, one after the other (gloo), for MGRAWA and LGRAWA
and each seed. ``--shards skewed`` gives each rank 80% of five classes and 20% of the other five
through a per-rank sampler over the *whole* training set (so the fresh probe can draw from all
classes); ``iid`` uses Lightning's DistributedSampler. Run from the repository root::

    python -m benchmarks.studies.grawa_probe --shards skewed --workloads digits mnist8k --seeds 0 1 2

MNIST 8k: the t10k file split 8000 / 2000 (``--mnist-root``; only the test set is offline here).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, SubsetRandomSampler
from typing_extensions import override

from benchmarks.studies._trainer import quiet_trainer
from lightning_hier import GrawaStrategy
from lightning_hier.callbacks import PullToCenter
from lightning_hier.data import DigitsDataModule, MNISTDataModule
from lightning_hier.data.arrays import ArrayDataset, collate_batch
from lightning_hier.data.datamodule import ArrayDataModule
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers

PROBES = ("fresh", "batch", "step")


class _MaxWeight(PullToCenter):
    """Records the largest replica weight of every round."""

    def __init__(self) -> None:
        super().__init__()
        self.max_weights: list[float] = []

    @override
    def on_round(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: Any) -> dict[str, float]:
        self.max_weights.append(float(report.weights.mean(dim=1).max()))
        return super().on_round(trainer, pl_module, report)


def _skewed(cls: type[ArrayDataModule]) -> type[ArrayDataModule]:
    class Skewed(cls):  # type: ignore[valid-type,misc]
        def train_dataloader(self) -> DataLoader[Any]:
            a, rank = self.arrays, dist.get_rank()
            g = torch.Generator().manual_seed(0)
            shards: list[list[int]] = [[], []]
            for c in range(a.num_classes):
                idx = (a.y_train == c).nonzero().flatten()
                idx = idx[torch.randperm(len(idx), generator=g)]
                k, major = int(0.8 * len(idx)), int(c >= a.num_classes // 2)
                shards[major] += idx[:k].tolist()
                shards[1 - major] += idx[k:].tolist()
            n = min(map(len, shards))  # equal step counts on both ranks
            return DataLoader(
                ArrayDataset(a.x_train, a.y_train),
                batch_size=self.batch_size,
                sampler=SubsetRandomSampler(shards[rank][:n]),
                drop_last=True,
                collate_fn=collate_batch,
            )

    return Skewed


def _workloads(mnist_root: str) -> dict[str, dict[str, Any]]:
    return {
        "digits": {
            "data": lambda cls=DigitsDataModule: cls(batch_size=32),
            "base": DigitsDataModule,
            "model": lambda: Classifier(mlp((1, 8, 8), 10, hidden=(64,)), 10, lr=0.1),
            "epochs": 4,
            "tau": 8,
        },
        "mnist8k": {
            "data": lambda cls=MNISTDataModule: cls(root=mnist_root, split="test", batch_size=64),
            "base": MNISTDataModule,
            "model": lambda: Classifier(mlp((1, 28, 28), 10, hidden=(128,)), 10, lr=0.05),
            "epochs": 2,
            "tau": 16,
        },
    }


def _work(names: list[str], seeds: list[int], skewed: bool, mnist_root: str) -> list[dict[str, Any]]:
    out = []
    for name in names:
        w = _workloads(mnist_root)[name]
        make: Callable[..., ArrayDataModule] = w["data"]
        dm = make(_skewed(w["base"])) if skewed else make()
        for seed in seeds:
            for variant in ("model", "layer"):
                for probe in PROBES:
                    torch.manual_seed(seed)
                    module, rec = w["model"](), _MaxWeight()
                    strategy = GrawaStrategy(variant=variant, tau=w["tau"], probe=probe, probe_seed=seed, timeout=120)
                    trainer = quiet_trainer(
                        strategy=strategy,
                        devices=2,
                        max_epochs=w["epochs"],
                        check_val_every_n_epoch=100,
                        callbacks=[rec],
                        use_distributed_sampler=not skewed,
                    )
                    trainer.fit(module, datamodule=dm)
                    acc = float(trainer.validate(module, datamodule=dm, verbose=False)[0]["val/acc"])
                    row = {"workload": name, "seed": seed, "variant": variant, "probe": probe, "acc": acc}
                    out.append({**row, "max_weight": statistics.mean(rec.max_weights)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", choices=("iid", "skewed"), default="skewed")
    parser.add_argument("--workloads", nargs="+", default=["digits", "mnist8k"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--mnist-root", default="../shared/datasets/mnist")
    args = parser.parse_args()
    rows = run_workers(
        _work, args.workloads, args.seeds, args.shards == "skewed", args.mnist_root, devices=2, timeout=3600
    )[0]
    for name in args.workloads:
        for variant in ("model", "layer"):
            for probe in PROBES:
                sel = [r for r in rows if (r["workload"], r["variant"], r["probe"]) == (name, variant, probe)]
                accs = [round(r["acc"], 4) for r in sel]
                print(
                    f"{name:8s} {variant[0]}grawa probe={probe:5s} acc {statistics.mean(accs):.4f} {accs} "
                    f"mean max weight {statistics.mean(r['max_weight'] for r in sel):.3f}"
                )


if __name__ == "__main__":
    main()
