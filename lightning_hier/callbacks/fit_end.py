"""When the fit ends: the last training batch, predicted from Lightning 2.6's own stopping rules.

A rule that merges its replicas must do so right after the fit's last optimizer step, before any
user hook or checkpoint sees the model (:mod:`lightning_hier.strategies._finish`,
:class:`~lightning_hier.callbacks.OnDDP`); Lightning runs the strategy's own ``on_train_end`` too
late for that. :func:`ends_after_this_batch` says, after a training batch, whether the loop stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl


def ends_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the fit loop stops after the training batch that just ended (Lightning 2.6's rules).

    Mirrors ``_TrainingEpochLoop.done`` and ``_FitLoop.done``: ``max_steps`` reached; or the
    epoch's last batch (Lightning always steps the optimizer on it, whatever the gradient
    accumulation) in the last epoch of ``max_epochs``; or ``trainer.should_stop`` already set
    when the loop may stop early. Call it after a training batch, before the next one starts
    (``on_train_batch_end`` up to ``on_train_epoch_end``). Every rank answers the same, as the
    loop's own decisions must (equal batch counts, ``should_stop`` agreed between ranks).
    """
    fit_loop = trainer.fit_loop
    if _limit_reached(trainer.global_step, fit_loop.max_steps):
        return True  # only an optimizer step raises global_step, so this is right after the last one
    progress = fit_loop.epoch_loop.batch_progress
    last_batch = progress.is_last_batch or progress.current.ready == trainer.num_training_batches
    if not last_batch:
        # a stop requested mid-epoch ends the epoch after this batch (and a step was taken unless
        # accumulating: then the pending micro-batches are dropped, as Lightning drops them)
        return trainer.should_stop and fit_loop._can_stop_early
    max_epochs = fit_loop.max_epochs
    last_epoch = max_epochs is not None and _limit_reached(trainer.current_epoch + 1, max_epochs)
    return last_epoch or (trainer.should_stop and fit_loop._can_stop_early)


def _limit_reached(value: int, limit: int | None) -> bool:
    # Lightning's _is_max_limit_reached: -1 (or None) means no limit
    return limit is not None and limit != -1 and value >= limit
