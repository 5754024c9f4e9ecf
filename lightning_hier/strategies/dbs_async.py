"""Lightning adapter of DBS-SGD in its asynchronous form (``dbs_async``; Ji et al. 2019).

The 2019 paper's own setting: workers of different speeds push gradients to a parameter server
(ASGD), and DBS gives each worker a batch in proportion to its measured speed, so every worker's
iteration takes about the same time and the staleness of the gradients the server applies stays
low. :class:`AsyncDBSStrategy` is :class:`~lightning_hier.strategies.dbs.DBSStrategy`'s
allocation (measured speed, batch shares, the DBS sampler, rebalancing) driving the workers of
:class:`~lightning_hier.strategies.param_server.AsgdStrategy`'s server instead of an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.dbs import SpeedShares
from lightning_hier.sync.param_server import ServerSync


class AsyncDBSStrategy(HierStrategy):
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
    checkpoints, logging, resume not bit-identical) is as for ``asgd``; the allocation's arguments
    are :class:`~lightning_hier.strategies.dbs.DBSStrategy`'s (``global_batch_size``,
    ``rebalance_every``, ``ema``, ``min_batch_size``, ``max_batch_size``, ``warmup_steps``,
    ``initial_sizes``, ``timer``; nothing is all-reduced, so ``dbs``'s ``sync_buffers`` and
    ``bucket_size_mb`` are not taken: BatchNorm statistics are rank 0's).

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
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy`.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="dbs_async_fork", accelerator="cpu", devices=3)  # doctest: +SKIP
    """

    strategy_name = "dbs_async"

    def __init__(
        self,
        global_batch_size: int | None = None,
        rebalance_every: int = 20,
        ema: float = 0.5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        warmup_steps: int = 5,
        initial_sizes: Sequence[int] | None = None,
        timer: str = "wall",
        sampler: str = "split",
        n: int | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        server = ServerSync("asgd" if n is None else "softsync", n, sampler=sampler, owner=owner)
        shares = SpeedShares(
            global_batch_size,
            rebalance_every,
            ema,
            min_batch_size,
            max_batch_size,
            warmup_steps,
            initial_sizes,
            # every rank reads the same clock, so speeds compare; rank 0's server threads are left out
            "thread" if timer == "cpu" else timer,
            # equal iteration times, round trips to the server included, are what equalise the staleness
            span="iteration",
            server=server,
            shared=server.sampler == "shared",
            owner=owner,
        )
        server.shares = shares
        super().__init__(sync=server, allocation=shares, **kwargs)
