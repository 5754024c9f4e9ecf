"""Asynchronous GRAWA: each worker meets a parameter server after its own ``tau`` steps.

GRAWA (Dimlioglu and Choromanska, AISTATS 2024) calls MGRAWA and LGRAWA asynchronous: in the
authors' setting a worker does not wait for the others at a round. Here, after its own ``tau``
local steps, a worker *reports* to the server (:mod:`lightning_hier.algorithms.ps_service`)
and pulls::

    worker w:  s_w = 1 / (EMA_w(n) + eps)^p            (its own norm probe and EMA, as in the lock-step form)
               send (x_w, s_w, lam)
    server:    X[w] = x_w ; S[w] = s_w                  (the latest replica and score of every worker)
               c = sum_v (S[v] / sum_u S[u]) X[v]       (over the workers that have reported; per tensor for LGRAWA)
               X[w] = X[w] + lam (c - X[w])             (the replica as worker w holds it after its pull)
               reply c
    worker w:  x_w <- x_w + lam (c - x_w)               (the pull of PeriodicAveraging)

A worker that has not reported yet has no score and carries no weight (its latest replica is
the initial model, which would drag the center back). The math is the lock-step form's:
:func:`~lightning_hier.algorithms.grawa.weigh_`, :func:`~lightning_hier.algorithms.grawa.normalise_weights`,
the worker's :meth:`~lightning_hier.algorithms.grawa.GradientWeightedCenter.local_scores` and the
shared round mechanism :class:`~lightning_hier.algorithms.averaging.PeriodicAveraging` (schedule,
pull, proximal pull, consensus, final round), which runs a policy with ``lock_step = False``
without collectives in its rounds.

The consensus model is the server's center of the latest replicas. Asking for it is a
collective point (validation, saving, end of fit): every worker first passes a barrier, so
every report made before it is in, and then every worker gets the same center. At the end of
fit a worker in a partial period reports its trained replica as it is (no pull) before that.
Messages carry at most four flat tensors, so a replica travels as one tensor per dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hier.algorithms.averaging import pull_
from lightning_hier.algorithms.centers import RoundContext
from lightning_hier.algorithms.grawa import (
    DEFAULT_BETA,
    GradientWeightedCenter,
    normalise_weights,
    segment_expansions,
    weigh_,
)
from lightning_hier.algorithms.param_server import PULL, Request, ServerContext
from lightning_hier.comm import FlatTensors

REPORT = 16
"""Request kind: a worker's round, payload ``(meta, *replica)``, ``meta = [scores..., lam, model norm]``."""
Exchange = Callable[[int, Sequence[Tensor]], tuple[Tensor, ...]]
"""A worker's link to the server: ``call(kind, payload) -> reply tensors`` (e.g. ``ps_service.Worker.call``)."""


