"""The DBS sampler callback: triggers the batch-size rebalance and logs what DBS measured."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from lightning_hier.strategies._dbs_shares import DBSShares


class DBSCallback(Callback):
    """Rebalances the per-rank batch sizes of :class:`~lightning_hier.strategies.DBSStrategy` on schedule.

    After every optimizer step it asks the strategy whether a rebalance period ended
    (``rebalance_every`` steps after ``warmup_steps``); if so, every rank all-gathers its measured
    throughput, the global batch is split again in proportion, and the callback logs, for every rank
    ``r`` (identical values on all ranks):

    - ``dbs/batch_size/rank{r}``: the new per-rank batch size;
    - ``dbs/samples_per_s/rank{r}``: the smoothed throughput of pure compute (samples per second);
    - ``dbs/compute_s/rank{r}``: mean compute seconds per step over the period;
    - ``dbs/idle_s/rank{r}``: mean seconds per step blocked in the gradient all-reduce, i.e. waiting
      for slower ranks (plus the transfer itself).

    Every strategy with DBS shares (``dbs``, ``dbs_async``, ``dbs_hpsgd``, ``dbs_localsgd``) adds one
    with these defaults when the Trainer has none, so ``Trainer(strategy="dbs")`` works alone; pass
    your own to change ``log``.
    The batch sampler itself is installed by the strategy (see
    :mod:`lightning_hier.algorithms.dbs_sampler`).

    Args:
        log: Log the metrics above through the LightningModule (the report is always kept in
            ``trainer.strategy.shares.history``).
    """

    def __init__(self, log: bool = True) -> None:
        self.log = log

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = _dbs_strategy(trainer)
        report = strategy.rebalance_if_due()
        if report is None or not self.log:
            return
        assert strategy.shares is not None
        metrics = {"dbs/rebalances": float(strategy.shares.rebalances)}
        for r, size in enumerate(report["sizes"]):
            metrics[f"dbs/batch_size/rank{r}"] = float(size)
            for key in ("samples_per_s", "compute_s", "idle_s"):
                metrics[f"dbs/{key}/rank{r}"] = float(report[key][r])
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)


def _dbs_strategy(trainer: pl.Trainer) -> DBSShares:
    from lightning_hier.strategies._dbs_shares import DBSShares  # the strategy module imports this one

    if not isinstance(trainer.strategy, DBSShares):
        used = type(trainer.strategy).__name__
        raise TypeError(
            "DBSCallback works with a strategy that has DBS batch shares ('dbs', 'dbs_async', 'dbs_hpsgd', "
            f"'dbs_localsgd'), but the Trainer uses {used}."
        )
    return trainer.strategy
