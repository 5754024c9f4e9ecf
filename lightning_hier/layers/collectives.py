"""Autograd-aware collectives of the grid layers, each counting its bytes.

Forward and backward of each function are a pair of collectives (Gholami et al., SPAA 2018,
arXiv 1712.04432, section 3; Megatron-LM's ``mappings.py`` for the fully connected pair):

==========================  ===========================  ====================================
function                    forward                      backward
==========================  ===========================  ====================================
:func:`gather_along`        all-gather over MODEL        keep this rank's slice (no message)
:func:`copy_to_model`       identity                     all-reduce (sum) over MODEL
:func:`all_reduce_sum`      all-reduce (sum) over MODEL  all-reduce (sum) over MODEL
:func:`split_along`         keep this rank's slice       all-gather over MODEL
:func:`row_exchange`        the rows a window reads      their gradients sent back and added
==========================  ===========================  ====================================

The sliced backward of :func:`gather_along` is exact because everything downstream of the gather
is computed identically on every rank of the MODEL group, so every rank holds the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function
from typing_extensions import override

from lightning_hier.comm import all_reduce_sum_, payload_bytes, wait_all
from lightning_hier.comm.collectives import p2p_wait_limit
from lightning_hier.layers.context import GridCommStats, GridContext
from lightning_hier.layers.rows import SlabPlan, even_shard_sizes, shard_range

__all__ = [
    "all_reduce_sum",
    "copy_to_model",
    "even_shard_sizes",
    "gather_along",
    "row_exchange",
    "shard_range",
    "split_along",
]


# ---------------------------------------------------------------------------- raw collectives
def _record(stats: GridCommStats | None, kind: str, payload: int, wire: float, calls: int = 1) -> None:
    if stats is not None:
        stats.add(payload, calls=calls)
        stats.add_wire(kind, wire)


def all_reduce_sum_raw_(tensor: Tensor, group: dist.ProcessGroup | None, size: int, g: GridContext, kind: str) -> None:
    """In-place SUM all-reduce of one tensor over ``group`` (of ``size`` ranks), counted under ``kind``."""
    if group is None or size == 1:
        return
    all_reduce_sum_([tensor], group, g.stats)
    if g.stats is not None:
        g.stats.add_wire(kind, 2 * (size - 1) / size * payload_bytes([tensor]))


def all_gather_raw(chunk: Tensor, g: GridContext, kind: str) -> list[Tensor]:
    """All-gather equal-size chunks over MODEL; returns the ``pr`` chunks ordered by r."""
    chunk = chunk.contiguous()
    out = [torch.empty_like(chunk) for _ in range(g.pr)]
    stats = g.stats
    if stats is None:
        dist.all_gather(out, chunk, group=g.model_group)
    else:
        with stats.blocked():
            dist.all_gather(out, chunk, group=g.model_group)
    full = payload_bytes(out)
    _record(stats, kind, payload_bytes([chunk]), (g.pr - 1) / g.pr * full)
    return out


def exchange(
    sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], g: GridContext, kind: str
) -> None:
    """Point-to-point messages inside the MODEL group: ``(tensor, global peer rank)`` pairs."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=g.model_group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=g.model_group) for t, peer in recvs]
    if not ops:
        return
    stats = g.stats
    wait_all(dist.batch_isend_irecv(ops), stats, p2p_wait_limit(g.model_group, g.timeout))
    sent = payload_bytes([t for t, _ in sends])
    _record(stats, kind, sent, sent, calls=len(sends))


# ---------------------------------------------------------------------------- autograd functions
def _gather_padded(x: Tensor, dim: int, sizes: Sequence[int], g: GridContext, kind: str) -> Tensor:
    """All-gather shards of ``sizes`` along ``dim`` (gloo gathers equal sizes only: pad short ones, trim after)."""
    width = max(sizes)
    if x.shape[dim] < width:
        pad = list(x.shape)
        pad[dim] = width - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    chunks = all_gather_raw(x, g, kind)
    return torch.cat([c.narrow(dim, 0, n) for c, n in zip(chunks, sizes, strict=True)], dim=dim)


class _GatherAlong(Function):
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], g: GridContext, kind: str) -> Tensor:
        ctx.dim, ctx.sizes, ctx.r = dim, sizes, g.r
        return _gather_padded(x, dim, sizes, g, kind)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        start = sum(ctx.sizes[: ctx.r])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.r]), None, None, None, None


def _model_sum(t: Tensor, g: GridContext, kind: str) -> Tensor:
    out = t.contiguous().clone()
    all_reduce_sum_raw_(out, g.model_group, g.pr, g, kind)
    return out


class _CopyToModel(Function):
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, g: GridContext, kind: str) -> Tensor:
        ctx.g, ctx.kind = g, kind
        return x.view_as(x)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _model_sum(grad, ctx.g, ctx.kind), None, None


class _AllReduceSum(_CopyToModel):
    # y = sum_r x_r on every rank, so dL/dx_r = sum_r' dL/dy_r': the same sum in the backward
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, g: GridContext, kind: str) -> Tensor:
        ctx.g, ctx.kind = g, kind
        return _model_sum(x, g, kind)


