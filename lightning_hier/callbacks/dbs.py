"""The DBS sampler callback: triggers the batch-size rebalance and logs what DBS measured."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hier.sync.dbs import SpeedShares


class DBSCallback(Callback):
    """Rebalances the per-rank batch sizes of DBS's shares (:class:`~lightning_hier.sync.SpeedShares`) on schedule.

    After every optimizer step it asks the strategy's allocation whether a rebalance period ended
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
            ``trainer.strategy.allocation.dbs.history``).
    """

    def __init__(self, log: bool = True) -> None:
        self.log = log

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        shares = _shares(trainer)
        report = shares.rebalance_if_due()
        if report is None or not self.log:
            return
        assert shares.dbs is not None
        metrics = {"dbs/rebalances": float(shares.dbs.rebalances)}
        for r, size in enumerate(report["sizes"]):
            metrics[f"dbs/batch_size/rank{r}"] = float(size)
            for key in ("samples_per_s", "compute_s", "idle_s"):
                metrics[f"dbs/{key}/rank{r}"] = float(report[key][r])
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)


def _shares(trainer: pl.Trainer) -> SpeedShares:
    allocation = getattr(trainer.strategy, "allocation", None)
    if not isinstance(allocation, SpeedShares):
        used = type(trainer.strategy).__name__
        raise TypeError(
            "DBSCallback works with a strategy that has DBS batch shares ('dbs', 'dbs_async', 'dbs_hpsgd', "
            f"'dbs_localsgd'), but the Trainer uses {used}."
        )
    return allocation