def pack(buckets: Sequence[Tensor]) -> list[Tensor]:
    """The buckets as one flat tensor per dtype (in order of first appearance): a message's payload."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for b in buckets:
        by_dtype.setdefault(b.dtype, []).append(b.reshape(-1))
    return [torch.cat(parts) for parts in by_dtype.values()]


def unpack_into_(out: Sequence[Tensor], packed: Sequence[Tensor]) -> None:
    """Inverse of :func:`pack`: copy ``packed`` into buckets shaped (and typed) like ``out``."""
    order = list(dict.fromkeys(b.dtype for b in out))
    offsets = dict.fromkeys(order, 0)
    for b in out:
        flat = packed[order.index(b.dtype)]
        start = offsets[b.dtype]
        b.copy_(flat[start : start + b.numel()].view_as(b))
        offsets[b.dtype] = start + b.numel()


class GrawaServerHandler:
    """The server side of asynchronous GRAWA: the latest replica and score of every worker.

    A :class:`~lightning_hier.algorithms.param_server.Handler`: serves :data:`REPORT` (record,
    combine, record the pull, reply the center) and ``PULL`` (reply the center); never defers.
    Every report is one server update (its staleness: other workers' reports since this worker's
    previous reply).

    Args:
        template: The flat buckets of the model (every worker's are laid out alike); the initial
            replica of every worker.
        workers: Global ranks of the workers (row order of the weight table).
        variant: ``'model'`` (one weight per worker) or ``'layer'`` (one per worker and tensor).
    """

    def __init__(self, template: FlatTensors, workers: Sequence[int], variant: str) -> None:
        self.rows = {w: i for i, w in enumerate(workers)}
        # in host memory, where the reports arrive (ps_wire.to_host), whatever device trains
        self.replicas = [template.clone("cpu") for _ in workers]
        width = len(template.tensors) if variant == "layer" else 1
        self.expand = [(i.cpu(), n.cpu()) for i, n in segment_expansions(template)] if variant == "layer" else []
        self.scores = torch.zeros(len(workers), width, dtype=torch.float64)
        self.norms = torch.zeros(len(workers), dtype=torch.float64)
        self.reported = torch.zeros(len(workers), dtype=torch.bool)
        self.lock = threading.Lock()  # the server thread writes, a checkpoint on its rank reads

    def weights(self) -> Tensor:
        """``[W, L]``: the reporters' scores normalised per column; uniform before any report."""
        if not bool(self.reported.any()):
            return torch.full_like(self.scores, 1.0 / len(self.rows))
        return normalise_weights(self.scores * self.reported.unsqueeze(1))

    def center(self) -> tuple[Tensor, list[Tensor]]:
        """The weights and the weighted center of the latest replicas."""
        weights = self.weights()
        out = [torch.zeros_like(b) for b in self.replicas[0]]
        for i, replica in enumerate(self.replicas):
            if self.reported.any() and not self.reported[i]:
                continue
            part = [b.clone() for b in replica]
            weigh_(part, weights[i], self.expand)
            torch._foreach_add_(out, part)
        return weights, out

    def handle(self, request: Request, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        with self.lock:
            if request.kind == REPORT:
                self._record(request)
            elif request.kind != PULL:
                raise ValueError(f"GrawaServerHandler: unknown request kind {request.kind} from {request.worker}.")
            weights, center = self.center()
            if request.kind == REPORT:
                lam = float(request.payload[0][-2])
                pull_(self.replicas[self.rows[request.worker]], center, lam)  # what the worker now holds
                ctx.applied([request])
        meta = torch.cat([weights.reshape(-1), self.norms])
        return {request.worker: (meta, *pack(center))}

    def _record(self, request: Request) -> None:
        i = self.rows[request.worker]
        meta, *packed = request.payload
        self.scores[i] = meta[:-2].to(torch.float64)
        self.norms[i] = float(meta[-1])
        self.reported[i] = True
        unpack_into_(self.replicas[i], packed)

    def flush(self, ctx: ServerContext) -> dict[int, tuple[Tensor, ...]]:
        return {}  # every request is answered at once

    def consensus(self) -> list[Tensor]:
        with self.lock:
            return self.center()[1]

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "replicas": [[b.clone() for b in r] for r in self.replicas],
                "scores": self.scores.clone(),
                "norms": self.norms.clone(),
                "reported": self.reported.clone(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            for mine, saved in zip(self.replicas, state["replicas"], strict=True):
                torch._foreach_copy_(mine, saved)
            self.scores, self.norms = state["scores"].clone(), state["norms"].clone()
            self.reported = state["reported"].clone()


class AsyncGradientWeightedCenter(GradientWeightedCenter):
    """The worker side of asynchronous GRAWA: a round is this worker's report to the server.

    Args:
        variant: ``'model'`` or ``'layer'`` (see :class:`~lightning_hier.algorithms.grawa.GradientWeightedCenter`).
        beta: EMA decay of the norms, in [0, 1).
        eps: Added to the norm before inverting (> 0).
        p: Exponent of the inverse norm (> 0).
        norm: MGRAWA's model norm, ``'sum'`` or ``'l2'``.

    Call :meth:`connect` before the first round (the server needs the model's buckets, which the
    round mechanism builds).
    """

    lock_step = False

    def __init__(
        self, variant: str = "model", beta: float = DEFAULT_BETA, eps: float = 1e-8, p: float = 1.0, norm: str = "sum"
    ) -> None:
        super().__init__(variant, beta, eps, p, norm)
        self.call: Exchange | None = None
        self.barrier: Callable[[], None] = lambda: None

    def connect(self, call: Exchange, barrier: Callable[[], None]) -> None:
        """Give the link to the server and the barrier every worker passes before reading the consensus."""
        self.call, self.barrier = call, barrier

    @override
    def combine(self, out: list[Tensor], ctx: RoundContext) -> dict[str, Any]:
        if self.call is None:
            raise RuntimeError("AsyncGradientWeightedCenter: not connected to a parameter server (call connect()).")
        self._bind(ctx.flat, ctx.world)
        if ctx.fresh:
            scores, model_norm = self.local_scores(ctx)
            meta = torch.cat([scores.cpu(), torch.tensor([ctx.lam]), model_norm.cpu()]).to(torch.float64)
            payload = [meta, *pack(out)]
            reply = self.call(REPORT, payload)
        else:
            self.barrier()  # every report made before this point is in: every worker reads the same center
            payload = []
            reply = self.call(PULL, payload)
        meta, *packed = reply
        unpack_into_(out, packed)
        width = self.scores_width
        workers = meta.numel() // (width + 1)
        self.weights = meta[: workers * width].reshape(workers, width).to(torch.float64).cpu()
        ctx.stats.add(sum(t.numel() * t.element_size() for t in (*payload, *reply)))
        if not ctx.fresh:
            return {}
        return {"weights": self.weights.clone(), "grad_norms": meta[workers * width :].to(torch.float64).cpu()}

    @property
    def scores_width(self) -> int:
        """``L``: columns of the weight table (1 for MGRAWA)."""
        assert self.ema is not None
        return int(self.ema.m.numel())
