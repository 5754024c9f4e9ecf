"""Byte and time accounting for collectives, so every strategy can report what it communicated."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class CommStats:
    """Running totals of one rank's communication.

    Attributes:
        bytes: Payload bytes this rank handed to collectives (an all-reduce of ``n`` bytes counts
            ``n``; on a ring each rank then sends about ``2 (p - 1) / p * n`` bytes on the wire).
        calls: Number of collective calls.
        blocked_s: Seconds this rank spent waiting for collectives to complete (the part of the
            communication that was *not* hidden behind computation).
    """

    bytes: int = 0
    calls: int = 0
    blocked_s: float = 0.0

    def add(self, nbytes: int, calls: int = 1) -> None:
        self.bytes += int(nbytes)
        self.calls += calls

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Time the enclosed wait as blocked communication."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - start

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.bytes = int(state["bytes"])
        self.calls = int(state["calls"])
        self.blocked_s = float(state["blocked_s"])
