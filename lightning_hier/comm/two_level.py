"""A mean over the data dimension in two levels, with each node's cross-node traffic split among its ranks.

``two_level_mean_(tensors, intra, inter)`` equals ``all_reduce_mean_`` over the whole data group
when ``intra`` is this rank's node-local data group and ``inter`` its cross-node group of the
same local index (:meth:`~lightning_hier.topology.Topology.data_level_groups`):

1. mean over ``intra`` (fast links): every rank of the node now holds the node's mean;
2. this rank's chunk ``i`` (``i``: its index in ``intra``) of each flat tensor is averaged over
   ``inter``, whose ranks all hold chunk ``i`` (slow links: ``1 / |intra|`` of the payload per rank,
   instead of all of it: together the node sends each value across once);
3. all-gather of the chunks over ``intra``.

Every intra group has the same size, so the mean of the node means is the mean over all
replicas. Pure ``torch.distributed``; groups are explicit arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hier.comm.collectives import Group, all_reduce_mean_, group_size, payload_bytes
from lightning_hier.comm.stats import CommStats


@torch.no_grad()
def two_level_mean_(tensors: Sequence[Tensor], intra: Group, inter: Group, stats: CommStats | None = None) -> None:
    """In-place mean of 1-D contiguous ``tensors`` over ``intra`` x ``inter`` (see the module docstring)."""
    all_reduce_mean_(tensors, intra, stats)
    if inter is None:
        return
    parts = group_size(intra)
    if parts == 1:
        all_reduce_mean_(tensors, inter, stats)
        return
    mine = dist.get_rank(intra)
    for t in tensors:
        # equal chunks (all_gather needs them): pad to a multiple of the node's ranks
        size = -(-t.numel() // parts)
        padded = torch.zeros(size * parts, dtype=t.dtype, device=t.device)
        padded[: t.numel()].copy_(t)
        chunks = list(padded.chunk(parts))
        all_reduce_mean_([chunks[mine]], inter, stats)
        work = dist.all_gather(chunks, chunks[mine].clone(), group=intra, async_op=True)
        assert work is not None
        with stats.blocked() if stats is not None else nullcontext():
            work.wait()
        if stats is not None:
            stats.add(payload_bytes([chunks[mine]]))
        t.copy_(padded[: t.numel()])
