"""The same objects without Lightning: a plain PyTorch loop with ``Sync.attach`` equals the Lightning strategy.

On 2 gloo ranks, with the same model, data shards, optimizer and seed, a hand-written loop that
attaches HPSGD, Local SGD, GRAWA or DBS to its optimizer ends with the same parameters on every
rank as a ``Trainer`` fit with the corresponding registered strategy (to 1e-6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import DBSStrategy, DiLoCoStrategy, GrawaStrategy, HPSGDStrategy, LocalSGDStrategy
from lightning_hier.sync import AveragingSync, DiLoCoSync, HPSGDSync, ShareWeightedGradients, SpeedShares
from lightning_hier.testing import run_workers
from tests.helpers import flat_params, trainer
from tests.user_models import UserClassifier

EPOCHS = 2


def _data() -> TensorDataset:
    x = torch.randn(96, 16, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x[:, :4].argmax(1))


class _Sharded(UserClassifier):
    """The classifier on this rank's fixed shard (no sampler, no shuffling: a loop can replay it)."""

    def train_dataloader(self) -> DataLoader:
        x, y = _data().tensors
        return DataLoader(TensorDataset(x[dist.get_rank() :: 2], y[dist.get_rank() :: 2]), batch_size=8)


class _Whole(UserClassifier):
    """The classifier on the whole dataset, which DBS splits itself."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=8)


def _lightning(strategy: Callable[[], Any], module: type[UserClassifier]) -> torch.Tensor:
    torch.manual_seed(0)
    model = module()
    t = trainer(strategy=strategy(), max_epochs=EPOCHS, use_distributed_sampler=False)
    t.fit(model)
    return flat_params(model)


def _plain(sync: Callable[[], Any], sharded: bool) -> torch.Tensor:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = _Sharded() if sharded else _Whole()
    optimizer = model.configure_optimizers()
    rule = sync()
    shares = rule.shares if isinstance(rule, ShareWeightedGradients) else None
    with rule.attach(model, optimizer, allocation=shares):
        loader = model.train_dataloader()
        if shares is not None:  # DBS re-batches the loader with each rank's share of every global batch
            loader = shares.training_loader(loader)
        for epoch in range(EPOCHS):
            if shares is not None:
                loader.batch_sampler.set_epoch(epoch)
            for x, y in loader:
                nn.functional.cross_entropy(model.model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    params = flat_params(model)
    dist.destroy_process_group()
    return params


def _dbs_sync() -> ShareWeightedGradients:
    return ShareWeightedGradients(SpeedShares(global_batch_size=16, initial_sizes=[12, 4], rebalance_every=10**6))


CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any], bool]] = {
    "hpsgd": (lambda: HPSGDStrategy(window=3, timeout=30), lambda: HPSGDSync(window=3), True),
    "localsgd": (lambda: LocalSGDStrategy(tau=4, timeout=30), lambda: AveragingSync.localsgd(tau=4), True),
    "diloco": (
        lambda: DiLoCoStrategy(window=4, fragments=2, fragment_sync_delay=1, timeout=30),
        lambda: DiLoCoSync(window=4, fragments=2, fragment_sync_delay=1),
        True,
    ),
    "lgrawa": (
        lambda: GrawaStrategy(variant="layer", tau=4, probe="step", timeout=30),
        lambda: AveragingSync.grawa(variant="layer", tau=4),
        True,
    ),
    "dbs": (
        lambda: DBSStrategy(global_batch_size=16, initial_sizes=[12, 4], rebalance_every=10**6, timeout=30),
        _dbs_sync,
        False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_plain_loop_with_the_same_objects_equals_the_lightning_strategy(name):
    strategy, sync, sharded = CASES[name]
    fitted = run_workers(_lightning, strategy, _Sharded if sharded else _Whole, devices=2)
    plain = run_workers(_plain, sync, sharded, devices=2)
    for rank in range(2):
        torch.testing.assert_close(plain[rank], fitted[rank], atol=1e-6, rtol=0)
    assert not torch.equal(plain[0], _initial())  # it trained


def _initial() -> torch.Tensor:
    torch.manual_seed(0)
    return flat_params(_Sharded())
