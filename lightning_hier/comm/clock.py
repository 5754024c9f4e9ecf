"""How long background collectives really take, measured when they finish rather than when waited for."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class PhaseClock:
    """Wall time from a launch to the completion of the last of its collectives.

    torch runs a work's future callbacks on the communication thread as the collective
    finishes, so the duration is known whether or not (and however late) anyone waits. A rank
    that launches last sees the transfer alone; one that launches early also sees how far the
    others were behind it.

    Create it just before launching, then :meth:`track` the works the launch returned.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._expected = 0
        self._ends: list[float] = []  # appended from the communication thread (atomic under the GIL)

    def track(self, works: Sequence[Any]) -> PhaseClock:
        """Time ``works`` (``dist.Work`` handles); returns ``self``."""
        self._expected += len(works)
        for work in works:
            work.get_future().add_done_callback(lambda _: self._ends.append(time.perf_counter()))
        return self

    def elapsed(self) -> float:
        """Launch to the last completion (0 with nothing tracked); to now while any is still running.

        A wait can return a moment before the communication thread has run the callbacks, so a
        reading right after a wait may be this upper bound.
        """
        end = max(self._ends, default=self.start) if len(self._ends) >= self._expected else time.perf_counter()
        return end - self.start
