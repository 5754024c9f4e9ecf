"""Lightning adapters of the asynchronous parameter server: ``asgd`` and ``softsync``.

- :class:`AsgdStrategy` (``asgd``): asynchronous SGD (Dean et al., NeurIPS 2012): every rank
  pushes its gradient to the server (a thread of rank 0), which applies it at once and answers
  with the new weights; optional staleness-aware learning rate ``lr / staleness`` (Zhang, Gupta,
  Lian, Liu, IJCAI 2016).
- :class:`SoftsyncStrategy` (``softsync``): n-softsync (same paper): the server applies the
  average of every ``ceil(W / n)`` gradients; ``n = 1`` is synchronous SGD, ``n = W`` is ASGD.

Each name also exists as ``name_spawn`` and ``name_fork``. The mechanism is in
:mod:`lightning_hier.algorithms.param_server` and :mod:`~lightning_hier.algorithms.ps_service`;
:class:`~lightning_hier.sync.ServerSync` is one rank's side of it, shared with ``dbs_async``.
"""

from __future__ import annotations

from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.base import Allocation
from lightning_hier.sync.param_server import ServerShards, ServerSync
from lightning_hier.sync.shared_queue import SharedQueue


class AsgdStrategy(HierStrategy):
    """ASGD: each rank pushes its gradient to a server on rank 0, which applies it at once.

    Rank 0 trains too; its worker calls the server in-process. The server's optimizer is a copy of
    the user's (same class and hyperparameters; rank 0's learning-rate schedule is followed), so
    momentum and Adam moments live on the server. Validation during fit, checkpoints'
    ``state_dict`` and every rank's module after fit hold the server's model. Staleness (server
    updates between a worker's pull and its push) is logged as ``ps/staleness_mean`` (over
    gradients), ``ps/staleness_worker_mean`` (over workers' means) and ``ps/staleness_max``, with
    each worker's mean staleness, iteration time and batch size (rank 0's logger, every
    ``log_every_n_steps`` steps; ``last_metrics`` holds the latest after every step).
    Resuming restores the server's model, optimizer and counters, but is not bit-identical: the
    order in which gradients arrive depends on timing.

    Args:
        staleness_lr: Divide the learning rate of a gradient of staleness ``s > 1`` by ``s``.
        server: ``'rank0'`` (default): the server is a thread of rank 0, which trains too (as in the
            authors' codes). ``'dedicated'``: rank 0 only serves (at least 2 ranks): the training
            data is split over the ``W - 1`` other ranks, the workers. Rank 0 still runs Lightning's
            loop, one step per worker step: it runs ``training_step`` without gradients on the first
            worker's batches, for its logs only (so its ``train/...`` metrics are the server's
            model on those batches), and its step waits until the server has applied that step's
            gradient of every worker, then hands the server its learning rate. Validation,
            checkpoints and every rank's module after fit hold the server's model, as with
            ``'rank0'``. With a user's own sharding (``use_distributed_sampler=False``) rank 0's
            loader still sets the number of steps.
        sampler: Where each rank's training batches come from. ``'split'`` (default): Lightning's
            ``DistributedSampler`` shard, ``N / W`` samples per rank and epoch, so every rank takes
            the same number of steps and a fast worker waits for the slow one at each epoch's end.
            ``'shared'``: every rank claims its next batch from a queue on the server (one cursor
            per epoch over the same per-epoch permutation), so every sample of an epoch is trained
            once across the ranks and a fast worker takes more steps, as in the papers'
            parameter servers (:mod:`lightning_hier.algorithms.claim_sampler`). The training loader
            then has no length: ``val_check_interval`` must be ``1.0``, ``limit_train_batches`` an
            int or ``1.0``, ``max_steps`` unset (stop by ``max_epochs``), no ``ModelCheckpoint``
            may save every ``n`` steps and no ``max_time`` is checked per step (rejected when fit
            starts). A module that logs per step with ``sync_dist=True`` would hang (the ranks log
            a different number of times): log per step without it. Needs ``server='rank0'``. A
            mid-epoch checkpoint loses the batches claimed ahead of training (at most the
            fetcher's look-ahead per rank).
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``: also the
            longest a worker may stay silent between two requests).

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="asgd_fork", accelerator="cpu", devices=3)  # doctest: +SKIP
    """

    strategy_name = "asgd"

    def __init__(
        self, staleness_lr: bool = False, server: str = "rank0", sampler: str = "split", **kwargs: Any
    ) -> None:
        sync = ServerSync("asgd", None, staleness_lr, server, sampler=sampler, owner=type(self).__name__)
        super().__init__(sync=sync, allocation=server_allocation(sync), **kwargs)


class SoftsyncStrategy(HierStrategy):
    """n-softsync: the server on rank 0 applies the average of every ``ceil(W / n)`` pushed gradients.

    A worker's reply waits for the update its gradient joins, so ``n = 1`` is synchronous SGD on
    the concatenated batches of all ranks and ``n = W`` is ASGD. The average weighs each gradient
    by its batch size. Everything else as :class:`AsgdStrategy`.

    Args:
        n: Softsync parameter, an integer >= 1; at most the number of workers (``W``, or ``W - 1``
            with a dedicated server; checked when fit starts, before any rank does).
        staleness_lr: Divide an update's learning rate by its gradients' mean staleness when > 1.
        server: ``'rank0'`` or ``'dedicated'``, as for :class:`AsgdStrategy`.
        sampler: ``'split'`` or ``'shared'``, as for :class:`AsgdStrategy`; ``'shared'`` needs ``n >= 2``
            (with ``n = 1`` a worker's reply waits for a gradient of every worker, which a worker
            whose epoch ended early never sends).
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy`.
    """

    strategy_name = "softsync"

    def __init__(
        self, n: int = 1, staleness_lr: bool = False, server: str = "rank0", sampler: str = "split", **kwargs: Any
    ) -> None:
        sync = ServerSync("softsync", n, staleness_lr, server, sampler=sampler, owner=type(self).__name__)
        super().__init__(sync=sync, allocation=server_allocation(sync), **kwargs)


def server_allocation(sync: ServerSync) -> Allocation | None:
    """The batches of a parameter-server run: the workers' shards, or claims from the server's queue."""
    if sync.sampler == "shared":
        return SharedQueue(sync, sync.owner)
    return ServerShards() if sync.server == "dedicated" else None
