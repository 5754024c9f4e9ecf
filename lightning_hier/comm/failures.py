"""Fail fast, and say which rank failed.

When one rank raises, its peers block in their next collective; when one rank hangs, its peers
block until the process-group timeout and the hung rank itself never notices. Both end as an
opaque "timed out" or "connection closed" error on the healthy ranks, and a hung rank can outlive
the job. :class:`FailureBoard` fixes both with the rendezvous store every job already has:

- a failing rank *reports* (``rank -> message``) before it unwinds;
- a rank that catches a communication error waits briefly for reports and names the culprit:
  the ranks that reported a real error, and the ranks that sent *no report* (hung or dead);
- a watchdog thread on every rank ends its own process shortly after any peer reported, unless
  its own main thread is already handling the failure; it also ends its process when the store
  has been unreachable for ``store_grace_s`` (the store lives in rank 0's process when Lightning
  launched the job: rank 0 is gone) or when the process that launched this rank died (this rank
  was re-parented): no orphaned or hung rank survives.

Nothing is sent per step: the watchdog polls one counter key of the store.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch.distributed as dist

log = logging.getLogger(__name__)

_COMM_ERROR_MARKERS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "recv",
    "did not answer",  # comm.p2p.PeerError
)
_STORE_HOST = "it lives in rank 0's process when Lightning launched the job: rank 0 is probably gone"


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because of a peer (timeout, lost peer)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError | TimeoutError | ConnectionError) and any(
        m in text for m in _COMM_ERROR_MARKERS
    )


class Parent(NamedTuple):
    """The process that launched a rank, which the rank's watchdog outlives by at most a grace period."""

    pid: int
    name: str
    """How messages call it (``'rank 0'``, ``'the launching process'``)."""


