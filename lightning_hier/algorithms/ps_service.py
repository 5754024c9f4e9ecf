"""The parameter server as a service: a serving thread on the server's rank, and the workers' clients.

:class:`ParameterServer` runs a :class:`~lightning_hier.algorithms.param_server.ServerCore` in a
background thread of the server's rank (rank 0 by default, which also trains: the GRAWA and
DBS-SGD authors' codes do the same), or in the foreground of a dedicated rank
(:meth:`ParameterServer.serve_forever`). Requests are served one at a time, in arrival order.

Transport, decided (see ``docs/algorithms.md``, "Asynchronous training"): ``torch.distributed``
point-to-point messages (:mod:`lightning_hier.comm.ps_wire`) on a *dedicated* process group that
only the server and the remote workers' clients use, so the serving threads never share a group
with the training thread's collectives. One receiving thread per remote worker waits for that
worker's next request and posts it to one queue; the serving thread applies it and sends the
replies. Each worker's messages, both ways, carry its rank as their tag (a gloo group is not safe
for concurrent operations on one tag from several threads). The serving thread measures each
worker's silence since its last reply and fails the run naming the worker that exceeds
``timeout``; a receive does not time out on its own, because a gloo receive that times out closes
its connection and fails the neighbouring workers' receives too, which would blame the wrong rank.
``torch.distributed.rpc`` was the alternative: it brings its own agent, thread pool and timeouts
outside the process group, cannot share the strategies' rendezvous and failure reporting, and its
TensorPipe agent is another dependency to configure per cluster; plain point-to-point keeps one
mechanism for every strategy here.

The worker on the server's rank calls the server in-process (:class:`LocalClient`): no network
round trip to itself. Remote workers use :class:`RemoteClient`. Both give a :class:`Worker` its
replies; the worker stamps each request with the version it last pulled and its iteration time.

Test hook: ``order`` scripts which worker is served next (a list of ranks); requests that arrive
out of turn wait until the script reaches them. After the script, arrival order resumes.

Shutdown: each worker sends ``DONE`` after its last reply; the serving thread ends once every
worker has, so every pushed contribution was applied (answered) exactly once and nothing is
applied after :meth:`ParameterServer.join` returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.algorithms.param_server import CLAIM, DONE, PULL, Reply, Request, ServerCore
from lightning_hier.comm.p2p import PeerError
from lightning_hier.comm.ps_wire import recv_message, send_message, to_host

Group = dist.ProcessGroup | None
POLL_S = 0.2
"""How often the serving thread, when idle, looks for a silent worker."""


class _Failed:
    """A receiving thread's error, posted to the serving thread."""

    def __init__(self, worker: int, error: BaseException) -> None:
        self.worker, self.error = worker, error


