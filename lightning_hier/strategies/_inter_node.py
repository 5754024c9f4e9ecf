"""The cross-node level of the grid and pipeline compositions, written once for both.

:class:`~lightning_hier.strategies.Grid2DStrategy` and
:class:`~lightning_hier.strategies.DecoupledStrategy` keep their own per-step data-parallel gradient
reduction *inside a node* (over ``data_intra``: the node's replicas with the same grid / stage
coordinates) and, with ``inter_node_every=m``, let the replicas of different nodes drift apart and
meet every ``m`` optimizer steps over ``data_inter`` with one of the existing pure rules:

- ``inter_node='localsgd'``: :class:`~lightning_hier.algorithms.averaging.LocalSGD` with ``tau=m``
  (a blocking mean of the replicas every ``m`` steps);
- ``inter_node='hpsgd'``: :class:`~lightning_hier.algorithms.hpsgd.HPSGD` with ``window=m`` (the
  window's change all-reduced in the background behind the next window).

Every rank of a node holds the same replica (their gradients are averaged every step), so each
``data_inter`` group averages the same pair of node models; the result is identical on every rank.

Without ``inter_node_every`` a multi-node job whose layout splits reduces gradients over
``data_intra`` and then ``data_inter`` (:func:`data_levels`,
:func:`~lightning_hier.comm.two_level.two_level_mean_`): the mean over ``data``, in two steps, each
rank of a node carrying its share of the node's mean across nodes.

The in-node level of these two strategies is always the per-step gradient reduction of their own
algorithm (what the data-parallel families call ``intra_node='step'``), so they take no
``intra_node`` argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from torch import Tensor

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import LocalSGD
from lightning_hier.algorithms.hpsgd import HPSGD
from lightning_hier.comm import CommStats, FlatTensors
from lightning_hier.comm.collectives import Group
from lightning_hier.topology import ProcessGroups, Topology

INTER_NODE_RULES = ("localsgd", "hpsgd")
"""Values of the ``inter_node`` argument."""


class InterNodeAlgorithm(Protocol):
    """What a composition needs from its cross-node rule (LocalSGD and HPSGD both provide it)."""

    flat: FlatTensors

    def step(self) -> Any:
        """Call after every optimizer step; synchronises when the period is over."""

    def finalize(self) -> None:
        """Leave the consensus model in the replica (end of fit)."""

    def consensus(self) -> AbstractContextManager[None]:
        """Hold the consensus model in the replica while inside."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's checkpoint state."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


def check_inter_node(owner: str, every: Any, rule: Any) -> tuple[int | None, str]:
    """Validate ``inter_node_every`` (``None`` or an integer >= 1) and ``inter_node`` (a rule name)."""
    checked = None if every is None else v.check_int(owner, "inter_node_every", every, minimum=1)
    return checked, v.check_choice(owner, "inter_node", rule, INTER_NODE_RULES)


def check_two_level(owner: str, topology: Topology, every: int | None) -> None:
    """Raise when ``inter_node_every`` is set but the layout has no node-local / cross-node split.

    Raises:
        ValueError: Naming the owner, the argument and value, and the layout's reason.
    """
    if every is None:
        return
    problem = topology.two_level_problem()
    if problem is not None:
        raise ValueError(
            f"{owner}: argument `inter_node_every`={every} synchronises across nodes, but {problem}; it needs "
            "num_nodes > 1 and a replica (pipe x model ranks) inside one node. Leave inter_node_every=None "
            "for the single-level rule."
        )


def data_levels(groups: ProcessGroups) -> tuple[Group, Group]:
    """``(node-local, cross-node)`` groups of a per-step gradient mean in two levels.

    On one node this is ``(data, None)``; on a layout whose replicas do not fit in a node it is the
    flat ``(data, None)`` too (the data dimension cannot split).
    """
    if groups.topology.num_nodes == 1 or groups.topology.two_level_problem() is not None:
        return (groups.data, None)
    return (groups.data_intra, groups.data_inter)


def build_inter_node(
    rule: str,
    every: int,
    params: Iterable[Tensor],
    groups: ProcessGroups,
    buffers: Iterable[Tensor] = (),
    stats: CommStats | None = None,
) -> InterNodeAlgorithm:
    """The cross-node rule over ``data_inter`` (the parameters become views of its flat buckets).

    Args:
        rule: One of :data:`INTER_NODE_RULES`.
        every: ``m``: the period (LocalSGD's ``tau``, HPSGD's ``window``) in optimizer steps.
        params: This rank's parameters (a grid shard, or a pipeline stage).
        groups: This rank's groups; ``data_inter`` must exist (see :func:`check_two_level`).
        buffers: Floating-point buffers averaged with the parameters (BatchNorm statistics).
        stats: Communication accounting.
    """
    group = groups.data_inter
    if group is None:
        raise ValueError(f"inter-node rule {rule!r}: this layout has no cross-node group (data_inter).")
    if rule == "hpsgd":
        return HPSGD(params, group, window=every, buffers=buffers, stats=stats)
    return LocalSGD(params, group, tau=every, buffers=buffers, stats=stats)


class InterNodeLevel:
    """The cross-node level of one composition: its arguments, its rule once fitting, and the hooks.

    A strategy keeps one and forwards to it: :meth:`check` before launch and at set-up,
    :meth:`build` when the algorithm is set up, :meth:`step` after every optimizer step,
    :meth:`consensus` / :meth:`finalize` / :meth:`state_dict` from the matching base hooks. Every
    hook does nothing while the level is off (``inter_node_every=None``).

    Args:
        owner: The strategy's class name (for error messages).
        every: The ``inter_node_every`` argument.
        rule: The ``inter_node`` argument.
    """

    def __init__(self, owner: str, every: Any, rule: Any) -> None:
        self.owner = owner
        self.every, self.rule = check_inter_node(owner, every, rule)
        self.algorithm: InterNodeAlgorithm | None = None

    @property
    def enabled(self) -> bool:
        """Whether the job synchronises across nodes on its own period (``inter_node_every`` set)."""
        return self.every is not None

    def check(self, topology: Topology) -> None:
        """See :func:`check_two_level`."""
        check_two_level(self.owner, topology, self.every)

    def build(
        self,
        params: Iterable[Tensor],
        groups: ProcessGroups,
        buffers: Iterable[Tensor] = (),
        stats: CommStats | None = None,
    ) -> InterNodeAlgorithm | None:
        """Create the rule over ``data_inter`` when enabled (see :func:`build_inter_node`); returns it."""
        if self.every is not None:
            self.algorithm = build_inter_node(self.rule, self.every, params, groups, buffers, stats)
        return self.algorithm

    def step(self) -> None:
        if self.algorithm is not None:
            self.algorithm.step()

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold the mean of the node replicas (the rule's consensus) while inside."""
        if self.algorithm is None:
            yield
            return
        with self.algorithm.consensus():
            yield

    def finalize(self) -> None:
        if self.algorithm is not None:
            self.algorithm.finalize()

    def state_dict(self) -> dict[str, Any]:
        return {"inter_node": self.algorithm.state_dict()} if self.algorithm is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.algorithm is not None and "inter_node" in state:
            self.algorithm.load_state_dict(state["inter_node"])
