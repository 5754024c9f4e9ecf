"""One rank's side of a parameter-server run, shared by ``asgd``, ``softsync`` and ``dbs_async``.

:class:`PSAdapter` connects a Lightning module and its optimizer to the service of
:mod:`lightning_hier.algorithms.ps_service`:

- **Step.** The strategy's optimizer step runs Lightning's closure (forward, backward, clipping:
  everything Lightning does before ``optimizer.step``) through a stand-in for the optimizer's
  ``step``; instead of updating locally, the rank pushes its flat gradient (times a weight) and
  loads the weights of the reply. The server's optimizer is a copy of the user's (same class,
  same parameter groups and hyperparameters); each step on rank 0 copies rank 0's current
  learning rates into it, so a learning-rate schedule applies on the server.
- **Lifecycle.** The server (a thread of rank 0) starts with the first training batch; at every
  point where the ranks meet in a collective (validation, checkpoints, the end of fit) every
  worker first sends ``DONE`` and rank 0 waits for the server to drain, so every pushed gradient
  is applied exactly once and no rank waits on a reply that needs a rank already in the
  collective. The next training batch starts it again.
- **Consensus.** The server's parameters (and rank 0's buffers, e.g. BatchNorm statistics) are
  broadcast into every rank's module for validation and saving, and left there after fit.
- **Dedicated server** (``server='dedicated'``). Rank 0 only serves: the workers are ranks
  ``1..W-1``. Rank 0 still runs Lightning's loop with as many steps as the workers (so every
  collective point lines up), but instead of pushing it *keeps pace*: its step ``k`` waits until the
  server has applied ``k`` gradients of every worker, then sets the server's learning rate from its
  own schedule and loads the server's model (:meth:`PSAdapter.keep_pace`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hier.algorithms.claim_sampler import ClaimQueue
from lightning_hier.algorithms.param_server import PUSH, Handler, ServerCore
from lightning_hier.algorithms.ps_link import SERVER_RANK, ServerLink, require_worker, served_workers
from lightning_hier.algorithms.ps_rules import FlatModel
from lightning_hier.algorithms.ps_service import ParameterServer
from lightning_hier.comm import CommStats, broadcast_

PACE_POLL_S = 0.002
"""How often a dedicated server rank looks at the count of applied gradients (see :meth:`PSAdapter.keep_pace`)."""
HandlerFactory = Callable[[FlatModel, int], Handler]
"""Builds the update rule from the server's model and the number of workers."""


