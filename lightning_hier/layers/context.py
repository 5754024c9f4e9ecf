"""Where a rank sits in the Pr x Pc grid, and what its layers communicated.

:class:`GridContext` carries the MODEL and BATCH process groups, this rank's coordinates and the
accounting object explicitly to every grid layer (no globals). :class:`GridCommStats` extends
:class:`~lightning_hier.comm.CommStats` with the *wire* volume of each collective, in the
units of the alpha-beta cost model (see :mod:`lightning_hier.planner`), broken down by the kind of
communication, so measured bytes per step can be compared with predicted word counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_hier.comm import CommStats

Group = dist.ProcessGroup | None


class ParamKind(str, Enum):
    """How a parameter's gradient is reduced (docs/algorithms.md, section 5, "gradient reduction rules").

    - ``SHARDED``: a distinct piece on every r (grid Linear rows), replicated over c: mean over BATCH.
    - ``REPLICATED``: identical on every rank and computed identically on every r (after an
      all-gather): mean over BATCH only.
    - ``PARTIAL``: identical on every rank, but each r computes the gradient of its own slab
      (domain-parallel Conv2d, BatchNorm affine): sum over MODEL, then mean over BATCH.
    """

    SHARDED = "sharded"
    REPLICATED = "replicated"
    PARTIAL = "partial"


@dataclass
class GridCommStats(CommStats):
    """:class:`CommStats` plus the per-process wire volume of each collective, by kind.

    ``wire_bytes`` uses the bandwidth terms of the cost model: an all-gather whose full result has
    ``n`` bytes counts ``(p - 1) / p * n``, an all-reduce of ``n`` bytes ``2 (p - 1) / p * n``, a
    point-to-point message the bytes this rank sends. Divided by the element size this is the
    "words per process" of :mod:`lightning_hier.planner`.

    Attributes:
        wire_bytes: Total wire bytes of this rank.
        by_kind: Wire bytes per kind of communication (``fc_gather``, ``fc_dx``, ``halo``, ...).
    """

    wire_bytes: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)

    def add_wire(self, kind: str, nbytes: float) -> None:
        self.wire_bytes += float(nbytes)
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + float(nbytes)

    def snapshot(self) -> dict[str, float]:
        """A copy of the per-kind totals (subtract two snapshots to get one step's volume)."""
        return dict(self.by_kind)

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.wire_bytes = float(state.get("wire_bytes", 0.0))
        self.by_kind = {str(k): float(v) for k, v in state.get("by_kind", {}).items()}


@dataclass(frozen=True)
class GridContext:
    """One rank's view of the Pr x Pc grid (rank = c * Pr + r).

    Args:
        pr: Size of the MODEL dimension (fully connected rows / spatial slabs).
        pc: Size of the BATCH dimension (batch blocks).
        r: This rank's MODEL coordinate.
        c: This rank's BATCH coordinate.
        model_group: The ranks with the same c (size ``pr``; ``None`` when ``pr == 1``).
        batch_group: The ranks with the same r (size ``pc``; ``None`` when ``pc == 1``).
        grid_group: All ``pr * pc`` ranks (``None`` when that is 1).
        model_ranks: Global ranks of ``model_group`` ordered by r (halo exchange neighbours).
        stats: Where every collective of the layers records its bytes (optional).
        timeout: Longest wait for a halo exchange's messages (``None``: the group's own limit,
            which gloo takes from the group's creation: the start-up ``init_timeout``).
    """

    pr: int = 1
    pc: int = 1
    r: int = 0
    c: int = 0
    model_group: Group = None
    batch_group: Group = None
    grid_group: Group = None
    model_ranks: tuple[int, ...] = (0,)
    stats: GridCommStats | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.pr < 1 or self.pc < 1 or not 0 <= self.r < self.pr or not 0 <= self.c < self.pc:
            raise ValueError(
                f"GridContext: invalid coordinates (r={self.r}, c={self.c}) in a {self.pr} x {self.pc} grid."
            )
        if len(self.model_ranks) != self.pr:
            raise ValueError(f"GridContext: `model_ranks` must list {self.pr} ranks, got {self.model_ranks}.")
        for name, size, group in (
            ("model_group", self.pr, self.model_group),
            ("batch_group", self.pc, self.batch_group),
        ):
            if (size > 1) != (group is not None):
                raise ValueError(f"GridContext: `{name}` must be given exactly when its size is > 1 (size {size}).")

    @classmethod
    def from_groups(
        cls,
        groups: Any,
        stats: GridCommStats | None = None,
        timeout: timedelta | None = None,
        node_local: bool = False,
    ) -> GridContext:
        """The context of this rank from :class:`~lightning_hier.topology.ProcessGroups` (``pipe == 1``).

        Args:
            groups: This rank's process groups.
            stats: Where the layers record their bytes.
            timeout: See the class arguments.
            node_local: The grid is this rank's node only (two-level training across nodes): BATCH
                is ``data_intra`` (the node's batch blocks) and the grid group the node; the
                replicas of different nodes are synchronised by the strategy, not by the layers.
        """
        topo = groups.topology
        if topo.pipe != 1:
            raise ValueError(f"GridContext: the grid has no pipeline dimension, got pipe={topo.pipe}.")
        if node_local:
            pc, batch_group, grid_group = topo.data_per_node, groups.data_intra, groups.node
        else:
            pc, batch_group = topo.data, groups.data
            grid_group = dist.group.WORLD if topo.world_size > 1 else None
        return cls(
            pr=topo.model,
            pc=pc,
            r=groups.coords.model,
            c=groups.coords.data % pc,
            model_group=groups.model,
            batch_group=batch_group,
            grid_group=grid_group,
            model_ranks=tuple(topo.group_ranks("model", groups.rank)),
            stats=stats,
            timeout=timeout,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> GridContext:
        return self  # process groups cannot be copied; a copied module shares its rank's context

    @property
    def world(self) -> int:
        return self.pr * self.pc
