"""GRAWA's fresh probe batches: samples drawn from the whole training set, apart from training.

Dimlioglu and Choromanska, "GRAWA: Gradient-based Weighted Averaging for Distributed Training of
Deep Learning Models", AISTATS 2024 (code: github.com/tolgadimli/GRAWA): every worker measures its
gradient norm on a batch drawn from the *whole* training set, independently of the worker's own
data shard. Measured on the batch a replica has just stepped on, the norm is small for every
replica that fits its own batch well, whatever its loss elsewhere, and the weights can favour the
worse replica (a user's demo: weights [3e-9, 1.0] with the own-batch probe, [0.39, 0.61] with a
fresh batch).

:class:`FreshBatches` draws such a batch from a training DataLoader's dataset (random access: a
map-style dataset) with the loader's batch size and collate function, from a generator seeded by
``(seed, rank, step)``: every rank draws its own batch, the same one again after a resume (no
state to checkpoint), and the training DataLoader's iteration is never touched.
:func:`isolated_rng` runs the probe with every global generator seeded from the same numbers and
then puts the training streams back, so dropout or augmentation in the probe neither consume nor
depend on the training RNG stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_hier.rng import capture_rng, restore_rng

_MASK = (1 << 63) - 1


class FreshBatches:
    """Probe batches of ``batch_size`` samples drawn without replacement from the whole of ``dataset``.

    Args:
        dataset: A map-style dataset (``len`` and integer indexing): the full training set, not a shard.
        collate_fn: Turns a list of samples into a batch (the training DataLoader's).
        batch_size: Samples per probe batch (the training batch size; capped at ``len(dataset)``).
        seed: Base seed shared by all ranks.
        rank: This rank's index; every rank draws its own batches.
    """

    def __init__(
        self, dataset: Any, collate_fn: Callable[[list[Any]], Any], batch_size: int, seed: int, rank: int
    ) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("FreshBatches: the training dataset is empty; nothing to draw a probe batch from.")
        self.batch_size = min(batch_size, self.size)
        self.seed, self.rank = seed, rank

    @classmethod
    def from_loader(cls, loader: DataLoader[Any], seed: int, rank: int, owner: str) -> FreshBatches:
        """The probe batches of one training DataLoader (its dataset, batch size and collate function)."""
        dataset = loader.dataset
        random_access = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        if isinstance(dataset, IterableDataset) or not random_access:
            raise ValueError(
                f"{owner}(probe='fresh') draws probe batches at random from the training dataset and needs a "
                f"map-style dataset (__len__ and __getitem__); the training DataLoader's dataset is "
                f"{type(dataset).__name__}. Use probe='batch' or probe='step' with an iterable dataset."
            )
        batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"{owner}(probe='fresh') draws probe batches of the training batch size, but the training "
                f"DataLoader's batch size is {batch_size!r} (a custom batch_sampler without `batch_size`); "
                "give the batch sampler a `batch_size` attribute, or use probe='batch' or probe='step'."
            )
        return cls(dataset, loader.collate_fn, batch_size, seed, rank)

    def seed_for(self, step: int) -> int:
        """The seed of the batch drawn after optimizer step ``step`` (also seeds the probe's RNG)."""
        return ((self.seed * 1_000_003 + self.rank) * 1_000_033 + step) & _MASK

    def indices(self, step: int) -> Tensor:
        """Dataset indices of the batch drawn after optimizer step ``step``."""
        generator = torch.Generator().manual_seed(self.seed_for(step))
        return torch.randperm(self.size, generator=generator)[: self.batch_size]

    def draw(self, step: int) -> Any:
        """The collated batch drawn after optimizer step ``step`` (fetched as a DataLoader fetches a batch)."""
        indices = [int(i) for i in self.indices(step)]
        fetch_many = getattr(self.dataset, "__getitems__", None)
        samples = fetch_many(indices) if fetch_many else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)


Loaders = Any
"""A DataLoader, or a dict, list or tuple of them (Lightning's combined training loaders)."""


def fresh_batches_of(loaders: Loaders, seed: int, rank: int, owner: str) -> Any:
    """A :class:`FreshBatches` for every training DataLoader, in the loaders' structure."""
    if isinstance(loaders, DataLoader):
        return FreshBatches.from_loader(loaders, seed, rank, owner)
    if isinstance(loaders, Mapping):
        return {k: fresh_batches_of(v, seed, rank, owner) for k, v in loaders.items()}
    if isinstance(loaders, Sequence) and not isinstance(loaders, str):
        return type(loaders)(fresh_batches_of(v, seed, rank, owner) for v in loaders)  # type: ignore[call-arg]
    raise ValueError(
        f"{owner}(probe='fresh') draws probe batches from the training DataLoaders' datasets, but the training "
        f"data is a {type(loaders).__name__}, not a DataLoader (or a dict or list of them). Use probe='batch' "
        "or probe='step'."
    )


def draw(batches: Any, step: int) -> Any:
    """The batch drawn after ``step`` from every :class:`FreshBatches` in ``batches``, in its structure."""
    if isinstance(batches, FreshBatches):
        return batches.draw(step)
    if isinstance(batches, Mapping):
        return {k: draw(v, step) for k, v in batches.items()}
    return type(batches)(draw(v, step) for v in batches)


def first(batches: Any) -> FreshBatches:
    """The first :class:`FreshBatches` in the structure (its seed stands for the whole probe)."""
    if isinstance(batches, FreshBatches):
        return batches
    return first(next(iter(batches.values() if isinstance(batches, Mapping) else batches)))


@contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run with Python's, NumPy's and torch's global generators seeded from ``seed``; restore them after."""
    saved = capture_rng()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    try:
        yield
    finally:
        restore_rng(saved)
