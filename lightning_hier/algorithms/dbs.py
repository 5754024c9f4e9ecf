"""DBS: performance-aware dynamic batch size for workers of different speeds.

Ji, Zhang, Fu, Gao, Li, "Performance-aware based dynamic batch size SGD for distributed deep
learning" (in Chinese), J. Computer Research and Development 56(11):2396-2409, 2019,
doi:10.7544/issn1000-1239.2019.20180880; the synchronous all-reduce form follows the same group's
DBS (Ye et al., arXiv 2007.11831, code github.com/Soptq/Dynamic_Load_Balance_DistributedDNN).

A fixed global batch ``B`` is split over the ``W`` ranks in proportion to their measured speed, so
every rank's step takes about the same time::

    start: b_w = B / W; every step: t_w = compute time (forward, backward, optimizer step, without
    the time blocked in collectives); every `rebalance_every` steps: v_w = EMA of samples_w / t_w,
    all-gather v, b = split of B proportional to v (largest remainder, sum B, within bounds)
    gradient = sum_w (b_w / B) * mean_grad_w      # one SUM all-reduce of the weighted gradients

The weighting makes the gradient the per-sample mean over the global batch whatever the split, so a
step equals single-process SGD on the concatenated batch. The data side is in
:mod:`lightning_hier.algorithms.dbs_sampler`. The asynchronous parameter-server form of the 2019
paper is not implemented (it would need ``torch.distributed.rpc``).

Pure torch: usable from a plain training loop::

    dbs = DynamicBatchSize(model.parameters(), group, rebalance_every=20)
    alloc = dbs.bind(global_batch=256)
    sampler = DynamicBatchSampler(len(dataset), alloc, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            dbs.begin_micro_batch()
            loss_fn(model(x), y).backward()
            dbs.reduce_gradients()
            opt.step(); opt.zero_grad()
            dbs.end_step()
            if dbs.due():
                dbs.rebalance()
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.algorithms.dbs_sampler import Allocation
from lightning_hier.comm import CommStats, FlatTensors, all_reduce_sum_, group_size
from lightning_hier.comm.collectives import Group

TIMERS = ("wall", "cpu")


def check_split(global_batch: int, world: int, min_size: int, max_size: int | None) -> None:
    """Raise ``ValueError`` unless ``global_batch`` can be split over ``world`` ranks within the bounds."""
    hi = global_batch if max_size is None else max_size
    if min_size < 1 or hi < min_size:
        raise ValueError(f"DBS: batch size bounds must satisfy 1 <= min <= max, got min={min_size}, max={hi}.")
    if not world * min_size <= global_batch <= world * hi:
        raise ValueError(
            f"DBS: a global batch of {global_batch} cannot be split over {world} ranks with per-rank batch "
            f"sizes in [{min_size}, {hi}]: it must lie in [{world * min_size}, {world * hi}] "
            f"(world size x min_batch_size, world size x max_batch_size)."
        )


def proportional_shares(total: float, weights: Sequence[float], low: float, high: float) -> list[float]:
    """The real-valued split ``x_w = clamp(lam * weight_w, low, high)`` with ``sum(x) == total``.

    ``lam`` is found exactly: the sum is piecewise linear and nondecreasing in ``lam``, with breaks where
    a rank reaches a bound; search the break points, then solve the linear piece.
    """
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"DBS: weights must be positive and finite, got {list(weights)}.")

    def clamped_sum(lam: float) -> float:
        return sum(min(high, max(low, lam * w)) for w in weights)

    points = sorted({low / w for w in weights} | {high / w for w in weights})
    i = bisect.bisect_left(points, total, key=clamped_sum)
    if i == len(points):
        return [float(high)] * len(weights)
    upper, lower = points[i], points[i - 1] if i > 0 else 0.0
    mid = (lower + upper) / 2
    free = [w for w in weights if low < mid * w < high]
    fixed = sum(low if mid * w <= low else high for w in weights if not low < mid * w < high)
    lam = (total - fixed) / sum(free) if free else upper
    return [min(high, max(low, lam * w)) for w in weights]


def split_batch(
    global_batch: int, weights: Sequence[float], min_size: int = 1, max_size: int | None = None
) -> list[int]:
    """Integer batch sizes proportional to ``weights``: sum exactly ``global_batch``, each in the bounds.

    The real-valued shares (:func:`proportional_shares`) are rounded by the largest-remainder method:
    every rank gets the floor of its share, and the samples left over go one each to the ranks with
    the largest fractional parts (ties: lower rank first). Every size is within 1 of its share.

    Args:
        global_batch: ``B``, the samples of one step over all ranks.
        weights: One positive weight per rank (measured throughputs).
        min_size: Smallest per-rank batch (>= 1).
        max_size: Largest per-rank batch (``None``: no bound but ``B``).

    Example:
        >>> split_batch(10, [1.0, 1.0, 1.0])
        [4, 3, 3]
        >>> split_batch(12, [2.0, 1.0])
        [8, 4]
        >>> split_batch(12, [100.0, 1.0], max_size=9)
        [9, 3]
    """
    check_split(global_batch, len(weights), min_size, max_size)
    high = global_batch if max_size is None else max_size
    shares = proportional_shares(global_batch, weights, min_size, high)
    sizes = [min(high, max(min_size, math.floor(s))) for s in shares]
    order = sorted(range(len(shares)), key=lambda r: (-(shares[r] - sizes[r]), r))
    while sum(sizes) < global_batch:  # one pass suffices in exact arithmetic; loop guards rounding
        for r in order:
            if sum(sizes) < global_batch and sizes[r] < high:
                sizes[r] += 1
    while sum(sizes) > global_batch:
        for r in reversed(order):
            if sum(sizes) > global_batch and sizes[r] > min_size:
                sizes[r] -= 1
    return sizes


def shard_sizes(num_samples: int, sizes: Sequence[int]) -> tuple[int, list[int]]:
    """Steps per epoch and per-rank shard sizes that give every rank the same number of steps.

    With the split ``sizes`` held for a whole epoch, rank ``w`` takes ``steps * sizes[w]`` samples;
    the ``num_samples - steps * sum(sizes)`` left over (less than one global batch) are skipped.

    Example:
        >>> shard_sizes(100, [6, 3])
        (11, [66, 33])
    """
    steps = num_samples // sum(sizes)
    return steps, [steps * int(b) for b in sizes]


@dataclass
class ThroughputMeter:
    """Samples per second of pure compute, averaged over windows and smoothed across them.

    Args:
        ema: Weight of the previous estimate: ``v = ema * v + (1 - ema) * v_window``; the first
            window sets ``v`` directly (no bias toward zero).
    """

    ema: float
    estimate: float = 0.0  # 0: nothing measured yet
    samples: int = 0
    compute_s: float = 0.0
    idle_s: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ThroughputMeter: `ema` must be in [0, 1), got {self.ema}.")

    def add(self, samples: int, compute_s: float, idle_s: float) -> None:
        """Record one measured step."""
        self.samples += samples
        self.compute_s += max(compute_s, 0.0)
        self.idle_s += idle_s
        self.steps += 1

    def close_window(self) -> dict[str, float]:
        """Fold the window into the estimate; returns the window's per-step means and the estimate."""
        per_step = max(self.steps, 1)
        window = {"compute_s": self.compute_s / per_step, "idle_s": self.idle_s / per_step}
        if self.steps and self.compute_s > 0:
            rate = self.samples / self.compute_s
            self.estimate = rate if self.estimate <= 0 else self.ema * self.estimate + (1 - self.ema) * rate
        self.samples, self.compute_s, self.idle_s, self.steps = 0, 0.0, 0.0, 0
        window["samples_per_s"] = self.estimate
        return window

    def state_dict(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if k != "ema"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


class DynamicBatchSize:
    """One rank's DBS state machine: throughput measurement, batch split, weighted gradient reduction.

    Call order per optimizer step: :meth:`begin_micro_batch` before each (micro-)batch,
    :meth:`reduce_gradients` after the last backward of the step, the optimizer step, then
    :meth:`end_step`; :meth:`rebalance` when :meth:`due` (a collective: every rank calls it at the same
    step, which the step-count schedule guarantees).

    Args:
        params: The model's parameters (those with ``requires_grad`` are reduced).
        group: Data-parallel group (``None``: a single worker).
        rebalance_every: Optimizer steps between rebalances.
        ema: Smoothing of the throughput estimate across rebalance windows (see :class:`ThroughputMeter`).
        min_batch_size: Smallest per-rank batch.
        max_batch_size: Largest per-rank batch (``None``: ``B``).
        warmup_steps: The first optimizer steps are not measured and no rebalance happens before
            ``warmup_steps + rebalance_every`` steps (one-off costs of the first steps).
        buffers: Tensors averaged with the same weights at every step (e.g. BatchNorm statistics),
            so all ranks keep identical models.
        bucket_bytes: Bucket size bound of the flat buffers reduced in one call.
        stats: Communication accounting; its blocked time is excluded from the compute time.
        timer: ``'wall'``: elapsed time minus the time blocked in collectives (what a step costs; on a
            GPU the device is synchronised around the gradient all-reduce and at the end of the step,
            so compute and waiting are told apart). ``'cpu'``: CPU time of this process
            (``time.process_time``), which leaves out time spent waiting for a CPU, so load from other
            processes on a shared machine is not taken for slowness; CPU training only.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: Group,
        rebalance_every: int = 20,
        ema: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        warmup_steps: int = 5,
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
        timer: str = "wall",
    ) -> None:
        if rebalance_every < 1 or warmup_steps < 0 or timer not in TIMERS:
            raise ValueError(
                f"DynamicBatchSize: need rebalance_every >= 1, warmup_steps >= 0 and timer in {TIMERS}, got "
                f"{rebalance_every}, {warmup_steps} and {timer!r}."
            )
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.group = group
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.rebalance_every, self.warmup_steps = rebalance_every, warmup_steps
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.meter = ThroughputMeter(ema)
        self.stats = stats if stats is not None else CommStats()
        self.bucket_bytes = bucket_bytes
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        self.timer = timer
        self.clock: Callable[[], float] = time.perf_counter if timer == "wall" else time.process_time
        self.allocation: Allocation | None = None
        self.steps = 0
        self.rebalances = 0
        self.last_rebalance_step = -1  # a step ends at most one period, even if asked twice
        self.history: list[dict[str, Any]] = []
        self._restored_sizes: list[int] | None = None
        self._fresh = True  # the first step after a (re)start carries one-off costs: not measured
        self._window: tuple[float, float] | None = None  # (start time, blocked seconds at start)
        self._window_samples = 0
        self._window_batches = 0

    # ------------------------------------------------------------------ data
    def bind(self, global_batch: int) -> Allocation:
        """The allocation of ``global_batch`` (created once: equal split, or the restored one)."""
        if self.allocation is not None:
            if self.allocation.global_batch != global_batch:
                raise ValueError(
                    f"DBS: the global batch changed from {self.allocation.global_batch} to {global_batch} "
                    "during the run; keep the training DataLoader's batch size (or set global_batch_size)."
                )
            return self.allocation
        check_split(global_batch, self.world, self.min_batch_size, self.max_batch_size)
        sizes = self._restored_sizes or split_batch(
            global_batch, [1.0] * self.world, self.min_batch_size, self.max_batch_size
        )
        if sum(sizes) != global_batch or len(sizes) != self.world:
            raise ValueError(
                f"DBS: the checkpoint was written with a global batch of {sum(sizes)} over {len(sizes)} ranks "
                f"(split {sizes}), but this run has {global_batch} over {self.world}; resume with the same "
                "global batch size."
            )
        self.allocation = Allocation(sizes, self.rank)
        return self.allocation

    # ------------------------------------------------------------------ per step
    def begin_micro_batch(self) -> None:
        """A (micro-)batch starts: open the timing window of this step and count its samples."""
        if self.allocation is None:
            raise RuntimeError("DynamicBatchSize: call bind() and train with DynamicBatchSampler batches.")
        if self._window is None:
            self._window = (self.clock(), self.stats.blocked_s)
        self._window_samples += self.allocation.consume()
        self._window_batches += 1

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Replace every gradient by ``sum_w (b_w / B) * grad_w`` (one SUM all-reduce of flat buckets).

        Each rank's gradient is the mean over its own samples of the step, so the weighted sum is the
        mean over all ``B`` samples. Missing gradients count as zeros, so every rank reduces the same
        buckets. Buffers passed to the constructor are averaged with the same weights.
        """
        if self.group is None:
            return
        assert self.allocation is not None and self._window_batches > 0, "begin_micro_batch() not called"
        weight = self._window_samples / (self._window_batches * self.allocation.global_batch)
        grads: list[Tensor] = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        buckets = FlatTensors(grads, self.bucket_bytes).buckets
        if self.flat_buffers is not None:
            buckets = buckets + self.flat_buffers.buckets
        torch._foreach_mul_(buckets, weight)
        _synchronize(self.device)  # on a GPU, the compute so far must be finished before timing the wait
        all_reduce_sum_(buckets, self.group, self.stats)
        with self.stats.blocked():  # NCCL's wait() does not block the host: wait for the result here
            _synchronize(self.device)

    def end_step(self) -> None:
        """The optimizer step is done: close its timing window and count it."""
        self.steps += 1
        _synchronize(self.device)  # count the optimizer step's GPU work in this step
        if self._window is not None and self.steps > self.warmup_steps and not self._fresh:
            start, blocked = self._window
            idle = self.stats.blocked_s - blocked
            # CPU time does not advance while blocked; wall time must have the wait taken out
            compute = self.clock() - start - (idle if self.timer == "wall" else 0.0)
            self.meter.add(self._window_samples, compute, idle)
        self._fresh = False
        self._window = None
        self._window_samples = self._window_batches = 0

    # ------------------------------------------------------------------ rebalance
    def due(self) -> bool:
        """Whether this step ends a rebalance period (the same answer on every rank)."""
        after = self.steps - self.warmup_steps
        return after > 0 and after % self.rebalance_every == 0 and self.last_rebalance_step != self.steps

    def rebalance(self, align: int = 1) -> dict[str, Any]:
        """All-gather the throughputs and split the global batch in proportion (a collective).

        Args:
            align: The new split starts at a batch index that is a multiple of ``align`` (the
                gradient-accumulation factor), so a step never mixes two splits.

        Returns:
            A report: ``step``, ``sizes`` (the new split), and per rank ``samples_per_s``,
            ``compute_s`` and ``idle_s`` (means per step over the period).
        """
        assert self.allocation is not None, "bind() first"
        window = self.meter.close_window()
        row = [window["samples_per_s"], window["compute_s"], window["idle_s"], float(self.allocation.drawn)]
        table = _gather_rows(row, self.rank, self.world, self.group, self.stats, self.device)
        rates = [float(v) for v in table[:, 0]]
        sizes = list(self.allocation.sizes)
        if min(rates) > 0:  # every rank measured something; else keep the split
            sizes = split_batch(self.allocation.global_batch, rates, self.min_batch_size, self.max_batch_size)
            drawn = int(table[:, 3].max())
            self.allocation.update(sizes, -(-drawn // align) * align)
            self.rebalances += 1
        report = {
            "step": self.steps,
            "sizes": sizes,
            "samples_per_s": rates,
            "compute_s": [float(v) for v in table[:, 1]],
            "idle_s": [float(v) for v in table[:, 2]],
        }
        self.history.append(report)
        self.last_rebalance_step = self.steps
        return report

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        sizes = self.allocation.sizes if self.allocation is not None else self._restored_sizes
        return {
            "sizes": list(sizes) if sizes is not None else [],
            "steps": self.steps,
            "rebalances": self.rebalances,
            "last_rebalance_step": self.last_rebalance_step,
            "meter": self.meter.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the split and the throughput estimates (call before :meth:`bind`)."""
        self._restored_sizes = [int(b) for b in state["sizes"]] or None
        self.steps, self.rebalances = int(state["steps"]), int(state["rebalances"])
        self.last_rebalance_step = int(state["last_rebalance_step"])
        self.meter.load_state_dict(state["meter"])
        if self.allocation is not None and self._restored_sizes is not None:
            self.allocation.update(self._restored_sizes, self.allocation.drawn)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_rows(
    row: Sequence[float], rank: int, world: int, group: Group, stats: CommStats, device: torch.device
) -> Tensor:
    """Every rank's ``row`` as a ``world x len(row)`` float64 table on the CPU (one SUM all-reduce)."""
    table = torch.zeros(world, len(row), dtype=torch.float64, device=device)
    table[rank] = torch.tensor(row, dtype=torch.float64, device=device)
    all_reduce_sum_([table], group, stats)
    return table.cpu()
