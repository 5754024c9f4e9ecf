"""Measure alpha (latency per message) and beta (seconds per word) on a live process group."""

from __future__ import annotations

import time
from collections.abc import Callable
from math import ceil, log2
from statistics import median

import torch
import torch.distributed as dist

from lightning_hier.planner.cost import Link, Links


def measure_link(
    group: dist.ProcessGroup | None = None,
    large_words: int = 1 << 18,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Link:
    """Fit the cost model's all-reduce ``2 alpha ceil(lg p) + 2 beta (p - 1) / p n`` on ``group``.

    A collective: every rank of ``group`` must call it. Times a one-word and a ``large_words``
    all-reduce (median of ``repeats`` after one warm-up each); every rank returns the same
    :class:`~lightning_hier.planner.Link` (the largest measured on any rank).

    Raises:
        ValueError: The group has one rank (nothing to measure).
    """
    p = dist.get_world_size(group)
    if p < 2:
        raise ValueError("measure_link: the group has a single rank; give alpha and beta instead.")
    small = _median_all_reduce(torch.zeros(1, dtype=dtype, device=device), group, repeats)
    large = _median_all_reduce(torch.zeros(large_words, dtype=dtype, device=device), group, repeats)
    lg = ceil(log2(p))
    return _agree(Link(small / (2 * lg), max(large - small, 1e-9) / (2 * (p - 1) / p * large_words)), group)


def _agree(link: Link, group: dist.ProcessGroup | None) -> Link:
    """The largest alpha and beta over ``group``: every rank must choose the same grid."""
    fit = torch.tensor([link.alpha, link.beta], dtype=torch.float64)
    dist.all_reduce(fit, op=dist.ReduceOp.MAX, group=group)
    return Link(alpha=float(fit[0]), beta=float(fit[1]))


def measure_links(num_nodes: int = 1) -> Callable[[int, int], Links]:
    """Measure intra-node and inter-node links of the default group; returns ``(pr, pc) -> Links``.

    A collective on the default group (every rank calls it; all get the same numbers). Ranks are
    laid out node by node, so a MODEL group (consecutive ranks) stays inside a node when
    ``pr <= ranks per node``; BATCH and whole-grid groups cross nodes when there are several.
    """
    world = dist.get_world_size()
    per_node = world // num_nodes
    inter = measure_link(None)
    intra = inter
    if num_nodes > 1 and per_node > 1:
        mine, _ = dist.new_subgroups(group_size=per_node)
        intra = _agree(measure_link(mine), None)  # each node measured its own: agree over all

    def links(pr: int, pc: int) -> Links:
        model = intra if pr <= per_node else inter
        return Links(model=model, batch=inter if num_nodes > 1 else intra, grid=inter if num_nodes > 1 else intra)

    return links


def _median_all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        if i:  # the first call sets up buffers and connections
            times.append(time.perf_counter() - start)
    return median(times)
