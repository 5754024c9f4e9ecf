"""Asynchronous GRAWA by hand: a single-process replay of a scripted arrival order, in plain torch.

Written from the formulas (docs/algorithms.md, "Asynchronous GRAWA"), independently of
``PeriodicAveraging`` and the server handler, so that both the in-process simulation and the
multi-process run under a real parameter server can be checked against it.

The workload: worker ``w`` trains ``nn.Linear(3, 2)`` (float64) with SGD on the MSE loss of its
own batches, ``batch(w, step)``, a round after every ``tau`` of its own steps; its norm probe is
the gradient of the step that closed the round (per tensor: weight, bias).
"""

from __future__ import annotations

import torch
from torch import Tensor

BETA, EPS, P = 0.5, 1e-8, 1.0
LR, LAM, RHO = 0.1, 0.5, 0.2


def initial_params() -> list[Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).double()
    return [lin.weight.detach().clone(), lin.bias.detach().clone()]


def batch(worker: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64) + worker  # workers disagree: the weights matter
    return x, y


def grads(params: list[Tensor], worker: int, step: int) -> list[Tensor]:
    w, b = (p.clone().requires_grad_(True) for p in params)
    x, y = batch(worker, step)
    loss = ((x @ w.T + b - y) ** 2).mean()
    return list(torch.autograd.grad(loss, [w, b]))


def replay(order: list[int], workers: int, tau: int, steps: int, variant: str) -> dict[str, list]:
    """Run the scripted rounds; every worker then finishes its ``steps`` and makes its final report.

    Returns each worker's final replica (before the consensus), the consensus and the weights
    every report got back (in order).
    """
    x = [initial_params() for _ in range(workers)]
    anchor = [initial_params() for _ in range(workers)]  # the last center each worker received
    m = [torch.zeros(2 if variant == "layer" else 1, dtype=torch.float64) for _ in range(workers)]
    r = [0] * workers
    done = [0] * workers
    last_norms: list[Tensor | None] = [None] * workers
    server_x = [initial_params() for _ in range(workers)]
    server_s: list[Tensor | None] = [None] * workers
    seen: list[Tensor] = []

    def local_steps(w: int, count: int) -> None:
        for _ in range(count):
            g = grads(x[w], w, done[w])
            x[w] = [p - LR * gi for p, gi in zip(x[w], g, strict=True)]
            x[w] = [p + RHO / tau * (a - p) for p, a in zip(x[w], anchor[w], strict=True)]
            last_norms[w] = torch.stack([gi.norm() for gi in g]).double()
            done[w] += 1

    def center() -> tuple[Tensor, list[Tensor]]:
        """``[W, L]`` weights (zero rows for workers that have not reported) and the center."""
        width = 2 if variant == "layer" else 1
        scores = torch.stack([s if s is not None else torch.zeros(width, dtype=torch.float64) for s in server_s])
        weights = scores / scores.sum(dim=0)
        c = []
        for t in range(2):  # tensor t takes column t (LGRAWA) or the one column (MGRAWA)
            column = weights[:, min(t, width - 1)]
            c.append(sum(column[v] * server_x[v][t] for v in range(workers)))
        return weights, c

    def report(w: int, lam: float) -> list[Tensor]:
        norms = last_norms[w]
        assert norms is not None
        n = norms if variant == "layer" else norms.sum().reshape(1)
        m[w] = BETA * m[w] + (1 - BETA) * n
        r[w] += 1
        server_s[w] = 1.0 / (m[w] / (1 - BETA ** r[w]) + EPS) ** P
        server_x[w] = [p.clone() for p in x[w]]
        weights, c = center()
        seen.append(weights)
        server_x[w] = [p + lam * (ci - p) for p, ci in zip(server_x[w], c, strict=True)]
        return c

    for w in order:
        local_steps(w, tau)
        c = report(w, LAM)
        x[w] = [p + LAM * (ci - p) for p, ci in zip(x[w], c, strict=True)]
        anchor[w] = c
    for w in range(workers):  # the rest of the fit (less than tau steps), then the final report, without a pull
        assert steps - done[w] < tau, "the order must script every full period"
        if steps > done[w]:
            local_steps(w, steps - done[w])
            report(w, 0.0)  # final reports commute: each only records its replica and score
    return {"replicas": x, "consensus": center()[1], "weights": seen}


class LibraryWorker:
    """One worker of the same workload built from the library's pieces (what the tests check against :func:`replay`).

    Args:
        worker: Its index (rank).
        variant: ``'model'`` or ``'layer'``.
        tau: Its period.
        group: The data-parallel group (``None`` in a single-process simulation).
    """

    def __init__(self, worker: int, variant: str, tau: int, group: object = None) -> None:
        from lightning_hier.algorithms import PeriodicAveraging
        from lightning_hier.algorithms.grawa_async import AsyncGradientWeightedCenter

        self.worker, self.done = worker, 0
        self.params = [torch.nn.Parameter(t) for t in initial_params()]
        self.policy = AsyncGradientWeightedCenter(variant, beta=BETA, eps=EPS, p=P)
        self.algo = PeriodicAveraging(self.params, group, self.policy, tau, lam=LAM, rho=RHO)  # type: ignore[arg-type]
        self.opt = torch.optim.SGD(self.params, lr=LR)

    def step(self):
        for p, g in zip(self.params, grads([p.detach() for p in self.params], self.worker, self.done), strict=True):
            p.grad = g
        self.opt.step()
        self.done += 1
        return self.algo.step()

    def replica(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.params]
