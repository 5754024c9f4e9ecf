"""A single-process reference of the two-level rules: 2 nodes x 2 workers simulated in one process.

Written from the rules (docs/algorithms.md, "Two levels"), not from lightning_hier's classes:
every worker keeps its own module and optimizer; the rules act on flat parameter vectors.
Worker ``w`` lives on node ``w // PER`` with local index ``w % PER`` (the layout of
``Trainer(devices=PER, num_nodes=NODES)``).

- Local SGD, ``intra_node='window'``: every ``tau`` steps the node's replicas become their
  mean; every ``m``-th time every replica becomes the mean of the node means.
- GRAWA (MGRAWA, norm 'sum'), ``'window'``: a node round pulls toward the node's center
  weighted by inverse EMA gradient norms (the node level's own EMA); every ``m``-th round is a
  flat round over all workers (the whole-job level's EMA).
- HPSGD (eager merge), ``'window'``: flat HPSGD inside each node; at every ``m``-th node merge
  ``G += F / N`` for the cross-node sum ``F`` launched ``m`` merges before, the node model, the
  replicas and their window starts shift by ``F / N - D``, and ``D = S_n - G`` is sent.
- ``intra_node='step'``: gradients averaged in the node every step; the flat rule over the
  workers with the same local index, every ``m`` windows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

NODES, PER = 2, 2
W = NODES * PER
Batch = tuple[Tensor, Tensor]


def node_of(w: int) -> list[int]:
    n = w // PER
    return list(range(n * PER, (n + 1) * PER))


def across_of(w: int) -> list[int]:
    return list(range(w % PER, W, PER))


class Workers:
    """``W`` modules with their optimizers, trained one step at a time on their own batches."""

    def __init__(
        self,
        make_module: Callable[[], nn.Module],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        loss: Callable[[nn.Module, Batch], Tensor],
        batch: Callable[[int, int], Batch],
    ) -> None:
        self.modules = [make_module() for _ in range(W)]
        self.opts = [make_optimizer(m) for m in self.modules]
        self.loss, self.batch = loss, batch

    def step(self, step: int, ddp_in_node: bool) -> None:
        for w, (m, opt) in enumerate(zip(self.modules, self.opts, strict=True)):
            opt.zero_grad()
            self.loss(m, self.batch(w, step)).backward()
        if ddp_in_node:  # mean of the node's gradients, before any optimizer step
            grads = [[p.grad.clone() for p in m.parameters()] for m in self.modules]
            for w, m in enumerate(self.modules):
                for i, p in enumerate(m.parameters()):
                    p.grad.copy_(sum(grads[v][i] for v in node_of(w)) / PER)
        for opt in self.opts:
            opt.step()

    def x(self, w: int) -> Tensor:
        return parameters_to_vector(self.modules[w].parameters()).detach().clone()

    def set(self, w: int, value: Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(value.clone(), self.modules[w].parameters())

    def grad_norm_sum(self, w: int) -> float:
        """MGRAWA's model norm, norm='sum': the sum of the per-tensor gradient norms."""
        return float(sum(p.grad.double().norm() for p in self.modules[w].parameters()))


def mean(xs: list[Tensor]) -> Tensor:
    return sum(xs[1:], xs[0].clone()) / len(xs)


# ---------------------------------------------------------------------------------- Local SGD
def _periodic(
    workers: Workers,
    steps: int,
    tau: int,
    m: int,
    intra_node: str,
    round_: Callable[[bool], list[Tensor]],
    final: Callable[[], object],
) -> list[list[Tensor]]:
    """The schedule of both averaging rules; replicas after every step, the last entry after the end of fit.

    ``round_(across)`` runs one round and returns every worker's center; ``final()`` is the
    whole-job round of a fit that ends mid-period or after a node round. Right after a whole-job
    round every replica becomes that round's center.
    """
    out, since, rounds, last_across = [], 0, 0, True
    period = tau * m if intra_node == "step" else tau
    centers: list[Tensor] = []
    for step in range(steps):
        workers.step(step, intra_node == "step")
        since += 1
        if since == period:
            since = 0
            across = intra_node == "step" or (rounds + 1) % m == 0
            centers = round_(across)
            rounds, last_across = rounds + 1, across
        out.append([workers.x(w) for w in range(W)])
    if since or not last_across:
        final()
    elif centers:
        for w in range(W):
            workers.set(w, centers[w])
    out.append([workers.x(w) for w in range(W)])
    return out


def local_sgd(workers: Workers, steps: int, tau: int, m: int, intra_node: str) -> list[list[Tensor]]:
    """Local SGD on two levels (every replica becomes its round's mean)."""
    return _periodic(
        workers,
        steps,
        tau,
        m,
        intra_node,
        lambda across: _uniform_round(workers, across),
        lambda: _uniform_round(workers, True),
    )


def _uniform_round(workers: Workers, across: bool) -> list[Tensor]:
    xs = [workers.x(w) for w in range(W)]
    node_means = [mean([xs[v] for v in node_of(w)]) for w in range(W)]
    centers = [mean([node_means[v] for v in across_of(w)]) if across else node_means[w] for w in range(W)]
    for w in range(W):
        workers.set(w, centers[w])
    return centers


