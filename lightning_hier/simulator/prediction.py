"""What the simulator predicts for one strategy (:class:`Prediction`), and the compute every model shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_hier.simulator.inputs import Cluster, Workload

FLOAT64 = 8
"""Bytes of a float64 (the score tables, losses and message headers)."""


@dataclass(frozen=True)
class Prediction:
    """What one strategy is predicted to do on one cluster, per optimizer step unless named otherwise.

    Attributes:
        strategy: Registry name.
        args: The strategy's arguments that the prediction used.
        workers: Ranks.
        step_s: Seconds per optimizer step (iteration, for the pipeline).
        samples_per_step: Training samples all replicas consume per step (the pipeline: per iteration,
            the epoch's mean, its fill and drain included).
        steps_per_epoch: Steps of one epoch (the pipeline's drain included).
        wire_bytes: Bytes each worker sends per step (mean over workers).
        payload_bytes: Bytes each worker hands to collectives per step (what ``CommStats`` counts).
        blocked_s: Seconds per step the least loaded worker waits (communication and slower peers).
        staleness: Steps between a change and its arrival in every replica (0: synchronous).
        detail: Extra numbers (per-round costs, the chosen grid, ...).
    """

    strategy: str
    args: dict[str, Any]
    workers: int
    step_s: float
    samples_per_step: float
    steps_per_epoch: float
    wire_bytes: float
    payload_bytes: float
    blocked_s: float
    staleness: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def epoch_s(self) -> float:
        return self.steps_per_epoch * self.step_s

    @property
    def wire_bytes_per_epoch(self) -> float:
        return self.wire_bytes * self.steps_per_epoch

    @property
    def payload_bytes_per_epoch(self) -> float:
        return self.payload_bytes * self.steps_per_epoch


def compute_s(workload: Workload, cluster: Cluster, samples: Sequence[float] | None = None) -> list[float]:
    """Each worker's compute seconds per step (``samples``: per-worker batch, default the workload's)."""
    batch = samples if samples is not None else [workload.batch_size] * cluster.workers
    return [(b * workload.sample_s + workload.step_s) / s for b, s in zip(batch, cluster.speed_list, strict=True)]


def batch_shares(workload: Workload, cluster: Cluster, shares: Sequence[float] | None = None) -> list[float]:
    """DBS's per-worker batches: ``shares`` as given (one per worker), or the global batch split by speed."""
    p, speeds = cluster.workers, cluster.speed_list
    if shares is None:
        return [workload.batch_size * p * s / sum(speeds) for s in speeds]
    if len(shares) != p or min(shares) <= 0:
        raise ValueError(f"dbs: `shares` must be {p} positive batch sizes (one per worker), got {list(shares)!r}.")
    return [float(s) for s in shares]


def steps_per_epoch(workload: Workload, replicas: int) -> float:
    """Optimizer steps of one epoch with ``replicas`` data-parallel replicas (at least 1)."""
    return max(1, workload.samples_per_epoch // (workload.batch_size * replicas))


__all__ = ["FLOAT64", "Prediction", "batch_shares", "compute_s", "steps_per_epoch"]
