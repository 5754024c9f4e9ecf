"""The decoupled pipeline inside a node, data parallelism across nodes (issue 20), under Trainer(num_nodes=2).

Two simulated nodes of two ranks each. With ``stages=1`` a node holds two replicas (the node-local
mean is not trivial); with ``stages=2`` a node holds one two-stage pipeline. The references are the
single-process simulations of :mod:`tests.node_replicas_reference`; the ``sync`` schedule is plain
backpropagation pipelined, so a node's pipeline trains as one ordinary network.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import DecoupledStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import flat_params, trainer
from tests.node_replicas_reference import node_steps, simulate_nodes

NODES, DEVICES, SAMPLES, BATCH, EPOCHS, LR, MOMENTUM = 2, 2, 48, 8, 2, 0.05, 0.9  # 12 steps


def _classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(16, 16)), 10, lr=LR, momentum=MOMENTUM, nesterov=False)


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


def _shard(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + replica)
    return torch.randn(SAMPLES, 1, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


class _Levels(Callback):
    """The groups the engine averages each update's gradient over, as global ranks."""

    def __init__(self) -> None:
        self.levels: list[list[int]] = []
        self.timeouts: list[float] = []
        self.directions: list[tuple[list[int], float]] = []

    def on_train_start(self, trainer, *args) -> None:
        pipe = trainer.strategy.pipeline
        self.levels = [dist.get_process_group_ranks(g) for g in pipe.data_groups]
        # after start-up every group waits `timeout` (30 s here), not the long init_timeout
        self.timeouts = [_timeout(g) for g in pipe.data_groups]
        # activations and their gradients: two groups over the same stages, one TCP connection each
        unique = {id(m.group): m.group for m in pipe.mailboxes if m.group is not None}
        self.directions = [(dist.get_process_group_ranks(g), _timeout(g)) for g in unique.values()]


def _timeout(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _fit(stages: int, schedule: str, every: int | None, rule: str) -> dict:
    x, y = _shard(int(os.environ["RANK"]) // stages)  # every stage of replica d reads shard d
    levels = _Levels()
    strategy = DecoupledStrategy(stages=stages, schedule=schedule, inter_node_every=every, inter_node=rule, timeout=30)
    t = trainer(
        strategy=strategy,
        devices=DEVICES,
        num_nodes=NODES,
        max_epochs=EPOCHS,
        use_distributed_sampler=False,
        callbacks=[levels],
    )
    module = _classifier()
    t.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    return {
        "levels": levels.levels,
        "timeouts": levels.timeouts,
        "directions": levels.directions,
        "whole": flat_params(module),
        "loss": float(t.callback_metrics["train/loss"]),
    }


def _reference(stages: int, nodes: int, every: int | None, rule: str | None) -> torch.Tensor:
    shards = [_shard(d) for d in range(NODES * DEVICES // stages)]
    nets = simulate_nodes(
        [_classifier().net for _ in range(nodes)], _optimizer, node_steps(shards, nodes, BATCH, EPOCHS), every, rule
    )
    return flat_params(nets[0])


@pytest.mark.parametrize(
    ("stages", "levels"),
    [
        (1, [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]),  # the node, then across
        (2, [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]),  # one replica per node: only the cross-node level
    ],
)
def test_per_step_two_level_mean_equals_single_process_sgd(stages, levels):
    out = run_workers(_fit, stages, "sync", None, "localsgd", devices=DEVICES, num_nodes=NODES)
    assert [o["levels"] for o in out] == levels
    assert all(o["timeouts"] == [30.0] * len(o["levels"]) for o in out)
    ref = _reference(stages, 1, None, None)  # the flat mean: one network on every replica's batch
    for o in out:
        torch.testing.assert_close(o["whole"], ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("stages", "every", "rule"),
    [(1, 3, "localsgd"), (2, 5, "localsgd"), (1, 5, "hpsgd"), (2, 3, "hpsgd")],
)
def test_periodic_across_nodes_equals_the_single_process_simulation(stages, every, rule):
    out = run_workers(_fit, stages, "sync", every, rule, devices=DEVICES, num_nodes=NODES)
    intra = [[0, 1], [2, 3]] if stages == 1 else []
    for rank, o in enumerate(out):  # the per-update mean stayed inside the node
        assert o["levels"] == ([intra[rank // 2]] if intra else [])
    ref = _reference(stages, NODES, every, rule)
    for o in out:
        torch.testing.assert_close(o["whole"], ref, atol=1e-6, rtol=0)


def test_delayed_gradients_train_across_nodes_and_end_on_one_model():
    out = run_workers(_fit, 2, "fdg", 2, "hpsgd", devices=DEVICES, num_nodes=NODES)
    assert all(torch.isfinite(o["whole"]).all() and o["loss"] < 2.5 for o in out)
    for rank, o in enumerate(out):  # the node's two stages, once per direction, with the strategy's timeout
        node = [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert o["directions"] == [(node, 30.0), (node, 30.0)]
    for o in out[1:]:
        assert torch.equal(o["whole"], out[0]["whole"])


def test_a_pipeline_spanning_nodes_is_rejected_when_the_trainer_is_built():
    strategy = DecoupledStrategy(stages=4, inter_node_every=2, start_method="fork")
    with pytest.raises(ValueError, match=r"DecoupledStrategy: argument `inter_node_every`=2 .*do not fit in the 2"):
        trainer(strategy=strategy, devices=DEVICES, num_nodes=NODES)


def test_two_level_on_one_node_is_rejected_when_the_trainer_is_built():
    strategy = DecoupledStrategy(stages=2, inter_node_every=2, start_method="fork")
    with pytest.raises(ValueError, match=r"`inter_node_every`=2 .*the job has one node \(num_nodes=1\)"):
        trainer(strategy=strategy)


def _auto_stages() -> int:
    x, y = _shard(0)
    strategy = DecoupledStrategy(schedule="sync", inter_node_every=3, timeout=30)
    t = trainer(strategy=strategy, devices=DEVICES, num_nodes=NODES, use_distributed_sampler=False, max_steps=2)
    t.fit(_classifier(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return strategy.num_stages


def test_auto_stages_keep_the_pipeline_inside_a_node():
    assert run_workers(_auto_stages, devices=DEVICES, num_nodes=NODES) == [2] * 4  # not 4: a node has 2 ranks
