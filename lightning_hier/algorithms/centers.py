"""How a round of periodic averaging combines the replicas: the policy interface and three policies.

A :class:`CenterPolicy` turns every rank's replica into the round's combined model ``c`` (a
collective); the mechanism in :mod:`lightning_hier.algorithms.averaging` does everything else
(schedule, pull, proximal pull, center, consensus model, checkpoints). Policies here:

- :class:`UniformCenter`, Local SGD (Stich, "Local SGD Converges Fast and Communicates Little",
  ICLR 2019; Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020).
- :class:`ElasticCenter`, EASGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging
  SGD", NeurIPS 2015).
- :class:`LeaderCenter`, LSGD (Teng, Gao, Zhang, Choromanska, Dong, Wang, "Leader Stochastic
  Gradient Descent for Distributed Training of Deep Learning Models", NeurIPS 2019).

GRAWA's gradient-weighted center is in :mod:`lightning_hier.algorithms.grawa`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_hier.comm import CommStats, FlatTensors, all_reduce_mean_, all_reduce_sum_, broadcast_
from lightning_hier.comm.collectives import Group

PER_RANK_LOG_LIMIT = 16
"""Groups up to this size log one metric per rank; larger groups log min / mean / max summaries."""


@dataclass
class RoundReport:
    """What one round did, for logging (identical on every rank unless noted).

    Attributes:
        round: Index of the round (0-based).
        step: Optimizer steps taken when the round ran.
        lam: Pull strength used.
        consensus_distance: Root-mean-square over ranks of ``||x_w - c||`` before the pull.
        bytes: Payload bytes this rank has communicated so far (cumulative).
        world: Number of ranks in the group.
        weights: ``[W, L]`` weight of every rank's replica in ``c`` (GRAWA: ``L`` = 1 per model,
            or one per parameter tensor; LSGD: one-hot on the leader); None for uniform means.
        grad_norms: ``[W]`` gradient norm measured by every rank's probe (GRAWA).
        losses: ``[W]`` running training loss of every rank (LSGD).
        leader: Group rank of the leader (LSGD).
    """

    round: int
    step: int
    lam: float
    consensus_distance: float
    bytes: int
    world: int
    weights: Tensor | None = None
    grad_norms: Tensor | None = None
    losses: Tensor | None = None
    leader: int | None = None

    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics: one per rank up to :data:`PER_RANK_LOG_LIMIT` ranks, else min / mean / max.

        ``grawa/weight`` is a rank's weight in the center (LGRAWA: its mean over the parameter
        tensors, with ``grawa/layer_weight_min`` / ``_max`` the spread over the tensors).
        """
        out = {
            "comm/rounds": float(self.round + 1),
            "comm/bytes": float(self.bytes),
            "avg/lam": float(self.lam),
            "avg/consensus_dist": float(self.consensus_distance),
        }
        if self.weights is not None and self.leader is None:
            out.update(_per_rank("grawa/weight", self.weights.mean(dim=1)))
            if self.weights.shape[1] > 1:
                out.update(_per_rank("grawa/layer_weight_min", self.weights.min(dim=1).values))
                out.update(_per_rank("grawa/layer_weight_max", self.weights.max(dim=1).values))
        if self.grad_norms is not None:
            out.update(_per_rank("grawa/grad_norm", self.grad_norms))
        if self.leader is not None:
            out["lsgd/leader"] = float(self.leader)
        if self.losses is not None:
            out.update(_per_rank("lsgd/loss", self.losses))
        return out


def _per_rank(name: str, values: Tensor) -> dict[str, float]:
    vals = values.reshape(-1).double()
    if vals.numel() <= PER_RANK_LOG_LIMIT:
        return {f"{name}/rank{r}": float(v) for r, v in enumerate(vals)}
    return {f"{name}/min": float(vals.min()), f"{name}/mean": float(vals.mean()), f"{name}/max": float(vals.max())}


@dataclass
class RoundContext:
    """What a policy may use while combining: the group, the accounting and the gradient norms."""

    group: Group
    world: int
    rank: int
    stats: CommStats
    flat: FlatTensors
    fresh: bool
    """True in a training round (measure, update state); False for the consensus model (reuse)."""
    norms: Callable[[], Tensor]
    """Per-parameter-tensor gradient norms of this rank (called only by policies that need them)."""
    lam: float = 0.0
    """The pull this round applies to the replica (an asynchronous server records the pulled replica)."""


