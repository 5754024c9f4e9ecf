"""Lightning adapters of the asynchronous parameter server: ``asgd`` and ``softsync``.

- :class:`AsgdStrategy` (``asgd``): asynchronous SGD (Dean et al., NeurIPS 2012): every rank
  pushes its gradient to the server (a thread of rank 0), which applies it at once and answers
  with the new weights; optional staleness-aware learning rate ``lr / staleness`` (Zhang, Gupta,
  Lian, Liu, IJCAI 2016).
- :class:`SoftsyncStrategy` (``softsync``): n-softsync (same paper): the server applies the
  average of every ``ceil(W / n)`` gradients; ``n = 1`` is synchronous SGD, ``n = W`` is ASGD.

Each name also exists as ``name_spawn`` and ``name_fork``. The mechanism is in
:mod:`lightning_hier.algorithms.param_server` and :mod:`~lightning_hier.algorithms.ps_service`;
:class:`~lightning_hier.strategies._ps_adapter.PSAdapter` connects it to Lightning once for these
strategies and for ``DBSStrategy(mode='async')``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.ps_link import SERVERS, served_workers
from lightning_hier.algorithms.ps_rules import AsgdHandler, SoftsyncHandler
from lightning_hier.strategies._ps_adapter import HandlerFactory, PSAdapter
from lightning_hier.strategies._shared_queue import SharedQueueStrategy
from lightning_hier.strategies._step_sync import local_sigterm_check

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer


class ParameterServerWorker(SharedQueueStrategy):
    """What a strategy needs to train through the parameter server (not registered itself).

    Subclasses implement :meth:`_handler`; :meth:`_push_weight` scales the pushed gradient (1).
    The server is rank 0's thread; every rank, rank 0 included, is a worker, unless
    :attr:`server` is ``'dedicated'``: then rank 0 only serves (see :meth:`_init_server`).
    """

    ps: PSAdapter | None = None
    server: str = "rank0"
    _service_group: Any = None
    _batch_samples = 0

    def _init_server(self, server: str, sampler: str = "split") -> None:
        """Check and keep the ``server`` (``'rank0'`` or ``'dedicated'``) and ``sampler`` arguments."""
        owner = type(self).__name__
        self.server = v.check_choice(owner, "server", server, SERVERS)
        if self._check_sampler(sampler) == "shared" and self.server == "dedicated":
            raise ValueError(
                f"{owner}: argument `sampler`='shared' needs every rank to train (each claims its own batches), "
                "but server='dedicated' makes rank 0 only serve, in step with the workers; use server='rank0' "
                "or sampler='split'."
            )

    @property
    def num_workers(self) -> int:
        """Ranks that compute gradients: ``W``, or ``W - 1`` with a dedicated server (layout arithmetic)."""
        return len(served_workers(self.topology.world_size, self.server))

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        world = self.topology.world_size  # in the main process, before any rank starts
        if self.server == "dedicated" and world < 2:
            raise ValueError(
                f"{type(self).__name__}: argument `server`='dedicated' needs at least 2 ranks (rank 0 only serves), "
                f"got {world}; use server='rank0' or more devices."
            )

    @property
    def _serves_only(self) -> bool:
        """This rank is the dedicated server: no gradients, no pushes."""
        return self.server == "dedicated" and self.global_rank == 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data split over the workers; with a dedicated server, rank 0 shares the first shard.

        Rank 0 then runs ``training_step`` without gradients on the first worker's batches (for its
        logs only), so every training sample is learnt from exactly once. Other stages: every rank.
        """
        if self.server != "dedicated" or not self._training_stage:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.num_workers, "rank": max(self.global_rank - 1, 0)}

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._serves_only:
            return super().training_step(*args, **kwargs)
        # the dedicated server rank: the module's step runs for its logs (a `sync_dist` log or a
        # torchmetrics sync is a collective every rank must join), without a graph; no gradient
        with torch.no_grad():
            output = super().training_step(*args, **kwargs)
        zero = torch.zeros((), device=self.root_device, requires_grad=True)
        if isinstance(output, dict):
            return {**output, "loss": zero}
        return zero if output is not None else None

    def _handler(self) -> HandlerFactory:
        """The server's update rule."""
        raise NotImplementedError

    def _push_weight(self) -> float:
        """Factor of this rank's gradient before it is pushed."""
        return 1.0

    # ------------------------------------------------------------------ sampler='shared'
    def _claim_speed(self) -> float:
        """This rank's measured speed, sent with each claim (0: none; only DBS sizes claims by it)."""
        return 0.0

    @override
    def _claim(self, epoch: int, n: int, num_samples: int) -> tuple[int, int]:
        ps = self.ps  # looked up at each claim: the loader may be built before the server (an LR schedule)
        if ps is None:
            raise self._fetched_before_setup()
        return ps.claim(epoch, n, num_samples, self._claim_speed())

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        local_sigterm_check(trainer)  # else Lightning's per-step broadcast keeps the workers in lock-step
        self._check_shared(trainer)  # every rank raises the same error, before any claim
        optimizer = self._require_single_optimizer()
        if self._service_group is None:  # a collective: every rank sets up together, once
            self._service_group = self.topology.build_service_group(self._timeout)
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        self.ps = PSAdapter(
            module,
            optimizer,
            self._handler(),
            self._service_group,
            self.global_rank,
            self.world_size,
            self._timeout,
            self.comm_stats,
            self.server,
            self._claim_queue if self.sampler == "shared" else None,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.ps is not None:
            self.ps.start()  # (again) after a validation, a checkpoint or the end of an earlier fit
        # a batch of no tensor: the server sees batch size 0 (softsync then weighs uniformly)
        with suppress(Exception):
            self._batch_samples += extract_batch_size(batch)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self._step_through_server(
            optimizer, lambda: super(ParameterServerWorker, self).optimizer_step(optimizer, closure, model, **kwargs)
        )

    def _step_through_server(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        ps = self.ps
        assert ps is not None
        try:
            if self._serves_only:
                output = ps.step_through_server(optimizer, run_step, ps.keep_pace)
            else:
                output = ps.step_through_server(
                    optimizer, run_step, lambda: ps.push(self._push_weight(), self._batch_samples)
                )
        finally:
            self._batch_samples = 0
        self._log_server_stats(ps.stats())
        return output

    def _log_server_stats(self, stats: dict[str, float]) -> None:
        """Keep the server's metrics every step; hand them to Lightning only at its logging cadence.

        Lightning's ``log_dict`` costs about a millisecond of the training thread per call, which on
        rank 0 alone (the only rank with server metrics) would count as compute and make DBS give
        rank 0 a smaller share; at ``log_every_n_steps`` the cost is spread thin.
        """
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        every = max(1, int(getattr(trainer, "log_every_n_steps", 1)))  # set by Lightning, not declared
        if trainer is None or (trainer.global_step + 1) % every == 0:
            self._log(stats)
        else:
            self.last_metrics.update(stats)

    @override
    def _finalize_algorithm(self) -> None:
        if self.ps is not None:
            self.ps.drain()
            self.ps.load_consensus()

    @contextmanager
    @override
    def _consensus(self) -> Iterator[None]:
        if self.ps is None:
            yield
        else:
            with self.ps.consensus():
                yield

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        if self.ps is None:
            return {}
        self.ps.drain()  # saving is a collective: every worker reaches it
        return self.ps.state_dict()

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if self.ps is not None:
            self.ps.load_state_dict(state)


class AsgdStrategy(ParameterServerWorker):
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
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy` (``timeout``: also the
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
        super().__init__(**kwargs)
        self.staleness_lr = v.check_bool(type(self).__name__, "staleness_lr", staleness_lr)
        self._init_server(server, sampler)

    @override
    def _handler(self) -> HandlerFactory:
        return lambda model, _: AsgdHandler(model, self.staleness_lr)


class SoftsyncStrategy(ParameterServerWorker):
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
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy`.
    """

    strategy_name = "softsync"

    def __init__(
        self, n: int = 1, staleness_lr: bool = False, server: str = "rank0", sampler: str = "split", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.staleness_lr = v.check_bool(type(self).__name__, "staleness_lr", staleness_lr)
        self._init_server(server, sampler)
        self.n = check_softsync_n(self, n)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_softsync_workers(self, self.n)  # in the main process, before any rank starts

    @override
    def _handler(self) -> HandlerFactory:
        return lambda model, workers: SoftsyncHandler(model, workers, self.n, self.staleness_lr)


def check_softsync_n(strategy: ParameterServerWorker, n: int) -> int:
    """``n`` of n-softsync, checked at construction (after :meth:`ParameterServerWorker._init_server`).

    Raises:
        ValueError: ``n`` is not an integer >= 1, or it is 1 with ``sampler='shared'``.
    """
    owner = type(strategy).__name__
    n = v.check_int(owner, "n", n, minimum=1)
    if strategy.sampler == "shared" and n == 1:
        raise ValueError(
            f"{owner}: argument `n`=1 (synchronous) cannot run with sampler='shared': each reply waits for a "
            "gradient of every worker, and with a shared queue the workers' epochs end after different "
            "numbers of steps; use n >= 2 or sampler='split'."
        )
    return n


def check_softsync_workers(strategy: ParameterServerWorker, n: int) -> None:
    """``n`` against the number of workers, when the launcher is configured (before any rank starts).

    Raises:
        ValueError: ``n`` exceeds the number of workers.
    """
    workers = strategy.num_workers
    if n > workers:
        what = "the number of ranks" if strategy.server == "rank0" else "the number of ranks but rank 0, the server"
        owner = type(strategy).__name__
        raise ValueError(f"{owner}: argument `n` must be an integer in [1, {workers}] ({what}), got {n}.")
