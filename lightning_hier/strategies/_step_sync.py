"""Take Lightning's per-step broadcast out of asynchronous training.

Lightning 2.6's training epoch loop broadcasts a "received SIGTERM" flag from rank 0 at the start
of *every* training batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``, on the default group,
whenever the world has more than one rank). A collective per step puts every rank in lock-step
with the slowest: under ``asgd`` with one rank four times slower, the server's per-worker push
counts were measured never more than one push apart, so fast workers never run ahead and
asynchronous training degenerates into synchronous rounds (every worker's staleness about
``W - 1``). :func:`local_sigterm_check` replaces that broadcast, on one trainer's loop, with
the rank's own flag: a rank that receives SIGTERM still stops (raising Lightning's
``SIGTERMException``); the others learn of it through the strategy's failure handling (their
server or peers go silent and the finite timeouts name the rank), not through a per-step sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.exceptions import SIGTERMException

if TYPE_CHECKING:
    import lightning.pytorch as pl

HOOK = "_broadcast_sigterm_tensor"
"""The epoch loop's method that broadcasts the flag (Lightning 2.6)."""


def local_sigterm_check(trainer: pl.Trainer) -> bool:
    """Make ``trainer``'s epoch loop check SIGTERM on this rank only; whether the hook was found.

    An instance attribute, so only this trainer changes. Returns ``False`` (and changes nothing)
    if the running Lightning has no such method.
    """
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(loop, HOOK, None)):
        return False

    def check_this_rank() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    setattr(loop, HOOK, check_this_rank)
    return True
