"""grid2d inside a node, Local SGD or HPSGD across nodes (issue 20), under a real Trainer(num_nodes=2).

Two simulated nodes of two ranks each. The reference is a single-process simulation: one ordinary
network per node, trained on the mean gradient of the node's batch blocks (what the node's grid
computes), the two node networks combined across nodes by the rule: Local SGD averages them every
``m`` steps (and at the end), HPSGD (eager merge) applies the mean of the previous window's changes
one window late, keeping its own newest change on top (and drains at the end).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import Grid2DStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import trainer

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
    nets = [_model().net for _ in range(NODES)]
    opts = [torch.optim.SGD(n.parameters(), lr=LR, momentum=MOMENTUM) for n in nets]
    per_node = DEVICES // pr
    blocks = [_data(b) for b in range(NODES * per_node)]
    rule_state = _Hpsgd(nets, every) if rule == "hpsgd" else _LocalSgd(nets, every)
    for _ in range(EPOCHS):
        for i in range(0, N, BATCH):
            for node, (net, opt) in enumerate(zip(nets, opts, strict=True)):
                opt.zero_grad()
                mine = blocks[node * per_node : (node + 1) * per_node]
                loss = sum(torch.nn.functional.cross_entropy(net(x[i : i + BATCH]), y[i : i + BATCH]) for x, y in mine)
                (loss / per_node).backward()  # the node's mean gradient over its batch blocks
                opt.step()
            rule_state.step()
    rule_state.finalize()
    return _flat({f"net.{k}": v for k, v in nets[0].state_dict().items()})


def _vectors(nets: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [torch.nn.utils.parameters_to_vector(n.parameters()).detach().clone() for n in nets]


def _load(net: torch.nn.Module, vector: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(vector.clone(), net.parameters())


class _LocalSgd:
    """Mean of the node networks every ``every`` steps and after a partial last period."""

    def __init__(self, nets: list[torch.nn.Module], every: int) -> None:
        self.nets, self.every, self.steps = nets, every, 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self._average()

    def finalize(self) -> None:
        if self.steps % self.every:
            self._average()

    def _average(self) -> None:
        mean = torch.stack(_vectors(self.nets)).mean(0)
        for net in self.nets:
            _load(net, mean)


class _Hpsgd:
    """HPSGD, eager merge, written out: launch at step 1, merge every ``every`` steps, drain at the end."""

    def __init__(self, nets: list[torch.nn.Module], every: int) -> None:
        self.nets, self.every = nets, every
        self.global_model = _vectors(nets)[0]  # S: every node starts from the same weights
        self.start: list[torch.Tensor] = []  # V per node
        self.in_flight: torch.Tensor | None = None  # the sum of the nodes' changes of the last window
        self.since = 0

    def step(self) -> None:
        x = _vectors(self.nets)
        if self.in_flight is None:  # the first window is the first step
            self.in_flight = sum(v - self.global_model for v in x)
            self.start, self.since = x, 0
            return
        self.since += 1
        if self.since < self.every:
            return
        changes = [v - s for v, s in zip(x, self.start, strict=True)]
        self.global_model = self.global_model + self.in_flight / len(x)
        self.start = [self.global_model + d for d in changes]  # x <- S + d, V <- x
        for net, v in zip(self.nets, self.start, strict=True):
            _load(net, v)
        self.in_flight, self.since = sum(changes), 0

    def finalize(self) -> None:
        x = _vectors(self.nets)
        assert self.in_flight is not None
        changes = sum(v - s for v, s in zip(x, self.start, strict=True))
        self.global_model = self.global_model + (self.in_flight + changes) / len(x)
        for net in self.nets:
            _load(net, self.global_model)


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inter_node_every": 0}, r"Grid2DStrategy: argument `inter_node_every` must be an integer >= 1, got 0"),
        ({"inter_node": "ddp"}, r"Grid2DStrategy: argument `inter_node` must be one of 'localsgd', 'hpsgd'"),
    ],
)
def test_bad_two_level_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Grid2DStrategy(**kwargs)
