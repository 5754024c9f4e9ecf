"""DBS arithmetic: the split of a global batch over the ranks, shard sizes, the throughput EMA.

Pure Python (no process groups): :mod:`lightning_hier.algorithms.dbs` (the per-rank state machine)
and :mod:`lightning_hier.algorithms.dbs_sampler` (the data side) build on it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


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


def split_remainder(total: int, sizes: Sequence[int]) -> list[int]:
    """Split ``total`` samples (fewer than ``sum(sizes)``) over the ranks in proportion to ``sizes``.

    The last global batch of an epoch is smaller than ``B`` when ``drop_last=False``; it is split by
    the same shares ``b_w / B`` as the full batches, rounded by largest remainder (ties: lower rank
    first). No bounds apply: a rank may get 0 samples (a batch of ``R < W`` samples cannot give every
    rank one), and never more than its full batch ``b_w``.

    Example:
        >>> split_remainder(5, [12, 12])
        [3, 2]
        >>> split_remainder(3, [90, 5, 5])
        [3, 0, 0]
    """
    whole = sum(sizes)
    if not 0 <= total < whole or min(sizes) < 0:
        raise ValueError(
            f"split_remainder: need 0 <= total < sum(sizes) = {whole} and sizes >= 0, got total={total}, "
            f"sizes={list(sizes)}."
        )
    # exact integer arithmetic: share_w = total * b_w / B = floor + numerator / B
    parts = [divmod(total * int(b), whole) for b in sizes]
    out = [floor for floor, _ in parts]
    order = sorted(range(len(sizes)), key=lambda r: (-parts[r][1], r))
    for r in order[: total - sum(out)]:
        out[r] += 1
    return out


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
