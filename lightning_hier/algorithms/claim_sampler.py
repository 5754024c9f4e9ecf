"""A shared queue of samples: every rank claims its next batch of an epoch from the parameter server.

Under a ``DistributedSampler`` every rank trains ``N / W`` samples per epoch, so every rank takes
the same number of steps and a fast asynchronous worker cannot push more often than a slow one:
it finishes its epoch early and waits. In an asynchronous parameter server as the papers run it
(Dean et al. 2012; Zhang et al. 2016; Ji et al. 2019) workers run freely and a fast worker takes
more steps. This module gives that to a sampler:

- every rank builds the same per-epoch permutation (``randperm(N)`` seeded with ``seed + epoch``,
  as ``DistributedSampler`` draws it);
- :class:`ClaimBatchSampler` *claims* the next ``n`` positions of it from the server
  (:data:`~lightning_hier.algorithms.param_server.CLAIM` requests) and yields those samples;
- the server's :class:`ClaimQueue` keeps one cursor per epoch: a claim gets ``[cursor, cursor + n)``
  and moves it; a claim past the end gets the remainder, and once nothing is left the claim
  is empty, which ends that rank's epoch.

So every sample of an epoch is trained exactly once across the ranks (``drop_last=False``), and
the number of steps of each rank follows its speed. The sampler has no ``__len__``: how many
batches a rank gets is only known when its epoch ends.

Batch sizes: a claim asks for ``n`` samples, or for ``n = 0``, "my share": the server then sizes
the claim from the speeds the workers report with their claims (:class:`ServerShares`, the DBS
split of :func:`~lightning_hier.algorithms.dbs_split.split_batch`), which is DBS-SGD in its
asynchronous setting without an all-gather between the workers.

Pure torch: the claim is a callable, so the sampler runs without a server in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from lightning_hier.algorithms.dbs_sampler import epoch_order, ordinary_sampling, with_batch_sampler
from lightning_hier.algorithms.dbs_split import check_split, split_batch
from lightning_hier.algorithms.param_server import Request
from lightning_hier.resumable import ResumePoint

SAMPLERS = ("split", "shared")
"""Where a rank's training batches come from: its own shard (``'split'``) or the server's shared queue."""
ClaimFn = Callable[[int, int, int], tuple[int, int]]
"""``claim(epoch, n, num_samples) -> (start, count)``: positions ``[start, start + count)`` of the epoch's order."""
KEEP_EPOCHS = 8
"""Cursors of epochs this far behind the newest one claimed are forgotten (every rank has left them)."""


def claim_payload(epoch: int, n: int, num_samples: int, speed: float = 0.0) -> Tensor:
    """The tensor of a claim request: the epoch, the samples asked (0: the server's share), ``N``, the speed."""
    return torch.tensor([epoch, n, num_samples, speed], dtype=torch.float64)


class ServerShares:
    """The DBS split on the server: each worker's batch in proportion to the speed it last reported.

    Args:
        global_batch: ``B``, the samples of one round of claims over all workers.
        workers: The workers' global ranks, in the order of the split.
        min_batch_size: Smallest batch of a worker.
        max_batch_size: Largest batch of a worker (``None``: ``B``).
        initial_sizes: The split before every worker has reported a speed (``None``: equal).
    """

    def __init__(
        self,
        global_batch: int,
        workers: Sequence[int],
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        initial_sizes: Sequence[int] | None = None,
    ) -> None:
        check_split(global_batch, len(workers), min_batch_size, max_batch_size)
        self.global_batch = global_batch
        self.workers = list(workers)
        self.bounds = (min_batch_size, max_batch_size)
        equal = split_batch(global_batch, [1.0] * len(self.workers), *self.bounds)
        self.sizes = [int(b) for b in initial_sizes] if initial_sizes is not None else equal
        self.speeds = [0.0] * len(self.workers)
        self.rebalances = 0

    def size(self, worker: int, speed: float) -> int:
        """Record ``worker``'s reported ``speed`` (samples/s; 0: none yet) and return its batch size."""
        index = self.workers.index(worker)
        if speed > 0 and speed != self.speeds[index]:
            self.speeds[index] = speed
            if min(self.speeds) > 0:  # every worker measured: the split follows the speeds
                self.sizes = split_batch(self.global_batch, self.speeds, *self.bounds)
                self.rebalances += 1
        return self.sizes[index]

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "speeds": list(self.speeds), "rebalances": self.rebalances}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sizes = [int(b) for b in state["sizes"]]
        self.speeds = [float(v) for v in state["speeds"]]
        self.rebalances = int(state["rebalances"])


