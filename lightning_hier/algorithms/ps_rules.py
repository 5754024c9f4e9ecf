"""Update rules of the parameter server: ASGD and n-softsync over one flat gradient.

- :class:`AsgdHandler`: asynchronous SGD (Dean et al., "Large Scale Distributed Deep Networks",
  NeurIPS 2012): each pushed gradient is applied at once and the pusher gets the new weights.
  With ``staleness_lr`` the step of a gradient of staleness ``s`` uses ``lr / s`` (``s >= 1``;
  a fresh gradient keeps ``lr``), the staleness-aware rate of Zhang, Gupta, Lian and Liu
  ("Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016).
- :class:`SoftsyncHandler`: n-softsync (same paper): the server applies the average of every
  ``c = ceil(W / n)`` gradients it receives. A worker's reply waits for the update its gradient
  belongs to, so ``n = 1`` is synchronous SGD on the concatenated batches and ``n = W`` is ASGD.

A rule's state is a :class:`FlatModel`: the consensus parameters as views of one flat tensor and an
optimizer over them (plain SGD or a copy of the user's optimizer), so the wire carries one flat
gradient and one flat weight vector per message.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hier.algorithms.param_server import PULL, PUSH, Request, ServerContext
from lightning_hier.comm.flat import FlatTensors

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]


class FlatModel:
    """The server's copy of the parameters, as views of one flat tensor, and the optimizer that updates it.

    Args:
        params: Initial values (copied into host memory, where the server's messages arrive:
            :func:`~lightning_hier.comm.ps_wire.to_host`); one dtype.
        optimizer: Builds the server's optimizer over the copies (default: SGD with ``lr``).
        lr: Learning rate of the default SGD.
    """

    def __init__(self, params: Sequence[Tensor], optimizer: OptimizerFactory | None = None, lr: float = 0.1) -> None:
        self.params = [nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False) for p in params]
        self._flat = FlatTensors(self.params)
        if len(self._flat.buckets) != 1:
            raise ValueError("FlatModel: parameters must share one dtype and device.")
        self.optimizer = optimizer(self.params) if optimizer is not None else torch.optim.SGD(self.params, lr=lr)

    @property
    def flat(self) -> Tensor:
        """The parameters as one vector (a view: copy it before sending it while updates run)."""
        return self._flat.buckets[0]

    def step(self, grad: Tensor, lr_scale: float = 1.0) -> None:
        """One optimizer step with the flat gradient ``grad`` (the learning rates scaled by ``lr_scale``)."""
        for p, g in zip(self.params, self._flat.split([grad]), strict=True):
            p.grad = g
        with _scaled_lr(self.optimizer, lr_scale):
            self.optimizer.step()
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        # a copy: the optimizer's own state_dict shares its state tensors, which later steps change
        return {"flat": self.flat.clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flat.copy_(state["flat"])
        self.optimizer.load_state_dict(state["optimizer"])


@contextmanager
def _scaled_lr(optimizer: Optimizer, scale: float) -> Iterator[None]:
    if scale == 1.0:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * scale
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr


def _weights_reply(model: FlatModel) -> tuple[Tensor, ...]:
    return (model.flat.clone(),)  # a snapshot: the model moves on while the reply travels


class AsgdHandler:
    """ASGD: apply each pushed flat gradient at once; reply with the new weights.

    Args:
        model: The consensus parameters and their optimizer.
        staleness_lr: Scale the step of a gradient of staleness ``s >= 1`` by ``1 / s``.
    """

    def __init__(self, model: FlatModel, staleness_lr: bool = False) -> None:
        self.model = model
        self.staleness_lr = staleness_lr

    def handle(self, request: Request, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        if request.kind == PUSH:
            s = ctx.staleness(request)
            self.model.step(request.payload[0], 1.0 / s if self.staleness_lr and s > 1 else 1.0)
            ctx.applied([request])
        elif request.kind != PULL:
            raise ValueError(f"AsgdHandler: unknown request kind {request.kind} from worker {request.worker}.")
        return {request.worker: _weights_reply(self.model)}

    def flush(self, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        return {}  # nothing is ever deferred

    def consensus(self) -> list[Tensor]:
        return [self.model.flat]  # what a reply carries

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


class SoftsyncHandler(AsgdHandler):
    """n-softsync: apply the average of every ``ceil(W / n)`` pushed gradients.

    With ``n = 1`` (groups of all ``W`` workers) a worker's reply waits for the update its
    gradient joins: each group then holds exactly one gradient of every worker, and the run is
    synchronous SGD on the concatenated batches. With ``n > 1`` the reply is the current weights at
    once, as for Zhang et al.'s learners: a reply that waited for a smaller group could need a
    worker that already waits in a collective of the training loop (an epoch's end), a deadlock.
    The average weights each gradient by its batch size (uniform when sizes are not given, or with
    ``by_batch_size=False``: for gradients the workers already weighed, as DBS-SGD's). When
    every worker has finished (or every worker still training waits), the pending gradients are
    applied as a smaller group: every pushed gradient is applied exactly once.

    Args:
        model: The consensus parameters and their optimizer.
        workers: Number of workers ``W``.
        n: Softsync parameter in ``[1, W]``: ``n = 1`` synchronous, ``n = W`` asynchronous.
        staleness_lr: Scale an update's step by ``1 / mean staleness`` of its gradients (when > 1).
        by_batch_size: Weigh each gradient of a group by its batch size (else: the plain mean).
    """

    def __init__(
        self, model: FlatModel, workers: int, n: int, staleness_lr: bool = False, by_batch_size: bool = True
    ) -> None:
        super().__init__(model, staleness_lr)
        self.by_batch_size = by_batch_size
        if not 1 <= n <= workers:
            raise ValueError(f"SoftsyncHandler: `n` must be in [1, {workers}] (the number of workers), got {n}.")
        self.group_size = math.ceil(workers / n)
        self.blocking = self.group_size == workers
        self.pending: list[tuple[Request, Tensor]] = []

    @override
    def handle(self, request: Request, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        if request.kind == PULL:
            return {request.worker: _weights_reply(self.model)}
        if request.kind != PUSH:
            raise ValueError(f"SoftsyncHandler: unknown request kind {request.kind} from worker {request.worker}.")
        self.pending.append((request, request.payload[0].clone()))
        replies = self.flush(ctx) if len(self.pending) >= self.group_size else {}
        return replies if self.blocking else {request.worker: _weights_reply(self.model)}

    @override
    def flush(self, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        if not self.pending:
            return {}
        requests = [r for r, _ in self.pending]
        sizes = [float(r.batch_size) for r in requests]
        by_size = self.by_batch_size and all(b > 0 for b in sizes)
        weights = [b / sum(sizes) for b in sizes] if by_size else [1 / len(sizes)] * len(sizes)
        grad = torch.zeros_like(self.pending[0][1])
        for w, (_, g) in zip(weights, self.pending, strict=True):
            grad.add_(g, alpha=w)
        mean_s = sum(ctx.staleness(r) for r in requests) / len(requests)
        self.model.step(grad, 1.0 / mean_s if self.staleness_lr and mean_s > 1 else 1.0)
        ctx.applied(requests)
        self.pending = []
        if not self.blocking:
            return {}  # every worker of the group had its reply already
        reply = _weights_reply(self.model)
        return {r.worker: reply for r in requests}

    @override
    def state_dict(self) -> dict[str, Any]:
        # no pending gradient outlives a checkpoint: the strategies drain the server (every worker
        # sends DONE, which flushes the last group) before they save
        return {"model": self.model.state_dict(), "pending": len(self.pending)}
