"""Evaluate every Pr x Pc factorisation of P and choose the grid with the least communication time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import sqrt
from typing import Literal

from torch import nn

from lightning_hier.planner.cost import (
    REFERENCE_LINK,
    Cost,
    FCLayer,
    Layer,
    Link,
    Links,
    grid_problems,
    memory_bytes,
    network_cost,
    thin_slabs,
)
from lightning_hier.planner.networks import model_layers
from lightning_hier.topology import factorizations

BatchScope = Literal["global", "replica"]


@dataclass(frozen=True)
class GridPlan:
    """One candidate grid: what the cost model predicts, and why it may be excluded.

    The cost is the model's, computed for every grid; three separate lists say why a grid is
    excluded: the model does not define it, the implementation cannot run it (the layers' own
    checks), or it breaks a limit the caller set.

    Attributes:
        pr, pc: The grid (MODEL x BATCH).
        batch: Global batch size B this candidate was evaluated at.
        cost: Messages and words per process, by kind.
        time_s: Predicted communication seconds per step.
        memory_bytes: Rough per-process memory estimate.
        undefined: Why the model has no such grid (``Pc > B``, ``B`` not divisible by ``Pc``).
        unsupported: Why the implementation cannot run it (:func:`~lightning_hier.planner.cost.grid_problems`).
        excluded: The caller's limits it breaks (``max_model``, memory, ``slab_min_kernel``).
    """

    pr: int
    pc: int
    batch: float
    cost: Cost
    time_s: float
    memory_bytes: float
    undefined: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    @property
    def problems(self) -> tuple[str, ...]:
        """Every reason the grid is excluded, the model's first."""
        return self.undefined + self.unsupported + self.excluded

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def grid(self) -> tuple[int, int]:
        return (self.pr, self.pc)

    @property
    def words(self) -> float:
        return self.cost.words


def as_layers(model: nn.Module | Sequence[Layer], input_shape: Sequence[int] | None = None) -> list[Layer]:
    """Layer descriptions of ``model`` (a module is traced on ``input_shape``, given without the batch)."""
    if isinstance(model, nn.Module):
        if input_shape is None:
            raise ValueError(
                "planner: `input_shape` (C, H, W or features, without the batch) is needed to trace a module."
            )
        return model_layers(model, input_shape)
    return list(model)


def plan_grids(
    model: nn.Module | Sequence[Layer],
    batch_size: int,
    world_size: int,
    *,
    input_shape: Sequence[int] | None = None,
    links: Link | Links | Callable[[int, int], Links] = REFERENCE_LINK,
    batch_scope: BatchScope = "global",
    max_model: int | None = None,
    memory_limit_bytes: float | None = None,
    first_input_grad: bool = False,
    slab_min_kernel: bool = False,
) -> list[GridPlan]:
    """Every factorisation ``Pr x Pc = world_size`` with its predicted communication.

    Args:
        model: A network (traced on ``input_shape``) or its layer descriptions.
        batch_size: The global batch B (``batch_scope='global'``, the paper's setting) or the batch
            of one MODEL group, i.e. the DataLoader's batch size (``'replica'``: B = batch_size * Pc).
        world_size: P.
        input_shape: Input shape without the batch dimension (for modules).
        links: Alpha and beta: one for all groups, one per group, or a function of ``(pr, pc)``
            giving one per group (e.g. :func:`~lightning_hier.planner.measure_links`).
        batch_scope: See ``batch_size``.
        max_model: Largest Pr to allow (docs/algorithms.md, section 5, restricts whole networks to Pr <= 8).
        memory_limit_bytes: Reject grids whose :func:`memory_bytes` estimate exceeds this.
        first_input_grad: The first layer's input needs a gradient (a slice of a network, such
            as AlexNet's FC layers evaluated alone).
        slab_min_kernel: Exclude grids whose slabs are thinner than a convolution's kernel (an
            efficiency rule of the caller's; the layers run on any slab, even an empty one).
    """
    layers = as_layers(model, input_shape)
    plans = []
    for pr, pc in factorizations(world_size):
        batch = float(batch_size * pc if batch_scope == "replica" else batch_size)
        undefined = []
        if batch_scope == "global" and pc > batch_size:
            undefined.append(f"Pc={pc} > B={batch_size}: some batch blocks would be empty")
        elif batch_scope == "global" and batch_size % pc:
            undefined.append(f"B={batch_size} is not divisible by Pc={pc}")
        cost = network_cost(layers, pr, pc, batch, first_input_grad)
        memory = memory_bytes(layers, pr, pc, batch)
        excluded = [f"Pr={pr} > max_model={max_model}"] if max_model is not None and pr > max_model else []
        excluded += thin_slabs(layers, pr) if slab_min_kernel else []
        if memory_limit_bytes is not None and memory > memory_limit_bytes:
            excluded.append(f"needs ~{memory / 2**20:.0f} MiB > limit {memory_limit_bytes / 2**20:.0f} MiB")
        link = links(pr, pc) if callable(links) else links
        reasons = (tuple(undefined), tuple(grid_problems(layers, pr)), tuple(excluded))
        plans.append(GridPlan(pr, pc, batch, cost, cost.time(link), memory, *reasons))
    return plans