class ParameterServer:
    """Serves a :class:`ServerCore` to a local worker (in-process) and remote workers (point-to-point).

    Args:
        core: The server state machine (its ``workers`` are every worker's global rank).
        group: The dedicated process group of the server and the remote workers.
        rank: This (the server's) global rank.
        timeout: Longest time a worker may stay silent after its last reply (or the start) before
            the run fails naming it, and the local worker's longest wait for a reply.
        order: Test hook: the ranks to serve first, in this order (arrival order after it).
    """

    def __init__(
        self,
        core: ServerCore,
        group: Group,
        rank: int,
        timeout: timedelta,
        order: Sequence[int] | None = None,
    ) -> None:
        self.core = core
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.order = list(order or ())
        self.lock = threading.Lock()
        """Held while a request is served: take it to read the core's state from another thread."""
        self.error: BaseException | None = None
        self._inbox: queue.Queue[Request | _Failed] = queue.Queue()
        self._held: list[Request] = []
        self._answered = {w: threading.Event() for w in core.workers}
        self._local: dict[int, Reply] = {}
        self._local_cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._silent_since: dict[int, float] = {}

    @property
    def remote(self) -> list[int]:
        return [w for w in self.core.workers if w != self.rank]

    def start(self) -> None:
        """Start serving (again, after :meth:`join`: every worker takes part anew)."""
        if self._threads:
            raise RuntimeError("ParameterServer.start: already serving.")
        self.core.done.clear()
        self._silent_since = dict.fromkeys(self.core.workers, time.monotonic())
        self._threads = [threading.Thread(target=self._serve, name="ps-serve", daemon=True)]
        for w in self.remote:
            self._answered[w].set()
            self._threads.append(threading.Thread(target=self._receive, args=(w,), name=f"ps-recv-{w}", daemon=True))
        for t in self._threads:
            t.start()

    def serve_forever(self) -> None:
        """Serve in the calling thread's stead until every worker is done (a dedicated server rank)."""
        self.start()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait until every worker sent ``DONE``; raises the serving thread's error, if any.

        After an error the receiving threads may still be blocked on a dead peer: they are
        daemons, left to end with the process (the run is failing).
        """
        serving, receivers = self._threads[:1], self._threads[1:]
        for t in serving:
            t.join(timeout)
        if self.error is None:
            for t in receivers:  # each ended after its worker's DONE
                t.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads = []
        if self.error is not None:
            raise self.error
        if alive:
            raise TimeoutError(f"ParameterServer.join: threads {alive} still running after {timeout} s.")

    def request(self, request: Request) -> Reply | None:
        """The local worker's in-process request; blocks for the reply (``None`` for ``DONE``)."""
        self._check()
        self._inbox.put(request)
        if request.kind == DONE:
            return None
        # the serving thread names a silent worker within `timeout`; this bound only guards against the
        # serving thread itself hanging (a handler that never returns)
        deadline = time.monotonic() + 2 * self.timeout.total_seconds() + POLL_S
        with self._local_cv:
            while request.worker not in self._local and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(self._late_message(), self._pending_workers())
                self._local_cv.wait(left)
            self._check()
            return self._local.pop(request.worker)

    def _late_message(self) -> str:
        return (
            f"lightning_hier parameter server (rank {self.rank}): no reply for the local worker within "
            f"{2 * self.timeout.total_seconds():g} s; waiting for rank(s) {self._pending_workers()}."
        )

    def _pending_workers(self) -> list[int]:
        return sorted(set(self.core.workers) - self.core.done - self.core.waiting)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ threads
    def _receive(self, worker: int) -> None:
        try:
            while True:
                # wait for the previous reply first: a worker waiting on a deferred reply is not silent
                # (the serving thread sets the event on its own failure too, so this wait ends)
                self._answered[worker].wait()
                if self.error is not None:
                    return
                self._answered[worker].clear()
                # bounded by the group's own limit only: the serving thread names a silent worker
                # itself (a gloo receive that times out closes the pair and fails its neighbours too)
                scalars, tensors = recv_message(worker, self.group, None, tag=worker)
                kind, version, batch_size, seconds = scalars
                req = Request(worker, int(kind), tuple(tensors), int(version), int(batch_size), seconds)
                self._inbox.put(req)
                if req.kind == DONE:
                    return
        except BaseException as err:  # handed to the serving thread, which fails the run naming the rank
            self._inbox.put(_Failed(worker, err))

    def _serve(self) -> None:
        try:
            while not self.core.finished:
                request = self._next()
                with self.lock:
                    replies = self.core.serve(request)
                for w, reply in replies.items():
                    self._deliver(w, reply)
        except BaseException as err:
            self.error = err
            for event in self._answered.values():
                event.set()  # let the receiving threads see the error and end
            with self._local_cv:
                self._local_cv.notify_all()

    def _deliver(self, worker: int, reply: Reply) -> None:
        self._silent_since[worker] = time.monotonic()
        if worker == self.rank:
            with self._local_cv:
                self._local[worker] = reply
                self._local_cv.notify_all()
            return
        send_message([reply.version], reply.tensors, worker, self.group, self.timeout, tag=worker)
        self._answered[worker].set()

    def _next(self) -> Request:
        """The next request to serve: the script's next worker, else the earliest arrival."""
        while True:
            want = self.order[0] if self.order else None
            for i, r in enumerate(self._held):
                if want is None or r.worker == want:
                    if want is not None:
                        self.order.pop(0)
                    return self._held.pop(i)
            try:
                item = self._inbox.get(timeout=min(POLL_S, self.timeout.total_seconds()))
            except queue.Empty:
                self._check_silence()
                continue
            if isinstance(item, _Failed):
                raise item.error
            self._silent_since.pop(item.worker, None)
            self._held.append(item)

    def _check_silence(self) -> None:
        """Fail naming the worker whose next request is overdue (measured from its last reply)."""
        now = time.monotonic()
        late = [w for w, t in self._silent_since.items() if now - t > self.timeout.total_seconds()]
        if late:
            raise PeerError(
                f"lightning_hier parameter server (rank {self.rank}): rank(s) {sorted(late)} did not answer within "
                f"{self.timeout.total_seconds():g} s (no request since the last reply: hung, dead or too slow)",
                sorted(late),
            )

    def state_dict(self) -> dict[str, Any]:
        """The core's state, taken between two requests."""
        with self.lock:
            return self.core.state_dict()

    def consensus(self) -> list[Tensor]:
        """A copy of the consensus state, taken between two requests."""
        with self.lock:
            return [t.clone() for t in self.core.handler.consensus()]


