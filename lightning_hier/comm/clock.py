"""How long background collectives really take, measured when they finish rather than when waited for."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


class PhaseClock:
    """Wall time from a launch to the completion of the last of its collectives.

    With gloo, torch runs a work's future callbacks on the communication thread as the collective
    finishes, so the duration is known whether or not (and however late) anyone waits. NCCL's
    futures complete with respect to CUDA streams, not when the GPU is done, so there the clock
    is read by :meth:`poll` instead (call it once a step: the end is then the first step boundary
    at which the works were seen finished, an upper bound). A rank that launches last sees the
    transfer alone; one that launches early also sees how far the others were behind it.

    Create it just before launching, then :meth:`track` the works the launch returned.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._works: list[Any] = []  # read by poll()
        self._expected = 0  # callback-timed works
        self._ends: list[float] = []  # appended from the communication thread (atomic under the GIL)
        self._polled: float | None = None

    def track(self, works: Sequence[Any], group: dist.ProcessGroup | None) -> PhaseClock:
        """Time ``works`` (``dist.Work`` handles on ``group``); returns ``self``."""
        if group is not None and dist.get_backend(group) == "gloo":
            self._expected += len(works)
            for work in works:
                work.get_future().add_done_callback(lambda _: self._ends.append(time.perf_counter()))
        else:
            self._works.extend(works)
        return self

    def poll(self) -> None:
        """Note the time if the polled works have all finished now (no-op for callback-timed ones)."""
        if self._works and self._polled is None and all(w.is_completed() for w in self._works):
            self._polled = time.perf_counter()

    def elapsed(self) -> float:
        """Launch to the last completion (0 with nothing tracked); to now while any is still running.

        A wait can return a moment before the communication thread has run the callbacks, so a
        reading right after a wait may be this upper bound.
        """
        if self._works:
            end = self._polled if self._polled is not None else time.perf_counter()
        elif len(self._ends) < self._expected:
            end = time.perf_counter()
        else:
            end = max(self._ends, default=self.start)
        return end - self.start