# ---------------------------------------------------------------------------------- GRAWA
class _Ema:
    def __init__(self, beta: float) -> None:
        self.beta, self.m, self.r = beta, [0.0] * W, [0] * W

    def score(self, w: int, norm: float, eps: float) -> float:
        self.m[w] = self.m[w] * self.beta + (1 - self.beta) * norm
        self.r[w] += 1
        nh = self.m[w] / (1 - self.beta ** self.r[w])
        return 1.0 / (nh + eps)


def grawa(
    workers: Workers, steps: int, tau: int, m: int, intra_node: str, lam: float, beta: float, eps: float = 1e-8
) -> list[list[Tensor]]:
    """MGRAWA (p = 1, norm 'sum', probe = the step's gradients, rho = 0) on two levels."""
    node_ema, job_ema = _Ema(beta), _Ema(beta)

    def round_(across: bool) -> list[Tensor]:
        return _grawa_round(workers, job_ema if across else node_ema, across, intra_node, lam, eps)

    # the final round: the whole job's level, every replica becomes c
    return _periodic(
        workers, steps, tau, m, intra_node, round_, lambda: _grawa_round(workers, job_ema, True, intra_node, 1.0, eps)
    )


def _grawa_round(workers: Workers, ema: _Ema, across: bool, intra_node: str, lam: float, eps: float) -> list[Tensor]:
    """One round; returns every worker's center ``c``."""
    xs = [workers.x(w) for w in range(W)]
    centers = []
    scores = [ema.score(w, workers.grad_norm_sum(w), eps) for w in range(W)]
    for w in range(W):
        # 'step': the rule over the workers with the same local index; 'window': the node or everyone
        group = across_of(w) if intra_node == "step" else (list(range(W)) if across else node_of(w))
        total = sum(scores[v] for v in group)
        c = sum(torch.tensor(scores[v] / total, dtype=torch.float64).float() * xs[v] for v in group)
        workers.set(w, xs[w] + lam * (c - xs[w]))
        centers.append(c)
    return centers


# ---------------------------------------------------------------------------------- HPSGD
def hpsgd(workers: Workers, steps: int, window: int, m: int, intra_node: str) -> list[list[Tensor]]:
    """HPSGD (eager merge, fixed windows, no outer optimizer) on two levels; replicas after every step."""
    if intra_node == "step":  # flat HPSGD over the workers of one local index, window m * H
        groups, window, m = [across_of(w) for w in range(W)], window * m, 0
    else:
        groups = [node_of(w) for w in range(W)]
    x0 = workers.x(0)
    S = [x0.clone() for _ in range(W)]  # the group model (node model), per worker
    V = [x0.clone() for _ in range(W)]
    G = [x0.clone() for _ in range(W)]  # the job's model (two levels)
    D = [torch.zeros_like(x0) for _ in range(W)]
    fly: list[Tensor] | None = None  # the deltas in flight, per worker
    inter: list[Tensor] | None = None  # the cross-node sums in flight, per worker
    since, merges, out = 0, 0, []
    for step in range(steps):
        workers.step(step, intra_node == "step")
        since += 1
        if fly is None:  # the first launch: the first step's change
            fly = [workers.x(w) - S[w] for w in range(W)]
            V = [workers.x(w) for w in range(W)]
            since = 0
        elif since == window:
            d = [workers.x(w) - V[w] for w in range(W)]
            for w in range(W):
                S[w] = S[w] + sum(fly[v] for v in groups[w]) / len(groups[w])
                workers.set(w, S[w] + d[w])
                V[w] = workers.x(w)
            fly, since, merges = d, 0, merges + 1
            if m and merges % m == 0:
                inter = _across(workers, S, V, G, D, inter)
        out.append([workers.x(w) for w in range(W)])
    # end of fit: merge the in-flight window and the steps since
    assert fly is not None
    d = [workers.x(w) - V[w] for w in range(W)]
    for w in range(W):
        S[w] = S[w] + sum(fly[v] for v in groups[w]) / len(groups[w])
        if since:
            S[w] = S[w] + sum(d[v] for v in groups[w]) / len(groups[w])
        workers.set(w, S[w])
        V[w] = S[w].clone()
    if intra_node == "window":
        _across(workers, S, V, G, D, inter, send=False)
        finals = [mean([workers.x(v) for v in across_of(w)]) for w in range(W)]
        for w in range(W):
            workers.set(w, finals[w])
    out.append([workers.x(w) for w in range(W)])
    return out


def _across(
    workers: Workers,
    S: list[Tensor],
    V: list[Tensor],
    G: list[Tensor],
    D: list[Tensor],
    inter: list[Tensor] | None,
    send: bool = True,
) -> list[Tensor] | None:
    """The cross-node merge: apply the sum in flight (shift S, x, V), then send D = S - G."""
    if inter is not None:
        for w in range(W):
            avg = inter[w] / NODES
            G[w] = G[w] + avg
            shift = avg - D[w]
            S[w], V[w] = S[w] + shift, V[w] + shift
            workers.set(w, workers.x(w) + shift)
    if not send:
        return None
    for w in range(W):
        D[w] = S[w] - G[w]
    return [sum(D[v] for v in across_of(w)) for w in range(W)]
