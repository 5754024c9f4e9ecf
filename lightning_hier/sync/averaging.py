"""The model-averaging family as a :class:`~lightning_hier.sync.base.Sync`: one round every ``tau`` steps.

One mechanism (:class:`~lightning_hier.algorithms.averaging.PeriodicAveraging`) and four policies
(:mod:`lightning_hier.algorithms.centers`, :mod:`~lightning_hier.algorithms.grawa`):

- Local SGD (:meth:`AveragingSync.localsgd`): uniform average (Stich, ICLR 2019; Lin et al., ICLR 2020);
- EASGD (:meth:`~AveragingSync.easgd`): elastic pull between replicas and a center (Zhang,
  Choromanska, LeCun, NeurIPS 2015);
- LSGD (:meth:`~AveragingSync.lsgd`): pull toward the leader, the replica of lowest running loss
  (Teng et al., NeurIPS 2019);
- GRAWA (:meth:`~AveragingSync.grawa`): a center weighted by inverse gradient norms, per model or
  per tensor (Dimlioglu and Choromanska, AISTATS 2024); its rounds may be asynchronous, through a
  server on rank 0 (``rounds='async'``).

:class:`AveragingSync` advances one algorithm per optimizer after every optimizer step (gradient
accumulation does not change the cadence) and returns each round's metrics. Two things come from
outside, both optional: a *pull schedule* (:class:`PullSchedule`, e.g. the
:class:`~lightning_hier.callbacks.PullToCenter` callback found among the loop's callbacks) that sets
``lam``, ``rho`` and ``tau`` per round and what is logged; and, for GRAWA, a *norm source*
(:class:`NormSource`) that measures the gradient norms on a probe batch instead of the step's own
gradients.

Plain PyTorch::

    sync = AveragingSync.grawa(variant="layer", tau=16)   # norms of the step's own gradients
    with sync.attach(model, optimizer):
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()  # every 16 steps: a pull toward the gradient-weighted center
            optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import PeriodicAveraging, float_buffers
from lightning_hier.algorithms.centers import CenterPolicy, ElasticCenter, LeaderCenter, RoundReport, UniformCenter
from lightning_hier.algorithms.claim_sampler import ClaimQueue
from lightning_hier.algorithms.dbs_compose import SampleWeightedCenter
from lightning_hier.algorithms.grawa import DEFAULT_BETA, NORMS, VARIANTS, GradientWeightedCenter, probe_grad_norms
from lightning_hier.algorithms.grawa_async import AsyncGradientWeightedCenter
from lightning_hier.algorithms.ps_link import require_worker
from lightning_hier.algorithms.round_guard import RoundGuard
from lightning_hier.algorithms.two_level import LevelRounds
from lightning_hier.comm import CommStats, all_reduce_mean_
from lightning_hier.comm.collectives import Group
from lightning_hier.sync.async_rounds import AsyncRounds
from lightning_hier.sync.base import (
    SAMPLE_WEIGHTS_PROBLEM,
    Binding,
    Sync,
    all_consensus,
    join_states,
    regroup_all,
    split_state,
)
from lightning_hier.sync.buckets import bucket_bytes, check_bucket_options
from lightning_hier.sync.dbs_compose import SampleWeights
from lightning_hier.sync.levels import Levels
from lightning_hier.sync.shared_queue import fetched_before_setup
from lightning_hier.topology import ProcessGroups, Topology

ROUNDS = ("sync", "async")
SERVER_KEY = "server"
"""Where rank 0 keeps the asynchronous rounds' server table in a checkpoint."""


@runtime_checkable
class PullSchedule(Protocol):
    """How strong and how often the rounds pull, and what a round logs (every rank answers the same)."""

    log_every_round: bool

    def lam_at(self, round_index: int, default: float) -> float:
        """Pull strength of round ``round_index`` (0-based); ``default`` is the rule's."""

    def rho_at(self, step: int, default: float) -> float:
        """Proximal strength after optimizer step ``step`` (0-based)."""

    def tau_at(self, round_index: int, default: int) -> int:
        """Length of the period that ends with round ``round_index``."""

    def round_metrics(self, report: RoundReport) -> dict[str, float]:
        """The metrics of one round."""


class NormSource(Protocol):
    """Where GRAWA's gradient norms are measured, when not on the step's own gradients."""

    def bind(self, binding: Binding) -> bool:
        """Prepare for a run of training; whether this source probes (False: use the step's gradients)."""

    def loss(self, step: int) -> Tensor:
        """A probe loss at the current weights, after optimizer step ``step`` (backward is taken on it)."""


