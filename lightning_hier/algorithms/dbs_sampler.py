"""The data side of DBS: a fixed global batch split into per-rank batches that may change at any step.

Every step of an epoch consumes one *global batch* of ``B`` consecutive indices of the epoch's
permutation (the same permutation on every rank: ``randperm(N)`` seeded with ``seed + epoch``, as
``DistributedSampler`` draws it). Rank ``r`` takes the slice ``[offset_r, offset_r + b_r)`` of it,
where ``b`` is the current :class:`Allocation`. Hence:

- every rank yields exactly ``N // B`` batches per epoch, whatever the split (unequal batch counts
  would desynchronise the collectives and hang the job), plus, with ``drop_last=False``, one last
  global batch of the ``R = N mod B`` samples left, split by the same shares (see
  :func:`~lightning_hier.algorithms.dbs_split.split_remainder`). A rank whose share of it rounds to
  0 still runs the step, on one sample of that batch, and gives its gradient the weight 0;
- over an epoch a rank's shard is the union of its slices, so its size is proportional to its
  batch size (:func:`~lightning_hier.algorithms.dbs.shard_sizes` for a constant split);
- the global batch of step ``k`` is the same set of samples as with ``DistributedSampler`` and equal
  per-rank batches of ``B / W`` (DDP), so DBS and DDP see the same data step by step;
- the split can change between any two steps without reloading the DataLoader.

A new split must only affect batches that no rank has drawn yet (DataLoaders and Lightning draw
batches ahead of training). :meth:`Allocation.update` takes the index from which the new split
applies; :meth:`~lightning_hier.algorithms.dbs.DynamicBatchSize.rebalance` sets it to the largest
number of batches any rank has drawn in this epoch.

Pure torch: usable with a plain training loop (see :mod:`lightning_hier.algorithms.dbs`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from typing_extensions import override

from lightning_hier.algorithms.dbs_split import split_remainder
from lightning_hier.resumable import ResumePoint


class Allocation:
    """The per-rank batch sizes of one fixed global batch: shared by the sampler and the algorithm.

    Args:
        sizes: Batch size of every rank of the data-parallel group (sums to the global batch).
        rank: This process's index in the data-parallel group.
    """

    def __init__(self, sizes: Sequence[int], rank: int) -> None:
        if not sizes or any(int(b) < 1 for b in sizes):
            raise ValueError(f"Allocation: every batch size must be >= 1, got {list(sizes)}.")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"Allocation: rank {rank} out of range [0, {len(sizes)}).")
        self.rank = rank
        self.global_batch = sum(int(b) for b in sizes)
        self.sizes: list[int] = [int(b) for b in sizes]
        self.drawn = 0
        self._segments: list[tuple[int, list[int]]] = [(0, self.sizes)]
        self._pending: deque[tuple[int, int]] = deque()  # (samples of this rank, of the global batch)
        self._resume_segments: list[tuple[int, list[int]]] | None = None

    @property
    def world(self) -> int:
        return len(self.sizes)

    def sizes_at(self, index: int) -> list[int]:
        """The split used for batch ``index`` of the current epoch."""
        chosen = self._segments[0][1]
        for start, sizes in self._segments:
            if start <= index:
                chosen = sizes
        return chosen

    def begin_epoch(self, start: int = 0) -> None:
        """A new pass over the data starts with the newest split; batches drawn ahead are discarded.

        ``start > 0`` resumes the epoch at that batch: with the splits :meth:`resume_segments`
        restored (those in force when the checkpoint was written), else with the newest.
        """
        self.drawn = start
        resumed = self._resume_segments if start > 0 else None
        self._segments = resumed or [(0, self.sizes)]
        self._resume_segments = None
        self._pending.clear()

    def segments(self) -> list[tuple[int, list[int]]]:
        """The splits of the current epoch: ``(first batch, sizes)``, in order (for checkpoints).

        Before a resumed epoch starts, those restored by :meth:`resume_segments`.
        """
        segments = self._resume_segments if self._resume_segments is not None else self._segments
        return [(start, list(sizes)) for start, sizes in segments]

    def resume_segments(self, segments: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Splits of the epoch a checkpoint was written in, for the epoch's resumed iteration.

        Batches drawn ahead of training before the checkpoint (DataLoader workers prefetch) may
        use an older split than the newest: a run resumed mid-epoch must draw them the same way.
        """
        self._resume_segments = [(int(start), [int(b) for b in sizes]) for start, sizes in segments]

    def draw(self) -> tuple[int, int]:
        """Offset and size of this rank's slice of the next global batch (called by the sampler)."""
        return self._take(self.sizes_at(self.drawn), self.global_batch)

    def draw_last(self, remainder: int) -> tuple[int, int]:
        """Offset and size of this rank's slice of a last, smaller global batch of ``remainder`` samples.

        The split is :func:`~lightning_hier.algorithms.dbs_split.split_remainder` of the current
        sizes (the same shares); the size may be 0.
        """
        return self._take(split_remainder(remainder, self.sizes_at(self.drawn)), remainder)

    def _take(self, sizes: Sequence[int], total: int) -> tuple[int, int]:
        # the training loop consumes the batches in drawn order (consume_share)
        self.drawn += 1
        self._pending.append((sizes[self.rank], total))
        return sum(sizes[: self.rank]), sizes[self.rank]

    def take_claimed(self, size: int) -> None:
        """Count a batch of ``size`` samples that the server sized (a shared queue's claim, not a slice).

        The training loop then consumes it as ``(size, B)``: its gradient weighs ``size / B``.
        """
        self.drawn += 1
        self._pending.append((int(size), self.global_batch))

    def consume_share(self) -> tuple[int, int]:
        """This rank's samples in the batch the training loop is about to use, and the global batch's.

        ``(b_r, B)`` for a full global batch; ``(r_r, R)`` for the last, smaller one, where ``r_r``
        may be 0 (the rank then trains on a stand-in sample whose gradient gets weight 0).
        """
        if not self._pending:
            raise RuntimeError(
                "DBS: a training batch arrived that DynamicBatchSampler did not draw. The training "
                "DataLoader must use the sampler installed by the strategy (do not wrap or replace it)."
            )
        return self._pending.popleft()

    def update(self, sizes: Sequence[int], effective_from: int) -> None:
        """Use ``sizes`` for batches ``effective_from, effective_from + 1, ...`` of this epoch and later."""
        new = [int(b) for b in sizes]
        if len(new) != self.world or sum(new) != self.global_batch or min(new) < 1:
            raise ValueError(f"Allocation: {new} is not a split of {self.global_batch} over {self.world} ranks.")
        if effective_from < self.drawn:
            raise ValueError(f"Allocation: batch {effective_from} was already drawn ({self.drawn} drawn so far).")
        self._segments.append((effective_from, new))
        self.sizes = new


