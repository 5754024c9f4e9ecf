"""Periodic model averaging: the shared mechanism of Local SGD and its weighted relatives.

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): every worker takes ``tau`` optimizer
steps on its own replica, then every replica is replaced by the uniform average over the
data-parallel group. Communication: P floats every ``tau`` steps, nothing in between (DDP: P
floats every step).

Pure torch: usable from a plain training loop::

    avg = LocalSGD(model.parameters(), group=None, tau=8)   # group=None: one worker, no-op
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        avg.step()
    avg.finalize()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hier.comm import CommStats, FlatTensors, all_reduce_mean_
from lightning_hier.comm.collectives import Group


class PeriodicSchedule:
    """Counts optimizer steps and fires every ``tau`` of them.

    Args:
        tau: Period in optimizer steps (>= 1).
    """

    def __init__(self, tau: int) -> None:
        if tau < 1:
            raise ValueError(f"PeriodicSchedule: `tau` must be >= 1, got {tau}.")
        self.tau = tau
        self.steps = 0
        self.since_sync = 0
        self.rounds = 0

    def step(self) -> bool:
        """Count one optimizer step; True when a synchronisation round is due."""
        self.steps += 1
        self.since_sync += 1
        return self.since_sync >= self.tau

    def synced(self) -> None:
        self.since_sync = 0
        self.rounds += 1

    def state_dict(self) -> dict[str, int]:
        return {"tau": self.tau, "steps": self.steps, "since_sync": self.since_sync, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps, self.since_sync, self.rounds = state["steps"], state["since_sync"], state["rounds"]


def float_buffers(module: nn.Module) -> list[Tensor]:
    """Floating-point buffers (BatchNorm running statistics); integer counters are left alone."""
    return [b for b in module.buffers() if b.is_floating_point()]


class LocalSGD:
    """Uniform model averaging every ``tau`` optimizer steps.

    Args:
        params: The replica's parameters; they become views of persistent flat buckets.
        group: Data-parallel group to average over (``None``: a single worker).
        tau: Averaging period in optimizer steps.
        buffers: Extra tensors averaged at every round (e.g. :func:`float_buffers` of the model
            for BatchNorm statistics); empty to leave them local.
        bucket_bytes: Bucket size bound for the flat buffers (``None``: one per dtype).
        stats: Communication accounting to update.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        tau: int,
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
    ) -> None:
        self.group = group
        self.schedule = PeriodicSchedule(tau)
        self.stats = stats if stats is not None else CommStats()
        self.flat = FlatTensors(list(params), bucket_bytes)
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None

    def _buckets(self) -> list[Tensor]:
        return self.flat.buckets + (self.flat_buffers.buckets if self.flat_buffers is not None else [])

    @torch.no_grad()
    def _average(self) -> None:
        all_reduce_mean_(self._buckets(), self.group, self.stats)

    def step(self) -> bool:
        """Call after every optimizer step; averages when a round is due. Returns whether it did."""
        if not self.schedule.step():
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average now and start a new round."""
        self._average()
        self.schedule.synced()

    def finalize(self) -> None:
        """End of training: average the steps taken since the last round, so all replicas agree."""
        if self.schedule.since_sync:
            self.sync()

    @contextmanager
    def consensus(self) -> Iterator[None]:
        """Hold the average in the replica while inside (e.g. to validate it), then restore the replica."""
        if self.schedule.since_sync == 0 or self.group is None:
            yield
            return
        backup = [b.clone() for b in self._buckets()]
        self._average()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._buckets(), backup)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
