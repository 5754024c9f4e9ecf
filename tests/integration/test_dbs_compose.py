"""``dbs_hpsgd`` and ``dbs_localsgd`` under a real Trainer: the single-process simulation, shares that follow speed."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import DBSHPSGDStrategy, DBSLocalSGDStrategy
from lightning_hier.callbacks import Straggler
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.dbs_compose_reference import weighted_hpsgd, weighted_localsgd
from tests.helpers import digits, flat_params, trainer
from tests.integration.test_dbs import _conv_classifier

N, B, EPOCHS, SEED, LR = 200, 24, 3, 7, 0.05
SPLIT = [18, 6]  # a fixed 3:1 split of the global batch of 24 (no rebalance)
STEPS_PER_EPOCH = N // B  # drop_last=True: 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100)
    return torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp((1, 8, 8), 10, hidden=(16,))


def _strategy(name: str, **args: Any) -> DBSHPSGDStrategy | DBSLocalSGDStrategy:
    cls = DBSHPSGDStrategy if name == "dbs_hpsgd" else DBSLocalSGDStrategy
    return cls(timeout=30, **args)


def _fit_fixed_split(name: str, period: int) -> torch.Tensor:
    pl.seed_everything(SEED, verbose=False)  # the seed of the data order (as for DistributedSampler)
    module = Classifier(_net(), 10, lr=LR, momentum=0.9)
    sync = {"window": period} if name == "dbs_hpsgd" else {"tau": period}
    strategy = _strategy(name, initial_sizes=SPLIT, rebalance_every=10**6, **sync)
    t = trainer(strategy=strategy, max_epochs=EPOCHS, limit_val_batches=0)
    x, y = _data()
    t.fit(module, DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True, drop_last=True))
    return flat_params(module)


def _shares_data(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker's slice of the global batch of ``step``: DBS's order (the epoch's permutation, B at a time)."""
    epoch, k = divmod(step, STEPS_PER_EPOCH)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
    start = k * B + sum(SPLIT[:worker])
    idx = order[start : start + SPLIT[worker]]
    x, y = _data()
    return x[idx], y[idx]


def _reference(name: str, period: int) -> torch.Tensor:
    sizes = [SPLIT] * (STEPS_PER_EPOCH * EPOCHS)
    model = (_net, lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9), _loss)
    if name == "dbs_hpsgd":
        return weighted_hpsgd(*model, _shares_data, sizes, period, "eager")
    return weighted_localsgd(*model, _shares_data, sizes, period)


def _loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(module(batch[0]), batch[1])


@pytest.mark.parametrize(("name", "period"), [("dbs_hpsgd", 3), ("dbs_localsgd", 5)])
def test_fit_with_unequal_shares_equals_the_single_process_simulation(name, period):
    # 24 steps: HPSGD launches at 1, merges at 4, ..., 22 and drains 23-24 at the end of fit; Local
    # SGD averages at 5, ..., 20 and once more at the end (a partial period)
    out = run_workers(_fit_fixed_split, name, period, devices=2)
    expected = _reference(name, period)
    for params in out:
        torch.testing.assert_close(params, expected, atol=1e-6, rtol=0)


def _fit_straggler(name: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = _conv_classifier()
    # CPU time: on this shared machine other processes' load is not taken for slowness ('spin')
    strategy = _strategy(name, rebalance_every=5, warmup_steps=2, timer="cpu")
    t = trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    t.callbacks.append(Straggler(ranks=1, factor=3.0, mode="spin"))
    t.fit(module, datamodule=digits(batch_size=64))  # the global batch of 128
    assert strategy.allocation.dbs is not None
    return {"history": strategy.allocation.dbs.history, "params": flat_params(module), "steps": t.global_step}


@pytest.mark.parametrize("name", ["dbs_hpsgd", "dbs_localsgd"])
def test_shares_follow_speed_when_one_rank_is_slowed(name):
    r0, r1 = run_workers(_fit_straggler, name, devices=2)
    assert r0["steps"] == r1["steps"] == 22  # 1437 // 128 = 11 steps per epoch, whatever the split
    history = r0["history"]
    assert history == r1["history"] and [h["step"] for h in history] == [7, 12, 17, 22]
    # rank 1 three times slower: about 3/4 of each global batch to rank 0 once measured (the start: 1/2).
    # Measured here: 0.70, 0.76, 0.80, 0.84. The drift past 3:1 is the emulation's: Straggler also
    # triples rank 1's fixed per-step costs, so the smaller its batch, the slower it is per sample
    # (the same under `dbs`, tests/integration/test_dbs.py)
    shares = [h["sizes"][0] / 128 for h in history]
    assert all(0.6 <= s <= 0.95 for s in shares), history
    assert history[-1]["samples_per_s"][0] > 2 * history[-1]["samples_per_s"][1], history
    assert torch.equal(r0["params"], r1["params"])  # one model after fit


def _fit_two_nodes(name: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = _conv_classifier()
    strategy = _strategy(name, rebalance_every=5, warmup_steps=2, timer="cpu")
    t = trainer(strategy=strategy, devices=2, num_nodes=2, max_epochs=2, limit_val_batches=0)
    t.callbacks.append(Straggler(ranks=[2, 3], factor=3.0, mode="spin"))  # node 1 is the slow node
    t.fit(module, datamodule=digits(batch_size=32))  # the global batch of 128 over 4 ranks
    assert strategy.allocation.dbs is not None
    return {"history": strategy.allocation.dbs.history, "params": flat_params(module), "node": t.node_rank}


@pytest.mark.parametrize("name", ["dbs_hpsgd", "dbs_localsgd"])
def test_two_nodes_with_a_slow_node_give_the_fast_node_the_larger_share(name):
    # 4 ranks on the 2 cores of this machine (oversubscribed): CPU time keeps the speeds apart
    out = run_workers(_fit_two_nodes, name, devices=2, num_nodes=2)
    assert [o["node"] for o in out] == [0, 0, 1, 1]
    history = out[0]["history"]
    assert all(o["history"] == history for o in out) and len(history) == 4
    fast, slow = sum(history[-1]["sizes"][:2]), sum(history[-1]["sizes"][2:])
    assert fast + slow == 128 and fast >= 1.5 * slow, history
    assert all(torch.equal(o["params"], out[0]["params"]) for o in out)  # one model after fit


def _fit_hpsgd_options() -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Classifier(_net(), 10, lr=LR, momentum=0.9, nesterov=True)
    # 'poll' builds its control group after the speeds' group: every rank in the same order
    options = {"mode": "poll", "merge": "paper", "compression": "bf16", "outer_momentum": 0.5}
    strategy = DBSHPSGDStrategy(window=2, rebalance_every=3, warmup_steps=1, timeout=30, **options)
    t = trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    t.callbacks.append(Straggler(ranks=1, factor=2.0, mode="spin"))
    x, y = _data()
    t.fit(module, DataLoader(TensorDataset(x, y), batch_size=12, shuffle=True))
    assert strategy.allocation.dbs is not None and strategy.sync.algorithm is not None
    return {
        "params": flat_params(module),
        "rebalances": strategy.allocation.dbs.rebalances,
        "merges": strategy.sync.algorithm.merges,
    }


def test_hpsgd_options_compose_with_the_shares():
    r0, r1 = run_workers(_fit_hpsgd_options, devices=2)
    assert torch.equal(r0["params"], r1["params"]) and torch.isfinite(r0["params"]).all()
    assert r0["rebalances"] >= 4 and r0["merges"] >= 4
