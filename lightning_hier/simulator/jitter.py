"""What a synchronisation costs when step times vary: the expected slowest of ``W`` workers.

A worker's compute per step is not a constant: on a shared machine other processes take its
core now and then (the benchmark's ranks measured a standard deviation of about half the mean
step on a busy 2-core host), and at scale the operating system's noise does the same ("The Case
of the Missing Supercomputer Performance", Petrini et al., SC 2003). A strategy that makes every
worker wait for the others every ``k`` steps pays, per synchronisation, the expected maximum of
``W`` workers' compute since the last one, not its mean. With the step times independent across
workers and steps, of standard deviation ``sigma`` (:attr:`Cluster.jitter_s`), ``k`` steps sum to
a spread ``sigma sqrt(k)``, and for normal sums the wait is::

    E[max of W] - mean = sigma sqrt(k) m_W,   m_W = E[max of W standard normals]

``m_1 = 0``, ``m_2 = 1 / sqrt(pi)``, ``m_3 = 3 / (2 sqrt(pi))``, ``m_1024 ~ 3.2``. Strategies that
never wait for all workers (the asynchronous ones, ``no-comm``) pay nothing.

Calibration: :func:`gini_sigma` estimates ``sigma`` from one worker's measured step times with
Gini's mean difference (``sigma = sqrt(pi) / 2 E|X - X'|``), which for two workers makes the wait
exact whatever the distribution (``E[max(X, Y)] - E[X] = E|X - Y| / 2``), and which the heavy
tail of a preempted step's time moves far less than it moves the sample standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from statistics import NormalDist

from lightning_hier.simulator.inputs import Cluster

_GRID = 4001  # trapezoid points over [-10, 10]: m_W to ~1e-9 for the worker counts used here


@cache
def expected_max_normal(workers: int) -> float:
    """``E[max of workers standard normals]`` (0 for one worker), by numerical integration."""
    if workers < 1:
        raise ValueError(f"expected_max_normal: `workers` must be >= 1, got {workers!r}.")
    if workers == 1:
        return 0.0
    normal, lo, hi = NormalDist(), -10.0, 10.0
    h = (hi - lo) / (_GRID - 1)
    total = 0.0
    for i in range(_GRID):
        x = lo + i * h
        weight = 0.5 if i in (0, _GRID - 1) else 1.0
        total += weight * x * workers * normal.pdf(x) * normal.cdf(x) ** (workers - 1)
    return total * h


def sync_wait(cluster: Cluster, steps: float) -> float:
    """Seconds a synchronisation after ``steps`` steps of compute adds: ``jitter sqrt(steps) m_W``."""
    if cluster.jitter_s <= 0 or steps <= 0:
        return 0.0
    return cluster.jitter_s * math.sqrt(steps) * expected_max_normal(cluster.workers)


def gini_sigma(samples: Sequence[float]) -> float:
    """The normal standard deviation whose Gini mean difference is that of ``samples`` (0 for < 2).

    ``E|X - X'| = 2 sigma / sqrt(pi)`` for a normal; the mean over all pairs is computed from the
    sorted samples in ``O(n log n)``.
    """
    n = len(samples)
    if n < 2:
        return 0.0
    ordered = sorted(samples)
    pairs = sum((2 * i - n + 1) * x for i, x in enumerate(ordered))  # sum over i<j of x_j - x_i
    mean_difference = 2 * pairs / (n * (n - 1))
    return math.sqrt(math.pi) / 2 * mean_difference


__all__ = ["expected_max_normal", "gini_sigma", "sync_wait"]
