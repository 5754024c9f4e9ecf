"""Several optimizers (a GAN under manual optimization) and manual optimization itself, as under DDP.

Each optimizer's parameters are synchronised by the strategy's rule on that optimizer's own steps:
the Local SGD case is checked against a single-process simulation of two replicas; ``hpsgd``,
``localsgd`` and ``dbs`` train a GAN by name at default arguments; ``mgrawa`` trains a module under
manual optimization (its probe cannot re-run such a step, so the rounds weigh the step's own
gradients); the strategies that cannot (the pipeline, the grid, the parameter servers) refuse
with the real reason, first.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import LocalSGDStrategy
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import flat_params, trainer
from tests.user_models import SameWeightsOnEveryRank, UserClassifier, UserGAN

TAU, EPOCHS = 3, 2


class _ShardedGAN(UserGAN):
    """The GAN with each rank's shard fixed (no sampler), so a single process can replay both ranks."""

    def train_dataloader(self) -> DataLoader:
        (points,) = super().train_dataloader().dataset.tensors
        return DataLoader(TensorDataset(points[dist.get_rank() :: 2]), batch_size=8)


def _fit_sharded() -> dict:
    torch.manual_seed(0)
    module = _ShardedGAN()
    t = trainer(strategy=LocalSGDStrategy(tau=TAU, timeout=30), max_epochs=EPOCHS, use_distributed_sampler=False)
    t.fit(module)
    return {"params": flat_params(module), "steps": t.global_step}


def _mean_(modules: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for tensors in zip(*(m.parameters() for m in modules), strict=True):
            mean = sum(tensors) / len(tensors)
            for t in tensors:
                t.copy_(mean)


def _simulated() -> torch.Tensor:
    """Two replicas in one process: each optimizer's parameters averaged every TAU of its own steps."""
    torch.manual_seed(0)
    first = _ShardedGAN()
    replicas = [first, copy.deepcopy(first)]
    opts = [r.configure_optimizers() for r in replicas]
    (points,) = UserGAN().train_dataloader().dataset.tensors
    shards = [points[r::2].split(8) for r in range(2)]
    steps = 0
    for _ in range(EPOCHS):
        for i, batches in enumerate(zip(*shards, strict=True)):
            steps += 1
            fakes = [
                r.generator_step(len(b), i, o[0], torch.Tensor.backward)[0]
                for r, o, b in zip(replicas, opts, batches, strict=True)
            ]
            if steps % TAU == 0:
                _mean_([r.generator for r in replicas])
            for r, o, b, fake in zip(replicas, opts, batches, fakes, strict=True):
                r.discriminator_step(b, fake, o[1], torch.Tensor.backward)
            if steps % TAU == 0:
                _mean_([r.discriminator for r in replicas])
    _mean_(replicas)  # the end of fit: a final round for the steps since the last one
    return flat_params(first)


def test_local_sgd_averages_each_optimizers_parameters_on_its_own_steps():
    r0, r1 = run_workers(_fit_sharded, devices=2)
    assert r0["steps"] == 2 * EPOCHS * 8  # global_step counts both optimizers' steps
    torch.testing.assert_close(r0["params"], r1["params"], atol=0, rtol=0)
    torch.testing.assert_close(r0["params"], _simulated(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["hpsgd", "diloco", "localsgd", "dbs", "mgrawa", "lgrawa"])
def test_a_gan_trains_by_name_at_default_arguments(name):
    torch.manual_seed(0)
    module = UserGAN()
    before = flat_params(module)
    t = trainer(strategy=f"{name}_fork", max_epochs=3, callbacks=[SameWeightsOnEveryRank()])
    t.fit(module)
    after = flat_params(module)
    assert torch.isfinite(after).all() and not torch.equal(after, before)


class _ManualClassifier(UserClassifier):
    """One optimizer, stepped by the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


@pytest.mark.parametrize("name", ["mgrawa", "lgrawa", "grawa", "localsgd", "hpsgd", "diloco", "dbs", "asgd"])
def test_manual_optimization_trains_by_name(name):
    torch.manual_seed(0)
    module = _ManualClassifier()
    before = flat_params(module)
    t = trainer(strategy=f"{name}_fork", max_epochs=2, callbacks=[SameWeightsOnEveryRank()])
    t.fit(module)
    after = flat_params(module)
    assert torch.isfinite(after).all() and not torch.equal(after, before)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("decoupled", "DecoupledStrategy needs automatic optimization with one optimizer, but UserGAN sets"),
        ("grid2d", "Grid2DStrategy needs automatic optimization with one optimizer, but UserGAN sets"),
        ("asgd", "the parameter server copies the one optimizer of the model onto rank 0"),
        ("softsync", "the parameter server copies the one optimizer of the model onto rank 0"),
        ("dbs_async", "the parameter server copies the one optimizer of the model onto rank 0"),
    ],
)
def test_strategies_that_cannot_train_a_gan_say_why_first(name, reason):
    with pytest.raises(WorkerFailed, match=reason):
        run_workers(lambda: trainer(strategy=name, max_epochs=1).fit(UserGAN()), devices=2)
