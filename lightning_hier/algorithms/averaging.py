"""Periodic model averaging: one mechanism, four policies (Local SGD, EASGD, LSGD, GRAWA).

Every worker trains its own replica ``x`` and, every ``tau`` optimizer steps, all workers of the
data-parallel group run one *round*::

    c       = combine(x_1, ..., x_W)          # the policy: uniform mean, weighted mean, leader's replica
    x      <- x + lam (T - x)                 # the pull (foreach lerp); T = c, or the old center (EASGD)
    center <- center + mu (c - center)        # mu = 1, EASGD: its moving rate beta

and, after every optimizer step when ``rho > 0``, the proximal pull ``x <- x + (rho / tau) (center - x)``.
Communication per round: P floats (plus a few per-rank scalars), nothing in between (DDP: P
floats every step). The policies, each a :class:`CenterPolicy`:

- :class:`UniformCenter`, Local SGD (Stich, "Local SGD Converges Fast and Communicates Little",
  ICLR 2019; Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): ``c`` is the
  mean, ``lam = 1``.
- :class:`ElasticCenter`, EASGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging
  SGD", NeurIPS 2015): ``x <- x - alpha (x - center)`` and ``center <- center + beta (mean(x) - center)``
  with the pre-pull ``x``; ``alpha = beta / W``.
- :class:`LeaderCenter`, LSGD (Teng et al., "Leader Stochastic Gradient Descent for Distributed
  Training of Deep Learning Models", NeurIPS 2019): ``c`` is the replica of the worker with the
  lowest running training loss, broadcast.
- :class:`~lightning_hier.algorithms.grawa.GradientWeightedCenter`, GRAWA (Dimlioglu and
  Choromanska, AISTATS 2024): ``c`` is a mean weighted by inverse gradient norms.

Pure torch, usable from a plain training loop::

    avg = PeriodicAveraging(model.parameters(), group=None, policy=UniformCenter(), tau=8)
    for x, y in data:
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        avg.observe(loss)          # only LSGD uses it
        avg.step()                 # GRAWA: avg.step(norms=...) to probe the gradient norms
    avg.finalize()                 # every replica now holds the consensus (a final round if mid-period)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hier.algorithms.centers import (
    CenterPolicy,
    ElasticCenter,
    LeaderCenter,
    RoundContext,
    RoundReport,
    UniformCenter,
)
from lightning_hier.algorithms.grawa import grad_norms
from lightning_hier.algorithms.periodic_schedule import PeriodicSchedule
from lightning_hier.algorithms.round_guard import RoundGuard, restore_point
from lightning_hier.algorithms.two_level import LevelRounds
from lightning_hier.comm import CommStats, FlatTensors, all_reduce_mean_, all_reduce_sum_, group_size
from lightning_hier.comm.collectives import Group

T = TypeVar("T")

__all__ = [
    "CenterPolicy",
    "ElasticCenter",
    "LeaderCenter",
    "LocalSGD",
    "PeriodicAveraging",
    "PeriodicSchedule",
    "RoundReport",
    "UniformCenter",
    "float_buffers",
    "pull_",
]


def float_buffers(module: nn.Module) -> list[Tensor]:
    """Floating-point buffers (BatchNorm running statistics); integer counters are left alone."""
    return [b for b in module.buffers() if b.is_floating_point()]


@torch.no_grad()
def pull_(x: Sequence[Tensor], target: Sequence[Tensor], strength: float) -> None:
    """``x <- x + strength (target - x)`` for every tensor, in place (one foreach lerp).

    ``strength = 1`` gives exactly ``target`` (torch's lerp is exact at weight 1).
    """
    torch._foreach_lerp_(list(x), list(target), strength)


class PeriodicAveraging:
    """The round mechanism shared by every policy (see the module docstring).

    Args:
        params: The replica's parameters; they become views of persistent flat buckets.
        group: Data-parallel group to average over (``None``: a single worker).
        policy: How a round combines the replicas (:class:`CenterPolicy`).
        tau: Period in optimizer steps.
        lam: Pull strength in (0, 1] (``None``: the policy's default, e.g. 1 for Local SGD).
        rho: Proximal strength in [0, 1]: after every step ``x <- x + (rho / tau) (center - x)``.
        buffers: Extra tensors averaged uniformly at every round (e.g. :func:`float_buffers` of the
            model for BatchNorm statistics); empty to leave them local.
        bucket_bytes: Bucket size bound for the flat buffers (``None``: one per dtype).
        stats: Communication accounting to update.
        levels: Two-level rounds (:class:`~lightning_hier.algorithms.two_level.LevelRounds`):
            most rounds inside the node, every ``m``-th across nodes; ``group`` is then the whole
            data group (the consensus model's). ``None``: every round over ``group``.

    ``lam``, ``rho`` and ``schedule.tau`` may be changed between steps (a pull schedule); every
    rank must make the same change.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        policy: CenterPolicy,
        tau: int,
        lam: float | None = None,
        rho: float = 0.0,
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
        levels: LevelRounds | None = None,
    ) -> None:
        self.group, self.levels = group, levels
        self.world = group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.guard: RoundGuard | None = None
        """Runs the rounds' collectives under a changing membership (``None``: a fixed group)."""
        self.policy = policy
        self.schedule = PeriodicSchedule(tau)
        self.lam = policy.default_lam(self.world) if lam is None else lam
        self.rho = rho
        _check_strengths(self.lam, self.rho)
        self.stats = stats if stats is not None else CommStats()
        self.flat = FlatTensors(list(params), bucket_bytes)
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        # the replicas start equal, so the initial center is the initial model
        self.center: list[Tensor] | None = self.flat.clone() if policy.keeps_center or rho > 0 else None
        self._replicas_equal = True  # until the first local step
        self._node_only = False  # the last round was inside the node only (two levels): nodes differ

    # ------------------------------------------------------------------ per step
    def observe(self, loss: Tensor) -> None:
        """Record a training loss (call once per micro-batch; only LSGD uses it)."""
        self.policy.observe(loss)

    def step(self, norms: Callable[[], Tensor] | None = None) -> RoundReport | None:
        """Call after every optimizer step: proximal pull, then a round when one is due.

        Args:
            norms: Returns this rank's per-parameter-tensor gradient norms when a policy needs
                them (GRAWA), e.g. a probe (:func:`~lightning_hier.algorithms.grawa.probe_grad_norms`);
                ``None``: the norms of the gradients in ``.grad`` (those of the step just taken).

        Returns:
            The round's report, or None when no round ran.
        """
        _check_strengths(self.lam, self.rho)
        if self.rho > 0 and self.center is not None:
            pull_(self.flat.buckets, self.center, self.rho / self.schedule.tau)
        if not self.schedule.step():
            return None
        return self._guarded(lambda: self.sync(norms), admit=True)

    def _guarded(self, collective: Callable[[], T], admit: bool = False) -> T:
        return collective() if self.guard is None else self.guard.run(self, collective, admit)

    def undo_point(self) -> Callable[[], None]:
        """How to undo a round that failed half-way (a fault-tolerant run): the replica and state as now."""
        return restore_point([self.flat, *([self.flat_buffers] if self.flat_buffers is not None else [])], self)

    def regroup(self, group: Group) -> None:
        """Average over ``group`` from now on (the live replicas of a fault-tolerant run; every member calls it)."""
        self.group, self.world = group, group_size(group)
        self.rank = 0 if group is None else group.rank()  # also a group made outside the default one

    @torch.no_grad()
    def sync(self, norms: Callable[[], Tensor] | None = None) -> RoundReport:
        """Run one round now (a collective on every rank of the group)."""
        x = self.flat.buckets
        c = self.flat.clone()
        index = self.schedule.rounds
        fields = self._combine(c, fresh=True, norms=norms, index=index, lam=self.lam)
        node_only = self.levels is not None and not self.levels.levels.reaches_across(index)
        distance = self._consensus_distance(x, c, self.levels.levels.intra if self.levels and node_only else self.group)
        target = self.center if self.policy.elastic and self.center is not None else c
        pull_(x, target, self.lam)
        if self.policy.elastic and self.center is not None:
            pull_(self.center, c, self.policy.center_rate)
        elif self.policy.keeps_center or self.rho > 0:
            self.center = c
        else:
            self.center = None
        lock_step = self.policy.lock_step
        if self.flat_buffers is not None and lock_step:  # asynchronous rounds average buffers at the consensus
            self._average_buffers(self.flat_buffers.buckets, index)
        # every replica is now c, unless the round stayed inside the node
        self._replicas_equal = lock_step and self.lam == 1.0 and not self.policy.elastic and not node_only
        self._node_only = node_only
        report = RoundReport(
            round=self.schedule.rounds,
            step=self.schedule.steps,
            lam=self.lam,
            consensus_distance=distance,
            bytes=self.stats.bytes,
            world=self.world,
            **fields,
        )
        self.schedule.synced()
        return report

    def _context(self, fresh: bool, norms: Callable[[], Tensor] | None = None, lam: float = 0.0) -> RoundContext:
        return self._context_in(self.group, fresh, norms, lam)

    def _context_in(
        self, group: Group, fresh: bool, norms: Callable[[], Tensor] | None = None, lam: float = 0.0
    ) -> RoundContext:
        probe = norms if norms is not None else (lambda: grad_norms(self.flat.tensors))
        rank = self.rank if group is self.group else dist.get_rank(group) if group is not None else 0
        return RoundContext(group, group_size(group), rank, self.stats, self.flat, fresh, probe, lam)

    def _combine(
        self,
        c: list[Tensor],
        fresh: bool,
        norms: Callable[[], Tensor] | None = None,
        index: int | None = None,
        lam: float = 0.0,
    ) -> dict[str, Any]:
        """``c`` <- the round's combination, over ``group`` or level by level (round ``index``; None: whole job)."""
        if self.levels is None:
            return self.policy.combine(c, self._context(fresh, norms, lam))
        fields: dict[str, Any] = {}
        for policy, group, level in self.levels.stages(self.policy, self.group, index):
            with self.levels.level_bytes.counting(level) if level else nullcontext():
                fields = policy.combine(c, self._context_in(group, fresh, norms, lam))
        return fields

    def _average_buffers(self, buffers: list[Tensor], index: int | None = None) -> None:
        """Mean of ``buffers`` over the round's groups in turn (the whole job when ``index`` is None)."""
        if self.levels is None:
            all_reduce_mean_(buffers, self.group, self.stats)
            return
        for _, group, level in self.levels.stages(self.policy, self.group, index):
            with self.levels.level_bytes.counting(level or "inter"):
                all_reduce_mean_(buffers, group, self.stats)

    def _consensus_distance(self, x: list[Tensor], c: list[Tensor], group: Group) -> float:
        norms = torch._foreach_norm(torch._foreach_sub(x, c))
        total = torch.stack(norms).double().pow(2).sum().reshape(1)
        if not self.policy.lock_step:  # an asynchronous round is this rank's alone: its own distance
            return float(total.sqrt())
        all_reduce_sum_([total], group, self.stats)
        return float(total.div(group_size(group)).sqrt())

    # ------------------------------------------------------------------ consensus model
    @torch.no_grad()
    def _consensus_params(self) -> list[Tensor] | None:
        """The consensus model's buckets, or None when this replica already is it (a collective)."""
        if not self.policy.lock_step:  # the server's center: the other replicas moved since this rank's round
            if self.schedule.since_sync == 0 and self._replicas_equal:
                return None  # at the start or after the end of fit, every replica is the consensus
            c = self.flat.clone()
            self.policy.combine(c, self._context(fresh=False))
            return c
        if self.policy.elastic:
            return self.center
        if self.schedule.since_sync == 0 and not self._node_only:
            if self._replicas_equal:
                return None
            if self.center is not None:
                # the pulled replicas x'_w = x_w + lam (c - x_w) combine to c: sum_w w_w x'_w = c
                # (exactly in exact arithmetic), so the stored c is the consensus, without communication
                return self.center
        if self.group is None:
            return None
        c = self.flat.clone()
        self._combine(c, fresh=False)
        return c

    @torch.no_grad()
    def _consensus_buffers(self) -> list[Tensor] | None:
        # buffers were averaged by the last round (lock-step) or the last consensus (finalize)
        synced = self.schedule.since_sync == 0 and (self.policy.lock_step or self._replicas_equal)
        if self.flat_buffers is None or (synced and not self._node_only) or self.group is None:
            return None
        mean = self.flat_buffers.clone()
        self._average_buffers(mean)
        return mean

    def _consensus_swaps(self) -> list[tuple[FlatTensors, list[Tensor]]]:
        swaps = []
        params = self._consensus_params()
        if params is not None:
            swaps.append((self.flat, params))
        buffers = self._consensus_buffers()
        if buffers is not None and self.flat_buffers is not None:
            swaps.append((self.flat_buffers, buffers))
        return swaps

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold the consensus model in the replica while inside (e.g. to validate it), then restore it.

        The consensus model is the EASGD center variable, or the policy's combination of the
        current replicas with its latest weights (no new measurement); buffers are averaged.
        """
        swaps = self._guarded(self._consensus_swaps)
        backups = [flat.clone() for flat, _ in swaps]
        for flat, new in swaps:
            flat.copy_(new)
        try:
            yield
        finally:
            for (flat, _), backup in zip(swaps, backups, strict=True):
                flat.copy_(backup)

    @torch.no_grad()
    def finalize(self, norms: Callable[[], Tensor] | None = None) -> None:
        """End of training: every replica takes the consensus of the trained replicas (a collective).

        The consensus, per policy:

        - a partial last period (steps since the last round, or no round at all): a *final round*
          over the replicas as they are, ``c = combine(x_1, ..., x_W)`` with a fresh measurement
          (Local SGD: the mean; LSGD: the leader of the period's running losses; GRAWA: weights
          from a new gradient-norm probe, folded into the norm EMA), and every replica becomes ``c``;
        - right after a round: the round's ``c`` (the pulled replicas still combine to it);
        - EASGD, always: the center catches up with the replicas, ``center <- mean(x)`` (a final
          elastic round with moving rate 1), and every replica becomes it. The center lags the
          replicas by about ``tau / beta`` steps (40 with the defaults), so the plain center of a
          short fit is mostly the initial model, and of a fit shorter than ``tau`` exactly it.

        Afterwards the replicas are equal and are the center, as right after a Local SGD round:
        calling it again changes nothing, and training may go on from there (the schedule starts
        a new period; the final round is not counted in ``schedule.rounds``).

        Args:
            norms: This rank's gradient-norm probe for GRAWA's final round (see :meth:`step`).
        """
        if self.schedule.since_sync == 0 and self._replicas_equal:
            return  # nothing trained since the replicas were last made equal
        self._guarded(lambda: self._final_round(norms))

    @torch.no_grad()
    def _final_round(self, norms: Callable[[], Tensor] | None) -> None:
        partial = self.schedule.since_sync > 0 or self._node_only  # two levels: the nodes still differ
        if not self.policy.lock_step:
            if partial:  # the final report: the server records the trained replica as it is (no pull)
                self.policy.combine(self.flat.clone(), self._context(fresh=True, norms=norms))
            c = self.flat.clone()
            self.policy.combine(c, self._context(fresh=False))
        elif self.group is None:
            c = None  # a single worker is its own consensus
        elif self.policy.elastic:
            c = self.flat.clone()
            all_reduce_mean_(c, self.group, self.stats)
        elif partial:
            c = self.flat.clone()
            self._combine(c, fresh=True, norms=norms)
        else:
            c = self.center  # right after a round with lam < 1: the replicas combine to the stored c
        if c is not None:
            self.flat.copy_(c)
        if (partial or not self.policy.lock_step) and self.flat_buffers is not None:
            self._average_buffers(self.flat_buffers.buckets)
        if self.policy.keeps_center or self.rho > 0:
            self.center = self.flat.clone()
        self.schedule.since_sync = 0
        self._replicas_equal, self._node_only = True, False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "center": None if self.center is None else [t.detach().clone() for t in self.center],
            "replicas_equal": self._replicas_equal,
            "policy": self.policy.state_dict(),
            **({"levels": self.levels.state_dict(), "node_only": self._node_only} if self.levels else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
        saved = state.get("center")
        buckets = self.flat.buckets
        self.center = None if saved is None else [t.to(b.device, b.dtype) for t, b in zip(saved, buckets, strict=True)]
        self._replicas_equal = bool(state.get("replicas_equal", self.schedule.since_sync == 0))
        self.policy.load_state_dict(state.get("policy", {}))
        if self.levels is not None:
            self.levels.load_state_dict(state.get("levels", {}))
            self._node_only = bool(state.get("node_only", False))


class LocalSGD(PeriodicAveraging):
    """Local SGD: uniform model averaging every ``tau`` optimizer steps (:class:`UniformCenter`, ``lam = 1``).

    Args:
        params: The replica's parameters; they become views of persistent flat buckets.
        group: Data-parallel group to average over (``None``: a single worker).
        tau: Averaging period in optimizer steps.
        buffers: Extra tensors averaged at every round (e.g. :func:`float_buffers`).
        bucket_bytes: Bucket size bound for the flat buffers (``None``: one per dtype).
        stats: Communication accounting to update.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        tau: int,
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__(params, group, UniformCenter(), tau, 1.0, 0.0, buffers, bucket_bytes, stats)


def _check_strengths(lam: float, rho: float) -> None:
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"PeriodicAveraging: pull strength `lam` must be in (0, 1], got {lam!r}.")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"PeriodicAveraging: proximal strength `rho` must be in [0, 1], got {rho!r}.")
