"""Lightning adapters of the model-averaging family (one mechanism, one adapter, four policies).

- :class:`LocalSGDStrategy` (``localsgd``): uniform average every ``tau`` steps (Stich, ICLR
  2019; Lin et al., ICLR 2020).
- :class:`EasgdStrategy` (``easgd``): elastic averaging with a center variable (Zhang, Choromanska,
  LeCun, NeurIPS 2015).
- :class:`LsgdStrategy` (``lsgd``): pull toward the leader, the replica with the lowest running
  loss (Teng et al., NeurIPS 2019).
- :class:`~lightning_hier.strategies.grawa.GrawaStrategy` (``grawa``, ``mgrawa``, ``lgrawa``):
  gradient-weighted center (Dimlioglu and Choromanska, AISTATS 2024).

Each name also exists as ``name_spawn`` and ``name_fork``. The math is in
:mod:`lightning_hier.algorithms.averaging`; :class:`AveragingStrategy` adapts it once for all
policies: it advances the algorithm once per real optimizer step (gradient accumulation does not
change the cadence), asks the :class:`~lightning_hier.callbacks.PullToCenter` callback for the
pull schedule and what to log, evaluates and saves the consensus model, and checkpoints every
replica with its center, norm EMAs and counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import PeriodicAveraging
from lightning_hier.algorithms.centers import CenterPolicy, ElasticCenter, LeaderCenter, RoundReport, UniformCenter
from lightning_hier.algorithms.two_level import LevelRounds
from lightning_hier.callbacks.pull import PullToCenter
from lightning_hier.strategies._algorithm import AlgorithmStrategy
from lightning_hier.strategies._buckets import bucket_arguments, check_bucket_options
from lightning_hier.strategies._finite import loss_of
from lightning_hier.strategies._two_level import TWO_LEVEL_ARGS, TwoLevelOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer


class AveragingStrategy(TwoLevelOptions, AlgorithmStrategy[PeriodicAveraging]):
    """Shared adapter of the averaging strategies (not registered itself).

    Subclasses validate their arguments, call :meth:`_configure` and implement :meth:`_policy`.
    Finalisation, the consensus model and checkpoint state are forwarded to ``self.algorithm``
    by :class:`~lightning_hier.strategies._algorithm.AlgorithmStrategy`.
    """

    pull: PullToCenter | None = None

    def _configure(
        self,
        tau: int,
        lam: float | None,
        rho: float,
        sync_buffers: bool,
        bucket_size_mb: float,
        lam_name: str = "lam",
        lam_may_be_none: bool = False,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        not_with: dict[str, tuple[Any, str]] | None = None,
        unsupported: str | None = None,
    ) -> None:
        """Validate and keep the shared arguments; ``lam`` may be ``None`` only where documented (EASGD's alpha).

        ``not_with``, ``unsupported``: what two-level synchronisation rejects (see :class:`TwoLevelOptions`).
        """
        owner = type(self).__name__
        self.tau = v.check_int(owner, "tau", tau, minimum=1)
        if lam is None and lam_may_be_none:
            self.lam = None
        else:  # an undocumented None would fall back to the policy's default silently
            self.lam = v.check_float(owner, lam_name, lam, 0.0, 1.0, low_inclusive=False)
        self.rho = v.check_float(owner, "rho", rho, 0.0, 1.0)
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self._step_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._base_lam = 1.0
        self._configure_two_level(inter_node_every, intra_node, not_with, unsupported)

    def _policy(self) -> CenterPolicy:
        """How a round combines the replicas."""
        raise NotImplementedError

    def _norms(self) -> Callable[[], Tensor] | None:
        """Gradient-norm probe for policies that need one (``None``: the step's own gradients)."""
        return None

    # ------------------------------------------------------------------ set-up and steps
    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        self._require_single_optimizer()
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        self.pull = _pull_callback(trainer)
        levels = self._levels()
        self.algorithm = PeriodicAveraging(
            module.parameters(),
            group=self._periodic_group(),
            policy=self._policy(),
            tau=self.tau * self._period_factor(),
            lam=self.lam,
            rho=self.rho,
            **bucket_arguments(module, self.sync_buffers, self.bucket_size_mb),
            stats=self.comm_stats,
            levels=LevelRounds(levels, self._policy(), self.comm_stats) if levels is not None else None,
        )
        self._base_lam = self.algorithm.lam

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.algorithm is not None:
            self._step_args = (args, kwargs)  # GRAWA's probe: the batch (probe='batch') or batch_idx
            loss = loss_of(output)
            if loss is not None:
                self.algorithm.observe(loss)  # LSGD elects its leader from the running loss
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.algorithm is not None and self.pull is not None
        self._apply_pull_schedule(self.algorithm, self.pull)
        report = self.algorithm.step(self._norms())
        if report is not None:
            self._log_round(self.pull, report)
        return output

    def _log_round(self, pull: PullToCenter, report: RoundReport) -> None:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        metrics = pull.on_round(trainer, module, report)
        if self.two_level and self.algorithm is not None:
            levels = self.algorithm.levels
            metrics.update(self._level_metrics(levels.level_bytes if levels is not None else None))
            metrics["avg/across_nodes"] = float(not self.algorithm._node_only)
        # rounds are rare and seldom fall on Lightning's log_every_n_steps: write each one itself
        self._log(metrics, logger=not pull.log_every_round)
        if pull.log_every_round and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)  # Lightning's step of this batch

    def _apply_pull_schedule(self, algorithm: PeriodicAveraging, pull: PullToCenter) -> None:
        owner, schedule = type(pull).__name__, algorithm.schedule
        lam = pull.lam_at(schedule.rounds, self._base_lam)
        algorithm.lam = v.check_float(owner, "lam", lam, 0.0, 1.0, low_inclusive=False)
        algorithm.rho = v.check_float(owner, "rho", pull.rho_at(schedule.steps, self.rho), 0.0, 1.0)
        tau = v.check_int(owner, "tau", pull.tau_at(schedule.rounds, self.tau), minimum=1)
        schedule.tau = tau * self._period_factor()  # intra_node='step': the rule runs every m periods

    @override
    def _finalize_algorithm(self) -> None:
        if self.algorithm is not None:
            # a partial last period gets a final round; GRAWA's probes the trained replicas for it
            self.algorithm.finalize(self._norms())
        self._step_args = None  # the probe batch is not needed after training


def _pull_callback(trainer: pl.Trainer) -> PullToCenter:
    found = [c for c in trainer.callbacks if isinstance(c, PullToCenter)]  # type: ignore[attr-defined]
    if len(found) > 1:
        raise ValueError(f"Trainer has {len(found)} PullToCenter callbacks; an averaging strategy uses one.")
    return found[0] if found else PullToCenter()


_NO_TWO_LEVEL = (
    "the method keeps {what} for one flat group, and a two-level version (one per node plus one "
    "across nodes) is not defined by its paper; two-level synchronisation is offered for localsgd and mgrawa/lgrawa"
)

_COMMON_ARGS = """        sync_buffers: Average floating-point buffers (BatchNorm statistics) uniformly at every round.
        bucket_size_mb: Size bound of the flat buffers reduced in one call (MiB, >= 0.001).
    {two_level}
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy` (``timeout``,
            ``start_method``, ...)."""


class LocalSGDStrategy(AveragingStrategy):
    """Local SGD: replicas train independently and are averaged every ``tau`` steps.

    The model after fit is the average of the trained replicas, also after a partial last period
    or a fit shorter than ``tau``.

    Args:
        tau: Averaging period in optimizer steps (gradient accumulation does not change it).
    {common}

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="localsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "localsgd"

    def __init__(
        self,
        tau: int = 8,
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._configure(
            tau, 1.0, 0.0, sync_buffers, bucket_size_mb, inter_node_every=inter_node_every, intra_node=intra_node
        )

    @override
    def _policy(self) -> CenterPolicy:
        return UniformCenter()


class EasgdStrategy(AveragingStrategy):
    """EASGD: every ``tau`` steps an elastic force moves each replica and a center variable toward each other.

    Per round, with the pre-pull replicas: ``x -= alpha (x - center)``, ``center += beta (mean(x) - center)``.
    Validation during fit and checkpoints' ``state_dict`` are the center variable (what the paper
    evaluates). At the end of fit the center catches up with the replicas, ``center = mean(x)``,
    and every rank's model is that average: the center lags the replicas by about ``tau / beta``
    steps (40 with the defaults), so it alone would return a mostly untrained model after a
    short fit, and exactly the initial model after a fit shorter than ``tau``. Measured (digits
    MLP, 2 replicas, defaults, 3 seeds): center vs replicas' mean 0.35 vs 0.70 accuracy after 22
    steps, 0.85 vs 0.90 after 44, 0.937 vs 0.947 after 88, 0.959 vs 0.955 after 176.

    Args:
        tau: Period in optimizer steps.
        beta: Moving rate of the center, in (0, 1].
        alpha: Pull of each replica toward the center, in (0, 1]; ``None``: ``beta / W`` (the
            paper's symmetric choice, W = number of data-parallel replicas).
        rho: Optional proximal pull toward the center after every step (``rho / tau`` per step).
    {common}
    """

    strategy_name = "easgd"

    def __init__(
        self,
        tau: int = 4,
        beta: float = 0.1,
        alpha: float | None = None,
        rho: float = 0.0,
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.beta = v.check_float(type(self).__name__, "beta", beta, 0.0, 1.0, low_inclusive=False)
        self._configure(
            tau,
            alpha,
            rho,
            sync_buffers,
            bucket_size_mb,
            lam_name="alpha",
            lam_may_be_none=True,
            inter_node_every=inter_node_every,
            intra_node=intra_node,
            unsupported=_NO_TWO_LEVEL.format(what="a center variable"),
        )

    @override
    def _policy(self) -> CenterPolicy:
        return ElasticCenter(self.beta)


class LsgdStrategy(AveragingStrategy):
    """LSGD: every ``tau`` steps each replica is pulled toward the leader (lowest running training loss).

    The leader's replica is broadcast; ``x += lam (x_leader - x)``. The running loss of a rank is
    the mean of its training losses since the previous round. The consensus model (validation,
    saved weights, the model after fit) is the current leader's replica; at the end of fit a
    partial last period elects its own leader (a final round).

    Args:
        tau: Period in optimizer steps.
        lam: Pull strength toward the leader, in (0, 1].
        rho: Proximal pull toward the last leader after every step (``rho / tau`` per step).
    {common}
    """

    strategy_name = "lsgd"

    def __init__(
        self,
        tau: int = 4,
        lam: float = 0.1,
        rho: float = 0.1,
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._configure(
            tau,
            lam,
            rho,
            sync_buffers,
            bucket_size_mb,
            inter_node_every=inter_node_every,
            intra_node=intra_node,
            unsupported=_NO_TWO_LEVEL.format(what="a leader"),
        )

    @override
    def _policy(self) -> CenterPolicy:
        return LeaderCenter()


for _cls in (LocalSGDStrategy, EasgdStrategy, LsgdStrategy):
    _cls.__doc__ = (_cls.__doc__ or "").replace("    {common}", _COMMON_ARGS)
    _cls.__doc__ = _cls.__doc__.replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="round"))
