"""The parameter server of asynchronous GRAWA rounds, for the averaging rule: start, checkpoint state.

Every rank builds the dedicated service group (a collective, once, at set-up), rank 0 starts
the serving thread (and trains too), every rank gets its :class:`~lightning_hier.algorithms.ps_service.Worker`.
The server serves while the ranks train; at every point where they meet in a collective
(validation, checkpoints, the end of fit), right after reading the consensus, every rank pauses
it and the next training batch resumes it, as in the parameter-server strategies
(:class:`~lightning_hier.algorithms.ps_link.ServerLink`, shared with :mod:`lightning_hier.sync.param_server`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_hier.algorithms.claim_sampler import ClaimQueue
from lightning_hier.algorithms.grawa_async import GrawaServerHandler
from lightning_hier.algorithms.param_server import ServerCore
from lightning_hier.algorithms.ps_link import SERVER_RANK, ServerLink
from lightning_hier.comm import FlatTensors
from lightning_hier.topology import Topology


class AsyncRounds(ServerLink):
    """This rank's side of the asynchronous rounds: its link to GRAWA's server (on rank 0).

    Pausing and resuming are :class:`~lightning_hier.algorithms.ps_link.ServerLink`'s; this adds
    the start-up and restoring the server's table from a checkpoint.
    """

    @classmethod
    def start(
        cls,
        topology: Topology,
        flat: FlatTensors,
        variant: str,
        timeout: timedelta,
        claims: Callable[[], ClaimQueue] | None = None,
    ) -> AsyncRounds:
        """Build the service group and connect (a collective on every rank); rank 0 starts serving.

        Args:
            topology: The run's layout (every rank is a data-parallel worker).
            flat: This rank's flat parameter buckets (the server's template and initial replicas).
            variant: GRAWA's ``'model'`` or ``'layer'``.
            timeout: Longest silence of a worker, and longest wait for a reply.
            claims: Builds the server's shared queue of samples (``sampler='shared'``; ``None``: none).
        """
        group = topology.build_service_group(timeout)
        workers = list(range(topology.world_size))

        def core() -> ServerCore:
            queue = claims() if claims is not None else None
            return ServerCore(GrawaServerHandler(flat, workers, variant), workers, claims=queue)

        return cls.connect(core, group, dist.get_rank(), SERVER_RANK, timeout)

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore the server's table from a checkpoint (rank 0; before any worker reports)."""
        if self.server is not None:
            with self.server.lock:
                self.server.core.load_state_dict(state)
