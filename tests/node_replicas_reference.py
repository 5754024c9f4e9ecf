"""Single-process simulation of two-level training (issue 20): node replicas and a rule across nodes.

Every node holds one ordinary network, trained each step on the mean gradient of its batch blocks
(what a node's grid, or its data-parallel pipelines, compute). Across nodes:

- ``'localsgd'``: the node networks are averaged every ``every`` steps and after a partial last period;
- ``'hpsgd'`` (eager merge): the first window is the first step; every ``every`` steps after it the
  global model takes the previous window's mean change and each node restarts from it plus its own
  newest change; the end of training drains (both pending changes are merged, every node takes ``S``);
- ``None``: no rule (one node: plain synchronous SGD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


def simulate_nodes(
    nets: Sequence[nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    steps: Sequence[Sequence[Sequence[Batch]]],
    every: int | None,
    rule: str | None,
) -> list[nn.Module]:
    """Train ``nets`` (one per node); ``steps[s][n]`` are node ``n``'s batch blocks at step ``s``."""
    optimizers = [make_optimizer(n) for n in nets]
    across = _Hpsgd(nets, every) if rule == "hpsgd" else _LocalSgd(nets, every)
    for blocks_per_node in steps:
        for net, opt, blocks in zip(nets, optimizers, blocks_per_node, strict=True):
            opt.zero_grad()
            loss = sum(torch.nn.functional.cross_entropy(net(x), y) for x, y in blocks)
            (loss / len(blocks)).backward()  # the node's mean gradient over its batch blocks
            opt.step()
        across.step()
    across.finalize()
    return list(nets)


def _vectors(nets: Sequence[nn.Module]) -> list[Tensor]:
    return [torch.nn.utils.parameters_to_vector(n.parameters()).detach().clone() for n in nets]


def _load(net: nn.Module, vector: Tensor) -> None:
    torch.nn.utils.vector_to_parameters(vector.clone(), net.parameters())


class _LocalSgd:
    def __init__(self, nets: Sequence[nn.Module], every: int | None) -> None:
        self.nets, self.every, self.steps = nets, every, 0

    def step(self) -> None:
        self.steps += 1
        if self.every is not None and self.steps % self.every == 0:
            self._average()

    def finalize(self) -> None:
        if self.every is not None and self.steps % self.every:
            self._average()

    def _average(self) -> None:
        mean = torch.stack(_vectors(self.nets)).mean(0)
        for net in self.nets:
            _load(net, mean)


class _Hpsgd:
    def __init__(self, nets: Sequence[nn.Module], every: int | None) -> None:
        assert every is not None
        self.nets, self.every = nets, every
        self.global_model = _vectors(nets)[0]  # S: every node starts from the same weights
        self.start: list[Tensor] = []  # V per node
        self.in_flight: Tensor | None = None  # the sum of the nodes' changes of the last window
        self.since = 0

    def step(self) -> None:
        x = _vectors(self.nets)
        if self.in_flight is None:  # the first window is the first step
            self.in_flight = torch.stack([v - self.global_model for v in x]).sum(0)
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
        self.in_flight, self.since = torch.stack(changes).sum(0), 0

    def finalize(self) -> None:
        x = _vectors(self.nets)
        assert self.in_flight is not None
        changes = torch.stack([v - s for v, s in zip(x, self.start, strict=True)]).sum(0)
        self.global_model = self.global_model + (self.in_flight + changes) / len(x)
        for net in self.nets:
            _load(net, self.global_model)


def node_steps(blocks: Sequence[Batch], nodes: int, batch: int, epochs: int) -> list[list[list[Batch]]]:
    """``steps[s][n]`` for :func:`simulate_nodes`: node ``n`` holds consecutive blocks, read ``batch`` rows a step."""
    per = len(blocks) // nodes
    rows = len(blocks[0][0])
    return [
        [[(x[i : i + batch], y[i : i + batch]) for x, y in blocks[n * per : (n + 1) * per]] for n in range(nodes)]
        for _ in range(epochs)
        for i in range(0, rows, batch)
    ]
