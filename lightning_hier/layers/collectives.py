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
:func:`halo_exchange`       rows from both neighbours    halo gradients sent back and added
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


def even_shard_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` nearly equal shards of ``n`` (the first ``n % parts`` one larger)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``index`` of :func:`even_shard_sizes`."""
    sizes = even_shard_sizes(n, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


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
class _GatherAlong(Function):
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], g: GridContext, kind: str) -> Tensor:
        ctx.dim, ctx.sizes, ctx.r = dim, sizes, g.r
        width = max(sizes)
        if x.shape[dim] < width:  # gloo gathers equal sizes only: pad short shards, trim after
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        chunks = all_gather_raw(x, g, kind)
        return torch.cat([c.narrow(dim, 0, n) for c, n in zip(chunks, sizes, strict=True)], dim=dim)

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
        n = x.shape[dim] // g.pr
        ctx.dim, ctx.g, ctx.kind = dim, g, kind
        return x.narrow(dim, g.r * n, n).clone()

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return torch.cat(all_gather_raw(grad, ctx.g, ctx.kind), dim=ctx.dim), None, None, None


class _Halo(Function):
    @staticmethod
    @override
    def forward(ctx: Any, x: Tensor, top: int, bottom: int, g: GridContext) -> Tensor:
        ctx.top, ctx.bottom, ctx.g = top, bottom, g
        up, down = _neighbours(g)
        rows = x.shape[2]
        above = x.new_zeros(x.shape[0], x.shape[1], top, x.shape[3])
        below = x.new_zeros(x.shape[0], x.shape[1], bottom, x.shape[3])
        sends, recvs = [], []
        if up is not None:  # the rank above needs my first rows as its bottom halo
            sends += [(x[:, :, :bottom], up)] if bottom else []
            recvs += [(above, up)] if top else []
        if down is not None:
            sends += [(x[:, :, rows - top :], down)] if top else []
            recvs += [(below, down)] if bottom else []
        exchange(sends, recvs, g, "halo")
        return torch.cat([above, x, below], dim=2)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        top, bottom, g = ctx.top, ctx.bottom, ctx.g
        up, down = _neighbours(g)
        rows = grad.shape[2] - top - bottom
        out = grad[:, :, top : top + rows].clone()
        from_up = grad.new_empty(grad.shape[0], grad.shape[1], bottom, grad.shape[3])
        from_down = grad.new_empty(grad.shape[0], grad.shape[1], top, grad.shape[3])
        sends, recvs = [], []
        if up is not None:  # my top halo's gradient belongs to the last rows of the rank above
            sends += [(grad[:, :, :top], up)] if top else []
            recvs += [(from_up, up)] if bottom else []
        if down is not None:
            sends += [(grad[:, :, top + rows :], down)] if bottom else []
            recvs += [(from_down, down)] if top else []
        exchange(sends, recvs, g, "halo")
        if up is not None and bottom:
            out[:, :, :bottom] += from_up
        if down is not None and top:
            out[:, :, rows - top :] += from_down
        return out, None, None, None


def _neighbours(g: GridContext) -> tuple[int | None, int | None]:
    up = g.model_ranks[g.r - 1] if g.r > 0 else None
    down = g.model_ranks[g.r + 1] if g.r < g.pr - 1 else None
    return up, down


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
    """This rank's equal slice of a tensor replicated over MODEL; the backward all-gathers."""
    if g.pr == 1:
        return x
    if x.shape[dim] % g.pr:
        raise ValueError(f"split_along: size {x.shape[dim]} of dim {dim} is not divisible by Pr={g.pr}.")
    return _SplitAlong.apply(x, dim % x.dim(), g, kind)


def halo_exchange(x: Tensor, top: int, bottom: int, g: GridContext) -> Tensor:
    """Prepend ``top`` rows from the rank above and append ``bottom`` rows from the rank below.

    ``x`` is this rank's slab ``[N, C, H_r, W]`` of a tensor split along H. Rows beyond the global
    edges are zeros (the zero padding of a convolution). The backward sends the gradient of each
    halo back to the rank that owns those rows, which adds it to its own.
    """
    if g.pr == 1 or (top == 0 and bottom == 0):
        return torch.nn.functional.pad(x, (0, 0, top, bottom)) if top or bottom else x
    return _Halo.apply(x, top, bottom, g)
