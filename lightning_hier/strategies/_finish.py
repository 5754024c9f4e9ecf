"""Finish an algorithm right after the last optimizer step of fit, before any user hook sees the model.

Lightning 2.6 calls the strategy's ``on_train_end`` *after* every callback's and the
LightningModule's ``on_train_end`` (``FitLoop.on_run_end``), and the last epoch's validation and
checkpoints (``on_train_epoch_end``, ``on_validation_end``) run earlier still. A strategy that
merges its replicas only in its own ``on_train_end`` therefore shows user hooks, the final
validation and ``ModelCheckpoint(save_last=True)`` a model that differs between ranks and from the
one ``fit()`` returns.

:class:`FinishFit` is an internal callback that the strategy puts first in ``trainer.callbacks``.
Its ``on_train_batch_end`` predicts, from the loop's own stopping rules, whether the batch just
trained is the last of the fit and, if so, has the strategy finish its algorithm (drain the
in-flight window, run the last round) before any other callback or the module sees the batch's
end. It asks again in ``on_validation_start`` and ``on_train_epoch_end``, which catches a stop
requested in a later callback's ``on_train_batch_end`` (``Timer`` with its default
``interval='step'``) and an epoch cut short by ``on_train_batch_start`` returning -1; it
finishes unconditionally in ``on_train_end``. What it cannot see is a stop decided after it
looked: in ``on_validation_end`` or in another callback's ``on_train_epoch_end`` (``EarlyStopping``,
``Timer(interval='epoch')``). Then checkpoints written before that decision hold the consensus
model of that moment; ``on_train_end``, ``on_fit_end`` and the model after ``fit()`` hold the
finished one.

A wrong prediction costs one extra finish (a blocking merge; for GRAWA also a probe of the
replicas) and nothing else for the data-parallel strategies: training goes on from the finished
model (their ``finalize`` leaves a state from which the next step starts anew). The decoupled
pipeline cannot go on after its stages are reassembled and raises a clear error instead; the
prediction mirrors Lightning's own stopping rules, so this is not expected to happen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hier.callbacks.fit_end import ends_after_this_batch

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl


@runtime_checkable
class Finishes(Protocol):
    """A strategy that can finish its algorithm early (idempotent until training goes on)."""

    def finish_training(self) -> None:
        """Leave the finished (consensus) model in every rank's module, once per end of training; a collective.

        :class:`FinishFit` calls it right after the fit's last optimizer step, not in the
        strategy's ``on_train_end``, which Lightning runs after every user ``on_train_end``: the
        last epoch's validation and checkpoints, user ``on_train_end`` / ``on_fit_end`` hooks
        (collectives in them included) and ``fit()``'s result all see the same finished model on
        every rank.
        """


class Finish:
    """Finish an algorithm once per end of training (held by a strategy, called by its ``finish_training``).

    The first call runs ``finalize``; later calls do nothing until :meth:`rearm` (the next
    training batch, or a new fit), so a wrong guess of the last step costs one extra finish.
    """

    def __init__(self) -> None:
        self.done = False  # finalized since the last training batch started

    def __call__(self, finalize: Callable[[], object]) -> None:
        if not self.done:
            # FinishFit may call this from on_validation_start, inside Lightning's inference mode:
            # what finalizing creates (a center, a probe's graph) must stay usable if training goes on
            with torch.inference_mode(False):
                finalize()
            self.done = True

    def rearm(self) -> None:
        """Training goes on: the replicas may differ again."""
        self.done = False


class FinishFit(Callback):
    """Finish the strategy's algorithm after the last optimizer step of fit (see the module docstring)."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if ends_after_this_batch(trainer):
            _finish(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before the strategy enters its consensus for validation (strategy hooks run after callbacks')
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and ends_after_this_batch(trainer):
            _finish(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before the monitoring callbacks (ModelCheckpoint) save at the epoch's end
        if ends_after_this_batch(trainer):
            _finish(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _finish(trainer)  # stops nobody predicted (early stopping); a no-op when already finished


def install(trainer: pl.Trainer) -> None:
    """Put one :class:`FinishFit` first in ``trainer.callbacks`` (idempotent across repeated fits).

    First, so that even callbacks acting in ``on_train_batch_end`` (``ModelCheckpoint`` with
    ``every_n_train_steps``) see the finished model.
    """
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, FinishFit) for c in callbacks):
        callbacks.insert(0, FinishFit())


def _finish(trainer: pl.Trainer) -> None:
    strategy = trainer.strategy
    if isinstance(strategy, Finishes):
        strategy.finish_training()
