"""Domain (spatial) parallel layers (Gholami et al., SPAA 2018, arXiv 1712.04432, section 3.2).

Rank (r, c) holds slab r of the image rows (the H axis split into Pr equal slabs) of the samples
of batch block c; weights are replicated on every rank.

- :class:`DomainConv2d`: exchanges the boundary rows its windows need with the two neighbouring
  slabs (the halo), convolves the haloed slab without padding along H (zero halo at the global
  edges) and, in the backward, sends each halo's gradient back to its owner. Its weight gradient
  is partial per slab: summed over MODEL, then averaged over BATCH.
- :class:`GridBatchNorm2d`: per-channel sum and sum of squares all-reduced over MODEL, so the
  statistics are those of the whole images of the batch block.
- :class:`SlabPool2d`: pooling whose windows never cross a slab boundary (checked), run locally.
- :class:`GatherSlabs`: the conv -> FC transition: all-gather the slabs over MODEL (then the
  wrapped ``Flatten`` / global pooling sees whole images, so the flatten order is unchanged).

With Pr = 1 every layer is its ordinary counterpart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier.layers.collectives import all_reduce_sum, gather_along, halo_exchange, split_along
from lightning_hier.layers.context import GridContext, ParamKind


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def conv_padding(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, bottom), (left, right)) zero padding of ``conv`` (resolving ``'same'`` / ``'valid'``)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0), (0, 0)
        sides = []
        for d, k in zip(_pair(conv.dilation), _pair(conv.kernel_size), strict=True):
            total = d * (k - 1)
            sides.append((total // 2, total - total // 2))  # as torch: the extra row goes last
        return sides[0], sides[1]
    ph, pw = _pair(conv.padding)
    return (ph, ph), (pw, pw)


class DomainConv2d(nn.Conv2d):
    """``nn.Conv2d`` on slabs of rows, with a halo exchange (same parameters and state as Conv2d).

    Supported along H (the split axis): zero padding, any kernel, stride and dilation for which
    every slab produces exactly ``H_r / stride`` output rows from its own rows plus a halo of
    ``top = padding`` rows from the slab above and ``bottom = max(0, k_eff - padding - stride)``
    rows from the slab below (``k_eff = dilation * (k - 1) + 1``), each no larger than a slab.
    That covers "same" convolutions of odd kernels (halo ``k // 2`` on both sides) and the usual
    stride-2 downsampling (k=3, padding=1; k=1, padding=0). Anything else is rejected with the
    reason. The W axis is not split, so anything goes there.

    Args:
        grid: This rank's grid context.
        split_input: The input is whole images replicated over MODEL (the first domain layer):
            take this rank's slab first.
        *args, **kwargs: As ``nn.Conv2d``.
    """

    param_kind = ParamKind.PARTIAL

    def __init__(self, *args: object, grid: GridContext, split_input: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grid, self.split_input = grid, split_input
        (top, bottom), self.pad_w = conv_padding(self)
        if grid.pr > 1 and self.padding_mode != "zeros":
            raise ValueError(
                f"DomainConv2d: padding_mode={self.padding_mode!r} is not supported under a spatial split "
                "(the global edge is known only to the edge slabs); use padding_mode='zeros' or Pr=1."
            )
        k_eff = self.dilation[0] * (self.kernel_size[0] - 1) + 1
        self.halo = (top, max(0, k_eff - top - self.stride[0]))
        self._torch_pad_h = (top, bottom)
        self._checked: set[int] = set()

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, grid: GridContext, split_input: bool = False) -> DomainConv2d:
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

    def check_height(self, height: int) -> None:
        """Raise a ValueError naming the problem if images of ``height`` rows cannot be split over Pr."""
        pr, stride = self.grid.pr, self.stride[0]
        if pr == 1 or height in self._checked:
            return
        k_eff = self.dilation[0] * (self.kernel_size[0] - 1) + 1
        top, bottom = self.halo
        rows = height // pr
        torch_out = (height + sum(self._torch_pad_h) - k_eff) // stride + 1
        problem = None
        if height % pr:
            problem = f"the height {height} is not divisible by Pr={pr}"
        elif rows % stride or torch_out * stride != height:
            problem = f"slabs of {rows} rows do not map onto output rows of stride {stride} (output height {torch_out})"
        elif max(top, bottom) > rows:
            problem = f"the halo ({top} rows above, {bottom} below) is larger than a slab of {rows} rows"
        if problem:
            raise ValueError(
                f"DomainConv2d(k={self.kernel_size}, stride={self.stride}, padding={self.padding}): {problem}. "
                "Use a smaller Pr, an input whose height is a multiple of Pr * (total stride), or Pr=1."
            )
        self._checked.add(height)

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.grid.pr == 1:
            return super().forward(x)
        if self.split_input:
            self.check_height(x.shape[2])
            x = split_along(x, 2, self.grid, "input_split")
        else:
            self.check_height(x.shape[2] * self.grid.pr)
        x = halo_exchange(x, self.halo[0], self.halo[1], self.grid)
        if any(self.pad_w):
            x = F.pad(x, self.pad_w)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class GridBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose batch statistics span the slabs of the MODEL group.

    The per-channel sum and sum of squares (shifted by the running mean, identical on the MODEL
    group, against cancellation) are all-reduced over MODEL in one message; the backward of that
    all-reduce carries the gradient sums the normalisation needs. Running statistics are updated
    with the MODEL-wide statistics, as ``nn.BatchNorm2d`` would on whole images.
    """

    param_kind = ParamKind.PARTIAL

    def __init__(self, *args: object, grid: GridContext, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.grid = grid

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d, grid: GridContext) -> GridBatchNorm2d:
        ref = bn.weight if bn.weight is not None else bn.running_mean
        kw = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, grid=grid, **kw)
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
        total = all_reduce_sum(local, self.grid, "bn_stats")
        n = x.shape[0] * x.shape[2] * x.shape[3] * self.grid.pr
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