class _SplitAlong(Function):
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, dim: int, g: GridContext, kind: str) -> Tensor:
        ctx.dim, ctx.g, ctx.kind = dim, g, kind
        ctx.sizes = even_shard_sizes(x.shape[dim], g.pr)
        start, stop = shard_range(x.shape[dim], g.pr, g.r)
        return x.narrow(dim, start, stop - start).clone()

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _gather_padded(grad, ctx.dim, ctx.sizes, ctx.g, ctx.kind), None, None, None


def _rows(x: Tensor, start: int, stop: int) -> Tensor:
    return x.narrow(2, start, stop - start)


class _RowExchange(Function):
    # forward: the rows plan.read of the image, assembled from my slab and the pieces of their
    # owners; backward: each piece's gradient goes back to its owner, which adds it to its rows
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, plan: SlabPlan, g: GridContext) -> Tensor:
        ctx.plan, ctx.g, ctx.shape = plan, g, x.shape
        first = plan.own[0]
        got = {q: x.new_empty(x.shape[0], x.shape[1], b - a, x.shape[3]) for q, a, b in plan.recv}
        sends = [(_rows(x, a - first, b - first), g.model_ranks[q]) for q, a, b in plan.send]
        exchange(sends, [(t, g.model_ranks[q]) for q, t in got.items()], g, "halo")
        start, stop = max(plan.read[0], plan.own[0]), min(plan.read[1], plan.own[1])
        mine = [_rows(x, start - first, stop - first)] if start < stop else []
        above = [got[q] for q, _, _ in plan.recv if q < plan.rank]
        below = [got[q] for q, _, _ in plan.recv if q > plan.rank]
        pieces = above + mine + below
        return torch.cat(pieces, dim=2) if pieces else _rows(x, 0, 0).clone()

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plan, g = ctx.plan, ctx.g
        first, offset = plan.own[0], plan.read[0]
        out = grad.new_zeros(ctx.shape)
        back = {q: grad.new_empty(grad.shape[0], grad.shape[1], b - a, grad.shape[3]) for q, a, b in plan.send}
        sends = [(_rows(grad, a - offset, b - offset), g.model_ranks[q]) for q, a, b in plan.recv]
        exchange(sends, [(t, g.model_ranks[q]) for q, t in back.items()], g, "halo")
        start, stop = max(plan.read[0], plan.own[0]), min(plan.read[1], plan.own[1])
        if start < stop:
            _rows(out, start - first, stop - first).add_(_rows(grad, start - offset, stop - offset))
        for q, a, b in plan.send:
            _rows(out, a - first, b - first).add_(back[q])
        return out, None, None


# ---------------------------------------------------------------------------- public wrappers
def gather_along(x: Tensor, dim: int, sizes: Sequence[int], g: GridContext, kind: str) -> Tensor:
    """All-gather this rank's shard (``sizes[r]`` wide along ``dim``) over MODEL; sliced backward."""
    if g.pr == 1:
        return x
    return _GatherAlong.apply(x, dim % x.dim(), tuple(sizes), g, kind)


def copy_to_model(x: Tensor, g: GridContext, kind: str) -> Tensor:
    """Identity forward; the backward sums the input gradient over MODEL (partial products)."""
    if g.pr == 1:
        return x
    return _CopyToModel.apply(x, g, kind)


def all_reduce_sum(x: Tensor, g: GridContext, kind: str) -> Tensor:
    """Sum over MODEL, differentiable (the backward is the same sum of the gradients)."""
    if g.pr == 1:
        return x
    return _AllReduceSum.apply(x, g, kind)


def split_along(x: Tensor, dim: int, g: GridContext, kind: str) -> Tensor:
    """This rank's shard (:func:`shard_range`) of a tensor replicated over MODEL; the backward all-gathers."""
    if g.pr == 1:
        return x
    return _SplitAlong.apply(x, dim % x.dim(), g, kind)


def row_exchange(x: Tensor, plan: SlabPlan, g: GridContext) -> Tensor:
    """The image rows ``plan.read`` that this rank's window reads, from its slab ``x`` and their owners.

    ``x`` is this rank's slab ``[N, C, H_r, W]`` (rows ``plan.own``) of a tensor split along H by
    :mod:`lightning_hier.layers.rows`. Every rank of the MODEL group calls it with its own plan of
    the same layer (the sends of one are the receives of the others). The backward sends the
    gradient of each received piece back to its owner, which adds it to its own rows.

    Raises:
        ValueError: ``x`` does not hold the rows the plan says this rank owns.
    """
    if x.shape[2] != plan.own[1] - plan.own[0]:
        raise ValueError(
            f"row_exchange: rank r={plan.rank} holds a slab of {x.shape[2]} rows, but owns rows "
            f"{plan.own[0]}..{plan.own[1]} of its layer's input by the row-ownership rule."
        )
    if g.pr == 1:
        return _rows(x, plan.read[0], plan.read[1])
    return _RowExchange.apply(x, plan, g)