class AveragingSync(Sync):
    """Periodic averaging with one of the four policies (see the module docstring and the strategies' docs).

    Args:
        policy: Builds the round's policy (a new one per run of training, and one per level).
        tau: Period in optimizer steps.
        lam: Pull strength in (0, 1]; ``None`` only where the policy has a default (EASGD's
            ``alpha = beta / W``).
        rho: Proximal pull toward the last center after every step (``rho / tau`` per step).
        sync_buffers: Average floating-point buffers (BatchNorm statistics) uniformly at every round.
        bucket_size_mb: Size bound of the flat buffers reduced in one call (MiB).
        levels: Flat (default) or two-level rounds.
        norms: GRAWA: where the gradient norms are measured (``None``: the step's own gradients).
        rounds: ``'sync'`` (lock-step collectives) or ``'async'`` (GRAWA through a server on rank 0).
        weights: DBS's sample weights of each replica (``dbs_localsgd``); ``None``: the plain mean.
        owner: The name in error messages.
        lam_name: The name of ``lam`` in error messages (EASGD calls it ``alpha``).
        lam_optional: Whether ``lam=None`` means the policy's default (EASGD) or is an error.
    """

    def __init__(
        self,
        policy: Callable[[], CenterPolicy],
        tau: int,
        lam: float | None = 1.0,
        rho: float = 0.0,
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        levels: Levels | None = None,
        norms: NormSource | None = None,
        rounds: str = "sync",
        weights: SampleWeights | None = None,
        owner: str = "AveragingSync",
        lam_name: str = "lam",
        lam_optional: bool = False,
    ) -> None:
        self.owner = owner
        self.policy = policy
        self.tau = v.check_int(owner, "tau", tau, minimum=1)
        if lam is None and lam_optional:  # the policy's own default (EASGD's alpha = beta / W)
            self.lam: float | None = None
        else:  # an undocumented None would fall back to the policy's default silently
            self.lam = v.check_float(owner, lam_name, lam, 0.0, 1.0, low_inclusive=False)
        self.rho = v.check_float(owner, "rho", rho, 0.0, 1.0)
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self.levels = levels if levels is not None else Levels(owner)
        self.rounds = v.check_choice(owner, "rounds", rounds, ROUNDS)
        self.lock_step = self.rounds == "sync"  # asynchronous rounds let the ranks run apart
        if self.rounds == "async":
            self.levels.refuse("rounds", "async", "asynchronous rounds talk to one parameter server; use rounds='sync'")
        self.norms = norms
        self.weights = weights
        self.schedule: PullSchedule | None = None
        self.claims: Callable[[], ClaimQueue] | None = None
        """The server's shared queue of samples (set by a shared-queue allocation; ``rounds='async'``)."""
        self.algorithms: list[PeriodicAveraging] = []
        self.server: AsyncRounds | None = None
        self._binding: Binding | None = None
        self._probing = False
        self._base_lam = 1.0

    # ------------------------------------------------------------------ the four policies
    @classmethod
    def localsgd(cls, tau: int = 8, **kwargs: Any) -> AveragingSync:
        """Local SGD: the replicas' uniform average every ``tau`` steps."""
        return cls(UniformCenter, tau, 1.0, 0.0, **kwargs)

    @classmethod
    def easgd(
        cls, tau: int = 4, beta: float = 0.1, alpha: float | None = None, rho: float = 0.0, **kwargs: Any
    ) -> AveragingSync:
        """EASGD: replicas and a center variable move toward each other every ``tau`` steps."""
        owner = kwargs.get("owner", cls.__name__)
        beta = v.check_float(owner, "beta", beta, 0.0, 1.0, low_inclusive=False)
        return cls(partial(ElasticCenter, beta), tau, alpha, rho, lam_name="alpha", lam_optional=True, **kwargs)

    @classmethod
    def lsgd(cls, tau: int = 4, lam: float = 0.1, rho: float = 0.1, **kwargs: Any) -> AveragingSync:
        """LSGD: every ``tau`` steps a pull toward the leader (the replica of lowest running loss)."""
        return cls(LeaderCenter, tau, lam, rho, **kwargs)

    @classmethod
    def grawa(
        cls,
        variant: str = "model",
        tau: int = 32,
        lam: float = 0.5,
        rho: float = 0.01,
        beta: float = DEFAULT_BETA,
        eps: float = 1e-8,
        p: float = 1.0,
        norm: str = "sum",
        rounds: str = "sync",
        **kwargs: Any,
    ) -> AveragingSync:
        """GRAWA: every ``tau`` steps a pull toward the center weighted by inverse gradient norms."""
        owner = kwargs.get("owner", cls.__name__)
        variant = v.check_choice(owner, "variant", variant, VARIANTS)
        beta = v.check_float(owner, "beta", beta, 0.0, 1.0, high_inclusive=False)
        eps = v.check_float(owner, "eps", eps, low=0.0, low_inclusive=False)
        p = v.check_float(owner, "p", p, 0.0, 8.0, low_inclusive=False)
        norm = v.check_choice(owner, "norm", norm, NORMS)
        kind = AsyncGradientWeightedCenter if rounds == "async" else GradientWeightedCenter
        sync = cls(partial(kind, variant, beta, eps, p, norm), tau, lam, rho, rounds=rounds, **kwargs)
        sync.variant = variant
        return sync

    variant: str = "model"
    """GRAWA's variant (the asynchronous server's table is per model or per tensor)."""

    @property
    def algorithm(self) -> PeriodicAveraging | None:
        """The first (with one optimizer: the only) optimizer's round mechanism; ``None`` before :meth:`bind`."""
        return self.algorithms[0] if self.algorithms else None

    # ------------------------------------------------------------------ set-up
    @override
    def check_layout(self, topology: Topology) -> None:
        self.levels.check(topology)

    @override
    def bind(self, binding: Binding) -> None:
        self._binding = binding
        groups, levels = binding.groups, self.levels
        sets = binding.parameter_sets()
        if self.rounds == "async" and len(sets) > 1:
            raise ValueError(
                f"{self.owner}: rounds='async' keeps one replica per rank on its server, so it synchronises one "
                f"optimizer; configure_optimizers returned {len(sets)}. Use rounds='sync'."
            )
        two = levels.window_levels(groups)
        levels.bind(binding.stats)
        self.algorithms = []
        for index, params in enumerate(sets):
            policy = self._new_policy()
            self.algorithms.append(
                PeriodicAveraging(
                    params,
                    group=levels.periodic_group(groups),
                    policy=policy,
                    tau=self.tau * levels.period_factor,
                    lam=self.lam,
                    rho=self.rho,
                    buffers=float_buffers(binding.module) if self.sync_buffers and index == 0 else (),
                    bucket_bytes=bucket_bytes(self.bucket_size_mb),
                    stats=binding.stats,
                    levels=LevelRounds(two, self.policy(), binding.stats) if two is not None else None,
                )
            )
        self._base_lam = self.algorithms[0].lam if self.algorithms else 1.0
        self._probing = self.norms.bind(binding) if self.norms is not None else False
        self.schedule = next((c for c in binding.callbacks if isinstance(c, PullSchedule)), None)
        # rounds are rare and seldom fall on a logging cadence: each one is written at its own step
        self.reporting = "lightning" if self.schedule is not None and not self.schedule.log_every_round else "each"
        if self.weights is not None:
            self.weights.reset()
        if self.rounds == "async" and self.algorithms:
            self._start_server(binding, self.algorithms[0])

    @override
    def fault_tolerance_problem(self) -> str | None:
        if self.rounds == "async":
            return "rounds='async' keeps every replica on a server in rank 0's process"
        if self.levels.enabled:
            return "two-level rounds keep groups per node; fault tolerance is for one flat group"
        if self.weights is not None:
            return SAMPLE_WEIGHTS_PROBLEM
        policy = self.policy()
        if isinstance(policy, ElasticCenter):
            return "EASGD's pull alpha = beta / W is fixed by the number of replicas at the start"
        if isinstance(policy, LeaderCenter):
            return "LSGD's leader is broadcast by its rank in the job's default group, which a live group is not"
        return None

    @override
    def regroup(self, groups: ProcessGroups, guard: RoundGuard) -> None:
        regroup_all(self._binding, groups, self.levels.periodic_group(groups), self.algorithms, guard)

    def _new_policy(self) -> CenterPolicy:
        policy = self.policy()
        if self.weights is not None and not isinstance(policy, SampleWeightedCenter):
            raise ValueError(f"{self.owner}: DBS's sample weights combine with Local SGD's uniform center only.")
        return policy

    def _start_server(self, binding: Binding, algorithm: PeriodicAveraging) -> None:
        policy = algorithm.policy
        assert isinstance(policy, AsyncGradientWeightedCenter)
        self.server = AsyncRounds.start(binding.topology, algorithm.flat, self.variant, binding.timeout, self.claims)
        policy.connect(require_worker(self.server).call, dist.barrier)

    # ------------------------------------------------------------------ per step
    @override
    def batch_started(self, batch: Any) -> None:
        if self.server is not None:
            self.server.resume()  # paused at the last consensus (validation, checkpoint)

    @override
    def observe(self, loss: Tensor | None) -> None:
        if loss is not None:
            for algorithm in self.algorithms:
                algorithm.observe(loss)  # LSGD elects its leader from the running loss

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        self.levels.average_in_node(self._binding, optimizer, self.sync_buffers)  # DDP inside the node

    @override
    def before_step(self, optimizer: Optimizer) -> None:
        if self.weights is not None:
            policy = self._of(optimizer).policy
            assert isinstance(policy, SampleWeightedCenter)
            policy.weight = self.weights.add_step()

    @override
    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        algorithm = self._of(optimizer)
        self._apply_schedule(algorithm)
        report = algorithm.step(self._probe(algorithm))
        if self.weights is not None and algorithm.schedule.since_sync == 0:
            self.weights.reset()  # the window was merged: the next one counts anew
        return self._metrics(algorithm, report) if report is not None else {}

    def _of(self, optimizer: Optimizer) -> PeriodicAveraging:
        assert self._binding is not None, "bind() first"
        return self.algorithms[self._binding.index_of(optimizer)]

    def _apply_schedule(self, algorithm: PeriodicAveraging) -> None:
        schedule = self.schedule
        if schedule is None:
            return
        owner, periods = type(schedule).__name__, algorithm.schedule
        lam = schedule.lam_at(periods.rounds, self._base_lam)
        algorithm.lam = v.check_float(owner, "lam", lam, 0.0, 1.0, low_inclusive=False)
        algorithm.rho = v.check_float(owner, "rho", schedule.rho_at(periods.steps, self.rho), 0.0, 1.0)
        tau = v.check_int(owner, "tau", schedule.tau_at(periods.rounds, self.tau), minimum=1)
        periods.tau = tau * self.levels.period_factor  # intra_node='step': the rule runs every m periods

    def _probe(self, algorithm: PeriodicAveraging) -> Callable[[], Tensor] | None:
        """The norms of a round: a probe of the norm source, or ``None`` (the step's own gradients)."""
        source, binding = self.norms, self._binding
        if source is None or not self._probing or binding is None:
            return None
        params, buffers = algorithm.flat.tensors, list(binding.module.buffers())

        def probed() -> Tensor:
            norms = probe_grad_norms(params, lambda: source.loss(algorithm.schedule.steps), buffers)
            if self.levels.node_steps:  # one weight per node: the mean of its ranks' norms
                _node_mean(norms, binding.groups.data_intra, binding.stats)
            return norms

        return probed

    def _metrics(self, algorithm: PeriodicAveraging, report: RoundReport) -> dict[str, float]:
        assert self._binding is not None
        metrics = self.schedule.round_metrics(report) if self.schedule is not None else report.metrics()
        if self.levels.enabled:
            levels = algorithm.levels
            metrics.update(self.levels.metrics(levels.level_bytes if levels is not None else None, self._binding.stats))
            metrics["avg/across_nodes"] = float(not algorithm._node_only)
        return metrics

    # ------------------------------------------------------------------ consensus, end, checkpoints
    @contextmanager
    @override
    def consensus(self) -> Iterator[None]:
        if self.server is not None:
            self.server.resume()  # a second consensus at the same point (validation, then a checkpoint) asks again
        with all_consensus([a.consensus for a in self.algorithms]):
            if self.server is not None:
                self.server.pause()  # every rank has read the server's center: no rank reports until training goes on
            yield

    @override
    def finalize(self) -> dict[str, float]:
        for algorithm in self.algorithms:
            # a partial last period gets a final round; GRAWA's probes the trained replicas for it
            algorithm.finalize(self._probe(algorithm))
        if self.weights is not None:
            self.weights.reset()
        if self.server is None:
            return {}
        self.server.pause()
        return self.server.metrics()

    @override
    def pause(self) -> None:
        if self.server is not None:
            self.server.pause()  # kept after it stops: a checkpoint saved after fit still holds the server's table

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.algorithms:
            return {}
        state = join_states([a.state_dict() for a in self.algorithms])
        if self.server is not None and self.server.server is not None:
            state[SERVER_KEY] = self.server.server.state_dict()  # rank 0 keeps every rank's latest replica
        return self.weights.wrap(state) if self.weights is not None else state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or not self.algorithms:
            return
        if self.weights is not None:
            state = self.weights.unwrap(state)
        server = state.get(SERVER_KEY)
        rule = {k: v for k, v in state.items() if k != SERVER_KEY}
        for algorithm, mine in zip(self.algorithms, split_state(rule, len(self.algorithms), self.owner), strict=True):
            algorithm.load_state_dict(mine)
        if self.server is not None and server is not None:
            self.server.load_server_state(server)

    # ------------------------------------------------------------------ a shared queue of samples
    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim ``n`` samples of ``epoch`` from the asynchronous rounds' server: ``(start, count)``."""
        link = self.server  # looked up at each claim: the loader may be built before set-up (an LR schedule)
        if link is None or self._binding is None:
            raise fetched_before_setup(self.owner)
        with self._binding.stats.blocked():
            return link.claim(epoch, n, num_samples)


def _node_mean(norms: Tensor, group: Group, stats: CommStats) -> Tensor:
    """The mean of the node's probed norms (``intra_node='step'``: a node's replicas are one)."""
    all_reduce_mean_([norms], group, stats)
    return norms
