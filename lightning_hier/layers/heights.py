"""The global height of the slabs each domain layer receives (slab heights alone do not tell it).

Under the row-ownership rule of :mod:`lightning_hier.layers.rows` a slab's height does not
determine the image's: on Pr = 2, rank 0 holds 4 rows of a 7-row and of an 8-row image alike. Every
layer that plans an exchange (or counts rows) needs the global height, and every rank of a MODEL
group must make the same decision about how to learn it, or their collectives would not match.

:class:`SlabHeights` is shared by the layers of one converted network. The first convolution,
which sees whole images (the same on every rank of the group), records their size; each layer
then looks up its global input height for that size. It is known from :func:`to_grid`'s trace
of the example input, or learnt the first time by one all-reduce of the slab heights over MODEL
(8 bytes, not counted in the communication statistics), and remembered. Layers used on their own
(no first convolution has recorded a size) all-reduce at every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_hier.layers.context import GridContext

Size = tuple[int, ...]


class SlabHeights:
    """Global input heights of the domain layers of one network, per size of its whole images."""

    def __init__(self) -> None:
        self.input_size: Size | None = None
        self._known: dict[tuple[str, Size], int] = {}

    def start(self, size: Sequence[int]) -> None:
        """Record the ``(H, W)`` of the whole images the first convolution received (a new forward)."""
        self.input_size = tuple(int(s) for s in size)

    def learn(self, layer: str, size: Sequence[int], height: int) -> None:
        """Record that ``layer`` receives ``height`` global rows when the images are ``size``."""
        self._known[(layer, tuple(int(s) for s in size))] = int(height)

    def height(self, layer: str, local: int, grid: GridContext, device: torch.device) -> int:
        """The global height of the tensor whose slab of ``local`` rows ``layer`` received here.

        A collective over MODEL when not known yet: call it on every rank of the group.
        """
        if grid.pr == 1:
            return local
        key = None if self.input_size is None else (layer, self.input_size)
        if key is not None and key in self._known:
            return self._known[key]
        total = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(total, group=grid.model_group)
        if key is not None:
            self._known[key] = int(total.item())
        return int(total.item())
