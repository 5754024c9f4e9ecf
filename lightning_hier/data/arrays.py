"""In-memory datasets: whole splits as tensors, fetched a batch at a time.

``ArrayDataset`` is an ordinary map-style dataset (any sampler, ``DistributedSampler`` or batch
sampler works), but it also implements ``__getitems__``, so a ``DataLoader`` fetches a whole batch
with one indexing operation instead of collating samples one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate
from typing_extensions import override


@dataclass
class Arrays:
    """One dataset in memory.

    ``x_*`` are ``uint8`` images (scaled by 1/255 on the device) or float features; ``mean`` and
    ``std`` (one value per channel, of the scaled data) normalise batches on the device.
    """

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


class _Batch(tuple):
    """Marks a batch that is already collated by ``ArrayDataset.__getitems__``."""


class ArrayDataset(Dataset[tuple[Tensor, Tensor]]):
    """Features and labels held as two tensors with the same first dimension."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"ArrayDataset: {len(x)} inputs but {len(y)} labels.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    @override
    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]

    def __getitems__(self, indices: Sequence[int]) -> _Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return _Batch((self.x[idx], self.y[idx]))


def collate_batch(data: object) -> object:
    """``collate_fn`` for :class:`ArrayDataset`: pass pre-collated batches, collate anything else."""
    if isinstance(data, _Batch):
        return tuple(data)
    return default_collate(data)  # type: ignore[arg-type]


def split_indices(n: int, val_count: int, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random split of ``range(n)`` into train and validation indices."""
    if not 0 < val_count < n:
        raise ValueError(f"split_indices: validation size must be in (0, {n}), got {val_count}.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[val_count:], perm[:val_count]
