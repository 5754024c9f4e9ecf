"""A rank's end of a parameter-server run that pauses where the ranks meet: :class:`ServerLink`.

Shared by the parameter-server strategies (``asgd``, ``softsync``, ``dbs_async``) and GRAWA's
asynchronous rounds, which meet in collectives (validation, checkpoints, the end of fit) between
stretches of asynchronous training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from typing_extensions import Self

from lightning_hier.algorithms.claim_sampler import claim_payload
from lightning_hier.algorithms.param_server import ServerCore
from lightning_hier.algorithms.ps_service import Group, ParameterServer, Worker, connect

SERVER_RANK = 0
"""The rank whose thread serves in the strategies (it trains too, as the authors' codes do, unless
the strategy's ``server='dedicated'``: then it only serves)."""
SERVERS = ("rank0", "dedicated")
"""Where the strategies' server runs: a thread of rank 0, which trains too, or rank 0 serving only."""


def served_workers(world: int, server: str) -> list[int]:
    """The global ranks that train and talk to the server: every rank, or all but rank 0 when dedicated."""
    return list(range(1 if server == "dedicated" else 0, world))


def require_worker(link: ServerLink) -> Worker:
    """``link``'s worker; a clear error on a rank that only serves (a bug in the caller)."""
    if link.worker is None:
        raise RuntimeError(f"rank {SERVER_RANK} only serves (server='dedicated'): it has no worker.")
    return link.worker


@dataclass
class ServerLink:
    """This rank's end of a served run, paused at every point where the ranks meet and resumed after.

    A training loop's collectives (validation, checkpoints, the end of fit) must not wait on a
    server that waits on a rank already in the collective, and a long validation must not count
    as a silent worker: so every rank :meth:`pause` s there (its worker says ``DONE`` and the
    server's rank waits until every worker has) and :meth:`resume` s with the next training step.

    Args:
        server: The server, on its own rank only (``None`` elsewhere).
        worker: This rank's worker (``None`` on a server rank that only serves).
        timeout: See :class:`ParameterServer`.
        serving: Whether the server serves this rank now (it does once :func:`connect` returns).
    """

    server: ParameterServer | None
    worker: Worker | None
    timeout: timedelta
    serving: bool = True

    @classmethod
    def connect(
        cls, core_factory: Callable[[], ServerCore], group: Group, rank: int, server: int, timeout: timedelta
    ) -> Self:
        """:func:`connect`, kept as a link (serving)."""
        return cls(*connect(core_factory, group, rank, server, timeout), timeout)

    def pause(self) -> None:
        """This worker says ``DONE``; the server's rank waits until every worker has (a no-op when paused)."""
        if not self.serving:
            return
        if self.worker is not None:
            self.worker.done()
        self.serving = False
        if self.server is not None:
            # the other ranks say DONE right after the same collective point: allow each the silence limit
            self.server.join(2 * self.timeout.total_seconds() + 5)

    def resume(self) -> None:
        """Serve again after :meth:`pause` (the server's rank starts it); a no-op while serving."""
        if self.serving:
            return
        if self.server is not None:
            self.server.start()
        self.serving = True

    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim the next ``n`` samples of ``epoch`` from the server's shared queue: ``(start, count)``.

        Serves again first (:meth:`resume`): the training loader fetches a batch ahead, so the
        first claim after a pause (validation, a checkpoint) may come before the training batch
        that would resume. ``n = 0`` asks for this worker's share, sized by the server from
        ``speed`` (samples/s; 0: not measured yet).
        """
        self.resume()
        (reply,) = require_worker(self).claim([claim_payload(epoch, n, num_samples, speed)])
        start, count = (int(x) for x in reply.tolist())
        return start, count

    def metrics(self) -> dict[str, float]:
        """The server's staleness and per-worker metrics (on the server's rank; empty elsewhere)."""
        if self.server is None:
            return {}
        with self.server.lock:
            return self.server.core.stats.summary()
