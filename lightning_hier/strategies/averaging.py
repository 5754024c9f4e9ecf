"""Lightning strategies of the model-averaging family: one rule (``AveragingSync``), four policies.

- :class:`LocalSGDStrategy` (``localsgd``): uniform average every ``tau`` steps (Stich, ICLR
  2019; Lin et al., ICLR 2020).
- :class:`EasgdStrategy` (``easgd``): elastic averaging with a center variable (Zhang, Choromanska,
  LeCun, NeurIPS 2015).
- :class:`LsgdStrategy` (``lsgd``): pull toward the leader, the replica with the lowest running
  loss (Teng et al., NeurIPS 2019).
- :class:`~lightning_hier.strategies.grawa.GrawaStrategy` (``grawa``, ``mgrawa``, ``lgrawa``):
  gradient-weighted center (Dimlioglu and Choromanska, AISTATS 2024).

Each name also exists as ``name_spawn`` and ``name_fork``. The math is in
:mod:`lightning_hier.algorithms.averaging`; :class:`~lightning_hier.sync.AveragingSync` advances it
once per real optimizer step (gradient accumulation does not change the cadence), takes the pull
schedule from a :class:`~lightning_hier.callbacks.PullToCenter` callback when the Trainer has one,
and holds the consensus model and the checkpoint state of every replica (center, norm EMAs,
counters). Each class here only builds that object from its arguments.
"""

from __future__ import annotations

from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.averaging import AveragingSync
from lightning_hier.sync.levels import TWO_LEVEL_ARGS, Levels

_NO_TWO_LEVEL = (
    "the method keeps {what} for one flat group, and a two-level version (one per node plus one "
    "across nodes) is not defined by its paper; two-level synchronisation is offered for localsgd and mgrawa/lgrawa"
)

_COMMON_ARGS = """        sync_buffers: Average floating-point buffers (BatchNorm statistics) uniformly at every round.
        bucket_size_mb: Size bound of the flat buffers reduced in one call (MiB, >= 0.001).
    {two_level}
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ...)."""


class LocalSGDStrategy(HierStrategy):
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
        owner = type(self).__name__
        levels = Levels(owner, inter_node_every, intra_node)
        sync = AveragingSync.localsgd(
            tau, sync_buffers=sync_buffers, bucket_size_mb=bucket_size_mb, levels=levels, owner=owner
        )
        super().__init__(sync=sync, **kwargs)


class EasgdStrategy(HierStrategy):
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
        owner = type(self).__name__
        levels = Levels(owner, inter_node_every, intra_node, _NO_TWO_LEVEL.format(what="a center variable"))
        sync = AveragingSync.easgd(
            tau, beta, alpha, rho, sync_buffers=sync_buffers, bucket_size_mb=bucket_size_mb, levels=levels, owner=owner
        )
        super().__init__(sync=sync, **kwargs)


class LsgdStrategy(HierStrategy):
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
        owner = type(self).__name__
        levels = Levels(owner, inter_node_every, intra_node, _NO_TWO_LEVEL.format(what="a leader"))
        sync = AveragingSync.lsgd(
            tau, lam, rho, sync_buffers=sync_buffers, bucket_size_mb=bucket_size_mb, levels=levels, owner=owner
        )
        super().__init__(sync=sync, **kwargs)


for _cls in (LocalSGDStrategy, EasgdStrategy, LsgdStrategy):
    _cls.__doc__ = (_cls.__doc__ or "").replace("    {common}", _COMMON_ARGS)
    _cls.__doc__ = _cls.__doc__.replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="round"))
