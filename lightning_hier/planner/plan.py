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
)
from lightning_hier.planner.networks import model_layers
from lightning_hier.topology import factorizations

BatchScope = Literal["global", "replica"]


@dataclass(frozen=True)
class GridPlan:
    """One candidate grid: its predicted communication and whether it is feasible.

    Attributes:
        pr, pc: The grid (MODEL x BATCH).
        batch: Global batch size B this candidate was evaluated at.
        cost: Messages and words per process, by kind.
        time_s: Predicted communication seconds per step.
        memory_bytes: Rough per-process memory estimate.
        problems: Why the grid is infeasible (empty when it is feasible).
    """

    pr: int
    pc: int
    batch: float
    cost: Cost
    time_s: float
    memory_bytes: float
    problems: tuple[str, ...] = ()

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
    slab_min_kernel: bool = True,
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
        slab_min_kernel: Require slabs of at least ``k`` rows per convolution (the planner's
            efficiency rule; the layers themselves only need the halo to fit in a slab).
    """
    layers = as_layers(model, input_shape)
    plans = []
    for pr, pc in factorizations(world_size):
        batch = float(batch_size * pc if batch_scope == "replica" else batch_size)
        problems = []
        if max_model is not None and pr > max_model:
            problems.append(f"Pr={pr} > max_model={max_model}")
        if batch_scope == "global" and pc > batch_size:
            problems.append(f"Pc={pc} > B={batch_size}: some batch blocks would be empty")
        elif batch_scope == "global" and batch_size % pc:
            problems.append(f"B={batch_size} is not divisible by Pc={pc}")
        problems += grid_problems(layers, pr, slab_min_kernel)
        cost = network_cost(layers, pr, pc, batch, first_input_grad)
        memory = memory_bytes(layers, pr, pc, batch)
        if memory_limit_bytes is not None and memory > memory_limit_bytes:
            problems.append(f"needs ~{memory / 2**20:.0f} MiB > limit {memory_limit_bytes / 2**20:.0f} MiB")
        link = links(pr, pc) if callable(links) else links
        plans.append(GridPlan(pr, pc, batch, cost, cost.time(link), memory, tuple(problems)))
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
    per_sample = kwargs.get("batch_scope") == "replica"
    return min(feasible, key=lambda p: (p.time_s / p.batch if per_sample else p.time_s, -p.pc))


def bandwidth_optimal_pr(layers: Sequence[Layer], batch_size: int, world_size: int) -> float:
    """The paper's bandwidth-only optimum for FC layers: sqrt(2 sum|W| P / (B sum(d_i + 2 d_{i-1})))."""
    fcs = [layer for layer in layers if isinstance(layer, FCLayer)]
    weights = sum(f.params for f in fcs)
    acts = sum(f.d_out + 2 * f.d_in for f in fcs)
    return sqrt(2 * weights * world_size / (batch_size * acts)) if acts else float(world_size)


def format_table(plans: Sequence[GridPlan], title: str = "") -> str:
    """A text table of candidate grids: messages, words per process, predicted time, memory."""
    per_sample = len({p.batch for p in plans}) > 1  # 'replica' scope: compare time per sample
    best = min(
        (p for p in plans if p.feasible),
        key=lambda p: (p.time_s / p.batch if per_sample else p.time_s, -p.pc),
        default=None,
    )
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
