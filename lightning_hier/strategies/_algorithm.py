"""A strategy driven by one algorithm object: the base hooks, delegated once for every such strategy.

Most algorithms of this package are a single pure-torch object with the same four entry points
(finish training, hold the consensus model, save and restore state). :class:`AlgorithmStrategy`
forwards :class:`~lightning_hier.strategies._base.HierStrategy`'s hooks to it, so a concrete
strategy only builds ``self.algorithm`` in ``_setup_algorithm`` and acts in ``optimizer_step``.

It also finishes the algorithm right after the last optimizer step of fit (through the internal
callback of :mod:`lightning_hier.strategies._finish`), not in the strategy's ``on_train_end``,
which Lightning calls after every user ``on_train_end``: the last epoch's validation and
checkpoints, user ``on_train_end`` / ``on_fit_end`` hooks and ``fit()``'s result all see the same
finished model on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from lightning.pytorch.trainer.states import TrainerFn

from lightning_hier.strategies import _finish
from lightning_hier.strategies._base import HierStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SyncAlgorithm(Protocol):
    """What :class:`AlgorithmStrategy` needs from an algorithm object."""

    def finalize(self) -> None:
        """Leave the consensus model in the replica (end of fit).

        Must be idempotent, and training must be able to go on afterwards (the next step starts
        anew from the consensus model): it may run one or more times before the real end of fit.
        """

    def consensus(self) -> AbstractContextManager[None]:
        """Hold the consensus model in the replica while inside, restore the replica after."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's algorithm state (tensors and plain types)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


A = TypeVar("A", bound=SyncAlgorithm)


class AlgorithmStrategy(HierStrategy, Generic[A]):
    """A :class:`HierStrategy` whose algorithm is ``self.algorithm`` (``None`` until fitting)."""

    algorithm: A | None = None
    _finished = False  # finalized since the last training batch started

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _finish.install(trainer)

    def finish_training(self) -> None:
        """Leave the finished (consensus) model in every rank's module, once per end of training.

        A collective. Called after the fit's last optimizer step (and again, as a no-op, from
        ``on_train_end``); a later training batch re-arms it, so a wrong guess of the last step
        costs one extra merge and nothing else.
        """
        if not self._finished:
            self._finalize_algorithm()
            self._finished = True

    def on_train_start(self) -> None:
        super().on_train_start()
        self._finished = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._finished = False  # training goes on: the replicas may differ again

    def _finalize_algorithm(self) -> None:
        if self.algorithm is not None:
            self.algorithm.finalize()

    @contextmanager
    def _consensus(self) -> Iterator[None]:
        if self.algorithm is None:
            yield
        else:
            with self.algorithm.consensus():
                yield

    def _algorithm_state(self) -> dict[str, Any]:
        return self.algorithm.state_dict() if self.algorithm is not None else {}

    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if self.algorithm is not None and state:
            self.algorithm.load_state_dict(state)
