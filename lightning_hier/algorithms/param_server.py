"""The parameter server's core: requests, the handler protocol, staleness accounting (no threads, no network).

An asynchronous parameter server (Dean et al., NeurIPS 2012; Zhang, Gupta, Lian, Liu, IJCAI 2016)
owns the consensus state and answers workers one request at a time, in the order they arrive.
This module is the pure state machine of that server; :mod:`lightning_hier.algorithms.ps_service`
runs it in a thread and carries requests over ``torch.distributed`` point-to-point messages.

A *request* is ``(worker, kind, payload tensors)`` plus the server version the worker last pulled,
its batch size and how long its iteration took. The update rule is a :class:`Handler`: it gets
each request and returns the replies to send now, by worker. A handler may defer a reply (n-softsync
answers a group of workers only once their average is applied with ``n = 1``); :class:`ServerCore`
then calls :meth:`Handler.flush` as soon as every worker still training is waiting, so no schedule
deadlocks, and once more when every worker has sent :data:`DONE`, so nothing stays pending.

Staleness of an applied gradient (or any contribution) is the number of server updates between
the worker's pull and the update that applies it; the handler reports each update with
:meth:`ServerContext.applied`, which counts it, records the staleness of every contribution and
advances the version.

Example (one worker, plain SGD on a vector, no processes)::

    >>> import torch
    >>> from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel
    >>> core = ServerCore(AsgdHandler(FlatModel([torch.zeros(2)], lr=0.5)), workers=[0])
    >>> core.serve(Request(0, PUSH, (torch.ones(2),), version=0))[0].tensors[0]
    tensor([-0.5000, -0.5000])
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

DONE = 0
"""Request kind: the worker has finished (no payload); the server ends when every worker sent it."""
PULL = 1
"""Request kind: reply with the current consensus state (no payload)."""
PUSH = 2
"""Request kind: a contribution to apply (a gradient for ASGD / n-softsync)."""
CLAIM = 3
"""Request kind: claim the next samples of an epoch from the shared queue (:class:`Claims`); no update."""


@dataclass(frozen=True)
class Request:
    """One message from a worker to the server.

    Attributes:
        worker: The sender's global rank.
        kind: :data:`DONE`, :data:`PULL`, :data:`PUSH`, :data:`CLAIM` or a handler's own kind (>= 16 is free).
        payload: The tensors (views of a receive buffer on the server: copy what you keep).
        version: The server version of the state the worker last pulled.
        batch_size: Samples behind this contribution (0 when not applicable).
        iteration_s: Seconds the worker spent since its previous reply (its iteration time).
    """

    worker: int
    kind: int
    payload: tuple[Tensor, ...] = ()
    version: int = 0
    batch_size: int = 0
    iteration_s: float = 0.0


@dataclass(frozen=True)
class Reply:
    """The server's answer: tensors (the consensus state, usually) and the version they are at."""

    tensors: tuple[Tensor, ...]
    version: int


class ServerContext(Protocol):
    """What a handler may ask of the server while it serves a request."""

    @property
    def version(self) -> int:
        """Number of updates applied so far."""

    def staleness(self, request: Request) -> int:
        """Updates applied since ``request``'s worker pulled (before applying it)."""

    def applied(self, requests: Sequence[Request]) -> None:
        """Record one server update made of ``requests`` (counts, staleness) and advance the version."""


