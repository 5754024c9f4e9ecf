"""A strategy driven by one algorithm object: the base hooks, delegated once for every such strategy.

Most algorithms of this package are a single pure-torch object with the same four entry points
(finish training, hold the consensus model, save and restore state). :class:`AlgorithmStrategy`
forwards :class:`~lightning_hier.strategies._base.HierStrategy`'s hooks to it, so a concrete
strategy only builds ``self.algorithm`` in ``_setup_algorithm`` and acts in ``optimizer_step``.
When the algorithm is finished (right after the fit's last optimizer step) is the base's
business: see :meth:`HierStrategy.finish_training`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, Protocol, TypeVar

from typing_extensions import override

from lightning_hier.strategies._base import HierStrategy


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

    @override
    def _finalize_algorithm(self) -> None:
        if self.algorithm is not None:
            self.algorithm.finalize()

    @contextmanager
    @override
    def _consensus(self) -> Iterator[None]:
        if self.algorithm is None:
            yield
        else:
            with self.algorithm.consensus():
                yield

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        return self.algorithm.state_dict() if self.algorithm is not None else {}

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if self.algorithm is not None and state:
            self.algorithm.load_state_dict(state)