class DynamicBatchSampler(ResumePoint, Sampler[list[int]]):
    """Batch sampler of one rank: its slice of every global batch, sized by the :class:`Allocation`.

    Use it as ``DataLoader(dataset, batch_sampler=...)`` with any map-style dataset. Call
    :meth:`set_epoch` at every epoch (Lightning does, through the :attr:`sampler` alias) so each
    epoch has a new order. :meth:`resume_at` resumes an epoch at a given global batch (a
    mid-epoch checkpoint; :class:`~lightning_hier.resumable.ResumePoint`).

    Args:
        num_samples: Length of the dataset.
        allocation: The shared per-rank batch sizes.
        shuffle: Visit the data in a new random order every epoch (else in index order).
        seed: Seed of the permutation; must be the same on every rank.
        drop_last: Skip the ``N mod B`` samples left after the last full global batch (``True``, every
            step has exactly ``B`` samples) or train on them as one smaller global batch (``False``).
    """

    def __init__(
        self, num_samples: int, allocation: Allocation, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if num_samples < 1 or (drop_last and num_samples < allocation.global_batch):
            raise ValueError(
                f"DynamicBatchSampler: the dataset has {num_samples} samples, fewer than one global batch of "
                f"{allocation.global_batch}, and drop_last={drop_last} leaves no step; `num_samples` must be >= "
                f"{allocation.global_batch} with drop_last=True, or >= 1 with drop_last=False."
            )
        self.num_samples = num_samples
        self.allocation = allocation
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @property
    def sampler(self) -> DynamicBatchSampler:
        """Alias of ``self``: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``."""
        return self

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.allocation.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    @override
    def __iter__(self) -> Iterator[list[int]]:
        skip = self._begin_iteration()
        order = epoch_order(self.num_samples, self.shuffle, self.seed, self.epoch)
        batch = self.allocation.global_batch
        full = self.num_samples // batch
        self.allocation.begin_epoch(start=min(skip, len(self)))
        for step in range(skip, full):
            offset, size = self.allocation.draw()
            start = step * batch + offset
            yield order[start : start + size].tolist()
        if len(self) > max(full, skip):
            start = full * batch
            offset, size = self.allocation.draw_last(self.num_samples - start)
            # every rank must run the step (equal step counts): with no share, train on the batch's
            # first sample; its gradient and buffers get weight 0 (Allocation.consume_share)
            yield order[start + offset : start + offset + size].tolist() if size else order[start : start + 1].tolist()


def dynamic_batch_loader(loader: DataLoader[Any], allocation: Allocation, seed: int) -> DataLoader[Any]:
    """The same DataLoader, batched by a :class:`DynamicBatchSampler` over the same dataset.

    Workers, ``collate_fn``, pinning and the other loader options are kept; the loader's
    ``batch_size`` is replaced by the allocation. The loader's ``drop_last`` applies to global
    batches: ``True`` skips the ``N mod B`` samples left after the last full global batch,
    ``False`` trains on them as one smaller global batch split by the same shares. Shuffling
    follows the loader's sampler: ``DistributedSampler`` (what Lightning injects) keeps its
    ``shuffle`` and ``seed``; ``RandomSampler`` shuffles with ``seed``; ``SequentialSampler`` does
    not shuffle.

    Raises:
        TypeError: The dataset is iterable, or the loader has a custom sampler or batch sampler
            (DBS must choose every batch itself).
    """
    if isinstance(loader.batch_sampler, DynamicBatchSampler):
        return loader
    order = ordinary_sampling(loader, seed, "DBS")
    sampler = DynamicBatchSampler(order.num_samples, allocation, order.shuffle, order.seed, order.drop_last)
    return with_batch_sampler(loader, sampler)


def with_batch_sampler(loader: DataLoader[Any], batch_sampler: Sampler[list[int]]) -> DataLoader[Any]:
    """A DataLoader over ``loader``'s dataset with every option kept but its batching: ``batch_sampler``."""
    return DataLoader(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


def epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> Tensor:
    """The order of an epoch's samples, the same on every rank: ``randperm(N)`` seeded with ``seed + epoch``.

    It is the order ``DistributedSampler`` draws, so a strategy's own sampler
    (:class:`DynamicBatchSampler`, the shared queue's) visits the samples as Lightning's would;
    ``arange(N)`` without ``shuffle``.
    """
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))


