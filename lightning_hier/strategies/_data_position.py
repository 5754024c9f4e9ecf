"""Where training is in its data, saved in checkpoints and restored into the training sampler.

Lightning 2.6 restores its loop counters on resume but not the position of a DataLoader that is
not "stateful": resumed mid-epoch, the loop counts the batches already trained, yet the loader
starts the epoch over, so the run trains on the epoch's first batches again and never on its
last ones. After a resume with ``max_steps`` it also gives ``set_epoch`` an epoch one too high
for the rest of the run (``FitLoop.on_advance_start`` passes ``epoch_progress.current.processed``,
which the restored counters leave one ahead of ``current_epoch``). Lightning's own DDP has both.

Here the strategy records the position itself: the epoch and the number of its batches trained
(``on_train_batch_start``), saved in every rank's checkpoint state. On resume it tells the training
sampler to run that epoch from that batch (:class:`~lightning_hier.resumable.ResumePoint`), and an
internal callback hands the sampler ``trainer.current_epoch`` at every later epoch start, after
Lightning's own ``set_epoch``. Samplers this applies to: DBS's
:class:`~lightning_hier.algorithms.dbs_sampler.DynamicBatchSampler`, and the ``DistributedSampler``
Lightning injects (or a ``SequentialSampler``) inside an ordinary ``BatchSampler``, wrapped in a
:class:`~lightning_hier.resumable.SkippingSampler`. Other samplers (a ``RandomSampler`` draws its
order from the global RNG; custom batch samplers; iterable datasets) and loaders that are already
stateful are left to Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import Callback
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler
from typing_extensions import override

from lightning_hier.resumable import ResumePoint, SkippingSampler

if TYPE_CHECKING:
    import lightning.pytorch as pl


class DataPosition:
    """The training data position of one rank: recorded per batch, saved, restored into the sampler."""

    def __init__(self) -> None:
        self.epoch: int | None = None  # epoch of the last training batch started (None: none yet)
        self.batches = 0  # batches of that epoch trained, counting the last one started
        self.sampler: ResumePoint | None = None  # the training sampler this position drives
        self._restored: tuple[int, int] | None = None  # the checkpoint's position
        self._pending = False  # restored, not yet handed to a sampler (once: a reloaded loader starts anew)

    def install(self, loader: object) -> None:
        """Find (or wrap) the resumable sampler of the training ``loader``; hand it a restored position."""
        self.sampler = resumable_sampler(loader)
        self._hand_over()

    def batch_started(self, epoch: int, batch_idx: int) -> None:
        """Record a training batch (``batch_idx`` counts from 0 within ``epoch``)."""
        self.epoch, self.batches = epoch, batch_idx + 1

    def state_dict(self, batches_per_epoch: float) -> dict[str, int] | None:
        """The position to resume at: ``{"epoch", "batches"}`` (the next epoch once this one is done)."""
        if self.epoch is None:  # nothing trained in this run yet: still the restored position, if any
            return None if self._restored is None else {"epoch": self._restored[0], "batches": self._restored[1]}
        if self.batches >= batches_per_epoch:
            return {"epoch": self.epoch + 1, "batches": 0}
        return {"epoch": self.epoch, "batches": self.batches}

    def restore(self, state: dict[str, int] | None) -> None:
        """Resume at a saved position (``None``: a checkpoint without one; Lightning's behaviour)."""
        self._restored = None if state is None else (int(state["epoch"]), int(state["batches"]))
        self._pending = self._restored is not None
        self._hand_over()

    def epoch_started(self, epoch: int) -> None:
        """A new epoch starts (not a resumed one): the sampler iterates ``epoch``."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def _hand_over(self) -> None:
        # the loader may be built before or after the checkpoint's state is applied: whichever is last
        if self.sampler is not None and self._pending and self._restored is not None:
            self.sampler.resume_at(*self._restored)
            self._pending = False


def count_epoch_under_way(trainer: pl.Trainer) -> None:
    """Count the epoch of a starting training batch as ready and started, where Lightning did not.

    Lightning 2.6.6, resumed under ``max_epochs`` from a checkpoint written at an epoch's last batch
    (``every_n_train_steps``), trains the next epoch without counting it (nor calling
    ``on_train_epoch_start``), and its ``fit_loop.epoch_progress`` stays one behind from then on
    (``ready == completed`` while an epoch runs). A mid-epoch checkpoint of such a run read, to the
    run resumed from it, as one written between epochs: Lightning counted the epoch's batches from 0
    again (``batch_idx``, and so this library's data position, from which the next resume started
    the epoch too early) and expected a whole epoch from there (it skipped the validation at the
    epoch's end, whose loader draws from the RNG), though the data went on where they stopped. Called
    when a training batch starts, when an uninterrupted run always has ``ready == completed + 1``.
    """
    progress = trainer.fit_loop.epoch_progress
    if progress.current.ready == progress.current.completed:
        progress.increment_ready()
        progress.increment_started()


def resumable_sampler(loader: object) -> ResumePoint | None:
    """The sampler of ``loader`` that can resume mid-epoch, wrapping an ordinary one in place; else None."""
    if not isinstance(loader, DataLoader) or isinstance(loader, _Stateful):
        return None  # not a torch DataLoader, or one that restores its own position (Lightning does it)
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, ResumePoint):
        return batch_sampler
    if type(batch_sampler) is not BatchSampler or batch_sampler.batch_size is None:
        return None
    inner = batch_sampler.sampler
    if isinstance(inner, SkippingSampler):
        return inner
    if not isinstance(inner, DistributedSampler | SequentialSampler):
        return None  # e.g. RandomSampler: its order comes from the global RNG at iteration time
    # BatchSampler.sampler is a plain attribute; the loader's own `sampler` keeps the original,
    # whose set_epoch Lightning may still call: the wrapper sets the epoch again before iterating
    wrapper = SkippingSampler(inner, batch_sampler.batch_size)
    batch_sampler.sampler = wrapper
    return wrapper


class EpochStart(Callback):
    """Hands the training sampler ``trainer.current_epoch`` at every epoch start (after Lightning's ``set_epoch``)."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        position = getattr(trainer.strategy, "data_position", None)
        if isinstance(position, DataPosition):
            position.epoch_started(trainer.current_epoch)


def install_callback(trainer: pl.Trainer) -> None:
    """Add one :class:`EpochStart` to ``trainer.callbacks`` (idempotent across repeated fits)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, EpochStart) for c in callbacks):
        callbacks.append(EpochStart())
