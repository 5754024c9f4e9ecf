"""Flatness of a minimum: the Hessian trace (Hutchinson) and the top Hessian eigenvalue (power iteration).

GRAWA (Dimlioglu and Choromanska, AISTATS 2024) claims flatter optima than its baselines and
reports, as the authors' code does (after PyHessian, Yao et al. 2020), two numbers of the loss
Hessian ``H`` at the trained weights:

- ``tr(H)`` by Hutchinson's estimator, ``E_v[v^T H v] = tr(H)`` for Rademacher probes ``v``
  (entries +-1): each probe costs one Hessian-vector product;
- the top eigenvalue by power iteration, ``v <- H v / ||H v||``, ``lambda = v^T H v``. It
  converges to the eigenvalue largest in *magnitude*, which at a minimum (``H`` positive
  semi-definite up to noise) is the largest one.

Hessian-vector products are double backward: ``H v = d/dx (g(x) . v)`` with ``g`` the gradient
built with ``create_graph=True``; nothing of size ``P x P`` is ever formed. ``H`` is the Hessian of
the *mean* of the loss over the given batches (each batch's loss is one term), so the measurement
is of a fixed, finite data set and repeatable.

Pure torch, no process group: measure on one rank, on the consensus model, in ``eval()`` mode so
that dropout and BatchNorm batch statistics do not make the loss random. Gradients and buffers
are left as they were (:func:`~lightning_hier.algorithms.grawa.preserved`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_hier.algorithms.grawa import preserved

Vector = list[Tensor]
"""A vector in parameter space: one tensor per parameter, shaped like it."""
LossFn = Callable[[Any], Tensor]
"""``loss_fn(batch)``: the scalar loss of one batch at the current parameters."""
_CHUNK = 8  # probes whose products share one forward and first backward (memory: CHUNK x P floats)


@dataclass
class TraceEstimate:
    """Hutchinson's estimate of ``tr(H)``.

    Attributes:
        trace: The mean of the probes' ``v^T H v``.
        stderr: Its standard error (sample standard deviation over ``sqrt(probes)``; 0 for one probe).
        samples: Every probe's ``v^T H v``, in order.
    """

    trace: float
    stderr: float
    samples: list[float]


@dataclass
class EigenEstimate:
    """The top Hessian eigenvalue by power iteration.

    Attributes:
        eigenvalue: ``v^T H v`` at the last iterate (unit ``v``).
        iterations: Hessian-vector products taken.
        converged: Whether the relative change fell below the tolerance before the iteration limit.
        vector: The last unit iterate ``v`` (the eigenvector estimate).
    """

    eigenvalue: float
    iterations: int
    converged: bool
    vector: Vector


def hessian_vector_products(
    params: Sequence[Tensor], loss_fn: LossFn, batches: Sequence[Any], vectors: Sequence[Vector]
) -> list[Vector]:
    """``H v`` for every ``v`` in ``vectors``, with ``H`` the Hessian of the mean loss over ``batches``.

    Per batch, one forward and one differentiable backward serve every vector; then one double
    backward per vector.

    Args:
        params: The parameters ``x`` (require grad).
        loss_fn: Scalar loss of one batch at the current parameters.
        batches: The data (at least one batch), each passed to ``loss_fn`` as it is.
        vectors: Vectors shaped like ``params``.
    """
    if not batches:
        raise ValueError("hessian_vector_products: `batches` is empty; give at least one batch.")
    params = list(params)
    out = [[torch.zeros_like(p) for p in params] for _ in vectors]
    with preserved(params, ()), torch.enable_grad():
        for batch in batches:
            grads = torch.autograd.grad(loss_fn(batch), params, create_graph=True)
            for i, v in enumerate(vectors):
                last = i == len(vectors) - 1
                hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=not last, allow_unused=True)
                for acc, h in zip(out[i], hv, strict=True):
                    if h is not None:  # a parameter the loss does not depend on: zero rows of H
                        acc.add_(h.detach(), alpha=1.0 / len(batches))
    return out


def _dot(a: Vector, b: Vector) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)))


def rademacher_probes(params: Sequence[Tensor], count: int, generator: torch.Generator) -> Iterator[Vector]:
    """``count`` random vectors with independent +-1 entries, shaped like ``params``."""
    for _ in range(count):
        yield [(torch.randint(0, 2, p.shape, generator=generator, dtype=p.dtype) * 2 - 1).to(p.device) for p in params]


def basis_probes(params: Sequence[Tensor]) -> Iterator[Vector]:
    """Every standard basis vector ``e_i`` (P of them): with these probes the estimate is exactly ``tr(H)``."""
    for j, p in enumerate(params):
        for k in range(p.numel()):
            e = [torch.zeros_like(q) for q in params]
            e[j].view(-1)[k] = 1.0
            yield e


def trace_estimate(
    params: Sequence[Tensor], loss_fn: LossFn, batches: Sequence[Any], probes: Iterable[Vector]
) -> TraceEstimate:
    """Hutchinson's ``mean_v v^T H v`` over the given probes, an unbiased ``tr(H)`` when ``E[v v^T] = I``.

    Rademacher probes (:func:`rademacher_probes`) satisfy that; the P basis probes
    (:func:`basis_probes`) instead give ``tr(H) / P`` exactly, which :func:`exact_trace` scales back.
    """
    samples: list[float] = []
    chunk: list[Vector] = []
    for v in probes:
        chunk.append(v)
        if len(chunk) == _CHUNK:
            samples += _quadratic_forms(params, loss_fn, batches, chunk)
            chunk = []
    if chunk:
        samples += _quadratic_forms(params, loss_fn, batches, chunk)
    if not samples:
        raise ValueError("trace_estimate: no probes given.")
    values = torch.tensor(samples, dtype=torch.float64)
    stderr = float(values.std() / len(samples) ** 0.5) if len(samples) > 1 else 0.0
    return TraceEstimate(float(values.mean()), stderr, samples)


def _quadratic_forms(
    params: Sequence[Tensor], loss_fn: LossFn, batches: Sequence[Any], vs: list[Vector]
) -> list[float]:
    return [_dot(v, hv) for v, hv in zip(vs, hessian_vector_products(params, loss_fn, batches, vs), strict=True)]


def hutchinson_trace(
    params: Sequence[Tensor], loss_fn: LossFn, batches: Sequence[Any], probes: int = 100, seed: int = 0
) -> TraceEstimate:
    """``tr(H)`` by Hutchinson's estimator with ``probes`` Rademacher probes drawn from ``seed``.

    The global RNG is not touched (the probes come from their own generator).
    """
    if probes < 1:
        raise ValueError(f"hutchinson_trace: `probes` must be >= 1, got {probes}.")
    generator = torch.Generator().manual_seed(seed)
    return trace_estimate(params, loss_fn, batches, rademacher_probes(list(params), probes, generator))


def exact_trace(params: Sequence[Tensor], loss_fn: LossFn, batches: Sequence[Any]) -> float:
    """``tr(H) = sum_i e_i^T H e_i`` over all P basis vectors (P Hessian-vector products: small models only)."""
    params = list(params)
    estimate = trace_estimate(params, loss_fn, batches, basis_probes(params))
    return estimate.trace * len(estimate.samples)


def top_eigenvalue(
    params: Sequence[Tensor],
    loss_fn: LossFn,
    batches: Sequence[Any],
    max_iterations: int = 100,
    tol: float = 1e-3,
    seed: int = 0,
) -> EigenEstimate:
    """The Hessian eigenvalue of largest magnitude, by power iteration from a random start.

    Stops when ``|lambda_k - lambda_{k-1}| <= tol |lambda_{k-1}|`` or after ``max_iterations``
    products (PyHessian's rule; the authors' defaults are 100 and 1e-3).

    Args:
        params: The parameters.
        loss_fn: Scalar loss of one batch.
        batches: The data.
        max_iterations: Most Hessian-vector products (>= 1).
        tol: Relative tolerance (>= 0).
        seed: Seed of the random start (its own generator; the global RNG is not touched).
    """
    if max_iterations < 1 or tol < 0:
        raise ValueError(f"top_eigenvalue: need max_iterations >= 1 and tol >= 0, got {max_iterations} and {tol}.")
    params = list(params)
    generator = torch.Generator().manual_seed(seed)
    v = _unit([torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params])
    eigenvalue: float | None = None
    for k in range(1, max_iterations + 1):
        (hv,) = hessian_vector_products(params, loss_fn, batches, [v])
        previous, eigenvalue = eigenvalue, _dot(v, hv)
        v = _unit(hv)
        if previous is not None and abs(eigenvalue - previous) <= tol * abs(previous):
            return EigenEstimate(eigenvalue, k, True, v)
    assert eigenvalue is not None
    return EigenEstimate(eigenvalue, max_iterations, False, v)


def _unit(v: Vector) -> Vector:
    norm = _dot(v, v) ** 0.5
    if norm == 0.0:
        return v  # H v = 0: the eigenvalue is 0 and any direction will do
    return [t / norm for t in v]