class SlabPool2d(nn.Module):
    """A max / average pooling whose windows stay inside a slab (checked), run on each slab.

    Supported along H: no padding, kernel (times dilation) no larger than the stride, and slab
    heights divisible by the stride, e.g. the usual ``MaxPool2d(2)``. Overlapping windows would
    need a halo padded with -inf; they are rejected with that reason.
    """

    def __init__(self, inner: nn.MaxPool2d | nn.AvgPool2d, grid: GridContext) -> None:
        super().__init__()
        self.inner, self.grid = inner, grid
        k, s = _pair(inner.kernel_size), _pair(inner.stride or inner.kernel_size)
        p = _pair(inner.padding)
        d = _pair(getattr(inner, "dilation", 1))
        self.stride_h = s[0]
        if grid.pr > 1 and (p[0] != 0 or d[0] * (k[0] - 1) + 1 > s[0]):
            raise ValueError(
                f"{type(inner).__name__}(kernel_size={inner.kernel_size}, stride={inner.stride}, "
                f"padding={inner.padding}): pooling windows overlap or are padded along H, so they would cross "
                "slab boundaries; only non-overlapping, unpadded windows (e.g. MaxPool2d(2)) are supported "
                "with Pr > 1."
            )

    def check_height(self, height: int) -> None:
        """Raise a ValueError if images of ``height`` rows do not split into slabs of whole windows."""
        if self.grid.pr > 1 and height % (self.grid.pr * self.stride_h):
            raise ValueError(
                f"{type(self.inner).__name__}: the height {height} is not a multiple of Pr * stride = "
                f"{self.grid.pr} * {self.stride_h}, so slabs would not hold whole pooling windows."
            )

    @override
    def forward(self, x: Tensor) -> Tensor:
        self.check_height(x.shape[2] * self.grid.pr)
        return self.inner(x)


class GatherSlabs(nn.Module):
    """The conv -> FC transition: all-gather the slabs over MODEL, then run ``inner`` on whole images."""

    def __init__(self, inner: nn.Module, grid: GridContext) -> None:
        super().__init__()
        self.inner, self.grid = inner, grid

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.grid.pr > 1:
            x = gather_along(x, 2, [x.shape[2]] * self.grid.pr, self.grid, "transition")
        return self.inner(x)
