"""Lightning adapter of DBS-SGD in its asynchronous form (``dbs_async``; Ji et al. 2019).

The 2019 paper's own setting: workers of different speeds push gradients to a parameter server
(ASGD), and DBS gives each worker a batch in proportion to its measured speed, so every worker's
iteration takes about the same time and the staleness of the gradients the server applies stays
low. :class:`AsyncDBSStrategy` is :class:`~lightning_hier.strategies.dbs.DBSStrategy`'s
allocation (measured speed, batch shares, the DBS sampler, rebalancing) driving the workers of
:class:`~lightning_hier.strategies.param_server.AsgdStrategy`'s server instead of an all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_hier.algorithms.claim_sampler import ClaimQueue, ServerShares
from lightning_hier.algorithms.ps_link import served_workers
from lightning_hier.algorithms.ps_rules import AsgdHandler, SoftsyncHandler
from lightning_hier.strategies._ps_adapter import HandlerFactory
from lightning_hier.strategies.dbs import DBSStrategy
from lightning_hier.strategies.param_server import ParameterServerWorker, check_softsync_n, check_softsync_workers

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader


class AsyncDBSStrategy(ParameterServerWorker, DBSStrategy):
    """DBS-SGD, asynchronous: speed-proportional batch shares, gradients pushed to an ASGD server on rank 0.

    Each rank's gradient (the mean over its ``b_w`` samples) is pushed with the weight
    ``W * b_w / B``: with equal shares every push counts as in ASGD, and a rank with twice the
    share moves the model twice as far, as its gradient stands for twice the samples. The split is
    rebalanced every ``rebalance_every`` steps from the measured speeds (an all-gather of ``W``
    floats: the one point where the workers meet besides validation and checkpoints). A rank's
    speed is its samples over its whole iteration, from the end of its previous step to the end of
    this one (``span='iteration'`` of :class:`~lightning_hier.algorithms.dbs.DynamicBatchSize`):
    the round trips to the server (its push, under ``sampler='shared'`` its claim) are part of a
    worker's iteration, and equal iteration times, not equal compute times, give every worker the
    same staleness (rank 0 reaches the server without a message, so timed on compute alone the
    remote workers iterated more slowly than their shares assumed). The first step of an epoch
    and after a validation is timed alone. With ``timer='cpu'`` the time is the
    CPU time of each rank's training thread (``'thread'``), not of its process: rank 0's process
    also runs the server's threads, whose work would otherwise count as rank 0's compute and shrink
    its share (torch's intra-op threads are left out as well: use ``torch.set_num_threads(1)``).
    Everything about the server (consensus,
    checkpoints, logging, resume not bit-identical) is as for ``asgd``; every argument is
    :class:`~lightning_hier.strategies.dbs.DBSStrategy`'s (``sync_buffers`` and ``bucket_size_mb``
    have no effect: nothing is all-reduced, and BatchNorm statistics are rank 0's).

    With ``sampler='shared'`` the workers run freely, as in the paper: each claims its next batch
    from a queue on the server (see :class:`~lightning_hier.strategies.param_server.AsgdStrategy`),
    and the server sizes every claim: each worker reports its smoothed measured speed with its
    claims, and the server splits the global batch ``B`` in proportion to the latest speeds
    (:class:`~lightning_hier.algorithms.claim_sampler.ServerShares`, the same split as the
    all-gather's), so no all-gather ties the workers together every ``rebalance_every`` steps; a
    worker folds its measurements into its estimate every ``rebalance_every`` of its own steps.
    Its gradient weighs ``W * b / B`` for a claim of ``b`` samples. ``dbs/...`` rebalance metrics
    are not logged then; the server's ``ps/worker{w}/batch_size`` are.

    With ``n`` the server is n-softsync's instead of ASGD's (Zhang et al., IJCAI 2016): it applies
    the plain mean of every ``ceil(W / n)`` pushed gradients, each already weighted ``W * b / B``,
    so an update moves the model by the same step per sample as ``softsync`` with equal shares and
    ``n = 1`` is synchronous DBS (``dbs``) through the server. The allocation is independent of
    the server's rule; this compares DBS-SGD with n-softsync at the same ``n``. Every pushed
    gradient counts in the staleness whatever the rule, so the mean staleness per push is
    ``(W - 1) / ceil(W / n)`` whatever the shares: DBS lowers each worker's mean and the maximum.

    Args:
        sampler: ``'split'`` (default; the DBS sampler: every rank the same number of steps) or
            ``'shared'`` (above).
        n: ``None`` (default): the ASGD server. An integer in ``[1, W]`` (the workers): the
            n-softsync server (``n >= 2`` with ``sampler='shared'``).
        **kwargs: See :class:`~lightning_hier.strategies.dbs.DBSStrategy`.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_async_fork", accelerator="cpu", devices=3)  # doctest: +SKIP
    """

    strategy_name = "dbs_async"
    _claim_batch = 0

    def __init__(self, sampler: str = "split", n: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_server(self.server, sampler)
        self.n = None if n is None else check_softsync_n(self, n)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.n is not None:
            check_softsync_workers(self, self.n)

    @override
    def _handler(self) -> HandlerFactory:
        n = self.n
        if n is None:
            return lambda model, _: AsgdHandler(model)
        # the pushes carry DBS's weights already: the group's plain mean keeps them
        return lambda model, workers: SoftsyncHandler(model, workers, n, by_batch_size=False)

    @override
    def _push_weight(self) -> float:
        assert self.algorithm is not None
        return self.world_size * self.algorithm.step_share

    @override
    def _clock(self) -> str:
        # every rank reads the same clock, so speeds compare; rank 0's server threads are left out
        return "thread" if self.timer == "cpu" else self.timer

    @override
    def _claim_size(self, loader: DataLoader[Any]) -> tuple[int, Callable[[int], None] | None]:
        allocation = self._training_allocation(loader)
        self._claim_batch = allocation.global_batch
        return 0, allocation.take_claimed  # 0: the server sizes each claim

    @override
    def _claim_speed(self) -> float:
        return self.shares.meter.estimate if self.shares is not None else 0.0

    @override
    def _claim_queue(self) -> ClaimQueue:
        workers = served_workers(self.world_size, self.server)
        shares = ServerShares(self._claim_batch, workers, self.min_batch_size, self.max_batch_size, self.initial_sizes)
        return ClaimQueue(shares)

    @override
    def rebalance_if_due(self) -> dict[str, Any] | None:
        if self.sampler != "shared":
            return super().rebalance_if_due()
        if self.shares is not None and self.shares.due():
            self.shares.measure()  # the new estimate goes to the server with the next claims
        return None

    @override
    def _shares_arguments(self, module: nn.Module) -> dict[str, Any]:
        # equal iteration times, round trips to the server included, are what equalise the staleness
        return super()._shares_arguments(module) | {"span": "iteration"}

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.shares is not None and (batch_idx == 0 or self.ps is None or not self.ps.running):
            self.shares.restart()  # the time since the last step holds a pause: an epoch's end, validation
        super().on_train_batch_start(batch, batch_idx)

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        DBSStrategy._setup_algorithm(self, trainer)  # the allocation and its callback
        ParameterServerWorker._setup_algorithm(self, trainer)  # the server and this rank's worker

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        algorithm = self.algorithm
        assert algorithm is not None
        # past DBSStrategy's step, which would all-reduce the gradients: the server applies them
        output = self._step_through_server(
            optimizer, lambda: super(DBSStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)
        )
        algorithm.end_step()
        return output

    @override
    def _algorithm_state(self) -> dict[str, Any]:
        return {"dbs": DBSStrategy._algorithm_state(self), "server": ParameterServerWorker._algorithm_state(self)}

    @override
    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        if state:
            DBSStrategy._load_algorithm_state(self, state["dbs"])
            ParameterServerWorker._load_algorithm_state(self, state["server"])