class Client(Protocol):
    """How a worker reaches the server."""

    def request(self, request: Request) -> Reply | None:
        """Send ``request``; the reply (``None`` for ``DONE``)."""


class LocalClient:
    """The server rank's own worker: calls the server in-process."""

    def __init__(self, server: ParameterServer) -> None:
        self.server = server

    def request(self, request: Request) -> Reply | None:
        return self.server.request(request)


class RemoteClient:
    """A remote worker's link to the server.

    Args:
        server: The server's global rank.
        group: The dedicated process group (the same as the server's).
        timeout: Longest wait for a reply; a late one raises a
            :class:`~lightning_hier.comm.p2p.PeerError` naming the server's rank.
        device: Where received tensors are allocated.
    """

    def __init__(self, server: int, group: Group, timeout: timedelta, device: torch.device | None = None) -> None:
        self.server, self.group, self.timeout, self.device = server, group, timeout, device

    def request(self, request: Request) -> Reply | None:
        scalars = [request.kind, request.version, request.batch_size, request.iteration_s]
        send_message(scalars, request.payload, self.server, self.group, self.timeout, tag=request.worker)
        if request.kind == DONE:
            return None
        tag = request.worker
        (version, *_), tensors = recv_message(self.server, self.group, self.timeout, tag=tag, device=self.device)
        return Reply(tuple(tensors), int(version))


class Worker:
    """A worker's side of the protocol: tracks the version it pulled and its iteration time.

    Args:
        rank: This worker's global rank.
        client: Its link to the server.
    """

    def __init__(self, rank: int, client: Client) -> None:
        self.rank = rank
        self.client = client
        self.version = 0
        self.requests = 0
        self._since = time.perf_counter()

    def pull(self) -> tuple[Tensor, ...]:
        """The server's current state."""
        return self.call(PULL)

    def call(self, kind: int, payload: Sequence[Tensor] = (), batch_size: int = 0) -> tuple[Tensor, ...]:
        """Send a request of ``kind`` with ``payload``; returns the reply's tensors."""
        now = time.perf_counter()
        request = Request(self.rank, kind, to_host(payload), self.version, batch_size, now - self._since)
        reply = self.client.request(request)
        assert reply is not None
        self.requests += kind != PULL
        self.version = reply.version
        self._since = time.perf_counter()
        return reply.tensors

    def claim(self, payload: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """A :data:`~lightning_hier.algorithms.param_server.CLAIM` request; returns the reply's tensors.

        Unlike :meth:`call`, a claim leaves the pulled version (the staleness of the next push
        counts from the last pull, not from the claim) and the iteration clock alone.
        """
        request = Request(self.rank, CLAIM, tuple(payload), self.version)
        reply = self.client.request(request)
        assert reply is not None
        return reply.tensors

    def done(self) -> None:
        """Tell the server this worker has finished (after its last reply)."""
        self.client.request(Request(self.rank, DONE, (), self.version))


def connect(
    core_factory: Callable[[], ServerCore],
    group: Group,
    rank: int,
    server: int,
    timeout: timedelta,
    order: Sequence[int] | None = None,
) -> tuple[ParameterServer | None, Worker | None]:
    """Build this rank's side: the server (on ``server``, started) and this rank's :class:`Worker`.

    The server's rank gets a worker (calling in-process) when it is one of the core's workers,
    none when it only serves (a dedicated server rank).

    Args:
        core_factory: Called with no argument on the server's rank to build the :class:`ServerCore`.
        group: The dedicated process group.
        rank: This global rank.
        server: The server's global rank.
        timeout: See :class:`ParameterServer`.
        order: See :class:`ParameterServer`.
    """
    if rank == server:
        ps = ParameterServer(core_factory(), group, rank, timeout, order)
        ps.start()
        return ps, Worker(rank, LocalClient(ps)) if rank in ps.core.workers else None
    return None, Worker(rank, RemoteClient(server, group, timeout))
