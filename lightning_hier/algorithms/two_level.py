"""Two-level synchronisation for hierarchical clusters: fast links inside a node, slow ones between.

One rule for every data-parallel family (HPSGD, Local SGD, GRAWA), after hierarchical Local SGD
(Lin, Stich, Patel and Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020: local
steps ``H``, block steps ``H_b``). The data-parallel replicas split into ``data_intra`` (the
replicas of one node) and ``data_inter`` (one replica per node, the same local index on every
node; built once by :class:`~lightning_hier.topology.Topology`). With ``inter_node_every = m``:

- ``intra_node='window'``: every synchronisation (an HPSGD window, a Local SGD / GRAWA round of
  ``tau`` steps) runs over ``data_intra``; every ``m``-th one also reaches across nodes. For a
  uniform mean the cross-node part is a second mean over ``data_inter`` after the node's mean
  (every intra group has the same size, so the mean of the node means is the global mean, and
  only ``data_inter`` traffic crosses the slow link).
- ``intra_node='step'``: DDP inside the node (gradients averaged over ``data_intra`` after every
  backward, so a node's replicas stay equal) and the family's periodic rule only across nodes,
  over ``data_inter``, every ``m`` windows / ``m * tau`` steps.

This module holds the parts the families share: the level schedule (:class:`TwoLevel`), the
argument check (:func:`two_level_problem`), the node's gradient average
(:func:`average_gradients_`) and the byte accounting per level (:class:`LevelBytes`). The
HPSGD inter-node merge is :mod:`lightning_hier.algorithms.hpsgd_two_level`; the averaging
family's rounds are in :mod:`lightning_hier.algorithms.averaging`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_hier.algorithms.centers import CenterPolicy, RoundContext
from lightning_hier.comm import CommStats, all_reduce_mean_, all_reduce_sum_, all_reduce_sum_async, group_size, wait_all
from lightning_hier.comm.collectives import Group

IntraNode = Literal["window", "step"]
INTRA_NODE: tuple[IntraNode, ...] = ("window", "step")
Level = Literal["intra", "inter"]


@dataclass(frozen=True)
class TwoLevel:
    """The groups and the period of a two-level rule (``intra_node='window'``).

    Args:
        intra: ``data_intra``, this rank's replicas on its node.
        inter: ``data_inter``, this rank's counterparts on the other nodes.
        every: ``m``: every ``m``-th synchronisation also reaches across nodes (1: every one).
    """

    intra: Group
    inter: Group
    every: int

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"TwoLevel: argument `every` must be an integer >= 1, got {self.every!r}.")

    def reaches_across(self, index: int) -> bool:
        """Whether synchronisation number ``index`` (0-based) also reaches across nodes."""
        return (index + 1) % self.every == 0


def two_level_problem(
    inter_node_every: int | None, intra_node: str, num_nodes: int, layout_problem: str | None
) -> str | None:
    """Why these two-level arguments cannot run on this layout, or ``None`` when they can.

    Args:
        inter_node_every: ``m``, or ``None`` for the flat rule.
        intra_node: ``'window'`` or ``'step'``.
        num_nodes: Lightning's ``num_nodes``.
        layout_problem: :meth:`Topology.two_level_problem`'s answer (why the data group cannot split).
    """
    if inter_node_every is None:
        return None if intra_node == "window" else f"intra_node={intra_node!r} needs inter_node_every"
    if num_nodes < 2:
        return f"two-level synchronisation needs num_nodes > 1, the Trainer has num_nodes={num_nodes}"
    if layout_problem:
        return f"the data-parallel group cannot split into node levels: {layout_problem}"
    return None


@torch.no_grad()
def average_gradients_(params: Iterable[Tensor], group: Group, stats: CommStats | None = None) -> None:
    """DDP inside the node: every ``.grad`` becomes its mean over ``group`` (a blocking collective).

    A parameter without a gradient on this rank gets a zero gradient first, so every rank
    reduces the same tensors in the same order.
    """
    if group is None:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    all_reduce_mean_(grads, group, stats)


def _chunks(tensor: Tensor, intra: Group) -> tuple[Tensor, ...]:
    return tensor.reshape(-1).tensor_split(group_size(intra))  # views: the tensors are contiguous


def node_shard(tensors: Sequence[Tensor], intra: Group) -> list[Tensor]:
    """This rank's share of every tensor: chunk ``i`` of ``d'``, ``i`` its index in ``data_intra`` (views).

    Empty chunks are left out; they are empty on the same ranks of every node.
    """
    index = 0 if intra is None else dist.get_rank(intra)
    return [c for t in tensors if (c := _chunks(t, intra)[index]).numel()]


def launch_across_nodes(tensors: Sequence[Tensor], levels: TwoLevel, bytes_: LevelBytes) -> list[dist.Work]:
    """Start the SUM across nodes of ``tensors``, which are equal on the ranks of a node.

    Each of the node's ``d'`` ranks reduces only its shard over its ``data_inter`` group, so the
    node sends the model once across the slow link, not ``d'`` times. Finish with
    :func:`complete_across_nodes_` after waiting for the returned handles.
    """
    with bytes_.counting("inter"):
        return all_reduce_sum_async(node_shard(tensors, levels.intra), levels.inter, bytes_.stats)


def complete_across_nodes_(tensors: Sequence[Tensor], levels: TwoLevel, bytes_: LevelBytes) -> None:
    """Once the shard sums are done: every rank's ``tensors`` become the whole sum (a SUM over ``data_intra``).

    The other ranks' shards are zeroed first, so the node's SUM gathers the shards exactly.
    """
    if levels.intra is None:
        return
    index = dist.get_rank(levels.intra)
    with torch.no_grad():
        for t in tensors:
            for j, chunk in enumerate(_chunks(t, levels.intra)):
                if j != index:
                    chunk.zero_()
    with bytes_.counting("intra"):
        all_reduce_sum_(tensors, levels.intra, bytes_.stats)


def sum_across_nodes_(tensors: Sequence[Tensor], levels: TwoLevel, bytes_: LevelBytes) -> None:
    """Blocking :func:`launch_across_nodes` and :func:`complete_across_nodes_`."""
    wait_all(launch_across_nodes(tensors, levels, bytes_), bytes_.stats)
    complete_across_nodes_(tensors, levels, bytes_)


@dataclass
class LevelBytes:
    """Payload bytes handed to collectives per level (``intra``: inside a node; ``inter``: crossing nodes).

    Counted as the growth of a shared :class:`CommStats` around each collective, so the total
    ``comm/bytes`` stays the sum of both.
    """

    stats: CommStats
    intra: int = 0
    inter: int = 0

    @contextmanager
    def counting(self, level: Level) -> Iterator[None]:
        """Add the bytes of the collectives run inside to ``level``."""
        before = self.stats.bytes
        try:
            yield
        finally:
            grown = self.stats.bytes - before
            if level == "intra":
                self.intra += grown
            else:
                self.inter += grown

    def metrics(self, prefix: str = "comm") -> dict[str, float]:
        """``{prefix}/bytes_intra`` and ``{prefix}/bytes_inter`` (running totals)."""
        return {f"{prefix}/bytes_intra": float(self.intra), f"{prefix}/bytes_inter": float(self.inter)}

    def state_dict(self) -> dict[str, int]:
        return {"intra": self.intra, "inter": self.inter}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.intra, self.inter = int(state.get("intra", 0)), int(state.get("inter", 0))


class LevelRounds:
    """The two-level rounds of periodic averaging (Local SGD, GRAWA): which policy runs over which group.

    Round ``k`` (0-based) of :class:`~lightning_hier.algorithms.averaging.PeriodicAveraging`:

    - not an ``m``-th round: the *node policy* combines the node's replicas over ``data_intra``
      (GRAWA: the node's center, weighted by inverse gradient norms as in a flat round);
    - every ``m``-th round, a policy that is a plain mean (:attr:`CenterPolicy.mean_of_means`,
      Local SGD): the node's mean over ``data_intra``, then the mean of the node means over
      ``data_inter`` (the global mean, with only ``data_inter`` traffic across nodes);
    - every ``m``-th round, any other policy (GRAWA): one round of the *whole-job policy* over the
      whole data group, exactly a flat round.

    The node policy and the whole-job policy are separate objects, so a stateful policy keeps
    one state per level (GRAWA: the norm EMA of the node rounds, and that of the whole-job
    rounds, each bias-corrected over its own rounds). The consensus model, the final round of a
    fit and the rounds after a resume use the whole-job level.

    Args:
        levels: ``data_intra``, ``data_inter`` and ``m``.
        node_policy: The policy of the node rounds (a new instance of the whole-job policy's class).
        stats: The shared accounting; bytes are also counted per level in :attr:`level_bytes`.
    """

    def __init__(self, levels: TwoLevel, node_policy: CenterPolicy, stats: CommStats) -> None:
        self.levels, self.node_policy = levels, node_policy
        self.level_bytes = LevelBytes(stats)
        self._across = _MeanAcrossNodes(levels, self.level_bytes)

    def stages(
        self, policy: CenterPolicy, group: Group, index: int | None
    ) -> list[tuple[CenterPolicy, Group, Level | None]]:
        """``(policy, group, level)`` in order for round ``index`` (``None``: a whole-job round).

        ``level`` is ``None`` where the stage counts its bytes per level itself.
        """
        intra: tuple[CenterPolicy, Group, Level | None] = (self.node_policy, self.levels.intra, "intra")
        if index is not None and not self.levels.reaches_across(index):
            return [intra]
        if policy.mean_of_means:
            return [intra, (self._across, self.levels.inter, None)]
        return [(policy, group, "inter")]

    def state_dict(self) -> dict[str, Any]:
        return {"node_policy": self.node_policy.state_dict(), "level_bytes": self.level_bytes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.node_policy.load_state_dict(state.get("node_policy", {}))
        self.level_bytes.load_state_dict(state.get("level_bytes", {}))


class _MeanAcrossNodes(CenterPolicy):
    """The mean of the node means: a sharded SUM across nodes (:func:`sum_across_nodes_`) over ``N``."""

    def __init__(self, levels: TwoLevel, bytes_: LevelBytes) -> None:
        self.levels, self.bytes = levels, bytes_
        self.nodes = group_size(levels.inter)

    @override
    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        sum_across_nodes_(out, self.levels, self.bytes)
        torch._foreach_div_(out, float(self.nodes))
        return {}