def copy_optimizer(optimizer: Optimizer, module: nn.Module) -> Callable[[list[nn.Parameter]], Optimizer]:
    """A factory of the user's optimizer over other tensors laid out like ``module.parameters()``."""
    index = {id(p): i for i, p in enumerate(module.parameters())}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError("parameter server: the optimizer holds a tensor that is not a module parameter.")

    def build(params: list[nn.Parameter]) -> Optimizer:
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [params[index[id(p)]] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        return type(optimizer)(groups, **_constructor_defaults(optimizer))

    return build


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes back.

    ``defaults`` can hold keys the class sets itself: torch's ``AdamW`` stores
    ``decoupled_weight_decay=True`` there but does not accept it as an argument. Every parameter
    group already carries every hyperparameter, so leaving such a key out changes nothing.
    """
    signature = inspect.signature(type(optimizer).__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in signature.parameters}


class PSAdapter:
    """The parameter-server side of one rank (see the module docstring).

    Args:
        module: The LightningModule (its parameters are the model).
        optimizer: The user's optimizer (its class and hyperparameters are copied to the server).
        handler: Builds the update rule on rank 0.
        group: The dedicated service group.
        rank: This global rank.
        world: Number of ranks.
        timeout: See :class:`~lightning_hier.algorithms.ps_service.ParameterServer`.
        stats: Communication accounting: bytes pushed, and the wait for each reply counted as
            blocked time (so DBS's speed measurement leaves it out).
        server: ``'rank0'`` (rank 0 serves and trains: every rank is a worker) or ``'dedicated'``
            (rank 0 only serves; see the module docstring).
        claims: Builds the server's shared queue of samples on rank 0 (``None``: none; see
            :meth:`claim`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        handler: HandlerFactory,
        group: dist.ProcessGroup,
        rank: int,
        world: int,
        timeout: timedelta,
        stats: CommStats | None = None,
        server: str = "rank0",
        claims: Callable[[], ClaimQueue] | None = None,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self._claims = claims
        self.workers = served_workers(world, server)
        self.comm_stats = stats if stats is not None else CommStats()
        self.params = list(module.parameters())
        self.rank, self.world, self.group, self.timeout = rank, world, group, timeout
        self.link: ServerLink | None = None
        """Connected at the first :meth:`start`; paused at every :meth:`drain`."""
        self._handler = handler
        self._core: ServerCore | None = None
        self._restored: dict[str, Any] | None = None
        self._model: FlatModel | None = None
        self._paced = 0  # contributions rank 0 (serving only) has waited for so far

    @property
    def server(self) -> ParameterServer | None:
        """The server (rank 0, once connected)."""
        return self.link.server if self.link is not None else None

    @property
    def running(self) -> bool:
        """Whether the server is serving this rank (between :meth:`start` and :meth:`drain`)."""
        return self.link is not None and self.link.serving

    def _build_core(self) -> ServerCore:
        if self._core is None:
            self._model = FlatModel(self.params, copy_optimizer(self.optimizer, self.module))
            claims = self._claims() if self._claims is not None else None
            self._core = ServerCore(self._handler(self._model, len(self.workers)), self.workers, claims=claims)
            if self._restored is not None:
                self._core.load_state_dict(self._restored)
                self._restored = None
        return self._core

    def start(self) -> None:
        """Start serving (rank 0) and pull the server's model (every rank); a no-op while running."""
        if self.running:
            return
        if self.link is None:
            self.link = ServerLink.connect(self._build_core, self.group, self.rank, SERVER_RANK, self.timeout)
            if self.server is not None:
                self._paced = self.server.core.stats.applied  # restored from a checkpoint, or 0
        else:
            self.link.resume()
        if self.link.worker is None:  # rank 0, serving only
            assert self.server is not None
            self._load(self.server.consensus()[0])
        else:
            self._load(self.link.worker.pull()[0])

    @property
    def serves_only(self) -> bool:
        """This rank is a dedicated server: it neither computes gradients nor pushes."""
        return self.rank not in self.workers

    def _load(self, flat: Tensor) -> None:
        flat = flat.to(self.params[0].device)
        offset = 0
        with torch.no_grad():
            for p in self.params:  # in place: the parameters keep their storage (views, optimizer state)
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def push(self, weight: float, batch_size: int) -> None:
        """Push this rank's gradient times ``weight`` and load the reply's weights."""
        assert self.link is not None and self.running, "start() first"
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().reshape(-1) for g in grads])
        if weight != 1.0:
            flat.mul_(weight)
        if self.server is not None:
            self._follow_learning_rate()
        self.comm_stats.add(flat.numel() * flat.element_size())
        with self.comm_stats.blocked():
            reply = require_worker(self.link).call(PUSH, [flat], batch_size=batch_size)[0]
        self._load(reply)

    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim the next ``n`` samples of ``epoch`` from the server's shared queue: ``(start, count)``.

        Called by the training sampler (:class:`~lightning_hier.algorithms.claim_sampler.ClaimBatchSampler`)
        when Lightning fetches a batch, which may be before the first training batch or after a
        pause (validation, a checkpoint): the server is (re)started first. See
        :meth:`~lightning_hier.algorithms.ps_link.ServerLink.claim`.
        """
        self.start()
        assert self.link is not None  # start() connected it
        with self.comm_stats.blocked():
            return self.link.claim(epoch, n, num_samples, speed)

    def keep_pace(self) -> None:
        """Rank 0 serving only: hand the server this step's learning rate, wait for the step, load.

        Every worker contributes one gradient per step, so rank 0's step ``k`` waits until ``k``
        times the number of workers have been applied (counted from the start of this fit). Rank 0
        thus stays at most a step ahead of the slowest worker, and its logs come at the workers'
        cadence. Its learning rate for step ``k`` is handed to the server before the wait, so the
        gradients of step ``k`` use it, except one pushed before rank 0 reached step ``k`` (a
        worker running ahead), which gets step ``k - 1``'s: a schedule is followed up to that race.

        Raises:
            Exception: The serving thread's error (e.g. a :class:`~lightning_hier.comm.p2p.PeerError`
                naming a silent worker).
            TimeoutError: The count is not reached within twice ``timeout`` (the server names a
                silent worker within ``timeout``: this only guards against a hung server).
        """
        server = self.server
        assert server is not None and self.serves_only and self.running
        self._follow_learning_rate()
        self._paced += len(self.workers)
        limit = 2 * self.timeout.total_seconds() + 1
        deadline = time.monotonic() + limit
        while True:
            if server.error is not None:
                raise server.error
            with server.lock:
                applied = server.core.stats.applied
            if applied >= self._paced:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"lightning_hier parameter server (rank {self.rank}): {applied} of {self._paced} gradients "
                    f"applied after {limit:g} s."
                )
            time.sleep(PACE_POLL_S)
        self._load(server.consensus()[0])

    def step_through_server(self, optimizer: Optimizer, run_step: Callable[[], Any], push: Callable[[], None]) -> Any:
        """Run Lightning's optimizer step ``run_step`` with ``optimizer.step`` replaced by closure + ``push``.

        Lightning's closure (forward, backward, clipping: all it does before ``optimizer.step``)
        runs as usual; the server, not this rank, updates the model.
        """

        def push_instead_of_step(closure: Callable[[], Any] | None = None, **_: Any) -> Any:
            assert closure is not None
            loss = closure()
            push()
            return loss

        optimizer.step = push_instead_of_step  # type: ignore[method-assign]
        try:
            return run_step()
        finally:
            del optimizer.step  # the class's step again

    def _follow_learning_rate(self) -> None:
        assert self.server is not None and self._model is not None
        with self.server.lock:
            for mine, theirs in zip(self.optimizer.param_groups, self._model.optimizer.param_groups, strict=True):
                theirs["lr"] = mine["lr"]

    def drain(self) -> None:
        """Every worker says ``DONE``; rank 0 waits until the server applied everything (while running)."""
        if self.link is not None:
            self.link.pause()

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Drain, then hold the server's model in every rank's module (a collective); restore after."""
        saved = [t.detach().clone() for t in self._tensors()]
        self.drain()
        self.load_consensus()
        try:
            yield
        finally:
            with torch.no_grad():
                for t, s in zip(self._tensors(), saved, strict=True):
                    t.copy_(s)

    def load_consensus(self) -> None:
        """Broadcast the server's parameters and rank 0's buffers into every rank's module (drained)."""
        if self.server is not None:
            self._load(self.server.consensus()[0])
        with torch.no_grad():
            broadcast_([t.data for t in self._tensors()], src=SERVER_RANK, group=dist.group.WORLD)

    def _tensors(self) -> list[Tensor]:
        return self.params + list(self.module.buffers())

    def stats(self) -> dict[str, float]:
        """The server's staleness and per-worker metrics (rank 0; empty elsewhere)."""
        return self.link.metrics() if self.link is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """The server's state on rank 0 (drained first: call at a collective point); empty elsewhere."""
        if self.rank != SERVER_RANK:
            return {}
        if self.server is not None:
            return self.server.state_dict()
        return self._build_core().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rank == SERVER_RANK and state:
            self._restored = state  # applied when the server is built, at the first training batch