class Sampling(NamedTuple):
    """How an ordinary DataLoader draws its samples (see :func:`ordinary_sampling`)."""

    num_samples: int
    shuffle: bool
    seed: int
    drop_last: bool


def ordinary_sampling(loader: DataLoader[Any], seed: int, owner: str) -> Sampling:
    """The dataset's length and the ``shuffle``, ``seed`` and ``drop_last`` of an ordinary loader.

    A strategy that chooses every rank's batches itself replaces the loader's sampler by one that
    draws the same per-epoch order; only map-style datasets and samplers whose order it can
    reproduce are accepted, with a clear error naming ``owner`` for the others.

    Raises:
        TypeError: The dataset is iterable, or the loader has a custom sampler or batch sampler.
    """
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"{owner} needs a map-style dataset (with __getitem__ and __len__), got an IterableDataset.")
    shuffle, seed = _shuffle_and_seed(loader, seed, owner)
    drop_last = bool(loader.batch_sampler.drop_last)  # type: ignore[union-attr]  # a BatchSampler (checked)
    return Sampling(len(loader.dataset), shuffle, seed, drop_last)  # type: ignore[arg-type]


def _shuffle_and_seed(loader: DataLoader[Any], seed: int, owner: str) -> tuple[bool, int]:
    custom = (
        f"{owner} chooses every rank's batches itself, so it replaces the training DataLoader's sampler; "
        "it cannot keep {}. Use an ordinary DataLoader(dataset, batch_size=..., shuffle=...)."
    )
    if type(loader.batch_sampler) is not BatchSampler:
        raise TypeError(custom.format(f"the custom batch sampler {type(loader.batch_sampler).__name__}"))
    sampler = loader.sampler
    if type(sampler) is DistributedSampler:
        return bool(sampler.shuffle), int(sampler.seed)
    if type(sampler) is SequentialSampler:
        return False, seed
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True, seed
    raise TypeError(custom.format(f"the sampler {type(sampler).__name__}"))
