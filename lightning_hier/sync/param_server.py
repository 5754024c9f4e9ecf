"""Training through a parameter server on rank 0, as a :class:`~lightning_hier.sync.base.Sync`.

- ``asgd``: asynchronous SGD (Dean et al., NeurIPS 2012): every rank pushes its gradient, the
  server applies it at once and answers with the new weights; optional staleness-aware learning
  rate (Zhang, Gupta, Lian, Liu, IJCAI 2016).
- ``softsync``: n-softsync (same paper): the server applies the mean of every ``ceil(W / n)``
  pushed gradients; ``n = 1`` is synchronous SGD, ``n = W`` ASGD.

The mechanism is :mod:`lightning_hier.algorithms.param_server` and
:mod:`~lightning_hier.algorithms.ps_service`; one rank's side of it is
:class:`~lightning_hier.sync.ps_adapter.PSAdapter`. :class:`ServerSync` replaces each optimizer
step by a push of the gradient (times a weight: DBS's ``W b_w / B`` under ``dbs_async``).
:class:`ServerShards` is the allocation of a *dedicated* server: the training data split over the
workers only. The rule needs points where every rank meets (validation, checkpoints, the end of
training) to drain the server, so it runs under the Lightning strategies, not in a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.claim_sampler import SAMPLERS, ClaimQueue
from lightning_hier.algorithms.ps_link import SERVERS, served_workers
from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel, SoftsyncHandler
from lightning_hier.sync.base import Allocation, Binding, Sync
from lightning_hier.sync.ps_adapter import HandlerFactory, PSAdapter
from lightning_hier.sync.shared_queue import fetched_before_setup
from lightning_hier.topology import Topology

RULES = ("asgd", "softsync")


class ServerSync(Sync):
    """The worker side of a parameter server (see the module docstring).

    Args:
        rule: ``'asgd'`` or ``'softsync'``.
        n: n-softsync's ``n`` (``rule='softsync'``: required), an integer in ``[1, workers]``.
        staleness_lr: Divide a gradient's (or update's) learning rate by its staleness when > 1.
        server: ``'rank0'`` (rank 0 serves and trains) or ``'dedicated'`` (rank 0 only serves).
        shares: DBS's shares: each push weighs ``W b_w / B`` and softsync's mean is then plain.
        sampler: ``'split'`` or ``'shared'`` (claims from the server's queue; see
            :class:`~lightning_hier.sync.shared_queue.SharedQueue`).
        owner: The name in error messages.
    """

    lock_step = False  # the workers push and pull on their own; they meet only at collective points
    reporting = "sparse"  # the server's metrics every step: handed over at the logging cadence only

    def __init__(
        self,
        rule: str = "asgd",
        n: int | None = None,
        staleness_lr: bool = False,
        server: str = "rank0",
        shares: Any = None,
        sampler: str = "split",
        owner: str = "ServerSync",
    ) -> None:
        self.owner = owner
        self.rule = v.check_choice(owner, "rule", rule, RULES)
        self.staleness_lr = v.check_bool(owner, "staleness_lr", staleness_lr)
        self.server = v.check_choice(owner, "server", server, SERVERS)
        self.sampler = sampler = v.check_choice(owner, "sampler", sampler, SAMPLERS)
        if sampler == "shared" and self.server == "dedicated":
            raise ValueError(
                f"{owner}: argument `sampler`='shared' needs every rank to train (each claims its own batches), "
                "but server='dedicated' makes rank 0 only serve, in step with the workers; use server='rank0' "
                "or sampler='split'."
            )
        self.n = None if n is None and self.rule == "asgd" else v.check_int(owner, "n", n, minimum=1)
        if sampler == "shared" and self.n == 1:
            raise ValueError(
                f"{owner}: argument `n`=1 (synchronous) cannot run with sampler='shared': each reply waits for a "
                "gradient of every worker, and with a shared queue the workers' epochs end after different "
                "numbers of steps; use n >= 2 or sampler='split'."
            )
        self.shares = shares
        self.claims: Callable[[], ClaimQueue] | None = None
        """The server's shared queue of samples (set by a shared-queue allocation)."""
        self.ps: PSAdapter | None = None
        self._world = 0
        self._service_group: dist.ProcessGroup | None = None
        self._batch_samples = 0
        self._device = torch.device("cpu")
        self._settled = False  # finalized: every rank holds the server's model

    # ------------------------------------------------------------------ layout
    def num_workers(self, world: int) -> int:
        """Ranks that compute gradients: ``W``, or ``W - 1`` with a dedicated server."""
        return len(served_workers(world, self.server))

    @property
    def workers(self) -> list[int]:
        """The ranks that compute gradients (known once the layout is)."""
        return served_workers(self._world, self.server)

    @override
    def check_layout(self, topology: Topology) -> None:
        self._world = world = topology.world_size
        if self.server == "dedicated" and world < 2:
            raise ValueError(
                f"{self.owner}: argument `server`='dedicated' needs at least 2 ranks (rank 0 only serves), "
                f"got {world}; use server='rank0' or more devices."
            )
        workers = self.num_workers(world)
        if self.n is not None and self.n > workers:
            what = "the number of ranks" if self.server == "rank0" else "the number of ranks but rank 0, the server"
            raise ValueError(f"{self.owner}: argument `n` must be an integer in [1, {workers}] ({what}), got {self.n}.")

    # ------------------------------------------------------------------ a run of training
    def _handler(self) -> HandlerFactory:
        if self.rule == "asgd" and self.n is None:
            return _Asgd(self.staleness_lr)
        # DBS's pushes carry their weights already: the group's plain mean keeps them
        return _Softsync(self.n or 1, self.staleness_lr, by_batch_size=self.shares is None)

    @override
    def bind(self, binding: Binding) -> None:
        if len(binding.optimizers) != 1:
            raise ValueError(
                f"{self.owner}: the parameter server copies the one optimizer of the model onto rank 0; "
                f"configure_optimizers returned {len(binding.optimizers)}. Use one optimizer."
            )
        self._world = binding.topology.world_size
        if self._service_group is None:  # a collective: every rank sets up together, once
            self._service_group = binding.topology.build_service_group(binding.timeout)
        self.ps = PSAdapter(
            binding.module,
            binding.optimizers[0],
            self._handler(),
            self._service_group,
            binding.rank,
            self._world,
            binding.timeout,
            binding.stats,
            self.server,
            self.claims,
        )
        self._batch_samples = 0
        self._device = next(iter(binding.module.parameters()), torch.zeros(())).device
        self._settled = False

    @property
    def serves_only(self) -> bool:
        """This rank is the dedicated server: no gradients, no pushes."""
        return self.ps is not None and self.ps.serves_only

    @property
    def running(self) -> bool:
        """Whether the server is serving this rank (training is under way)."""
        return self.ps is not None and self.ps.running

    @override
    def batch_started(self, batch: Any) -> None:
        self._settled = False
        if self.ps is not None:
            self.ps.start()  # (again) after a validation, a checkpoint or the end of an earlier fit
        self._batch_samples += batch_size_of(batch)  # a batch of no tensor: 0 (softsync then weighs uniformly)

    @override
    def training_step(self, run: Callable[[], Any]) -> Any:
        if not self.serves_only:
            return run()
        # the dedicated server rank: the module's step runs for its logs (a `sync_dist` log or a
        # torchmetrics sync is a collective every rank must join), without a graph; no gradient
        with torch.no_grad():
            output = run()
        zero = torch.zeros((), device=self._device, requires_grad=True)
        if isinstance(output, dict):
            return {**output, "loss": zero}
        return zero if output is not None else None

    @override
    def run_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        ps = self.ps
        assert ps is not None, "bind() first"
        try:
            if ps.serves_only:
                return ps.step_through_server(optimizer, step, ps.keep_pace)
            return ps.step_through_server(optimizer, step, lambda: ps.push(self._push_weight(), self._batch_samples))
        finally:
            self._batch_samples = 0

    def _push_weight(self) -> float:
        """``W b_w / B`` under DBS's shares (equal shares: 1), else 1."""
        if self.shares is None:
            return 1.0
        return self._world * self.shares.step_share

    @override
    def after_step(self, optimizer: Optimizer) -> dict[str, float]:
        return self.ps.stats() if self.ps is not None else {}

    @contextmanager
    @override
    def consensus(self) -> Iterator[None]:
        if self.ps is None or self._settled:  # after finalize every rank holds the server's model already
            yield
            return
        with self.ps.consensus():
            yield

    @override
    def finalize(self) -> dict[str, float]:
        if self.ps is not None:
            self.ps.drain()
            self.ps.load_consensus()
            # nothing to broadcast until training goes on; after fit the module may even be on the
            # CPU (Lightning's teardown), which an NCCL broadcast could not send
            self._settled = True
        return {}

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.ps is None:
            return {}
        self.ps.drain()  # saving is a collective: every worker reaches it
        return self.ps.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ps is not None:
            self.ps.load_state_dict(state)

    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim ``n`` samples of ``epoch`` from the server's queue: ``(start, count)``."""
        ps = self.ps  # looked up at each claim: the loader may be built before the server (an LR schedule)
        if ps is None:
            raise fetched_before_setup(self.owner)
        return ps.claim(epoch, n, num_samples, speed)


