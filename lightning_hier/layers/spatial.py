"""Domain (spatial) parallel layers (Gholami et al., SPAA 2018, arXiv 1712.04432, section 3.2).

Rank (r, c) holds slab r of the image rows of the samples of batch block c; which rows that is,
for every tensor between the first convolution and the conv -> FC transition, is decided by the
one row-ownership rule of :mod:`lightning_hier.layers.rows` (``torch.tensor_split`` sizes, so
heights need not be divisible by Pr). Weights are replicated on every rank.

- :class:`DomainConv2d`: derives the input rows its output rows read (from kernel, stride,
  padding, dilation), receives the ones it does not own from whichever ranks own them (one
  neighbour, several, or none), pads the image's edges with zeros and convolves; the backward
  sends each received row's gradient back to its owner. Its weight gradient is partial per
  slab: summed over MODEL, then averaged over BATCH.
- :class:`GridBatchNorm2d`: per-channel sum and sum of squares all-reduced over MODEL, so the
  statistics are those of the whole images of the batch block.
- :class:`~lightning_hier.layers.pooling.SlabPool2d`: max / average pooling the same way
  (a -inf edge for max).
- :class:`GatherSlabs`: the conv -> FC transition: all-gather the slabs over MODEL (then the
  wrapped ``Flatten`` / global pooling sees whole images, so the flatten order is unchanged).

With Pr = 1 every layer is its ordinary counterpart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier.layers.collectives import all_reduce_sum, gather_along, row_exchange, split_along
from lightning_hier.layers.context import GridContext, ParamKind
from lightning_hier.layers.heights import SlabHeights
from lightning_hier.layers.rows import RowWindow, SlabPlan, even_shard_sizes, slab_plan, split_problems


def pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    """``(H, W)`` of a size given as one int or a pair."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def conv_padding(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, bottom), (left, right)) zero padding of ``conv`` (resolving ``'same'`` / ``'valid'``)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0), (0, 0)
        sides = []
        for d, k in zip(pair(conv.dilation), pair(conv.kernel_size), strict=True):
            total = d * (k - 1)
            sides.append((total // 2, total - total // 2))  # as torch: the extra row goes last
        return sides[0], sides[1]
    ph, pw = pair(conv.padding)
    return (ph, ph), (pw, pw)


def conv_window(conv: nn.Conv2d) -> RowWindow:
    """The :class:`~lightning_hier.layers.rows.RowWindow` of ``conv`` along H."""
    (top, bottom), _ = conv_padding(conv)
    return RowWindow(conv.kernel_size[0], conv.stride[0], top, bottom, conv.dilation[0])


def window_rows(x: Tensor, window: RowWindow, height: int, fill: float, grid: GridContext) -> tuple[Tensor, SlabPlan]:
    """The input rows this rank's output rows read, padded with ``fill`` beyond the image's edges.

    ``x`` is this rank's slab of an input of ``height`` global rows. A rank without output rows
    gets one window of zeros (``window.reach`` rows): the caller computes on it and keeps none of
    the result, so the layer's parameters still get their (zero) gradient here and the exchange's
    backward, which other ranks wait for, still runs.
    """
    plan = slab_plan(window, height, grid.pr, grid.r)
    rows = row_exchange(x, plan, grid)
    if plan.out_rows == 0:
        return F.pad(rows, (0, 0, 0, window.reach - rows.shape[2])), plan
    if any(plan.pad):
        rows = F.pad(rows, (0, 0, *plan.pad), value=fill)
    return rows, plan


def reject(owner: str, problems: list[str], grid: GridContext) -> None:
    """Raise a ValueError naming ``owner`` if it has ``problems`` and must run on slabs (Pr > 1)."""
    if grid.pr > 1 and problems:
        raise ValueError(f"{owner} cannot run on slabs of image rows: {'; '.join(problems)}. Use Pr=1 for it.")


class DomainConv2d(nn.Conv2d):
    """``nn.Conv2d`` on slabs of rows, exchanging the rows its windows read (same parameters and state as Conv2d).

    Any kernel, stride, dilation and zero padding along H (the split axis), any height and Pr:
    slabs may be uneven, thinner than the kernel's reach (rows then come from several ranks) or
    empty. The W axis is not split, so anything goes there. Only ``padding_mode='zeros'`` is
    supported with Pr > 1 (the global edge is known only to the edge slabs).

    Args:
        grid: This rank's grid context.
        split_input: The input is whole images replicated over MODEL (the first domain layer):
            take this rank's slab first.
        heights: The global heights shared by the network's domain layers (a private one if not given).
        name: This layer's key in ``heights`` (its path in the network).
        *args, **kwargs: As ``nn.Conv2d``.
    """

    param_kind = ParamKind.PARTIAL

    def __init__(
        self,
        *args: object,
        grid: GridContext,
        split_input: bool = False,
        heights: SlabHeights | None = None,
        name: str = "",
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grid, self.split_input = grid, split_input
        self.heights = heights if heights is not None else SlabHeights()
        self.slab_name = name or f"conv@{id(self)}"
        _, self.pad_w = conv_padding(self)
        self.window = conv_window(self)
        owner = f"DomainConv2d(kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding})"
        reject(owner, split_problems(padding_mode=self.padding_mode), grid)

    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        grid: GridContext,
        split_input: bool = False,
        heights: SlabHeights | None = None,
        name: str = "",
    ) -> DomainConv2d:
        w = conv.weight
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device=w.device,
            dtype=w.dtype,
            grid=grid,
            split_input=split_input,
            heights=heights,
            name=name,
        )
        new.load_state_dict(conv.state_dict())
        return new

    def to_conv(self) -> nn.Conv2d:
        w = self.weight
        conv = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,  # type: ignore[arg-type]
            stride=self.stride,  # type: ignore[arg-type]
            padding=self.padding,  # type: ignore[arg-type]
            dilation=self.dilation,  # type: ignore[arg-type]
            groups=self.groups,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
            device=w.device,
            dtype=w.dtype,
        )
        conv.load_state_dict(self.state_dict())
        return conv

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.grid.pr == 1:
            return super().forward(x)
        if self.split_input:
            height = x.shape[2]
            self.heights.start(x.shape[2:])
            x = split_along(x, 2, self.grid, "input_split")
        else:
            height = self.heights.height(self.slab_name, x.shape[2], self.grid, x.device)
        rows, plan = window_rows(x, self.window, height, 0.0, self.grid)
        if any(self.pad_w):
            rows = F.pad(rows, self.pad_w)
        y = F.conv2d(rows, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return y if plan.out_rows else y[:, :, :0]


class GridBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose batch statistics span the slabs of the MODEL group.

    The per-channel sum and sum of squares (shifted by the running mean, identical on the MODEL
    group, against cancellation) are all-reduced over MODEL in one message; the backward of that
    all-reduce carries the gradient sums the normalisation needs. Running statistics are updated
    with the MODEL-wide statistics, as ``nn.BatchNorm2d`` would on whole images.
    """

    param_kind = ParamKind.PARTIAL

    def __init__(
        self, *args: object, grid: GridContext, heights: SlabHeights | None = None, name: str = "", **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grid = grid
        self.heights = heights if heights is not None else SlabHeights()
        self.slab_name = name or f"bn@{id(self)}"

    @classmethod
    def from_batchnorm(
        cls, bn: nn.BatchNorm2d, grid: GridContext, heights: SlabHeights | None = None, name: str = ""
    ) -> GridBatchNorm2d:
        ref = bn.weight if bn.weight is not None else bn.running_mean
        kw = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        new = cls(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            grid=grid,
            heights=heights,
            name=name,
            **kw,
        )
        new.load_state_dict(bn.state_dict())
        new.train(bn.training)
        return new

    def to_batchnorm(self) -> nn.BatchNorm2d:
        bn = nn.BatchNorm2d(self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats)
        ref = self.weight if self.weight is not None else self.running_mean
        if ref is not None:
            bn.to(device=ref.device, dtype=ref.dtype)
        bn.load_state_dict(self.state_dict())
        bn.train(self.training)
        return bn

    @override
    def forward(self, x: Tensor) -> Tensor:
        use_batch_stats = self.training or self.running_mean is None
        if self.grid.pr == 1 or not use_batch_stats:
            return super().forward(x)
        dtype = x.dtype
        if dtype in (torch.float16, torch.bfloat16):  # statistics in fp32, as torch's batch norm under autocast
            x = x.float()
        shift = self.running_mean.detach().to(x.dtype) if self.running_mean is not None else x.new_zeros(x.shape[1])
        xs = x - shift[None, :, None, None]
        local = torch.stack([xs.sum((0, 2, 3)), (xs * xs).sum((0, 2, 3))])
        height = self.heights.height(self.slab_name, x.shape[2], self.grid, x.device)
        total = all_reduce_sum(local, self.grid, "bn_stats")
        n = x.shape[0] * height * x.shape[3]
        mean_s = total[0] / n
        var = total[1] / n - mean_s * mean_s
        mean = mean_s + shift
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n)
        y = (x - mean[None, :, None, None]) * torch.rsqrt(var + self.eps)[None, :, None, None]
        if self.affine:
            y = y * self.weight[None, :, None, None] + self.bias[None, :, None, None]
        return y.to(dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, n: int) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_((var * n / max(n - 1, 1)).to(self.running_var.dtype), factor)


class GatherSlabs(nn.Module):
    """The conv -> FC transition: all-gather the slabs over MODEL, then run ``inner`` on whole images.

    Args:
        inner: The ``Flatten`` or global pooling to run on whole images.
        grid: This rank's grid context.
        heights: The global heights shared by the network's domain layers (a private one if not given).
        name: This layer's key in ``heights``.
    """

    def __init__(self, inner: nn.Module, grid: GridContext, heights: SlabHeights | None = None, name: str = "") -> None:
        super().__init__()
        self.inner, self.grid = inner, grid
        self.heights = heights if heights is not None else SlabHeights()
        self.slab_name = name or f"gather@{id(self)}"

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.grid.pr > 1:
            height = self.heights.height(self.slab_name, x.shape[2], self.grid, x.device)
            x = gather_along(x, 2, even_shard_sizes(height, self.grid.pr), self.grid, "transition")
        return self.inner(x)
