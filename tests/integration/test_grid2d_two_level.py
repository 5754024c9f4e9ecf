"""grid2d inside a node, Local SGD or HPSGD across nodes (issue 20), under a real Trainer(num_nodes=2).

Two simulated nodes of two ranks each, against the single-process simulation of
:mod:`tests.node_replicas_reference` (one ordinary network per node, the rule across nodes).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import Grid2DStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.planner import Link, best_grid, model_layers
from lightning_hier.testing import run_workers
from tests.helpers import trainer
from tests.node_replicas_reference import node_steps, simulate_nodes

NODES, DEVICES, N, BATCH, EPOCHS, LR, MOMENTUM = 2, 2, 48, 8, 2, 0.05, 0.9  # 12 optimizer steps


def _data(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + block)
    return torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _model() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=LR, momentum=MOMENTUM, nesterov=False)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].detach().reshape(-1).double() for k in sorted(state)])


def _fit(grid: tuple[int, int], every: int | None, rule: str) -> torch.Tensor:
    module = _model()
    block = int(os.environ["RANK"]) // grid[0]  # ranks of one MODEL group read the same batches
    loader = DataLoader(TensorDataset(*_data(block)), batch_size=BATCH, shuffle=False)
    strategy = Grid2DStrategy(grid=grid, inter_node_every=every, inter_node=rule, timeout=30)
    t = trainer(strategy=strategy, devices=DEVICES, num_nodes=NODES, max_epochs=EPOCHS, use_distributed_sampler=False)
    t.fit(module, loader)
    assert t.strategy.grid_context.pc == DEVICES // grid[0]  # the BATCH reduction stayed inside the node
    return _flat(t.strategy.lightning_module_state_dict())


def _reference(pr: int, every: int, rule: str) -> torch.Tensor:
    per_node = DEVICES // pr
    steps = node_steps([_data(b) for b in range(NODES * per_node)], NODES, BATCH, EPOCHS)
    nets = simulate_nodes([_model().net for _ in range(NODES)], _optimizer, steps, every, rule)
    return _flat({f"net.{k}": v for k, v in nets[0].state_dict().items()})


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


@pytest.mark.parametrize(
    ("grid", "every", "rule"),
    [
        ((1, 4), 3, "localsgd"),  # two batch blocks per node: the node averages gradients every step
        ((2, 2), 5, "localsgd"),  # the MODEL dimension inside the node; 12 steps leave 2 for the final mean
        ((1, 4), 3, "hpsgd"),
        ((2, 2), 5, "hpsgd"),
    ],
)
def test_two_nodes_equal_the_single_process_simulation(grid, every, rule):
    out = run_workers(_fit, grid, every, rule, devices=DEVICES, num_nodes=NODES)
    ref = _reference(grid[0], every, rule)
    for params in out:
        torch.testing.assert_close(params, ref, atol=1e-6, rtol=0)


def test_a_grid_wider_than_a_node_is_rejected_when_the_trainer_is_built():
    strategy = Grid2DStrategy(grid=(4, 1), inter_node_every=2, start_method="fork")
    with pytest.raises(ValueError, match=r"Grid2DStrategy: argument `inter_node_every`=2 .*do not fit in the 2 ranks"):
        trainer(strategy=strategy, devices=DEVICES, num_nodes=NODES)


def test_two_level_on_one_node_is_rejected_when_the_trainer_is_built():
    strategy = Grid2DStrategy(grid=(1, 2), inter_node_every=2, start_method="fork")
    with pytest.raises(ValueError, match=r"`inter_node_every`=2 .*the job has one node \(num_nodes=1\)"):
        trainer(strategy=strategy)


def _auto_grid() -> tuple[int, int]:
    torch.manual_seed(0)
    wide = Classifier(mlp((1, 8, 8), 10, hidden=(2048,)), 10, lr=LR)
    # bandwidth-only links and a wide layer: on 4 ranks the planner would shard over all 4 (Pr = 4)
    strategy = Grid2DStrategy(grid="auto", alpha=0.0, beta=4e-10, inter_node_every=2, timeout=30)
    t = trainer(strategy=strategy, devices=DEVICES, num_nodes=NODES, max_steps=2)
    t.fit(wide, DataLoader(TensorDataset(*_data(0)), batch_size=BATCH))
    return strategy.grid


def test_auto_grid_plans_the_grid_of_one_node():
    layers = model_layers(Classifier(mlp((1, 8, 8), 10, hidden=(2048,)), 10), (1, 8, 8))
    assert best_grid(layers, BATCH, 4, links=Link(0.0, 4e-10), batch_scope="replica").grid == (4, 1)
    assert run_workers(_auto_grid, devices=DEVICES, num_nodes=NODES) == [(2, 2)] * 4
