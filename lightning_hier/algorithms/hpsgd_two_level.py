"""Two-level HPSGD: the flat HPSGD recurrence inside each node, an overlapped merge across nodes.

The rule (``intra_node='window'``, ``inter_node_every = m``; see
:mod:`lightning_hier.algorithms.two_level` for the shared definitions). Inside a node,
:class:`~lightning_hier.algorithms.hpsgd.HPSGD` runs unchanged over ``data_intra``: its global
model ``S`` becomes the *node model* ``S_n`` (equal on the node's ranks, one window stale).
Across nodes every rank also keeps ``G``, the model every rank of the job agrees on, and the
change ``D`` its node sent last. At every ``m``-th merge of the node::

    wait for the SUM F = sum_n D_n launched m merges ago (if any)
    G   <- G + F / N                       # N nodes
    S_n <- S_n + (F / N - D)               # the node's unsent changes now sit on the new G
    x   <- x + (F / N - D);  V <- V + (F / N - D)   # the replica and its window start, likewise
    D   <- S_n - G;  launch SUM(D) across nodes      # behind the next m windows

``D`` is equal on the node's ranks, so each of the node's ``d'`` ranks reduces only its
``1 / d'`` shard of it over its ``data_inter`` group, and when the sum is waited for the node
puts the shards together with a SUM over ``data_intra`` (the fast link): the node sends the
model once across nodes, not ``d'`` times (:func:`~lightning_hier.algorithms.two_level.launch_across_nodes`).

The shift ``F / N - D`` moves ``S_n``, the replica and its window start together, so the
window's change ``x - V`` and the intra reduction in flight are untouched: the intra recurrence
goes on as if nothing happened, and its merges land on the new ``G``. In exact arithmetic
``S_n = G + (changes of node n not yet sent)`` at all times, and the slow link has ``m`` windows
of compute to hide behind, where flat HPSGD gives one.

The consensus model (validation, the checkpoint's weights) is the mean over nodes of every
node's HPSGD consensus (``mean_n C_n``; ``G`` plus the in-flight ``D`` plus the unsent changes
cancel out of it), one blocking sharded mean across nodes. At the end of fit each node finishes
its HPSGD (every replica becomes ``S_n``), and the nodes' models are averaged over
``data_inter``, blocking: every rank then holds the same model, as after flat HPSGD.

Floating-point buffers (BatchNorm statistics) are averaged inside the node at every merge, as
flat HPSGD does, and across nodes only for the consensus model and at the end of fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.algorithms.hpsgd import HPSGD, Merge
from lightning_hier.algorithms.two_level import (
    LevelBytes,
    TwoLevel,
    complete_across_nodes_,
    launch_across_nodes,
    sum_across_nodes_,
)
from lightning_hier.comm import group_size, wait_all


class TwoLevelHPSGD:
    """HPSGD inside the node and an overlapped merge across nodes every ``m`` merges.

    Args:
        node: The node's :class:`~lightning_hier.algorithms.hpsgd.HPSGD`, built over
            ``levels.intra`` in mode ``'fixed'``.
        levels: ``data_intra``, ``data_inter`` and ``m``.

    Raises:
        ValueError: If ``node`` does not reduce over ``levels.intra`` or is not in mode ``'fixed'``.
    """

    def __init__(self, node: HPSGD, levels: TwoLevel) -> None:
        if node.group is not levels.intra:
            raise ValueError("TwoLevelHPSGD: the node's HPSGD must reduce over `levels.intra` (data_intra).")
        if node.mode != "fixed":
            raise ValueError(f"TwoLevelHPSGD: the node's HPSGD must use mode='fixed', got {node.mode!r}.")
        self.node, self.levels = node, levels
        self.nodes = group_size(levels.inter)
        self.level_bytes = LevelBytes(node.stats)
        self.base: list[Tensor] = node.flat.clone()  # G
        self.sent: list[Tensor] = node.flat.zeros_like()  # D, as this node sent it
        self.in_flight: list[Tensor] = node.flat.zeros_like()  # F once waited for
        self.pending = False
        self.inter_merges = 0
        self._works: list[dist.Work] = []

    # ------------------------------------------------------------------ the recurrence
    def step(self) -> Merge | None:
        """Call after every optimizer step; returns the node merge's metrics when a window closed."""
        node = self.node
        if node.launched and node.since_launch + 1 >= node.window and self.levels.reaches_across(node.merges):
            # this step's merge reaches across: put F together now, behind the node's reduction in
            # flight (waited for by the merge anyway), not behind the one the merge launches next
            self._wait()
        with self.level_bytes.counting("intra"):
            merge = node.step()
        if merge is not None and self.levels.reaches_across(merge.merges - 1):
            self._merge_across()
        return merge

    @torch.no_grad()
    def _merge_across(self) -> None:
        self._apply_in_flight()
        torch._foreach_copy_(self.sent, torch._foreach_sub(self.node.global_model, self.base))  # D = S_n - G
        torch._foreach_copy_(self.in_flight, self.sent)
        self._works = launch_across_nodes(self.in_flight, self.levels, self.level_bytes)
        self.pending = True

    def _wait(self) -> None:
        """Wait for the cross-node SUM in flight; then ``F`` is whole on every rank (the only place it becomes so)."""
        if self._works:
            wait_all(self._works, self.node.stats)
            self._works = []
            complete_across_nodes_(self.in_flight, self.levels, self.level_bytes)

    def _apply_in_flight(self) -> None:
        """Wait for the pending SUM; ``G += F / N`` and shift ``S_n``, ``x`` and ``V`` by ``F / N - D``."""
        self._wait()
        if not self.pending:
            return
        mean = torch._foreach_div(self.in_flight, float(self.nodes))
        torch._foreach_add_(self.base, mean)
        shift = torch._foreach_sub(mean, self.sent)
        for part in self._shifted():
            torch._foreach_add_(part, shift)
        self.pending = False
        self.inter_merges += 1

    def _shifted(self) -> list[list[Tensor]]:
        """``S_n``, the replica and (eager rule) its window start: what moves with the node's base."""
        parts = [self.node.global_model, self.node.replica]
        start = self.node._start()
        if start is not self.node.global_model:
            parts.append(start)
        return parts

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: finish the node's HPSGD, then average the node models across nodes (blocking).

        Afterwards every rank holds the same model and a new fit may go on from it. Calling it
        again changes nothing.
        """
        if not self.node.launched and not self.pending:
            return
        with self.level_bytes.counting("intra"):
            self.node.finalize()
        self._apply_in_flight()
        self._mean_across_nodes()
        for part in (self.node.global_model, self.base):
            torch._foreach_copy_(part, self.node.replica)
        if self.node._own_start is not None:
            torch._foreach_copy_(self.node._own_start, self.node.replica)
        if self.node.flat_buffers is not None:
            torch._foreach_copy_(self.node.global_buffers, self.node._buffers())

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold ``mean_n C_n`` (the nodes' HPSGD consensus models, averaged across nodes) while inside."""
        with self.node.consensus(), torch.no_grad():
            self._mean_across_nodes()
            yield

    def _mean_across_nodes(self) -> None:
        """The replica and buffers (equal on the node's ranks) become their mean over nodes (blocking)."""
        tensors = self.node.replica + self.node._buffers()
        sum_across_nodes_(tensors, self.levels, self.level_bytes)
        torch._foreach_div_(tensors, float(self.nodes))

    def metrics(self) -> dict[str, float]:
        """Per-level bytes and the cross-node merges so far."""
        return {**self.level_bytes.metrics(), "hpsgd/inter_merges": float(self.inter_merges)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The node's HPSGD state plus ``G``, ``D``, the finished cross-node sum and the counters."""
        self._wait()
        split = self.node.flat.split
        return {
            **self.node.state_dict(),
            "two_level": {
                "base": split(self.base),
                "sent": split(self.sent),
                "in_flight": split(self.in_flight),
                "pending": self.pending,
                "inter_merges": self.inter_merges,
                "every": self.levels.every,
                "level_bytes": self.level_bytes.state_dict(),
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`.

        Raises:
            ValueError: If the checkpoint was written by flat HPSGD or with another ``m``.
        """
        mine = state.get("two_level")
        if mine is None or int(mine["every"]) != self.levels.every:
            written = "flat HPSGD" if mine is None else f"inter_node_every={mine['every']}"
            raise ValueError(
                f"HPSGD: the checkpoint was written with {written}, this run uses inter_node_every={self.levels.every}."
            )
        self._wait()
        self.node.load_state_dict({k: v for k, v in state.items() if k != "two_level"})
        for name in ("base", "sent", "in_flight"):
            self.node.flat.load(getattr(self, name), mine[name], "HPSGD", name)
        self.pending, self.inter_merges = bool(mine["pending"]), int(mine["inter_merges"])
        self.level_bytes.load_state_dict(mine["level_bytes"])
