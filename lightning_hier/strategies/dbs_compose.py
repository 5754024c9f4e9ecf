"""DBS shares inside HPSGD and Local SGD: ``dbs_hpsgd`` and ``dbs_localsgd`` (each also ``_spawn``, ``_fork``).

Heterogeneous workers on slow links: DBS (Ji et al. 2019; Ye et al. 2020) gives each rank a share
of every global batch in proportion to its measured speed, so a slow rank no longer holds the others
back; HPSGD (Zhou et al. 2020) or Local SGD (Stich 2019; Lin et al. 2020) replaces the per-step
gradient all-reduce by one average per window, so the slow link is crossed once per window, and
with HPSGD behind the next window's compute. Each window's change of rank ``i`` is weighted by the
samples ``n_i`` it processed in the window: ``delta = sum_i n_i delta_i / N``
(:mod:`lightning_hier.algorithms.dbs_compose` derives the rule; with equal speeds it is the plain
mean, bit for bit).

The composition is two bases, not a copy of either strategy: :class:`DBSShares` (the batch split,
its sampler, timing and rebalance, as in ``dbs``) first, then the unchanged
:class:`~lightning_hier.strategies.hpsgd.HPSGDStrategy` or
:class:`~lightning_hier.strategies.averaging.LocalSGDStrategy`; :class:`SampleWeighted` between
them counts the window's samples and hands the factor ``W n_i / N`` to the averaging algorithm
before every step. Every argument is one of the two strategies' and means the same.

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
  per level (samples of the node inside it, of each node across nodes); not built yet, so it is
  rejected at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from typing_extensions import override

from lightning_hier.algorithms.dbs_compose import SampleWeightedCenter, SampleWindow
from lightning_hier.algorithms.hpsgd import HPSGD
from lightning_hier.strategies._dbs_shares import DBSShares
from lightning_hier.strategies.averaging import LocalSGDStrategy
from lightning_hier.strategies.hpsgd import HPSGDStrategy

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from torch.optim import Optimizer

    from lightning_hier.algorithms.centers import CenterPolicy
    from lightning_hier.comm.collectives import Group

_TWO_LEVEL = ("inter_node_every", "intra_node")


class SampleWeighted(DBSShares):
    """DBS shares whose window changes are weighted by samples (the shared part of the two compositions).

    Before every optimizer step it adds the step's samples (this rank's and all ranks') to the
    window, and hands ``W n_i / N`` to the averaging algorithm (:meth:`_apply_weight`); after the
    step, a window that was sent or merged (:meth:`_window_sent`) starts a new count. Speeds are
    all-gathered on a group of their own, so a rebalance never queues behind a window's reduction
    still in flight.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        owner = type(self).__name__
        for name in _TWO_LEVEL:  # arguments of the two-level forms, where the averaging strategy has them
            value = getattr(self, name, None)
            if value is not None and not (name == "intra_node" and value == "window"):
                raise ValueError(
                    f"{owner}: argument `{name}`={value!r} is not supported with DBS shares: the window's "
                    "sample weights would have to be per level (inside a node, across nodes); use the "
                    "default (flat averaging over all data-parallel ranks)."
                )
        self.samples = SampleWindow()
        self._speed_group: dist.ProcessGroup | None = None

    def _apply_weight(self, weight: float) -> None:
        """Give the averaging algorithm this rank's factor ``W n_i / N`` for the current window."""
        raise NotImplementedError

    def _window_sent(self) -> bool:
        """Whether the step just taken sent (HPSGD) or merged (Local SGD) the window."""
        raise NotImplementedError

    @override
    def _shares_group(self) -> Group:
        if self._speed_group is None:
            self._speed_group = self.topology.build_second_group("data", self.global_rank, self._timeout)
        return self._speed_group

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.samples = SampleWindow()  # a new fit (or evaluation) starts with an empty window
        super().setup(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        shares = self.shares
        assert shares is not None
        # the step's micro-batches have all begun (on_train_batch_start), so its samples are known
        self.samples.add(*shares.step_samples)
        self._apply_weight(self.samples.weight(shares.world))
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._window_sent():
            self.samples.reset()
        shares.end_step()
        return output

    @override
    def _finalize_algorithm(self) -> None:
        super()._finalize_algorithm()  # sends the steps since the last window with the factor set last
        self.samples.reset()

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        return {"sync": super()._algorithm_state(), "dbs": self._shares_state(), "samples": self.samples.state_dict()}

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        super()._load_algorithm_state(state["sync"])
        self._load_shares_state(state["dbs"])
        self.samples.load_state_dict(state["samples"])


class DBSHPSGDStrategy(SampleWeighted, HPSGDStrategy):
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
    :class:`~lightning_hier.strategies.hpsgd.HPSGDStrategy`), with their defaults. Logs both
    strategies' metrics (``dbs/...`` at rebalances, ``hpsgd/...`` at merges).

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_hpsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> DBSHPSGDStrategy(window=8, rebalance_every=10, timer="cpu").window
        8
    """

    strategy_name = "dbs_hpsgd"

    @override
    def _apply_weight(self, weight: float) -> None:
        # flat HPSGD only: the composition rejects the two-level arguments before setup
        assert isinstance(self.algorithm, HPSGD)
        self.algorithm.change_weight = weight

    @override
    def _window_sent(self) -> bool:
        assert isinstance(self.algorithm, HPSGD)
        return self.algorithm.since_launch == 0


class DBSLocalSGDStrategy(SampleWeighted, LocalSGDStrategy):
    """DBS x Local SGD: batch shares follow each rank's speed; every ``tau`` steps a sample-weighted average.

    Every rank trains its replica on its share ``b_i`` of each global batch (DBS's sampler and
    rebalance); every ``tau`` steps the replicas are replaced by ``sum_i n_i x_i / N``
    (:class:`~lightning_hier.algorithms.dbs_compose.SampleWeightedCenter`), which is the common
    start plus the sample-weighted mean of the changes. BatchNorm buffers (``sync_buffers``) are
    averaged uniformly, as in ``localsgd``.

    Arguments: DBS's (see :class:`~lightning_hier.strategies.dbs.DBSStrategy`) and Local SGD's
    (``tau``, ``sync_buffers``, ``bucket_size_mb``), with their defaults.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_localsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> DBSLocalSGDStrategy(tau=4, initial_sizes=[24, 8]).tau
        4
    """

    strategy_name = "dbs_localsgd"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._center = SampleWeightedCenter()

    @override
    def _policy(self) -> CenterPolicy:
        self._center = SampleWeightedCenter()  # a new fit: a fresh policy, as LocalSGDStrategy's
        return self._center

    @override
    def _apply_weight(self, weight: float) -> None:
        self._center.weight = weight

    @override
    def _window_sent(self) -> bool:
        assert self.algorithm is not None
        return self.algorithm.schedule.since_sync == 0