class _Asgd:
    """ASGD's update rule on the server (picklable, unlike a closure)."""

    def __init__(self, staleness_lr: bool) -> None:
        self.staleness_lr = staleness_lr

    def __call__(self, model: FlatModel, workers: int) -> AsgdHandler:
        return AsgdHandler(model, self.staleness_lr)


class _Softsync:
    """n-softsync's update rule on the server."""

    def __init__(self, n: int, staleness_lr: bool, by_batch_size: bool) -> None:
        self.n, self.staleness_lr, self.by_batch_size = n, staleness_lr, by_batch_size

    def __call__(self, model: FlatModel, workers: int) -> SoftsyncHandler:
        if self.by_batch_size:
            return SoftsyncHandler(model, workers, self.n, self.staleness_lr)
        return SoftsyncHandler(model, workers, self.n, by_batch_size=False)


class ServerShards(Allocation):
    """The training data of a dedicated server's run: split over the workers, rank 0 sharing the first shard.

    Rank 0 then runs ``training_step`` without gradients on the first worker's batches (for its
    logs only), so every training sample is learnt from exactly once. Other stages: every rank.
    """

    @override
    def sampler_kwargs(self, topology: Topology, rank: int, training: bool) -> dict[str, int]:
        if not training:
            return super().sampler_kwargs(topology, rank, training)
        return {"num_replicas": topology.world_size - 1, "rank": max(rank - 1, 0)}


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (0 when it holds none)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 0