def best_grid(model: nn.Module | Sequence[Layer], batch_size: int, world_size: int, **kwargs: object) -> GridPlan:
    """The feasible grid with the least predicted communication time (per sample for ``'replica'``).

    Ties go to the larger Pc (more batch parallelism). Keyword arguments: see :func:`plan_grids`.

    Raises:
        ValueError: No factorisation of ``world_size`` is feasible (the message lists why).
    """
    plans = plan_grids(model, batch_size, world_size, **kwargs)  # type: ignore[arg-type]
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        reasons = "; ".join(f"{p.pr}x{p.pc}: {p.problems[0]}" for p in plans)
        raise ValueError(f"planner: no feasible grid for P={world_size}, batch {batch_size}: {reasons}")
    return cheapest(feasible)


def cheapest(plans: Sequence[GridPlan]) -> GridPlan:
    """The plan with the least predicted time (per sample when their batches differ); ties to the larger Pc."""
    per_sample = len({p.batch for p in plans}) > 1  # 'replica' scope
    return min(plans, key=lambda p: (p.time_s / p.batch if per_sample else p.time_s, -p.pc))


def model_best(plans: Sequence[GridPlan]) -> GridPlan:
    """The cheapest grid the cost model defines, whatever the implementation or the limits say."""
    return cheapest([p for p in plans if not p.undefined])


def bandwidth_optimal_pr(layers: Sequence[Layer], batch_size: int, world_size: int) -> float:
    """The paper's bandwidth-only optimum for FC layers: sqrt(2 sum|W| P / (B sum(d_i + 2 d_{i-1})))."""
    fcs = [layer for layer in layers if isinstance(layer, FCLayer)]
    weights = sum(f.params for f in fcs)
    acts = sum(f.d_out + 2 * f.d_in for f in fcs)
    return sqrt(2 * weights * world_size / (batch_size * acts)) if acts else float(world_size)


def format_table(plans: Sequence[GridPlan], title: str = "") -> str:
    """A text table of candidate grids: messages, words per process, predicted time, memory."""
    feasible = [p for p in plans if p.feasible]
    best = cheapest(feasible) if feasible else None
    head = (
        f"{'grid Pr x Pc':>13} {'B':>7} {'messages':>9} {'words/process':>14} {'time ms':>10} {'memory MiB':>11}  note"
    )
    lines = [title, head] if title else [head]
    for p in plans:
        note = "best" if p is best else ("" if p.feasible else "infeasible: " + p.problems[0])
        lines.append(
            f"{f'{p.pr} x {p.pc}':>13} {p.batch:>7.0f} {p.cost.messages:>9.0f} {p.words / 1e6:>13.3f}M "
            f"{p.time_s * 1e3:>10.3f} {p.memory_bytes / 2**20:>11.1f}  {note}"
        )
    return "\n".join(lines)
