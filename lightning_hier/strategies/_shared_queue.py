"""The ``sampler='shared'`` mode under Lightning: the claiming loader and the checks of the Trainer's options.

The strategies that train through a server on rank 0 (``asgd``, ``softsync``, ``dbs_async``, and
GRAWA's asynchronous rounds) can let the ranks claim their batches from the server's shared queue
(:class:`~lightning_hier.sync.SharedQueue`, or DBS's :class:`~lightning_hier.sync.SpeedShares` with
a server). The training loader then claims its batches from the server's shared queue
(:mod:`lightning_hier.algorithms.claim_sampler`), so the ranks take different numbers of steps per
epoch and the loader has no length; :func:`check_shared_trainer` rejects the Trainer options that
need equal step counts. What that means in Lightning 2.6 (read in
``loops/fit_loop.py``, ``loops/training_epoch_loop.py``, ``loops/fetchers.py`` and
``trainer/connectors/data_connector.py``):

- ``has_len_all_ranks`` finds no ``__len__`` and skips its all-reduce of the lengths;
  ``trainer.num_training_batches`` is ``inf``. The prefetching data fetcher then fetches one batch
  ahead to learn that the epoch ends, and the epoch ends on each rank when its claim comes back
  empty (``batch_progress.is_last_batch``).
- The progress bar shows no total for the epoch (only the batches done and the rate).
- ``val_check_interval``: ``1.0`` (the default) validates at each rank's last batch of the epoch,
  a point every rank reaches once per epoch: allowed. An ``int`` would validate after every ``k``
  batches of *each rank*, and the ranks do not all reach the same counts (a collective that some
  ranks never join): rejected here. Any other float (or a time interval) is rejected too
  (Lightning rejects a float itself for a loader of unknown length, with a message about
  ``IterableDataset``).
- ``limit_train_batches``: a float other than ``1.0`` is rejected (Lightning would, likewise); an
  ``int`` ``k`` caps *each* rank's epoch at ``k`` batches, so the fast ranks take no more steps
  than the slow one and samples of the epoch are left untrained: allowed, but it undoes the mode.
- ``max_steps`` would count each rank's own optimizer steps: a fast rank reaches it in an earlier
  epoch than the slow one and goes on to the end of fit (a broadcast of the server's model) while
  the others meet at their next epoch end (a metric sync): mismatched collectives. Rejected; stop
  by ``max_epochs``.
- ``trainer.estimated_stepping_batches`` must fetch a batch to learn the loader has no length
  (and would then return ``max_steps``, ``-1``); read in ``configure_optimizers`` (a schedule
  sized to the fit: ``OneCycleLR``) it fetches before the server exists, which is an error that
  says so. Size such a schedule by epochs.
- ``ModelCheckpoint(every_n_train_steps=...)`` or ``train_time_interval`` would save (a
  collective) at each rank's own step or time: rejected. Saving at epoch ends is fine.
- ``Trainer(max_time=...)`` (or a ``Timer(interval='step')``) broadcasts its stop decision from
  rank 0 after every training batch (``Timer._check_time_remaining``), a per-step collective:
  rejected. ``Timer(interval='epoch')`` checks at epoch ends: allowed.

Per-step collectives that would hold the ranks together: Lightning's SIGTERM broadcast is replaced
(:mod:`~lightning_hier.strategies._step_sync`); a module that logs per step with
``sync_dist=True`` (or syncs a torchmetrics metric per step) would all-reduce a different number
of times on each rank and hang: log per step without it (the epoch-end sync is fine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.callbacks.timer import Interval

if TYPE_CHECKING:
    import lightning.pytorch as pl


def _fail(owner: str, what: str, value: object, allowed: str) -> ValueError:
    return ValueError(
        f"{owner}: with sampler='shared' the ranks take different numbers of steps per epoch, so {what} must be "
        f"{allowed}; got {value!r}. Use sampler='split' for it."
    )


def check_shared_trainer(owner: str, trainer: pl.Trainer) -> None:
    """Reject the Trainer options that need every rank to take the same number of steps (module docstring).

    Raises:
        ValueError: ``val_check_interval`` is not ``1.0``, ``limit_train_batches`` a float other than
            ``1.0``, ``max_steps`` is set, a ``ModelCheckpoint`` saves every ``n`` training steps or by
            time, or a ``Timer`` (``max_time``) checks after every step.
    """
    interval = trainer.val_check_interval
    if getattr(trainer, "_val_check_time_interval", None) is not None or isinstance(interval, int) or interval != 1.0:
        shown = getattr(trainer, "_val_check_time_interval", None) or interval
        raise _fail(owner, "Trainer(val_check_interval)", shown, "1.0 (validate at the end of each epoch)")
    if trainer.max_steps != -1:
        raise _fail(owner, "Trainer(max_steps)", trainer.max_steps, "-1 (unset: stop by max_epochs)")
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit != 1.0:
        raise _fail(owner, "Trainer(limit_train_batches)", limit, "1.0 or an int (batches per rank)")
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and (
            callback._every_n_train_steps > 0 or callback._train_time_interval is not None
        ):
            steps, interval_ = callback._every_n_train_steps, callback._train_time_interval
            shown = f"every_n_train_steps={steps}" if steps > 0 else f"train_time_interval={interval_}"
            raise _fail(owner, "ModelCheckpoint", shown, "saving at epoch ends (every_n_epochs)")
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, not declared
        if isinstance(callback, Timer) and callback._duration is not None and callback._interval == Interval.step:
            shown = f"Timer(duration={callback._duration}, interval='step') (Trainer(max_time=...))"
            raise _fail(owner, "a time limit", shown, "checked at epoch ends: Timer(..., interval='epoch')")
