"""DBS: performance-aware dynamic batch size for workers of different speeds.

Ji, Zhang, Fu, Gao, Li, "Performance-aware based dynamic batch size SGD for distributed deep
learning" (in Chinese), J. Computer Research and Development 56(11):2396-2409, 2019,
doi:10.7544/issn1000-1239.2019.20180880; the synchronous all-reduce form follows the same group's
DBS (Ye et al., arXiv 2007.11831, code github.com/Soptq/Dynamic_Load_Balance_DistributedDNN).

A fixed global batch ``B`` is split over the ``W`` ranks in proportion to their measured speed, so
every rank's step takes about the same time::

    start: b_w = B / W (or given sizes); every step: t_w = compute time (forward, backward, optimizer step, without
    the time blocked in collectives); every `rebalance_every` steps: v_w = EMA of samples_w / t_w,
    all-gather v, b = split of B proportional to v (largest remainder, sum B, within bounds)
    gradient = sum_w (b_w / B) * mean_grad_w      # one SUM all-reduce of the weighted gradients

The weighting makes the gradient the per-sample mean over the global batch whatever the split, so a
step equals single-process SGD on the concatenated batch. With ``drop_last=False`` the ``R < B``
samples left at the end of an epoch form one smaller global batch, split by the same shares
(``r_w``, a rank may get 0) and weighted ``r_w / R``, so that step too equals single-process SGD on
those ``R`` samples. The data side is in
:mod:`lightning_hier.algorithms.dbs_sampler`. The asynchronous parameter-server form of the 2019
paper is ``dbs_async`` (:mod:`lightning_hier.strategies.dbs_async`), over
:mod:`lightning_hier.algorithms.param_server`.

Pure torch: usable from a plain training loop::

    dbs = DynamicBatchSize(model.parameters(), group, rebalance_every=20)
    alloc = dbs.bind(global_batch=256)
    sampler = DynamicBatchSampler(len(dataset), alloc, shuffle=True, seed=0, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            dbs.begin_micro_batch()
            # loss_scale() is 1 except where a step mixes batch splits (see its docstring)
            (loss_fn(model(x), y) * dbs.loss_scale()).backward()
            dbs.reduce_gradients()
            opt.step(); opt.zero_grad()
            dbs.end_step()
            if dbs.due():
                dbs.rebalance()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier import _validate as v
from lightning_hier.algorithms.dbs_sampler import Allocation
from lightning_hier.algorithms.dbs_split import (  # re-exported: the split arithmetic lived here
    ThroughputMeter,
    check_split,
    proportional_shares,
    shard_sizes,
    split_batch,
    split_remainder,
)
from lightning_hier.comm import CommStats, FlatTensors, all_reduce_sum_, group_size
from lightning_hier.comm.collectives import Group

TIMERS = ("wall", "cpu", "thread")
SPANS = ("compute", "iteration")
# what each timer reads; the CPU clocks stand still while blocked, so only wall time has waits taken out
_CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "thread": time.thread_time,
}

__all__ = [
    "TIMERS",
    "DynamicBatchSize",
    "ThroughputMeter",
    "check_initial_sizes",
    "check_split",
    "proportional_shares",
    "shard_sizes",
    "split_batch",
    "split_remainder",
]


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
        initial_sizes: The split to start from, one batch size per rank summing to the global batch
            given to :meth:`bind`, each within the bounds (``None``: the equal split). Reproducible
            heterogeneity experiments start from a known, unequal split.
        buffers: Tensors averaged with the same weights at every step (e.g. BatchNorm statistics),
            so all ranks keep identical models.
        bucket_bytes: Bucket size bound of the flat buffers reduced in one call.
        stats: Communication accounting; its blocked time is excluded from the compute time.
        timer: ``'wall'``: elapsed time minus the time blocked in collectives (what a step costs; on a
            GPU the device is synchronised around the gradient all-reduce and at the end of the step,
            so compute and waiting are told apart). ``'cpu'``: CPU time of this process
            (``time.process_time``), which leaves out time spent waiting for a CPU, so load from other
            processes on a shared machine is not taken for slowness; CPU training only. ``'thread'``:
            CPU time of the calling thread only (``time.thread_time``), for a process that runs other
            work in background threads (a parameter server's threads), which ``'cpu'`` would count as
            this rank's compute; intra-op threads of torch are left out too, so use it with
            ``torch.set_num_threads(1)`` or tensors too small to be split.
        span: What a step's time spans. ``'compute'``: from its first batch to the end of its
            optimizer step, without the time blocked in collectives (a wait for a slower rank is
            not this rank's slowness). ``'iteration'``: from the end of the previous step, with
            everything between (data, Lightning's loop) and every wait (for an asynchronous
            worker the round trips to its parameter server are its own cost, and equal iteration
            times are what equalise the staleness); the first step after :meth:`restart` spans
            only itself.
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
        initial_sizes: Sequence[int] | None = None,
        buffers: Iterable[Tensor] = (),
        bucket_bytes: int | None = None,
        stats: CommStats | None = None,
        timer: str = "wall",
        span: str = "compute",
    ) -> None:
        if rebalance_every < 1 or warmup_steps < 0 or timer not in TIMERS or span not in SPANS:
            raise ValueError(
                f"DynamicBatchSize: need rebalance_every >= 1, warmup_steps >= 0, timer in {TIMERS} and span in "
                f"{SPANS}, got {rebalance_every}, {warmup_steps}, {timer!r} and {span!r}."
            )
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.group = group
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.rebalance_every, self.warmup_steps = rebalance_every, warmup_steps
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.initial_sizes = None if initial_sizes is None else [int(b) for b in initial_sizes]
        self.meter = ThroughputMeter(ema)
        self.stats = stats if stats is not None else CommStats()
        self.bucket_bytes = bucket_bytes
        extra = list(buffers)
        self.flat_buffers = FlatTensors(extra, bucket_bytes) if extra else None
        self.timer = timer
        self.clock = _CLOCKS[timer]
        self.span = span
        self._last_end: tuple[float, float] | None = None  # (time, blocked seconds) at the last step's end
        self.allocation: Allocation | None = None
        self.steps = 0
        self.rebalances = 0
        self.last_rebalance_step = -1  # a step ends at most one period, even if asked twice
        self.history: list[dict[str, Any]] = []
        self._restored_sizes: list[int] | None = None
        self._restored_segments: list[tuple[int, list[int]]] | None = None
        self._fresh = True  # the first step after a (re)start carries one-off costs: not measured
        self._window: tuple[float, float] | None = None  # (start time, blocked seconds at start)
        self._window_samples = 0
        self._window_total = 0  # samples of the step over all ranks (B, or R for the last batch)
        # gradient weight of the step: the share b_r / B (r_r / R for a last, smaller batch) of its
        # first micro-batch with samples; None until one arrives (0.0 if none has any)
        self._window_weight: float | None = None
        self._window_partial = False  # the step holds a smaller last batch: not a throughput sample
        self._loss_scale = 1.0

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
        if self._restored_sizes is None and self.initial_sizes is not None:
            bounds = (self.min_batch_size, self.max_batch_size)
            check_initial_sizes("DynamicBatchSize", self.initial_sizes, global_batch, self.world, *bounds)
        sizes = (
            self._restored_sizes
            or self.initial_sizes
            or split_batch(global_batch, [1.0] * self.world, self.min_batch_size, self.max_batch_size)
        )
        if sum(sizes) != global_batch or len(sizes) != self.world:
            raise ValueError(
                f"DBS: the checkpoint was written with a global batch of {sum(sizes)} over {len(sizes)} ranks "
                f"(split {sizes}), but this run has {global_batch} over {self.world}; resume with the same "
                "global batch size."
            )
        self.allocation = Allocation(sizes, self.rank)
        if self._restored_segments is not None:
            self.allocation.resume_segments(self._restored_segments)
        return self.allocation

    # ------------------------------------------------------------------ per step
    def begin_micro_batch(self) -> None:
        """A (micro-)batch starts: open the timing window of this step and count its samples."""
        if self.allocation is None:
            raise RuntimeError("DynamicBatchSize: call bind() and train with DynamicBatchSampler batches.")
        if self._window is None:
            self._window = self._last_end or (self.clock(), self.stats.blocked_s)
        samples, total = self.allocation.consume_share()
        self._window_samples += samples
        self._window_total += total
        self._window_partial |= total != self.allocation.global_batch
        share = samples / total
        if self._window_weight is None and samples > 0:
            self._window_weight = share
        # the step's gradient is reduced with one weight (the first share); a micro-batch with
        # another share (the last, smaller batch after full ones) rescales its loss to match
        self._loss_scale = share / self._window_weight if self._window_weight else 0.0

    @property
    def step_share(self) -> float:
        """``b_w / B`` of the current step (the weight of this rank's gradient; 0 without samples)."""
        return self._window_weight or 0.0

    @property
    def step_samples(self) -> tuple[int, int]:
        """``(n_w, N)``: samples of the current step on this rank and over all ranks (every micro-batch).

        Every rank knows the whole split, so ``N`` needs no communication;
        :class:`~lightning_hier.algorithms.dbs_compose.SampleWindow` sums them over a window.
        """
        return self._window_samples, self._window_total

    def loss_scale(self) -> float:
        """Factor for the loss of the current micro-batch before its backward.

        1.0 except in a step (an accumulation window) whose micro-batches have different shares, e.g.
        full batches followed by the smaller last batch of an epoch (``drop_last=False``):
        :meth:`reduce_gradients` applies one weight per step, so such a micro-batch's loss is scaled
        by its share over the step's weight; 0.0 for a micro-batch of which this rank has no sample.
        """
        return self._loss_scale

    def reduce_gradients(self) -> None:
        """Replace every gradient by ``sum_w (b_w / B) * grad_w`` (one SUM all-reduce of flat buckets).

        Each rank's gradient is the mean over its own samples of the step, so the weighted sum is the
        mean over all ``B`` samples (``r_w / R`` and ``R`` for a last, smaller batch: a rank without
        samples contributes zeros). Buffers passed to the constructor are averaged with the same
        weights. See :func:`reduce_weighted_`.
        """
        if self.group is None:
            return
        assert self.allocation is not None and self._window is not None, "begin_micro_batch() not called"
        buffers = self.flat_buffers.buckets if self.flat_buffers is not None else []
        reduce_weighted_(self.params, self.step_share, self.group, self.stats, self.bucket_bytes, buffers)

    def end_step(self) -> None:
        """The optimizer step is done: close its timing window and count it."""
        self.steps += 1
        _synchronize(self.device)  # count the optimizer step's GPU work in this step
        # a smaller last batch is no throughput sample: fixed per-step costs would dominate it
        measured = self._window is not None and not self._window_partial
        now = self.clock()  # one reading ends this step and, for span='iteration', starts the next
        if measured and self.steps > self.warmup_steps and not self._fresh:
            assert self._window is not None
            start, blocked = self._window
            idle = self.stats.blocked_s - blocked
            # CPU time does not advance while blocked; wall time must have the wait taken out
            waits = idle if self.timer == "wall" and self.span == "compute" else 0.0
            self.meter.add(self._window_samples, now - start - waits, idle)
        self._fresh = False
        self._last_end = (now, self.stats.blocked_s) if self.span == "iteration" else None
        self._window = None
        self._window_samples = self._window_total = 0
        self._window_weight, self._window_partial, self._loss_scale = None, False, 1.0

    def restart(self) -> None:
        """Training resumes after a pause (an epoch's end, validation): the next step spans only itself."""
        self._last_end = None

    # ------------------------------------------------------------------ rebalance
    def due(self) -> bool:
        """Whether this step ends a rebalance period (the same answer on every rank)."""
        after = self.steps - self.warmup_steps
        return after > 0 and after % self.rebalance_every == 0 and self.last_rebalance_step != self.steps

    def measure(self) -> dict[str, float]:
        """End a rebalance period on this rank alone: fold its window into the speed estimate.

        For a split decided elsewhere (a parameter server sizing each worker's claims from the
        speeds the workers report, :class:`~lightning_hier.algorithms.claim_sampler.ServerShares`):
        no communication. Returns this rank's ``samples_per_s``, ``compute_s`` and ``idle_s``.
        """
        self.last_rebalance_step = self.steps
        return self.meter.close_window()

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
        segments = self.allocation.segments() if self.allocation is not None else self._restored_segments
        return {
            "sizes": list(sizes) if sizes is not None else [],
            "segments": [[start, list(b)] for start, b in segments or []],
            "steps": self.steps,
            "rebalances": self.rebalances,
            "last_rebalance_step": self.last_rebalance_step,
            "meter": self.meter.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the split and the throughput estimates (call before :meth:`bind`)."""
        self._restored_sizes = [int(b) for b in state["sizes"]] or None
        # the splits of the checkpoint's epoch (absent in checkpoints of format 1)
        self._restored_segments = [(int(start), [int(x) for x in b]) for start, b in state.get("segments", [])] or None
        self.steps, self.rebalances = int(state["steps"]), int(state["rebalances"])
        self.last_rebalance_step = int(state["last_rebalance_step"])
        self.meter.load_state_dict(state["meter"])
        if self.allocation is not None and self._restored_sizes is not None:
            self.allocation.update(self._restored_sizes, self.allocation.drawn)
        if self.allocation is not None and self._restored_segments is not None:
            self.allocation.resume_segments(self._restored_segments)


def check_initial_sizes(
    owner: str,
    sizes: Sequence[int],
    global_batch: int | None,
    world: int | None,
    min_size: int = 1,
    max_size: int | None = None,
) -> list[int]:
    """``sizes`` as a list if it is a valid initial split, else a ``ValueError`` that names it.

    ``global_batch`` and ``world`` are checked where known (``None``: not yet known).
    """
    hi = max_size if max_size is not None else (global_batch if global_batch is not None else None)
    allowed = f"a non-empty list of per-rank batch sizes, integers >= {min_size}"
    allowed += "" if hi is None else f" and <= {hi}"
    values = v.check_int_list(owner, "initial_sizes", sizes, minimum=min_size, maximum=hi, allowed=allowed)
    if world is not None and len(values) != world:
        raise ValueError(
            f"{owner}: argument `initial_sizes` must have one batch size per data-parallel rank ({world}), "
            f"got {len(values)}: {values}."
        )
    if global_batch is not None and sum(values) != global_batch:
        raise ValueError(
            f"{owner}: argument `initial_sizes` must sum to the global batch {global_batch}, got "
            f"{values} (sum {sum(values)})."
        )
    return values


@torch.no_grad()
def reduce_weighted_(
    params: Sequence[Tensor],
    weight: float,
    group: Group,
    stats: CommStats,
    bucket_bytes: int | None = None,
    buffers: Sequence[Tensor] = (),
) -> None:
    """DBS's gradient reduction: every ``.grad`` of ``params`` becomes ``sum_w weight_w * grad_w``.

    ``weight`` is this rank's ``b_w / B`` of the step. Missing gradients count as zeros, so every
    rank reduces the same buckets; ``buffers`` (flat buckets of BatchNorm statistics) are averaged
    with the same weights. One SUM all-reduce; a no-op without a group.
    """
    if group is None:
        return
    grads: list[Tensor] = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    buckets = FlatTensors(grads, bucket_bytes).buckets + list(buffers)
    torch._foreach_mul_(buckets, weight)
    device = buckets[0].device if buckets else torch.device("cpu")
    _synchronize(device)  # on a GPU, the compute so far must be finished before timing the wait
    all_reduce_sum_(buckets, group, stats)
    with stats.blocked():  # NCCL's wait() does not block the host: wait for the result here
        _synchronize(device)


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
