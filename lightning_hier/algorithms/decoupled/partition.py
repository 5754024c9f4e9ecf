"""Cutting an ordered list of blocks into contiguous pipeline stages.

A *split* is the tuple of the ``K - 1`` block indices where stages ``1 .. K - 1`` start: with
``split = (s_1, ..., s_{K-1})`` stage ``k`` holds blocks ``[s_k, s_{k+1})`` (``s_0 = 0``,
``s_K = n``). :func:`balanced_split` chooses it from measured per-block costs so that the slowest
stage is as fast as possible, since a lock-step pipeline runs at the pace of its slowest stage.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor, nn


def check_split_points(split: Sequence[int], num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Validate ``split`` for ``num_blocks`` blocks and ``num_stages`` stages.

    Raises:
        ValueError: Too many stages for the blocks, wrong length, or points not strictly
            increasing within ``(0, num_blocks)``.
    """
    check_stage_count(num_blocks, num_stages)
    points = tuple(split)
    bounds = (0, *points, num_blocks)
    if len(points) != num_stages - 1 or any(b >= c for b, c in pairwise(bounds)):
        raise ValueError(
            f"split {list(points)} is invalid for {num_blocks} blocks and {num_stages} stages: it must hold "
            f"{num_stages - 1} strictly increasing block indices in [1, {num_blocks - 1}]."
        )
    return points


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    """Every stage needs at least one block.

    Raises:
        ValueError: ``num_stages > num_blocks``.
    """
    if num_stages > num_blocks:
        raise ValueError(
            f"cannot cut {num_blocks} block(s) into {num_stages} stages: every stage needs at least one block. "
            f"Use stages <= {num_blocks} or a model with more blocks."
        )


def stage_ranges(split: Sequence[int], num_blocks: int) -> list[range]:
    """Block indices of each stage."""
    bounds = (0, *split, num_blocks)
    return [range(a, b) for a, b in pairwise(bounds)]


def balanced_split(
    costs: Sequence[float], num_stages: int, cut_costs: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Contiguous partition of ``costs`` into ``num_stages`` non-empty parts minimising the slowest part.

    A part's time is the sum of its blocks' ``costs`` plus, with ``cut_costs``, the cost of each
    cut it borders: ``cut_costs[i]`` is what cutting after block ``i`` adds to each of the two
    stages it joins (the time of its messages: the activation one way, its gradient the other).
    So a cut where the network is narrow wins over an equally balanced one where it is wide.

    Exact dynamic programme, ``O(num_stages * n^2)``; ties are broken deterministically (the
    earliest cut wins), so every rank computing it from the same costs gets the same split.

    Raises:
        ValueError: Too many stages for the blocks, or ``cut_costs`` not of length ``len(costs) - 1``.
    """
    n = len(costs)
    check_stage_count(n, num_stages)
    if cut_costs is not None and len(cut_costs) != n - 1:
        raise ValueError(f"balanced_split: `cut_costs` needs one entry per cut point ({n - 1}), got {len(cut_costs)}.")
    edge = [0.0, *(float(c) for c in (cut_costs or [0.0] * (n - 1))), 0.0]  # edge[i]: a stage starting/ending at i
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: minimal bottleneck of the first i blocks in j stages; cut[j][i]: start of stage j-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c] + edge[c] + edge[i])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    points: list[int] = []
    i = n
    for j in range(num_stages, 1, -1):
        i = cut[j][i]
        points.append(i)
    return tuple(reversed(points))


@torch.no_grad()
def _restore(tensors: Sequence[Tensor], saved: Sequence[Tensor]) -> None:
    for t, s in zip(tensors, saved, strict=True):
        t.copy_(s)


def measure_block_costs(blocks: Sequence[nn.Module], sample: Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward + backward of each block on the activations ``sample`` produces.

    The blocks are left as they were: buffers (BatchNorm statistics) are restored, gradients
    cleared and the global RNG state is untouched.
    """
    devices = [sample.device] if sample.device.type == "cuda" else []
    costs: list[float] = []
    h = sample
    with torch.random.fork_rng(devices=devices):
        for block in blocks:
            buffers = list(block.buffers())
            saved = [b.clone() for b in buffers]
            times = []
            for _ in range(repeats + 1):  # the first run warms up allocators and kernels
                x = h.detach().requires_grad_(h.is_floating_point())
                _sync(sample.device)
                start = time.perf_counter()
                with torch.enable_grad():
                    out = block(x)
                    if out.requires_grad:
                        out.backward(torch.ones_like(out))
                _sync(sample.device)
                times.append(time.perf_counter() - start)
            costs.append(statistics.median(times[1:]))
            h = out.detach()
            _restore(buffers, saved)
            for p in block.parameters():
                p.grad = None
    return costs


def block_output_bytes(blocks: Sequence[nn.Module], sample: Tensor, wire_dtype: torch.dtype | None = None) -> list[int]:
    """Bytes of each block's output on ``sample`` (what a cut after the block sends each way).

    With ``wire_dtype``, floating outputs wider than it count at its size (they travel in it).
    Runs the blocks in eval mode without gradients (buffers and the global RNG are untouched) and
    restores their modes.
    """
    modes = [b.training for b in blocks]
    sizes = []
    h = sample
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[sample.device] if sample.device.type == "cuda" else []):
            for block in blocks:
                h = block.eval()(h)
                size = h.element_size()
                if wire_dtype is not None and h.is_floating_point():
                    size = min(size, wire_dtype.itemsize)
                sizes.append(h.numel() * size)
    finally:
        for block, mode in zip(blocks, modes, strict=True):
            block.train(mode)
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
