"""Batch samplers that resume in the middle of an epoch, at a given epoch.

A checkpoint taken after ``b`` batches of epoch ``e`` must resume with batch ``b`` of epoch
``e``. An ordinary sampler restarts the epoch (the resumed run trains on the epoch's first
batches again and never sees its last ones), and Lightning 2.6 hands ``set_epoch`` an epoch one
too high after a resume with ``max_steps``. A sampler with a :class:`ResumePoint` is told
``resume_at(e, b)`` before the iteration that resumes: that iteration runs epoch ``e`` from batch
``b``, whatever ``set_epoch`` said in between; later iterations follow ``set_epoch`` again.

- :class:`SkippingSampler` wraps the per-sample sampler of an ordinary ``BatchSampler`` (a
  ``DistributedSampler`` or ``SequentialSampler``: samplers whose order is a function of the
  epoch) and skips ``b * batch_size`` samples;
- :class:`~lightning_hier.algorithms.dbs_sampler.DynamicBatchSampler` (DBS) starts at global
  batch ``b`` itself.

Pure torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler
from typing_extensions import override


class ResumePoint:
    """The epoch a sampler iterates next, and how many batches its next iteration skips (a mixin)."""

    epoch: int = 0
    _resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` from the next iteration on, unless a resume position is pending."""
        if self._resume is None:  # the resume position wins: Lightning's epoch may be off after a resume
            self.epoch = int(epoch)

    def resume_at(self, epoch: int, batches: int) -> None:
        """Make the next iteration run epoch ``epoch`` from its batch ``batches`` (0: from its start)."""
        if epoch < 0 or batches < 0:
            raise ValueError(f"{type(self).__name__}: cannot resume at epoch {epoch}, batch {batches}.")
        self._resume = (int(epoch), int(batches))
        self.epoch = int(epoch)

    def _begin_iteration(self) -> int:
        """Call at the start of ``__iter__``: the number of batches this iteration skips."""
        skip = self._resume[1] if self._resume is not None else 0
        self._resume = None
        return skip


class SkippingSampler(ResumePoint, Sampler[int]):
    """The sampler inside an ordinary ``BatchSampler``, able to resume mid-epoch (see the module docstring).

    Args:
        sampler: The per-sample sampler (its ``set_epoch``, if any, is called before each iteration).
        batch_size: The ``BatchSampler``'s batch size: skipping ``b`` batches skips ``b * batch_size``
            samples (every batch before the last is full).
    """

    def __init__(self, sampler: Sampler[Any], batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.epoch = int(getattr(sampler, "epoch", 0))

    @override
    def __iter__(self) -> Iterator[Any]:
        skip = self._begin_iteration()
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return itertools.islice(iter(self.sampler), skip * self.batch_size, None)

    def __len__(self) -> int:
        # the whole epoch: Lightning counts the batches already trained before a resume itself
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)
