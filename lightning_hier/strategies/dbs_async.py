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
from lightning_hier.algorithms.ps_rules import AsgdHandler
from lightning_hier.strategies._ps_adapter import HandlerFactory
from lightning_hier.strategies.dbs import DBSStrategy
from lightning_hier.strategies.param_server import ParameterServerWorker

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader


class AsyncDBSStrategy(ParameterServerWorker, DBSStrategy):
    """DBS-SGD, asynchronous: speed-proportional batch shares, gradients pushed to an ASGD server on rank 0.

    Each rank's gradient (the mean over its ``b_w`` samples) is pushed with the weight
    ``W * b_w / B``: with equal shares every push counts as in ASGD, and a rank with twice the
    share moves the model twice as far, as its gradient stands for twice the samples. The split is
    rebalanced every ``rebalance_every`` steps from the measured speeds (an all-gather of ``W``
    floats: the one point where the workers meet besides validation and checkpoints); the wait for
    the server's reply is not counted as compute time. With ``timer='cpu'`` the compute time is the
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

    Args:
        sampler: ``'split'`` (default; the DBS sampler: every rank the same number of steps) or
            ``'shared'`` (above).
        **kwargs: See :class:`~lightning_hier.strategies.dbs.DBSStrategy`.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_async_fork", accelerator="cpu", devices=3)  # doctest: +SKIP
    """

    strategy_name = "dbs_async"
    _claim_batch = 0

    def __init__(self, sampler: str = "split", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_server(self.server, sampler)

    @override
    def _handler(self) -> HandlerFactory:
        return lambda model, _: AsgdHandler(model)

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
        allocation = self._build_shares().bind(self._check_training_loader(loader))
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