class Claims(Protocol):
    """The server's shared queue of samples (:class:`~lightning_hier.algorithms.claim_sampler.ClaimQueue`)."""

    def answer(self, request: Request) -> tuple[Tensor, ...]:
        """The reply to a :data:`CLAIM` request (never deferred)."""

    def state_dict(self) -> dict[str, Any]:
        """The queue's position (saved with the server's state)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


class Handler(Protocol):
    """An update rule of the parameter server (ASGD, n-softsync, asynchronous GRAWA, ...).

    Replies are tuples of tensors; the server stamps them with its version. A handler must copy
    payload tensors it keeps (they are views of a reused receive buffer).
    """

    def handle(self, request: Request, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        """Serve a :data:`PULL`, :data:`PUSH` or own-kind request; return the replies to send now, by worker."""

    def flush(self, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        """Apply what is pending; answer the workers that wait (every worker still training does).

        Also called when every worker has finished (no one waits: the replies are ignored).
        """

    def consensus(self) -> list[Tensor]:
        """The consensus state (the server's model), as the tensors a worker loads."""

    def state_dict(self) -> dict[str, Any]:
        """The handler's state (model, optimizer, pending contributions)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


@dataclass
class WorkerStats:
    """What the server saw of one worker."""

    pushes: int = 0
    applied: int = 0
    iteration_s_sum: float = 0.0
    batch_size: int = 0
    batch_size_sum: int = 0
    staleness_sum: int = 0

    def mean_iteration_s(self) -> float:
        return self.iteration_s_sum / self.pushes if self.pushes else 0.0

    def mean_staleness(self) -> float:
        """Mean staleness of this worker's applied contributions (0 before any)."""
        return self.staleness_sum / self.applied if self.applied else 0.0


@dataclass
class ServerStats:
    """Staleness of every applied contribution (histogram, mean, max) and per-worker accounting."""

    histogram: Counter[int] = field(default_factory=Counter)
    workers: dict[int, WorkerStats] = field(default_factory=dict)
    updates: int = 0

    @property
    def applied(self) -> int:
        """Contributions applied (each gradient counts once, however many were averaged per update)."""
        return sum(self.histogram.values())

    @property
    def mean_staleness(self) -> float:
        n = self.applied
        return sum(s * c for s, c in self.histogram.items()) / n if n else 0.0

    @property
    def max_staleness(self) -> int:
        return max(self.histogram, default=0)

    @property
    def worker_mean_staleness(self) -> float:
        """The mean over workers of each worker's mean staleness (workers with an applied contribution).

        :attr:`mean_staleness` is the mean over contributions, which weighs each worker by how often
        it pushes; with ``W`` workers pushing as in ASGD it is about ``W - 1`` whatever their
        speeds, while this mean grows with the spread of the speeds (a slow worker's few pushes
        are very stale). Which of the two a paper calls "average staleness" is often unsaid.
        """
        means = [s.mean_staleness() for s in self.workers.values() if s.applied]
        return sum(means) / len(means) if means else 0.0

    def summary(self) -> dict[str, float]:
        """Flat scalar metrics for a logger."""
        out = {
            "ps/staleness_mean": self.mean_staleness,
            "ps/staleness_max": float(self.max_staleness),
            "ps/staleness_worker_mean": self.worker_mean_staleness,
            "ps/updates": float(self.updates),
            "ps/applied": float(self.applied),
        }
        for w, s in sorted(self.workers.items()):
            out[f"ps/worker{w}/iteration_s"] = s.mean_iteration_s()
            out[f"ps/worker{w}/batch_size"] = float(s.batch_size)
            out[f"ps/worker{w}/staleness_mean"] = s.mean_staleness()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "histogram": dict(self.histogram),
            "updates": self.updates,
            "workers": {w: vars(s).copy() for w, s in self.workers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.histogram = Counter({int(k): int(v) for k, v in state["histogram"].items()})
        self.updates = int(state["updates"])
        self.workers = {int(w): WorkerStats(**s) for w, s in state["workers"].items()}


class ServerCore:
    """The server's state machine: serves one request at a time through a :class:`Handler`.

    Args:
        handler: The update rule.
        workers: Global ranks of every worker that will send requests.
        trace: Keep ``(worker, staleness)`` of every applied contribution in :attr:`trace`, in
            order (tests and replays; it grows without bound).
        claims: The shared queue that answers :data:`CLAIM` requests (``None``: they are an error).

    Raises:
        ValueError: ``workers`` is empty or has duplicates.
    """

    def __init__(
        self, handler: Handler, workers: Sequence[int], trace: bool = False, claims: Claims | None = None
    ) -> None:
        if not workers or len(set(workers)) != len(workers):
            raise ValueError(f"ServerCore: `workers` must be distinct ranks, at least one; got {list(workers)}.")
        self.handler = handler
        self.workers = tuple(workers)
        self.stats = ServerStats(workers={w: WorkerStats() for w in workers})
        self.version = 0
        self.done: set[int] = set()
        self.waiting: set[int] = set()
        self.trace: list[tuple[int, int]] | None = [] if trace else None
        self.claims = claims

    @property
    def finished(self) -> bool:
        """Every worker sent :data:`DONE`."""
        return len(self.done) == len(self.workers)

    def staleness(self, request: Request) -> int:
        return self.version - request.version

    def applied(self, requests: Sequence[Request]) -> None:
        for r in requests:
            self.stats.histogram[self.staleness(r)] += 1
            self.stats.workers[r.worker].applied += 1
            self.stats.workers[r.worker].staleness_sum += self.staleness(r)
            if self.trace is not None:
                self.trace.append((r.worker, self.staleness(r)))
        self.stats.updates += 1
        self.version += 1

    def serve(self, request: Request) -> dict[int, Reply]:
        """Serve one request; returns the replies to send now, by worker.

        Raises:
            ValueError: The request comes from an unknown worker, one that already sent
                :data:`DONE`, or one that still waits for a reply.
        """
        w = request.worker
        if w not in self.stats.workers or w in self.done or w in self.waiting:
            state = "unknown" if w not in self.stats.workers else "done" if w in self.done else "waiting"
            raise ValueError(f"ServerCore: request of kind {request.kind} from worker {w}, which is {state}.")
        if request.kind == DONE:
            self.done.add(w)
            return self._settle({})
        if request.kind == CLAIM:  # answered at once, outside the update rule: no push, no version change
            if self.claims is None:
                raise ValueError(f"ServerCore: worker {w} claims samples, but this server has no shared queue.")
            return {w: Reply(self.claims.answer(request), self.version)}
        if request.kind != PULL:
            ws = self.stats.workers[w]
            ws.pushes += 1
            ws.iteration_s_sum += request.iteration_s
            ws.batch_size = request.batch_size
            ws.batch_size_sum += request.batch_size
        self.waiting.add(w)
        return self._settle(self.handler.handle(request, self))

    def _settle(self, replies: dict[int, tuple[Tensor, ...]]) -> dict[int, Reply]:
        self.waiting.difference_update(replies)
        if self.finished:
            self.handler.flush(self)  # contributions still pending when the last worker finished
        elif self.waiting and self.waiting == set(self.workers) - self.done:
            more = self.handler.flush(self)
            self.waiting.difference_update(more)
            replies = {**replies, **more}
            if self.waiting:
                raise RuntimeError(
                    f"ServerCore: {type(self.handler).__name__}.flush left {sorted(self.waiting)} waiting."
                )
        return {w: Reply(t, self.version) for w, t in replies.items()}

    def state_dict(self) -> dict[str, Any]:
        """Version, statistics and the handler's state (call between requests)."""
        state = {"version": self.version, "stats": self.stats.state_dict(), "handler": self.handler.state_dict()}
        if self.claims is not None:
            state["claims"] = self.claims.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.stats.load_state_dict(state["stats"])
        self.handler.load_state_dict(state["handler"])
        if self.claims is not None and "claims" in state:
            self.claims.load_state_dict(state["claims"])