class FailureBoard:
    """Failure reports of a distributed job, kept in the c10d store.

    Args:
        store: The job's rendezvous store (shared by all ranks).
        rank: This process's global rank.
        world_size: Number of ranks.
        prefix: Key prefix unique to this run (so a restarted job never reads stale reports).
        grace_s: How long a peer waits for reports, and how long the watchdog lets a rank's own
            error handling run before it ends the process.
        poll_s: Watchdog polling period.
        store_grace_s: How long the store may stay unreachable before the watchdog ends the process.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        prefix: str,
        grace_s: float = 3.0,
        poll_s: float = 0.5,
        store_grace_s: float = 5.0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.store_grace_s = store_grace_s
        self.store_lost = False
        """Whether the last look at the store failed (its host is gone, or the network)."""
        self._reported = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/failure/{rank}"

    @property
    def _count_key(self) -> str:
        return f"{self.prefix}/failures"

    def report(self, message: str) -> None:
        """Record that this rank failed (idempotent; never raises)."""
        if self._reported.is_set():
            return
        self._reported.set()
        try:
            self.store.set(self._key(self.rank), message)
            self.store.add(self._count_key, 1)
        except Exception as err:  # the store may already be gone; reporting is best effort
            log.debug("rank %d could not report its failure: %s", self.rank, err)

    def reports(self) -> dict[int, str]:
        """All failure reports so far, by rank (none when the store is unreachable: see :attr:`store_lost`)."""
        try:
            found: dict[int, str] = {}
            if self.store.add(self._count_key, 0) > 0:
                for r in range(self.world_size):
                    if self.store.check([self._key(r)]):
                        found[r] = self.store.get(self._key(r)).decode(errors="replace")
        except Exception:
            self.store_lost = True
            return {}
        self.store_lost = False
        return found

    def wait_for_reports(self, timeout_s: float | None = None) -> dict[int, str]:
        """Poll until every rank reported or ``timeout_s`` (default: the grace period) passed."""
        deadline = time.monotonic() + (self.grace_s if timeout_s is None else timeout_s)
        found = self.reports()
        while len(found) < self.world_size and not self.store_lost and time.monotonic() < deadline:
            time.sleep(min(0.1, self.poll_s))
            found = self.reports()
        return found

    def describe(self, found: dict[int, str]) -> str:
        """A one-paragraph diagnosis naming the failed and the silent ranks."""
        causes = {r: m for r, m in found.items() if r != self.rank and not _looks_secondary(m)}
        # this rank's own report may be missing too (the store was gone when it reported)
        silent = [r for r in range(self.world_size) if r not in found and r != self.rank]
        parts = [f"lightning_hier: rank {self.rank} saw a failed collective."]
        parts += [f"Rank {r} failed first: {m}" for r, m in sorted(causes.items())]
        if silent:
            parts.append(f"No failure report from rank(s) {silent}: hung (stuck outside a collective) or dead.")
        if self.store_lost:
            parts.append(f"The rendezvous store is unreachable ({_STORE_HOST}).")
        if not causes and not silent:
            parts.append("Every rank reported a communication error; see each rank's log for the cause.")
        return " ".join(parts)

    def start_watchdog(self, terminate: Callable[[str], None] | None = None, parent: Parent | None = None) -> None:
        """Start the thread that ends this process when the job can no longer finish.

        It ends the process once a peer reported a failure, once the store has been unreachable
        for ``store_grace_s``, or, with ``parent``, once this process's parent is no longer
        ``parent.pid`` (the launcher died and the process was re-parented). Each time it first
        waits ``grace_s`` for this rank's own error handling, which can name the culprit.

        Args:
            terminate: Called with the reason instead of printing it and ``os._exit(1)``.
            parent: The process that launched this rank; ``None``: not watched (a rank that is
                the launching process, or one started by an external launcher).
        """
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, args=(terminate or _terminate, parent), name="lightning-hier-watchdog", daemon=True
        )
        self._thread.start()

    def stop_watchdog(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.poll_s + 1)

    def _watch(self, terminate: Callable[[str], None], parent: Parent | None) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self._why_end(parent)
            if reason is None or self._reported.is_set():
                continue
            # let this rank's own error handling win if its collectives fail on their own
            if self._stop.wait(self.grace_s) or self._reported.is_set():
                continue
            terminate(reason())
            return

    def _why_end(self, parent: Parent | None) -> Callable[[], str] | None:
        """Why this rank should end (a message, made when it ends), or ``None``."""
        me = f"lightning_hier: rank {self.rank} is ending its process"
        gone = _parent_gone(me, parent)
        if gone is not None:
            return gone
        try:
            failed = self.store.add(self._count_key, 0) > 0
        except Exception as err:
            # look once more after the grace period (every failed look logs a warning of torch's)
            if self._stop.wait(self.store_grace_s) or self._store_reachable():
                return None
            # a launcher that died takes the store with it: name the launcher, the more precise
            # cause, when its death is what the grace period revealed
            gone = _parent_gone(me, parent)
            if gone is not None:
                return gone
            lost = f"the rendezvous store has been unreachable for {self.store_grace_s:g} s ({_STORE_HOST}): {err}"
            return lambda: f"{me}: {lost}"
        if not failed:
            return None

        def peers() -> str:
            found = self.reports()
            failures = "; ".join(f"rank {r}: {m}" for r, m in sorted(found.items()))
            return f"{me} because rank(s) {sorted(found)} failed: {failures}"

        return peers

    def _store_reachable(self) -> bool:
        try:
            self.store.add(self._count_key, 0)
        except Exception:
            return False
        return True


def _parent_gone(me: str, parent: Parent | None) -> Callable[[], str] | None:
    """The message for a watched launcher that is gone (this process was re-parented), or ``None``."""
    if parent is None or os.getppid() == parent.pid:
        return None
    return lambda: f"{me}: {parent.name} (PID {parent.pid}), which launched it, is gone."


def _looks_secondary(message: str) -> bool:
    return any(m in message.lower() for m in _COMM_ERROR_MARKERS) or "DistBackendError" in message


def _terminate(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)