class ClaimQueue:
    """The server's cursors, one per epoch, over that epoch's order (answers ``CLAIM`` requests).

    Args:
        shares: Sizes the claims that ask for ``n = 0`` (``None``: such claims are an error).
    """

    def __init__(self, shares: ServerShares | None = None) -> None:
        self.shares = shares
        self.cursors: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.claimed: dict[int, int] = {}
        """Samples claimed so far by each worker (all epochs)."""

    def claim(self, worker: int, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Give ``worker`` the next ``n`` positions of ``epoch`` (fewer at its end; none once it is used up).

        Raises:
            ValueError: ``n < 0``, ``n = 0`` without :attr:`shares`, or an epoch claimed with two
                different dataset sizes (the ranks' datasets differ).
        """
        if n < 0 or (n == 0 and self.shares is None):
            raise ValueError(f"ClaimQueue: worker {worker} asked for {n} samples; ask for n >= 1 (0 needs shares).")
        if self.lengths.setdefault(epoch, num_samples) != num_samples:
            raise ValueError(
                f"ClaimQueue: worker {worker} claims epoch {epoch} of a dataset of {num_samples} samples, another "
                f"worker of one of {self.lengths[epoch]}: every rank must train on the same dataset."
            )
        if n == 0:
            assert self.shares is not None
            n = self.shares.size(worker, speed)
        start = self.cursors.get(epoch, 0)
        count = max(0, min(n, num_samples - start))
        self.cursors[epoch] = start + count
        self.claimed[worker] = self.claimed.get(worker, 0) + count
        self._forget_before(epoch - KEEP_EPOCHS)
        return start, count

    def answer(self, request: Request) -> tuple[Tensor, ...]:
        """Serve a claim request (its payload is :func:`claim_payload`); the reply is ``[start, count]``."""
        epoch, n, num_samples, speed = request.payload[0].tolist()
        start, count = self.claim(request.worker, int(epoch), int(n), int(num_samples), float(speed))
        return (torch.tensor([start, count], dtype=torch.int64),)

    def _forget_before(self, epoch: int) -> None:
        for e in [e for e in self.cursors if e < epoch]:
            del self.cursors[e], self.lengths[e]

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursors": dict(self.cursors),
            "lengths": dict(self.lengths),
            "claimed": dict(self.claimed),
            "shares": self.shares.state_dict() if self.shares is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursors = {int(e): int(c) for e, c in state["cursors"].items()}
        self.lengths = {int(e): int(c) for e, c in state["lengths"].items()}
        self.claimed = {int(w): int(c) for w, c in state["claimed"].items()}
        if self.shares is not None and state.get("shares"):
            self.shares.load_state_dict(state["shares"])


class ClaimBatchSampler(ResumePoint, Sampler[list[int]]):
    """Batch sampler of one rank: the batches it claims from the shared queue (no ``__len__``).

    Call :meth:`set_epoch` at every epoch (Lightning does, through the :attr:`sampler` alias).
    After :meth:`resume_at` the next iteration runs the given epoch from wherever the server's
    cursor is (the server's state holds the position, not this rank); an epoch the server has
    already used up (a checkpoint written at its end) is skipped to the next.

    Args:
        num_samples: Length of the dataset (the same on every rank).
        batch_size: Samples to claim per batch; 0: the server's share for this rank.
        claim: The link to the server (:data:`ClaimFn`).
        shuffle: A new random order every epoch (else index order).
        seed: Seed of the permutation; the same on every rank.
        drop_last: Do not train on a last claim shorter than asked (its samples are skipped);
            ``False`` trains every sample of the epoch exactly once across the ranks. Only for
            claims of a fixed size.
        on_batch: Called with the size of every batch yielded (DBS's allocation counts them).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        claim: ClaimFn,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if num_samples < 1 or batch_size < 0:
            raise ValueError(
                f"ClaimBatchSampler: need num_samples >= 1 and batch_size >= 0 (0: the server's share), got "
                f"{num_samples} and {batch_size}."
            )
        self.num_samples, self.batch_size, self.claim = num_samples, batch_size, claim
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_batch = on_batch
        self.epoch = 0

    @property
    def sampler(self) -> ClaimBatchSampler:
        """Alias of ``self``: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``."""
        return self

    def _order(self, epoch: int) -> Tensor:
        return epoch_order(self.num_samples, self.shuffle, self.seed, epoch)

    @override
    def __iter__(self) -> Iterator[list[int]]:
        resuming = self._resume is not None
        self._begin_iteration()  # the batches to skip are the server's business: its cursor is the position
        order = self._order(self.epoch)
        first = True
        while True:
            start, count = self.claim(self.epoch, self.batch_size, self.num_samples)
            if first and resuming and count == 0:  # resumed at the end of an epoch: go on with the next
                self.epoch += 1
                order = self._order(self.epoch)
                start, count = self.claim(self.epoch, self.batch_size, self.num_samples)
            first = False
            if count == 0 or (self.drop_last and count < self.batch_size):
                return
            if self.on_batch is not None:
                self.on_batch(count)
            yield order[start : start + count].tolist()


def claim_batch_loader(
    loader: DataLoader[Any],
    batch_size: int,
    claim: ClaimFn,
    seed: int,
    owner: str,
    on_batch: Callable[[int], None] | None = None,
) -> DataLoader[Any]:
    """The same DataLoader, batched by a :class:`ClaimBatchSampler` over the same dataset.

    Shuffling and its seed follow the loader's sampler as in
    :func:`~lightning_hier.algorithms.dbs_sampler.dynamic_batch_loader` (a ``DistributedSampler``
    keeps its ``shuffle`` and ``seed``); ``drop_last`` is the loader's.

    Raises:
        TypeError: The dataset is iterable, or the loader has a custom sampler or batch sampler
            (``owner``, the strategy, is named).
    """
    if isinstance(loader.batch_sampler, ClaimBatchSampler):
        return loader
    order = ordinary_sampling(loader, seed, owner)
    sampler = ClaimBatchSampler(
        order.num_samples, batch_size, claim, order.shuffle, order.seed, order.drop_last, on_batch
    )
    return with_batch_sampler(loader, sampler)
