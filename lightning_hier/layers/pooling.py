"""Max and average pooling on slabs of image rows (overlapping and padded windows included).

A pooling window is a :class:`~lightning_hier.layers.rows.RowWindow` like a convolution's: each
rank receives the input rows its output rows read from their owners (:func:`window_rows`), pads
the image's edges (-inf for max, which no window then picks; zeros for average, counted in the
divisor as torch's ``count_include_pad=True`` does) and pools locally with no padding along H.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_hier.layers.context import GridContext
from lightning_hier.layers.heights import SlabHeights
from lightning_hier.layers.rows import RowWindow, split_problems
from lightning_hier.layers.spatial import pair, reject, window_rows

Pool = nn.MaxPool2d | nn.AvgPool2d


def pool_window(pool: Pool) -> RowWindow:
    """The :class:`~lightning_hier.layers.rows.RowWindow` of ``pool`` along H."""
    k = pair(pool.kernel_size)
    s = pair(pool.stride or pool.kernel_size)
    p = pair(pool.padding)
    d = pair(getattr(pool, "dilation", 1))
    return RowWindow(k[0], s[0], p[0], p[0], d[0])


def pool_problems(pool: Pool) -> list[str]:
    """Why ``pool`` cannot run on slabs (see :func:`~lightning_hier.layers.rows.split_problems`)."""
    return split_problems(
        ceil_mode=bool(pool.ceil_mode),
        count_include_pad=bool(getattr(pool, "count_include_pad", True)),
        pad_rows=pair(pool.padding)[0],
        return_indices=bool(getattr(pool, "return_indices", False)),
    )


class SlabPool2d(nn.Module):
    """A max / average pooling on slabs of rows: any kernel, stride, padding and dilation along H.

    Args:
        inner: The ordinary pooling (kept as is: it runs unchanged with Pr = 1).
        grid: This rank's grid context.
        heights: The global heights shared by the network's domain layers (a private one if not given).
        name: This layer's key in ``heights``.

    Raises:
        ValueError: With Pr > 1, for ``ceil_mode=True``, ``return_indices=True`` or an average
            pooling padded along H with ``count_include_pad=False``.
    """

    def __init__(self, inner: Pool, grid: GridContext, heights: SlabHeights | None = None, name: str = "") -> None:
        super().__init__()
        self.inner, self.grid = inner, grid
        self.heights = heights if heights is not None else SlabHeights()
        self.slab_name = name or f"pool@{id(self)}"
        self.window = pool_window(inner)
        owner = (
            f"{type(inner).__name__}(kernel_size={inner.kernel_size}, stride={inner.stride}, padding={inner.padding})"
        )
        reject(owner, pool_problems(inner), grid)

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.grid.pr == 1:
            return self.inner(x)
        height = self.heights.height(self.slab_name, x.shape[2], self.grid, x.device)
        is_max = isinstance(self.inner, nn.MaxPool2d)
        rows, plan = window_rows(x, self.window, height, float("-inf") if is_max else 0.0, self.grid)
        y = self._pool(rows)
        return y if plan.out_rows else y[:, :, :0]

    def _pool(self, rows: Tensor) -> Tensor:
        m = self.inner
        k, s = pair(m.kernel_size), pair(m.stride or m.kernel_size)
        pad = (0, pair(m.padding)[1])  # H is padded already; W as the original
        if isinstance(m, nn.MaxPool2d):
            return F.max_pool2d(rows, k, s, pad, pair(m.dilation))
        return F.avg_pool2d(rows, k, s, pad, False, m.count_include_pad, m.divisor_override)
