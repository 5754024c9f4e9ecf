"""DBS shares inside HPSGD and Local SGD: ``dbs_hpsgd`` and ``dbs_localsgd`` (each also ``_spawn``, ``_fork``).

Heterogeneous workers on slow links: DBS (Ji et al. 2019; Ye et al. 2020) gives each rank a share
of every global batch in proportion to its measured speed, so a slow rank no longer holds the others
back; HPSGD (Zhou et al. 2020) or Local SGD (Stich 2019; Lin et al. 2020) replaces the per-step
gradient all-reduce by one average per window, so the slow link is crossed once per window, and
with HPSGD behind the next window's compute. Each window's change of rank ``i`` is weighted by the
samples ``n_i`` it processed in the window: ``delta = sum_i n_i delta_i / N``
(:mod:`lightning_hier.algorithms.dbs_compose` derives the rule; with equal speeds it is the plain
mean, bit for bit).

The composition is objects, not a copy of either strategy: DBS's allocation
(:class:`~lightning_hier.sync.SpeedShares`: the batch split, its sampler, timing and rebalance, as in
``dbs``), the unchanged window rule (:class:`~lightning_hier.sync.HPSGDSync` or Local SGD's
:class:`~lightning_hier.sync.AveragingSync`), and :class:`~lightning_hier.sync.SampleWeights`
between them, which counts the window's samples and gives the rule the factor ``W n_i / N`` before
every step. Every argument is one of the two strategies' and means the same; which combinations
are refused is decided in one place, :func:`~lightning_hier.sync.compose.check_composition`.

Combinations that are not offered, and why:

- EASGD: its elastic force is symmetric (each replica moves by ``alpha (x_i - c)``, the center by
  ``beta (mean(x) - c)`` with ``alpha = beta / W``); sample weights would make the center's move no
  longer the sum of the replicas' moves, so the scheme's conservation breaks, and the replicas never
  restart from a common point, so there is no window change to weight.
- LSGD and GRAWA: the center is the leader's replica or a gradient-norm weighting; a second
  weighting by samples has no derivation behind it.
- grid2d and the decoupled pipeline: the ranks of one model (its Pr grid row or its K stages)
  must all process the same samples, shaped alike, in every step, so a per-rank share cannot follow
  a rank's speed; the slowest grid member or stage sets the pace regardless.
- HPSGD's or Local SGD's two-level form (``inter_node_every``): the weights would have to be
  per level (samples of the node inside it, of each node across nodes); not built yet, so these
  strategies do not take the two-level arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_hier.algorithms.dbs_compose import SampleWeightedCenter
from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.averaging import AveragingSync
from lightning_hier.sync.dbs import SpeedShares
from lightning_hier.sync.dbs_compose import SampleWeights
from lightning_hier.sync.hpsgd import HPSGDSync


def window_shares(
    owner: str,
    global_batch_size: int | None,
    rebalance_every: int,
    ema: float,
    min_batch_size: int,
    max_batch_size: int | None,
    warmup_steps: int,
    initial_sizes: Sequence[int] | None,
    timer: str,
) -> tuple[SpeedShares, SampleWeights]:
    """DBS's shares for a window rule (its arguments as ``dbs``'s) and the sample weights that connect them.

    Speeds are all-gathered on a group of their own (``speed_group='own'``), so a rebalance never
    queues behind a window's reduction still in flight.
    """
    shares = SpeedShares(
        global_batch_size,
        rebalance_every,
        ema,
        min_batch_size,
        max_batch_size,
        warmup_steps,
        initial_sizes,
        timer,
        speed_group="own",
        owner=owner,
    )
    return shares, SampleWeights(shares)


class DBSHPSGDStrategy(HierStrategy):
    """DBS x HPSGD: batch shares follow each rank's speed; each window's change counts by its samples.

    Every rank trains its replica on its share ``b_i`` of each global batch (DBS's sampler and
    rebalance); every ``window`` steps HPSGD launches the window's change, scaled by ``W n_i / N``,
    as a background SUM all-reduce, so the global model advances by ``sum_i n_i delta_i / N``
    (:mod:`lightning_hier.algorithms.dbs_compose`). BatchNorm buffers (``sync_buffers``) are
    averaged with the same weights.

    Arguments: DBS's (``global_batch_size``, ``rebalance_every``, ``ema``, ``min_batch_size``,
    ``max_batch_size``, ``warmup_steps``, ``initial_sizes``, ``timer``; see
    :class:`~lightning_hier.strategies.dbs.DBSStrategy`) and HPSGD's (``window``, ``mode``,
    ``merge``, ``outer_lr``, ``outer_momentum``, ``compression``, ``sync_buffers``,
    ``reset_optimizer_state``, ``bucket_size_mb``; see
    :class:`~lightning_hier.strategies.hpsgd.HPSGDStrategy`), with their defaults; not HPSGD's
    two-level arguments (see the module docstring). Logs both strategies' metrics (``dbs/...`` at
    rebalances, ``hpsgd/...`` at merges). **kwargs: see :class:`~lightning_hier.strategies.HierStrategy`.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_hpsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> DBSHPSGDStrategy(window=8, rebalance_every=10, timer="cpu").sync.window
        8
    """

    strategy_name = "dbs_hpsgd"

    def __init__(
        self,
        global_batch_size: int | None = None,
        rebalance_every: int = 20,
        ema: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        warmup_steps: int = 5,
        initial_sizes: Sequence[int] | None = None,
        timer: str = "wall",
        window: int = 2,
        mode: str = "fixed",
        merge: str = "eager",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        compression: str = "none",
        sync_buffers: bool = True,
        reset_optimizer_state: bool = False,
        bucket_size_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        shares, weights = window_shares(
            owner,
            global_batch_size,
            rebalance_every,
            ema,
            min_batch_size,
            max_batch_size,
            warmup_steps,
            initial_sizes,
            timer,
        )
        sync = HPSGDSync(
            window,
            mode,
            merge,
            outer_lr,
            outer_momentum,
            compression,
            sync_buffers,
            reset_optimizer_state,
            bucket_size_mb,
            weights=weights,
            owner=owner,
        )
        super().__init__(sync=sync, allocation=shares, **kwargs)


class DBSLocalSGDStrategy(HierStrategy):
    """DBS x Local SGD: batch shares follow each rank's speed; every ``tau`` steps a sample-weighted average.

    Every rank trains its replica on its share ``b_i`` of each global batch (DBS's sampler and
    rebalance); every ``tau`` steps the replicas are replaced by ``sum_i n_i x_i / N``
    (:class:`~lightning_hier.algorithms.dbs_compose.SampleWeightedCenter`), which is the common
    start plus the sample-weighted mean of the changes. BatchNorm buffers (``sync_buffers``) are
    averaged uniformly, as in ``localsgd``.

    Arguments: DBS's (see :class:`~lightning_hier.strategies.dbs.DBSStrategy`) and Local SGD's
    (``tau``, ``sync_buffers``, ``bucket_size_mb``), with their defaults; **kwargs: see
    :class:`~lightning_hier.strategies.HierStrategy`.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_localsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> DBSLocalSGDStrategy(tau=4, initial_sizes=[24, 8]).sync.tau
        4
    """

    strategy_name = "dbs_localsgd"

    def __init__(
        self,
        global_batch_size: int | None = None,
        rebalance_every: int = 20,
        ema: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        warmup_steps: int = 5,
        initial_sizes: Sequence[int] | None = None,
        timer: str = "wall",
        tau: int = 8,
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        shares, weights = window_shares(
            owner,
            global_batch_size,
            rebalance_every,
            ema,
            min_batch_size,
            max_batch_size,
            warmup_steps,
            initial_sizes,
            timer,
        )
        sync = AveragingSync(
            SampleWeightedCenter,
            tau,
            sync_buffers=sync_buffers,
            bucket_size_mb=bucket_size_mb,
            weights=weights,
            owner=owner,
        )
        super().__init__(sync=sync, allocation=shares, **kwargs)
