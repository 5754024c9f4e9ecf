"""The parameter server of asynchronous GRAWA rounds, for the strategy: start, checkpoint state, stop.

Every rank builds the dedicated service group (a collective, once, at set-up), rank 0 starts
the serving thread (and trains too), every rank gets its :class:`~lightning_hier.algorithms.ps_service.Worker`.
The server serves while the ranks train: at every point where they meet in a collective
(validation, checkpoints, the end of fit), right after reading the consensus, every rank tells the
server it is done (:meth:`AsyncRounds.pause`) and rank 0 waits until it stopped, so a long
validation never counts as a silent worker; the next training batch starts it again
(:meth:`AsyncRounds.resume`), as the parameter-server strategies do (``strategies/_ps_adapter.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_hier.algorithms.grawa_async import GrawaServerHandler
from lightning_hier.algorithms.param_server import ServerCore
from lightning_hier.algorithms.ps_service import ParameterServer, Worker, connect
from lightning_hier.comm import FlatTensors
from lightning_hier.topology import Topology

SERVER_RANK = 0


@dataclass
class AsyncRounds:
    """This rank's side of the asynchronous rounds: the server (rank 0 only) and its worker link."""

    server: ParameterServer | None
    worker: Worker
    timeout: timedelta
    stopped: bool = False

    @classmethod
    def start(cls, topology: Topology, flat: FlatTensors, variant: str, timeout: timedelta) -> AsyncRounds:
        """Build the service group and connect (a collective on every rank); rank 0 starts serving.

        Args:
            topology: The run's layout (every rank is a data-parallel worker).
            flat: This rank's flat parameter buckets (the server's template and initial replicas).
            variant: GRAWA's ``'model'`` or ``'layer'``.
            timeout: Longest silence of a worker, and longest wait for a reply.
        """
        group = topology.build_service_group(timeout)
        rank, workers = dist.get_rank(), list(range(topology.world_size))

        def core() -> ServerCore:
            return ServerCore(GrawaServerHandler(flat, workers, variant), workers)

        server, worker = connect(core, group, rank, SERVER_RANK, timeout)
        return cls(server, worker, timeout)

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore the server's table from a checkpoint (rank 0; before any worker reports)."""
        if self.server is not None:
            with self.server.lock:
                self.server.core.load_state_dict(state)

    def pause(self) -> None:
        """Tell the server this rank is done for now; rank 0 waits for every rank (a no-op when paused)."""
        if self.stopped:
            return
        self.worker.done()
        self.stopped = True
        if self.server is not None:
            # the other ranks send DONE right after the same consensus: allow them the silence limit
            self.server.join(2 * self.timeout.total_seconds() + 5)

    def resume(self) -> None:
        """Serve again (rank 0) after :meth:`pause`; a no-op while serving."""
        if self.stopped and self.server is not None:
            self.server.start()
        self.stopped = False

    def metrics(self) -> dict[str, float]:
        """Staleness of the reports, reports applied, per-rank iteration time (rank 0; empty elsewhere)."""
        return self.server.core.stats.summary() if self.server is not None else {}
