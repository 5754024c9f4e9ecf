"""The levels of a data-parallel rule: one flat group, or inside the node and across nodes.

:class:`Levels` is the two-level option of the data-parallel families (``inter_node_every``,
``intra_node``) as data, held by the rule it shapes (:class:`~lightning_hier.sync.HPSGDSync`,
:class:`~lightning_hier.sync.AveragingSync`). The rule itself is
:mod:`lightning_hier.algorithms.two_level`:

- flat (``inter_node_every=None``): the rule runs over the whole data-parallel group;
- ``intra_node='window'``: every window / round runs inside the node (``data_intra``), every
  ``m``-th one also across nodes;
- ``intra_node='step'``: DDP inside the node (gradients, and float buffers with ``sync_buffers``,
  averaged over ``data_intra`` after every backward) and the rule only across nodes
  (``data_inter``) every ``m`` windows / ``m * tau`` steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import float_buffers
from lightning_hier.algorithms.two_level import INTRA_NODE, LevelBytes, TwoLevel, average_gradients_, two_level_problem
from lightning_hier.comm import CommStats, all_reduce_mean_
from lightning_hier.comm.collectives import Group
from lightning_hier.topology import ProcessGroups, Topology

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_hier.sync.base import Binding

TWO_LEVEL_ARGS = """        inter_node_every: ``None`` (default): one flat data-parallel group. An integer ``m >= 1``:
            two-level synchronisation on a multi-node job (``num_nodes > 1``): inside the node every
            {unit}, across nodes every ``m``-th one (see :mod:`lightning_hier.algorithms.two_level`).
        intra_node: With ``inter_node_every``: ``'window'`` (default; the {unit} rule inside the
            node) or ``'step'`` (DDP inside the node: gradients averaged over the node's replicas
            after every backward; the periodic rule then runs only across nodes, every ``m`` {unit}s)."""
"""The docstring of the two arguments, for the strategies that take them (``{unit}``: window or round)."""


class Levels:
    """Flat or two-level synchronisation (see the module docstring).

    Args:
        owner: The holder's name, for error messages.
        inter_node_every: ``m``, or ``None`` for the flat rule.
        intra_node: ``'window'`` or ``'step'`` (only with ``inter_node_every``).
        unsupported: Why the holder offers no two-level rule at all (``None``: it does).

    Raises:
        ValueError: A bad value, ``intra_node='step'`` without ``inter_node_every``, or two levels
            where ``unsupported`` says why not.
    """

    def __init__(
        self,
        owner: str,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        unsupported: str | None = None,
    ) -> None:
        self.owner = owner
        if inter_node_every is not None:
            inter_node_every = v.check_int(owner, "inter_node_every", inter_node_every, minimum=1)
        self.inter_node_every = inter_node_every
        self.intra_node = v.check_choice(owner, "intra_node", intra_node, INTRA_NODE)
        if inter_node_every is None and intra_node != "window":
            raise ValueError(
                f"{owner}: argument `intra_node` must be 'window' without `inter_node_every`, got {intra_node!r}: "
                "'step' (DDP inside the node) is a two-level option."
            )
        if inter_node_every is not None and unsupported:
            raise ValueError(f"{owner}: argument `inter_node_every`={inter_node_every} is not offered: {unsupported}.")
        self._intra_bytes: LevelBytes | None = None

    def refuse(self, name: str, value: object, reason: str) -> None:
        """Raise if two levels are on: the holder's argument ``name`` = ``value`` cannot go with them."""
        if self.enabled:
            raise ValueError(
                f"{self.owner}: argument `inter_node_every`={self.inter_node_every} cannot be combined with "
                f"{name}={value!r}: {reason}."
            )

    @property
    def enabled(self) -> bool:
        """Whether two-level synchronisation is on."""
        return self.inter_node_every is not None

    @property
    def node_steps(self) -> bool:
        """DDP inside the node (``intra_node='step'``)."""
        return self.enabled and self.intra_node == "step"

    def check(self, topology: Topology) -> None:
        """Raise when the layout cannot split into node levels (before any rank starts, and at set-up)."""
        problem = two_level_problem(
            self.inter_node_every, self.intra_node, topology.num_nodes, topology.two_level_problem()
        )
        if problem:
            raise ValueError(
                f"{self.owner}: argument `inter_node_every`={self.inter_node_every!r} (intra_node={self.intra_node!r}) "
                f"cannot run: {problem}."
            )

    # ------------------------------------------------------------------ what the rule is built over
    def periodic_group(self, groups: ProcessGroups) -> Group:
        """The group of the periodic rule: ``data``, or ``data_inter`` when DDP runs inside the node."""
        return groups.data_inter if self.node_steps else groups.data

    @property
    def period_factor(self) -> int:
        """``m`` with ``intra_node='step'`` (the rule runs across nodes every ``m`` periods), else 1."""
        return self.inter_node_every if self.node_steps and self.inter_node_every is not None else 1

    def window_levels(self, groups: ProcessGroups) -> TwoLevel | None:
        """The groups and period of ``intra_node='window'``; ``None`` otherwise."""
        if not self.enabled or self.node_steps or self.inter_node_every is None:
            return None
        return TwoLevel(groups.data_intra, groups.data_inter, self.inter_node_every)

    # ------------------------------------------------------------------ DDP inside the node
    def bind(self, stats: CommStats) -> None:
        """Count the node's gradient bytes (``intra_node='step'``) in ``stats`` (running totals across fits)."""
        if self.node_steps and (self._intra_bytes is None or self._intra_bytes.stats is not stats):
            self._intra_bytes = LevelBytes(stats)

    @torch.no_grad()
    def average_in_node(self, binding: Binding | None, optimizer: Optimizer, sync_buffers: bool) -> None:
        """``intra_node='step'``: average ``optimizer``'s gradients over the node's replicas (and the buffers).

        The float buffers (forward updated the BatchNorm statistics) go with the first optimizer's
        parameters, so the node's replicas stay equal.
        """
        if not self.node_steps or self._intra_bytes is None or binding is None:
            return
        index = binding.index_of(optimizer)
        params = [p for p in binding.parameter_sets()[index] if p.requires_grad]
        buffers = float_buffers(binding.module) if sync_buffers and index == 0 else []
        groups, stats = binding.groups, binding.stats
        with self._intra_bytes.counting("intra"):
            average_gradients_(params, groups.data_intra, stats)
            if buffers:
                all_reduce_mean_(buffers, groups.data_intra, stats)

    def metrics(self, level_bytes: LevelBytes | None, stats: CommStats) -> dict[str, float]:
        """``comm/bytes_intra`` and ``comm/bytes_inter``; empty on the flat rule.

        Args:
            level_bytes: The algorithm's own count per level (``intra_node='window'``), else ``None``.
            stats: The shared accounting.
        """
        if not self.enabled:
            return {}
        if level_bytes is not None:
            return level_bytes.metrics()
        # intra_node='step': the node's gradients are intra, the periodic rule's collectives inter
        intra = self._intra_bytes.intra if self._intra_bytes is not None else 0
        return {"comm/bytes_intra": float(intra), "comm/bytes_inter": float(stats.bytes - intra)}
