"""The grid's part of the adapter: per-step gradient reduction by parameter kind, BatchNorm statistics, two levels.

:class:`GridSync` is :class:`~lightning_hier.strategies.grid2d.Grid2DStrategy`'s ``sync`` object.
After backward it reduces the gradients as the layers' kinds need
(:class:`~lightning_hier.layers.GradientReducer`: sharded and replicated weights over BATCH,
slab-partial ones over MODEL first); with ``inter_node_every`` the grid is each node's and the node
replicas meet every ``m`` steps by the cross-node rule (:mod:`lightning_hier.strategies._inter_node`).
BatchNorm running statistics, computed per batch block, are averaged over BATCH for validation,
saving and at the end of fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.comm import CommStats, all_reduce_mean_
from lightning_hier.layers import GradientReducer, GridCommStats, GridContext
from lightning_hier.strategies._inter_node import InterNodeLevel
from lightning_hier.sync.base import Binding, Sync


class GridSync(Sync):
    """The grid's reductions and consensus (see the module docstring).

    Args:
        inter_level: The cross-node level (off unless ``inter_node_every`` is set).
    """

    def __init__(self, inter_level: InterNodeLevel) -> None:
        self.owner = inter_level.owner
        self.inter_level = inter_level
        self.reducer: GradientReducer | None = None
        self._module: nn.Module | None = None
        self._context: GridContext | None = None
        self._stats: CommStats = CommStats()

    def start(self, module: nn.Module, context: GridContext | None, stats: GridCommStats) -> None:
        """The module and grid of this run (set up, evaluated or saved)."""
        self._module, self._context, self._stats = module, context, stats

    @override
    def bind(self, binding: Binding) -> None:
        assert self._module is not None and self._context is not None, "start() first"
        self.reducer = GradientReducer(self._module, self._context)

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        assert self.reducer is not None
        self.reducer.reduce()  # after backward, before clipping and the step

    @override
    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        self.inter_level.step()  # across nodes, every inter_node_every steps
        stats = self._stats
        return {"comm/wire_bytes": stats.wire_bytes} if isinstance(stats, GridCommStats) else {}

    @contextmanager
    @override
    def consensus(self) -> Iterator[None]:
        with self.inter_level.consensus():  # the mean of the node replicas first (buffers included)
            buffers = self._block_buffers()
            saved = [b.clone() for b in buffers]
            self._average_buffers(buffers)
            try:
                yield
            finally:
                with torch.no_grad():
                    for b, s in zip(buffers, saved, strict=True):
                        b.copy_(s)

    @override
    def finalize(self) -> dict[str, float]:
        self.inter_level.finalize()
        self._average_buffers(self._block_buffers())
        return {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inter_level.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inter_level.load_state_dict(state)

    def _block_buffers(self) -> list[Tensor]:
        g, module = self._context, self._module
        return float_buffers(module) if g is not None and g.batch_group is not None and module is not None else []

    def _average_buffers(self, buffers: list[Tensor]) -> None:
        if buffers and self._context is not None:
            with torch.no_grad():
                all_reduce_mean_(buffers, self._context.batch_group, self._stats)
