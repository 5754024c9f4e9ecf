"""Which rank owns which image rows, and which rows a sliding window needs (pure arithmetic).

This module is the one source of truth of the domain-parallel geometry, shared by the layers
(:mod:`lightning_hier.layers.spatial`, :mod:`lightning_hier.layers.pooling`), the exchange of
rows (:func:`lightning_hier.layers.collectives.row_exchange`) and the planner
(:mod:`lightning_hier.planner.cost`).

**Row ownership.** Every tensor on slabs with ``H`` global rows is split over the ``Pr`` ranks of
a MODEL group by :func:`even_shard_sizes`: rank ``r`` owns the contiguous rows
:func:`shard_range` ``(H, Pr, r)``; the first ``H % Pr`` ranks own one row more (the sizes of
``torch.tensor_split``). Slabs may be empty when ``H < Pr``. A layer's output rows follow the same
rule on the output height, so the next layer knows where every row lives.

**Windows.** Output row ``o`` of a convolution or pooling with kernel ``k``, stride ``s``,
dilation ``d`` and ``p`` rows of padding above reads input rows ``o s - p`` to
``o s - p + d (k - 1)``. A rank's output rows therefore need one contiguous range of input rows;
the rows it does not own come from whichever ranks own them (one neighbour, several when slabs are
thinner than the kernel's reach, none when the stride skips them), and rows outside the image are
padding (zeros, or -inf for a max-pool).
"""

from __future__ import annotations

from dataclasses import dataclass


def even_shard_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` nearly equal shards of ``n`` (the first ``n % parts`` one larger)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``index`` of :func:`even_shard_sizes`."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class RowWindow:
    """The sliding window of a convolution or pooling along H (the split axis).

    Attributes:
        kernel: Kernel rows.
        stride: Stride along H.
        pad_top: Padding rows above the image.
        pad_bottom: Padding rows below the image.
        dilation: Dilation along H.
    """

    kernel: int
    stride: int = 1
    pad_top: int = 0
    pad_bottom: int = 0
    dilation: int = 1

    @property
    def reach(self) -> int:
        """Input rows one output row reads: ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    def out_height(self, height: int) -> int:
        """Output rows of an input of ``height`` rows (as torch computes them, floor mode)."""
        return max(0, (height + self.pad_top + self.pad_bottom - self.reach) // self.stride + 1)

    def halo(self) -> tuple[int, int]:
        """Rows read from the slab above and below on equal slabs thicker than the reach, that hold whole strides."""
        return self.pad_top, max(0, self.reach - self.pad_top - self.stride)

    def rows_needed(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """``[lo, hi)`` of the input rows that output rows ``[out_start, out_stop)`` read (may reach into padding)."""
        if out_stop <= out_start:
            return 0, 0
        return out_start * self.stride - self.pad_top, (out_stop - 1) * self.stride - self.pad_top + self.reach


@dataclass(frozen=True)
class SlabPlan:
    """What one rank does for one windowed layer: the rows it owns, reads, receives and sends.

    Attributes:
        rank: This rank's MODEL coordinate r.
        own: Input rows ``[start, stop)`` this rank owns.
        out: Output rows ``[start, stop)`` this rank computes.
        read: Input rows ``[start, stop)`` of the image its output reads (clipped to the image).
        pad: Padding rows ``(above, below)`` its window needs beyond the image's edges.
        recv: ``(peer r, start, stop)`` input rows received from each other owner, in row order.
        send: ``(peer r, start, stop)`` owned input rows sent to each rank that reads them.
    """

    rank: int
    own: tuple[int, int]
    out: tuple[int, int]
    read: tuple[int, int]
    pad: tuple[int, int]
    recv: tuple[tuple[int, int, int], ...]
    send: tuple[tuple[int, int, int], ...]

    @property
    def out_rows(self) -> int:
        return self.out[1] - self.out[0]


def _read_range(window: RowWindow, height: int, pr: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
    lo, hi = window.rows_needed(*shard_range(window.out_height(height), pr, r))
    top = min(max(-lo, 0), hi - lo)  # rows above the image (all of them if the window is)
    bottom = min(max(hi - height, 0), hi - lo - top)
    return (lo + top, hi - bottom), (top, bottom)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def slab_plan(window: RowWindow, height: int, pr: int, r: int) -> SlabPlan:
    """The :class:`SlabPlan` of rank ``r`` of ``pr`` for ``window`` on an input of ``height`` rows."""
    own = shard_range(height, pr, r)
    read, pad = _read_range(window, height, pr, r)
    recv, send = [], []
    for q in range(pr):
        if q == r:
            continue
        got = _overlap(read, shard_range(height, pr, q))
        if got:
            recv.append((q, *got))
        given = _overlap(_read_range(window, height, pr, q)[0], own)
        if given:
            send.append((q, *given))
    out = shard_range(window.out_height(height), pr, r)
    return SlabPlan(r, own, out, read, pad, tuple(recv), tuple(send))


def split_problems(
    *,
    padding_mode: str = "zeros",
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    pad_rows: int = 0,
    return_indices: bool = False,
) -> list[str]:
    """Why a windowed layer cannot run on slabs of rows (empty when it can, at any Pr and height).

    The layers raise these at construction when ``Pr > 1``; the planner reports them as the reason
    a grid is excluded.

    Args:
        padding_mode: A convolution's ``padding_mode``: only zero padding is known off the edge slabs.
        ceil_mode: A pooling's ``ceil_mode``: its partial last window is not supported.
        count_include_pad: An average pooling's flag: excluding padding from the divisor is not
            supported when the window is padded along H.
        pad_rows: Padding rows along H.
        return_indices: A max-pooling's flag: indices into a slab are not indices into the image.
    """
    problems = []
    if padding_mode != "zeros":
        problems.append(f"padding_mode={padding_mode!r} (only 'zeros' is supported on slabs)")
    if ceil_mode:
        problems.append("ceil_mode=True (a partial last window is not supported on slabs)")
    if not count_include_pad and pad_rows:
        problems.append("count_include_pad=False with padding along H (not supported on slabs)")
    if return_indices:
        problems.append("return_indices=True (indices into a slab are not indices into the image)")
    return problems