class CenterPolicy:
    """How a round combines the replicas. This base class is the uniform mean (Local SGD).

    Subclasses override :meth:`combine` (and the state methods if they keep state).
    """

    elastic: ClassVar[bool] = False
    """Pull toward the *previous* center, then move the center (EASGD); else pull toward ``c``."""
    keeps_center: ClassVar[bool] = True
    """Keep ``c`` between rounds (the proximal target and the consensus model right after a round)."""
    center_rate: float = 1.0
    """``mu`` in ``center <- center + mu (c - center)``."""
    lock_step: ClassVar[bool] = True
    """Every rank takes part in every round (collectives); False: a rank's round is its own exchange
    with a parameter server, and only the consensus model (validation, saving, end of fit) is collective."""

    mean_of_means: ClassVar[bool] = False
    """``c`` is the plain mean of the replicas, so a two-level round may take the mean of the node
    means (:class:`~lightning_hier.algorithms.two_level.LevelRounds`)."""

    def default_lam(self, world: int) -> float:
        return 1.0

    def observe(self, loss: Tensor) -> None:
        """Record one micro-batch's training loss (LSGD elects its leader from them)."""

    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        """Turn ``out`` (a copy of this rank's buckets) into ``c`` in place; a collective.

        Returns:
            Extra :class:`RoundReport` fields.
        """
        all_reduce_mean_(out, ctx.group, ctx.stats)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class UniformCenter(CenterPolicy):
    """Local SGD: ``c`` is the uniform mean and the replicas are replaced by it (``lam = 1``)."""

    keeps_center = False  # right after a round every replica *is* the center: no copy to keep
    mean_of_means = True


class ElasticCenter(CenterPolicy):
    """EASGD: an elastic force between each replica and a center variable.

    Args:
        beta: Moving rate of the center, ``center <- center + beta (mean(x) - center)``; the
            replicas' pull defaults to ``alpha = beta / W`` (the symmetric force of the paper).
    """

    elastic = True

    def __init__(self, beta: float = 0.1) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"ElasticCenter: `beta` must be in (0, 1], got {beta}.")
        self.center_rate = beta

    @override
    def default_lam(self, world: int) -> float:
        return self.center_rate / world


class LeaderCenter(CenterPolicy):
    """LSGD: ``c`` is the replica of the worker with the lowest running training loss.

    The running loss is the mean of the losses observed since the previous round (the value of
    that round is kept until new losses arrive). Non-finite losses never win; ties go to the
    lowest rank.
    """

    def __init__(self) -> None:
        self.loss_sum: Tensor | None = None
        self.loss_count = 0
        self.last = float("inf")

    @override
    def default_lam(self, world: int) -> float:
        return 0.1

    @override
    def observe(self, loss: Tensor) -> None:
        value = loss.detach().to(torch.float64).reshape(())
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_count += 1

    def running_loss(self) -> float:
        if self.loss_count == 0 or self.loss_sum is None:
            return self.last
        return float(self.loss_sum) / self.loss_count

    @override
    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        mine = self.running_loss()
        if ctx.fresh:
            self.last, self.loss_sum, self.loss_count = mine, None, 0
        losses = torch.zeros(ctx.world, dtype=torch.float64, device=out[0].device)
        losses[ctx.rank] = mine if mine == mine else float("inf")  # a diverged (NaN) replica never leads
        all_reduce_sum_([losses], ctx.group, ctx.stats)
        leader = int(torch.argmin(losses))  # the first minimum: ties go to the lowest rank
        src = leader if ctx.group is None else dist.get_global_rank(ctx.group, leader)
        broadcast_(out, src=src, group=ctx.group, stats=ctx.stats)
        weights = torch.zeros(ctx.world, 1, dtype=torch.float64)
        weights[leader] = 1.0
        return {"leader": leader, "losses": losses.cpu(), "weights": weights}

    @override
    def state_dict(self) -> dict[str, Any]:
        total = 0.0 if self.loss_sum is None else float(self.loss_sum)
        return {"loss_sum": total, "loss_count": self.loss_count, "last": self.last}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_count = int(state["loss_count"])
        self.loss_sum = torch.tensor(float(state["loss_sum"]), dtype=torch.float64) if self.loss_count else None
        self.last = float(state["last"])
