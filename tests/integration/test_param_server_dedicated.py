"""``asgd`` / ``softsync`` with ``server='dedicated'`` under a real Trainer: rank 0 only serves."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import AsgdStrategy, SoftsyncStrategy
from lightning_hier.testing import run_workers
from tests.helpers import flat_params, trainer
from tests.integration.test_param_server import BATCH, EPOCHS, N, _data, _fit_shards, _model, _sgd_reference

STEPS = EPOCHS * N // BATCH


class _Seen(Callback):
    """Training sample ids (the sampler's), gradients after each step, parameters at every validation."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.grads: list[bool] = []
        self.val_params: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        self.grads.append(any(p.grad is not None for p in pl_module.parameters()))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.ids.extend(int(i) for i in batch[0][:, 0, 0, 0])  # the id is written into the first pixel

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.val_params.append(flat_params(pl_module))


# _fit_shards: worker r trains on shard r in order; rank 0, the server, reads shard 0 for its logs only


def test_dedicated_server_with_one_worker_equals_plain_sgd_exactly():
    out = run_workers(_fit_shards, AsgdStrategy(server="dedicated", timeout=30), devices=2)
    ref = _sgd_reference([1])  # rank 1 is the only worker; rank 0's batches are not learnt from
    for o in out:
        assert torch.equal(o["params"], ref)
        assert o["steps"] == STEPS  # rank 0 ran as many (gradient-free) steps as the worker
    stats = out[0]["stats"]
    assert stats["ps/applied"] == STEPS and stats["ps/staleness_max"] == 0.0
    assert "ps/worker0/iteration_s" not in stats  # rank 0 is not a worker


def test_dedicated_softsync_n1_equals_synchronous_sgd_on_the_two_workers_batches():
    out = run_workers(_fit_shards, SoftsyncStrategy(n=1, server="dedicated", timeout=30), devices=3)
    ref = _sgd_reference([1, 2])
    for o in out:
        torch.testing.assert_close(o["params"], ref, atol=1e-6, rtol=0)
    assert out[0]["stats"]["ps/updates"] == STEPS and out[0]["stats"]["ps/applied"] == 2 * STEPS


def _fit_sampled(server: str) -> dict:
    """The injected sampler over one dataset of ids; a validation loader; 3 ranks."""
    x, y = _data(0, n=60)
    x[:, 0, 0, 0] = torch.arange(60, dtype=x.dtype)  # each sample carries its id
    train = DataLoader(TensorDataset(x, y), batch_size=5)
    val = DataLoader(TensorDataset(x[:12], y[:12]), batch_size=4)
    module, seen = _model(), _Seen()
    strategy = AsgdStrategy(server=server, timeout=30)
    t = trainer(strategy=strategy, devices=3, max_epochs=1, callbacks=[seen], limit_val_batches=3)
    t.fit(module, train, val)
    assert strategy.sync.ps is not None
    return {
        "ids": seen.ids,
        "grads": seen.grads,
        "val": seen.val_params,
        "params": flat_params(module),
        "stats": strategy.sync.ps.stats(),
    }


def test_dedicated_sampler_splits_over_the_workers_and_every_rank_validates_the_servers_model():
    r0, r1, r2 = run_workers(_fit_sampled, "dedicated", devices=3)
    # the workers' shards: disjoint, together the whole dataset; rank 0 reads the first (logs only)
    assert sorted(r1["ids"] + r2["ids"]) == list(range(60))
    assert r0["ids"] == r1["ids"]
    assert not any(r0["grads"]) and all(r1["grads"])  # rank 0's steps build no graph, compute no gradient
    assert r0["stats"]["ps/applied"] == 60 // 5  # 6 steps x 2 workers: each sample learnt from once
    assert set(r0["stats"]) >= {"ps/worker1/batch_size", "ps/worker2/batch_size"}
    assert "ps/worker0/batch_size" not in r0["stats"]
    for r in (r1, r2):  # consensus in validation and after fit: the server's model on every rank
        assert torch.equal(r["val"][-1], r0["val"][-1])
        assert torch.equal(r["params"], r0["params"])


def test_rank0_server_keeps_every_rank_a_worker():
    r0, r1, r2 = run_workers(_fit_sampled, "rank0", devices=3)
    assert sorted(r0["ids"] + r1["ids"] + r2["ids"]) == list(range(60))
    assert r0["stats"]["ps/applied"] == 3 * 4


@pytest.mark.parametrize(
    ("strategy", "devices", "match"),
    [
        (
            AsgdStrategy(server="dedicated", start_method="fork"),
            1,
            r"AsgdStrategy: argument `server`='dedicated' needs at least 2 ranks .*got 1",
        ),
        (
            SoftsyncStrategy(n=3, server="dedicated", start_method="fork"),
            3,
            r"SoftsyncStrategy: argument `n` must be an integer in \[1, 2\] \(the number of ranks but rank 0, "
            r"the server\), got 3",
        ),
    ],
)
def test_dedicated_layouts_without_enough_workers_are_rejected_before_launch(strategy, devices, match):
    with pytest.raises(ValueError, match=match):
        trainer(strategy=strategy, devices=devices)


def test_unknown_server_placement_is_rejected():
    with pytest.raises(ValueError, match=r"AsgdStrategy: argument `server` must be one of .*'rank0'.*'dedicated'"):
        AsgdStrategy(server="rank1")
