"""Rank layout and process groups: one object that validates the layout and builds every group once.

Every strategy of this package describes its processes as a grid with up to three named
dimensions, laid out row-major with the *inner* dimensions varying fastest::

    rank = data * (pipe * model) + pipe_index * model + model_index

- ``data``:  data-parallel replicas (``N`` for the pipeline strategy, ``Pc`` (BATCH) for the
  2D grid, the whole world for the averaging strategies).
- ``pipe``:  pipeline stages ``K`` of the decoupled-backpropagation strategy, so that
  ``rank(d, k) = d * K + k`` (stages of one replica on consecutive ranks).
- ``model``: the MODEL dimension ``Pr`` of the integrated model x batch x domain grid, so that
  ``rank = c * Pr + r`` (model-parallel ranks consecutive, i.e. inside a node).

On a multi-node job (``num_nodes > 1``) the data dimension also splits in two levels, for the
two-level synchronisation of hierarchical clusters (fast links inside a node, slow between):

- ``data_intra``: the data-parallel replicas *on one node* (same pipe/model coordinates);
- ``data_inter``: one replica per node, those with the same local data index on every node.

A two-level average is then an average over ``data_intra`` followed by one over ``data_inter``,
which equals the average over ``data`` (every intra group has the same size).

The layout arithmetic is pure Python (testable without processes); :meth:`Topology.build`
creates the ``torch.distributed`` groups, once, on every rank, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from lightning_hier import _validate as v

Dim = Literal["data", "pipe", "model"]
DIMS: tuple[Dim, ...] = ("data", "pipe", "model")
Level = Literal["intra", "inter"]
LEVELS: tuple[Level, ...] = ("intra", "inter")


@dataclass(frozen=True)
class Coords:
    """Coordinates of one rank in the grid."""

    data: int
    pipe: int
    model: int

    def __getitem__(self, dim: Dim) -> int:
        return int(getattr(self, dim))


@dataclass(frozen=True)
class Topology:
    """A validated rank layout.

    Args:
        world_size: Total number of processes.
        pipe: Number of pipeline stages ``K`` (1: no pipeline).
        model: Size ``Pr`` of the MODEL dimension of a 2D grid (1: no model parallelism).
        num_nodes: Number of nodes; ranks ``[n * world/num_nodes, (n+1) * world/num_nodes)`` live on
            node ``n``. Used for node-local groups and to check that inner dimensions stay inside a
            node when possible.

    Raises:
        ValueError: If a size is not a positive integer or ``world_size`` is not divisible by
            ``pipe * model``.
    """

    world_size: int
    pipe: int = 1
    model: int = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pipe", "model", "num_nodes"):
            # frozen: set through object.__setattr__, as a plain int (numpy integers overflow silently)
            object.__setattr__(self, name, v.check_int("Topology", name, getattr(self, name), minimum=1))
        inner = self.pipe * self.model
        if self.world_size % inner:
            raise ValueError(
                f"Topology: world size {self.world_size} is not divisible by pipe x model = "
                f"{self.pipe} x {self.model} = {inner}; choose a world size that is a multiple of {inner}."
            )
        if self.world_size % self.num_nodes:
            raise ValueError(f"Topology: world size {self.world_size} is not divisible by num_nodes={self.num_nodes}.")

    @property
    def data(self) -> int:
        """Number of data-parallel replicas."""
        return self.world_size // (self.pipe * self.model)

    def size(self, dim: Dim) -> int:
        """Size of one dimension."""
        return {"data": self.data, "pipe": self.pipe, "model": self.model}[dim]

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    def coords(self, rank: int) -> Coords:
        """Grid coordinates of ``rank``."""
        self._check_rank(rank)
        data, rest = divmod(rank, self.pipe * self.model)
        pipe, model = divmod(rest, self.model)
        return Coords(data=data, pipe=pipe, model=model)

    def rank_of(self, data: int = 0, pipe: int = 0, model: int = 0) -> int:
        """Inverse of :meth:`coords`."""
        for dim, value in (("data", data), ("pipe", pipe), ("model", model)):
            if not 0 <= value < self.size(dim):  # type: ignore[arg-type]
                raise ValueError(f"Topology: {dim} index {value} out of range [0, {self.size(dim)}).")  # type: ignore[arg-type]
        return (data * self.pipe + pipe) * self.model + model

    def group_ranks(self, dim: Dim, rank: int) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except ``dim`` (ordered by ``dim``)."""
        c = self.coords(rank)
        fixed = {"data": c.data, "pipe": c.pipe, "model": c.model}
        return [self.rank_of(**{**fixed, dim: i}) for i in range(self.size(dim))]

    def all_groups(self, dim: Dim) -> list[list[int]]:
        """Every group along ``dim``, in a deterministic order (one per combination of the others)."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks(dim, rank)), None)
        return [list(g) for g in seen]

    @property
    def data_per_node(self) -> int:
        """Data-parallel replicas on each node (0 when a replica's inner ranks span nodes)."""
        inner = self.pipe * self.model
        return self.ranks_per_node // inner if self.ranks_per_node % inner == 0 else 0

    def two_level_problem(self) -> str | None:
        """Why the data dimension cannot split into node-local and cross-node groups, or ``None``."""
        if self.num_nodes == 1:
            return "the job has one node (num_nodes=1)"
        if self.data_per_node == 0:
            return (
                f"a replica's pipe x model = {self.pipe * self.model} ranks do not fit in the "
                f"{self.ranks_per_node} ranks of a node"
            )
        return None

    def data_level_groups(self, level: Level) -> list[list[int]]:
        """Every ``data_intra`` or ``data_inter`` group, in a deterministic order.

        Raises:
            ValueError: If :meth:`two_level_problem` names a reason the split is impossible.
        """
        problem = self.two_level_problem()
        if problem:
            raise ValueError(f"Topology: no two-level data groups: {problem}.")
        per = self.data_per_node
        groups: list[list[int]] = []
        for line in self.all_groups("data"):  # one line per (pipe, model) coordinate
            if level == "intra":
                groups += [line[n * per : (n + 1) * per] for n in range(self.num_nodes)]
            else:
                groups += [line[i::per] for i in range(per)]
        return groups

    def node_groups(self) -> list[list[int]]:
        """Ranks of each node (contiguous blocks)."""
        n = self.ranks_per_node
        return [list(range(i * n, (i + 1) * n)) for i in range(self.num_nodes)]

    def describe(self) -> dict[str, int]:
        """Plain-typed summary, stored in checkpoints to reject a resume on another layout."""
        return {
            "world_size": self.world_size,
            "data": self.data,
            "pipe": self.pipe,
            "model": self.model,
            "num_nodes": self.num_nodes,
        }

    def build(self, rank: int, timeout: timedelta | None = None) -> ProcessGroups:
        """Create the process groups of every dimension; a collective call on all ranks.

        Groups that span the whole world reuse the default group, and singleton dimensions get
        no group at all, so a plain data-parallel layout creates no extra groups.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build: torch.distributed is not initialized.")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"Topology.build: layout is for {self.world_size} processes but the default group has "
                f"{dist.get_world_size()}."
            )
        groups: dict[str, dist.ProcessGroup | None] = {}
        for dim in DIMS:
            groups[dim] = self._new_groups(self.all_groups(dim), rank, timeout)
        groups["node"] = self._new_groups(self.node_groups(), rank, timeout)
        groups.update(self._level_groups(rank, groups["data"], timeout))
        return ProcessGroups(
            topology=self,
            rank=rank,
            coords=self.coords(rank),
            data=groups["data"],
            pipe=groups["pipe"],
            model=groups["model"],
            node=groups["node"],
            data_intra=groups["data_intra"],
            data_inter=groups["data_inter"],
        )

    def _level_groups(
        self, rank: int, data: dist.ProcessGroup | None, timeout: timedelta | None
    ) -> dict[str, dist.ProcessGroup | None]:
        # one node: the node-local level is the whole data group and there is no cross-node level;
        # new groups are only created on a real multi-node layout
        if self.num_nodes == 1:
            return {"data_intra": data, "data_inter": None}
        if self.two_level_problem():
            return {"data_intra": None, "data_inter": None}
        return {f"data_{level}": self._new_groups(self.data_level_groups(level), rank, timeout) for level in LEVELS}

    def build_service_group(self, timeout: timedelta | None = None) -> dist.ProcessGroup:
        """A second group over every rank, for a background service (the parameter server).

        A collective call on all ranks, made once. A service thread's point-to-point traffic gets
        its own group so it never shares one with the training thread's collectives. It is gloo
        whatever the training backend: the service's messages live in host memory (NCCL sends
        device memory only) and every receive needs its own time limit, which NCCL cannot give.
        """
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            raise RuntimeError(f"Topology.build_service_group: needs the default group of {self.world_size} ranks.")
        group = dist.new_group(list(range(self.world_size)), timeout=timeout, backend="gloo")
        assert group is not None
        return group

    def build_second_group(self, dim: Dim, rank: int, timeout: timedelta | None = None) -> dist.ProcessGroup | None:
        """A new group along ``dim`` for ``rank`` (``None`` when the dimension has size 1), never the world group.

        For small control messages that must not queue behind a bulk collective in flight on the
        built group (HPSGD's readiness flag, DBS's speeds). A collective call on all ranks.
        """
        return self._new_groups(self.all_groups(dim), rank, timeout, reuse_world=False)

    def _new_groups(
        self, all_groups: list[list[int]], rank: int, timeout: timedelta | None, reuse_world: bool = True
    ) -> dist.ProcessGroup | None:
        if len(all_groups[0]) == 1:
            return None
        if len(all_groups) == 1 and reuse_world:
            return dist.group.WORLD
        mine: dist.ProcessGroup | None = None
        for ranks in all_groups:  # every rank must create every group, in the same order
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        return mine

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Topology: rank {rank} out of range [0, {self.world_size}).")


@dataclass(frozen=True)
class ProcessGroups:
    """The groups of one rank, built once by :meth:`Topology.build`.

    A ``None`` group means the dimension has size 1 on this layout (nothing to communicate).
    """

    topology: Topology
    rank: int
    coords: Coords
    data: dist.ProcessGroup | None
    pipe: dist.ProcessGroup | None
    model: dist.ProcessGroup | None
    node: dist.ProcessGroup | None
    data_intra: dist.ProcessGroup | None = None
    data_inter: dist.ProcessGroup | None = None

    def group(self, dim: Dim) -> dist.ProcessGroup | None:
        """The group along ``dim`` that contains this rank."""
        return getattr(self, dim)

    def size(self, dim: Dim) -> int:
        return self.topology.size(dim)

    def pipe_neighbours(self) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next pipeline stage of this replica (``None`` at the ends)."""
        c = self.coords
        prev = self.topology.rank_of(c.data, c.pipe - 1, c.model) if c.pipe > 0 else None
        nxt = self.topology.rank_of(c.data, c.pipe + 1, c.model) if c.pipe < self.topology.pipe - 1 else None
        return prev, nxt


def factorizations(n: int) -> list[tuple[int, int]]:
    """All ``(a, b)`` with ``a * b == n``, ``a`` ascending (candidate ``(Pr, Pc)`` grids)."""
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]
