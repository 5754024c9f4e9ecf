"""The hook through which a fault-tolerant run drives an algorithm's collectives (:class:`RoundGuard`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from lightning_hier.comm import FlatTensors

T = TypeVar("T")


class Undoable(Protocol):
    """An algorithm whose collective can be undone and run again among fewer replicas."""

    def undo_point(self) -> Callable[[], None]:
        """Called before the collective; the returned function puts the state back as it was then."""
        ...

    def regroup(self, group: Any) -> None:
        """Run over ``group`` from now on (every member of it calls this)."""
        ...


class RoundGuard(Protocol):
    """Runs an algorithm's collectives under a membership that may change (a fault-tolerant run).

    :meth:`run` calls ``collective`` (a round, a consensus, the final round, HPSGD's wait for a
    window in flight) over the replicas alive at that point, after the algorithm's ``regroup`` if
    they changed, and when a replica fails during it, undoes it (:meth:`Undoable.undo_point`) and
    runs it again among the survivors. ``admit``: restarted replicas may be admitted at this point.
    The implementation is :class:`~lightning_hier.strategies.FaultTolerance`.
    """

    def run(self, algorithm: Undoable, collective: Callable[[], T], admit: bool) -> T: ...


def restore_point(flats: Sequence[FlatTensors], algorithm: Any) -> Callable[[], None]:
    """An :meth:`Undoable.undo_point` from ``flats`` (the replica's buckets) and ``algorithm``'s state dict.

    The buckets are cloned and the state deep-copied now; the returned function copies both back.
    """
    buckets = [b for f in flats for b in f.buckets]
    saved = [b.clone() for b in buckets]
    state = copy.deepcopy(algorithm.state_dict())

    def undo() -> None:
        with torch.no_grad():
            torch._foreach_copy_(buckets, saved)
        algorithm.load_state_dict(state)

    return undo
