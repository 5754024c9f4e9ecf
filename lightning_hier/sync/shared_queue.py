"""A shared queue of samples on a server: each rank claims its next batch, so a fast rank takes more steps.

:class:`SharedQueue` is the allocation of ``sampler='shared'`` (``asgd``, ``softsync``, and GRAWA's
asynchronous rounds): the training loader is re-batched by a
:class:`~lightning_hier.algorithms.claim_sampler.ClaimBatchSampler` whose claims of
``batch_size`` samples go to the server (:mod:`lightning_hier.algorithms.claim_sampler`), and the
server is given the queue. Every sample of an epoch is trained once across the ranks, and the
ranks take different numbers of steps per epoch (``equal_steps`` is False; the Lightning adapter
then rejects the Trainer options that need equal step counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hier.algorithms.claim_sampler import ClaimQueue, claim_batch_loader
from lightning_hier.sync.base import Allocation, Binding


def fetched_before_setup(owner: str) -> RuntimeError:
    """The error of a claim before the server exists (the loop fetched a training batch early)."""
    return RuntimeError(
        f"{owner}: a training batch was fetched before set-up. With sampler='shared' the training loader has no "
        "length, and reading trainer.estimated_stepping_batches in configure_optimizers (a schedule sized to the "
        "whole fit, such as OneCycleLR or a cosine) makes Lightning fetch a batch to find the length out. Size the "
        "schedule by epochs (an 'epoch' interval) or use sampler='split'."
    )


class Claims(Protocol):
    """A server that keeps a shared queue: it is given the queue and answers claims."""

    claims: Callable[[], ClaimQueue] | None

    def claim(self, epoch: int, n: int, num_samples: int, speed: float = 0.0) -> tuple[int, int]:
        """Claim ``n`` samples of ``epoch``: ``(start, count)`` in the epoch's order."""


class SharedQueue(Allocation):
    """Claim ``batch_size`` samples at a time from ``server``'s queue (see the module docstring).

    Args:
        server: The rule that runs the server (:class:`~lightning_hier.sync.param_server.ServerSync`,
            or :class:`~lightning_hier.sync.averaging.AveragingSync` with asynchronous rounds).
        owner: The name in error messages.
    """

    equal_steps = False

    def __init__(self, server: Claims, owner: str = "SharedQueue") -> None:
        self.server = server
        self.owner = owner

    @override
    def bind(self, binding: Binding) -> None:
        self.server.claims = ClaimQueue  # the server builds its queue when it starts

    @override
    def training_loader(self, loader: Any, seed: int = 0) -> Any:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"{self.owner}: sampler='shared' needs a torch DataLoader, got {type(loader).__name__}.")
        if loader.batch_size is None:
            raise ValueError(
                f"{self.owner}: sampler='shared' claims batch_size samples at a time, but the training "
                "DataLoader has none (a custom batch sampler); use DataLoader(dataset, batch_size=...)."
            )
        return claim_batch_loader(loader, loader.batch_size, self._claim, seed, self.owner)

    def _claim(self, epoch: int, n: int, num_samples: int) -> tuple[int, int]:
        return self.server.claim(epoch, n, num_samples)
