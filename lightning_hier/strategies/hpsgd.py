"""Lightning adapter of HPSGD (registered as ``hpsgd``, ``hpsgd_spawn``, ``hpsgd_fork``).

Hierarchical Parallel SGD (Zhou, Ye, Zhang and Lv, arXiv 2009.02701, 2020): each window's
all-reduce of the model change runs in the background while the next window computes. The
algorithm lives in :mod:`lightning_hier.algorithms.hpsgd`; this module only connects it to
Lightning's hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from typing_extensions import override

from lightning_hier import _validate as v
from lightning_hier.algorithms.compression import COMPRESSIONS
from lightning_hier.algorithms.hpsgd import HPSGD, MERGES, MODES, Merge
from lightning_hier.algorithms.hpsgd_two_level import TwoLevelHPSGD
from lightning_hier.strategies._algorithm import AlgorithmStrategy
from lightning_hier.strategies._buckets import bucket_arguments, check_bucket_options
from lightning_hier.strategies._step_sync import local_sigterm_check
from lightning_hier.strategies._two_level import TWO_LEVEL_ARGS, TwoLevelOptions

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer


class HPSGDStrategy(TwoLevelOptions, AlgorithmStrategy[HPSGD | TwoLevelHPSGD]):
    """HPSGD: replicas train locally; each window's change is all-reduced behind the next window.

    The model is not wrapped in DDP: there is no per-step gradient all-reduce. Every ``window``
    optimizer steps the replica's change over the window is launched as an asynchronous SUM
    all-reduce; when the next window closes it is waited for, the global model ``S`` advances by
    the average change (one window stale) and the replica restarts from ``S`` plus its own
    newest change (``merge='eager'``, the default) or from ``S`` alone (``merge='paper'``, Zhou
    et al.'s rule, which needs light inner momentum). Validation during fit and the checkpoint's
    ``state_dict`` hold the model ``fit()`` would return at that point (``S`` advanced by the
    window in flight and the mean of the steps since), equal on every rank; at the end of fit
    those are merged for good, so no update is lost. The exact rules are in
    :mod:`lightning_hier.algorithms.hpsgd`.

    Args:
        window: ``H``, optimizer steps per window (gradient accumulation does not change it). In
            mode ``'poll'``, the minimum window.
        mode: ``'fixed'`` (deterministic; resumes bit-identically) or ``'poll'`` (merge as soon
            as the reduction has completed on every rank, after at least ``window`` steps; ranks
            agree through a MIN all-reduce of a flag on a separate control group each step;
            window lengths then depend on timing).
        merge: ``'eager'`` (replica restarts from ``S + own newest window change``; safe with
            momentum 0.9, Nesterov and AdamW) or ``'paper'`` (replica restarts from ``S``).
        outer_lr: Outer learning rate applied to the averaged window change (``1.0``: added as is).
        outer_momentum: Outer Nesterov momentum on the averaged change, as DiLoCo (``0.0``: none).
        compression: ``'none'`` (float32 window changes) or ``'bf16'`` (bfloat16 with error
            feedback: half the bytes; the global model stays float32).
        sync_buffers: Average floating-point buffers (BatchNorm statistics) at each merge, with
            the same one-window staleness as the parameters. ``False``: buffers stay local and
            each rank evaluates ``S`` with its own buffers.
        reset_optimizer_state: Clear the inner optimizer's state (momentum, Adam moments) at every
            merge; by default it carries over.
        bucket_size_mb: Size bound of one flat buffer (MiB, >= 0.001): the parameters are views of a few
            buckets, so a very large model is reduced in a few calls, not one per tensor.
    {two_level}
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy` (``timeout``,
            ``start_method``, ...).

    Logged at every merge (also kept in ``last_metrics``): ``hpsgd/window`` (steps in the window
    just closed), ``hpsgd/blocked_s`` (seconds waiting for the previous reduction: ~0 when it
    was hidden), ``hpsgd/bytes`` (bytes launched for this window), ``hpsgd/consensus_distance``
    (``||x - S||`` on this rank), ``hpsgd/merges``, and the running totals ``comm/bytes`` and
    ``comm/blocked_s``; with ``inter_node_every`` also ``comm/bytes_intra``, ``comm/bytes_inter``
    and (``intra_node='window'``) ``hpsgd/inter_merges``.

    Two levels (``inter_node_every=m``, ``intra_node='window'``): HPSGD runs unchanged inside each
    node over ``data_intra``; every ``m``-th merge the node's change since its last cross-node
    send is SUM-reduced over ``data_inter`` in the background and merged ``m`` windows later
    (:mod:`lightning_hier.algorithms.hpsgd_two_level`). ``intra_node='step'``: DDP inside the
    node and flat HPSGD over ``data_inter`` with a window of ``m * window`` steps. Mode ``'poll'``
    is flat only.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="hpsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> strategy = HPSGDStrategy(window=8, timeout=120)
        >>> strategy.window
        8
    """

    strategy_name = "hpsgd"

    def __init__(
        self,
        window: int = 2,
        mode: str = "fixed",
        merge: str = "eager",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        compression: str = "none",
        sync_buffers: bool = True,
        reset_optimizer_state: bool = False,
        bucket_size_mb: float = 25.0,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.window = v.check_int(owner, "window", window, minimum=1)
        self.mode = v.check_choice(owner, "mode", mode, MODES)
        self.merge = v.check_choice(owner, "merge", merge, MERGES)
        self.outer_lr = v.check_float(owner, "outer_lr", outer_lr, low=0.0, low_inclusive=False)
        self.outer_momentum = v.check_float(
            owner, "outer_momentum", outer_momentum, low=0.0, high=1.0, high_inclusive=False
        )
        self.compression = v.check_choice(owner, "compression", compression, COMPRESSIONS)
        self.sync_buffers, self.bucket_size_mb = check_bucket_options(owner, sync_buffers, bucket_size_mb)
        self.reset_optimizer_state = v.check_bool(owner, "reset_optimizer_state", reset_optimizer_state)
        self.algorithm = None
        self._control_group: dist.ProcessGroup | None = None
        self._configure_two_level(
            inter_node_every,
            intra_node,
            {"mode": ("poll", "the readiness agreement of mode 'poll' is over one flat group; use mode='fixed'")},
        )

    @override
    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        # Lightning's per-step SIGTERM-flag broadcast would wait behind the window's reduction in
        # flight: on a 100 Mbit/s link about 0.1 s per window, which hid nothing of it
        # (benchmarks/README.md, "Issue 18: the fit around the steady state"); the windows' own
        # collectives keep the ranks together, and a signalled rank still stops (see _step_sync)
        local_sigterm_check(trainer)
        optimizer = self._require_single_optimizer()
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        levels = self._levels()
        node = HPSGD(
            module.parameters(),
            group=levels.intra if levels is not None else self._periodic_group(),
            window=self.window * self._period_factor(),
            mode=self.mode,
            merge=self.merge,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            compression=self.compression,
            **bucket_arguments(module, self.sync_buffers, self.bucket_size_mb),
            stats=self.comm_stats,
            control_group=self._poll_group(),
            optimizer=optimizer,
            reset_optimizer_state=self.reset_optimizer_state,
        )
        self.algorithm = TwoLevelHPSGD(node, levels) if levels is not None else node

    def _poll_group(self) -> dist.ProcessGroup | None:
        """A second data-parallel group for the readiness flag, so it never queues behind the bulk reduction."""
        if self.mode != "poll" or self.groups.data is None:
            return None
        if self._control_group is None:
            for ranks in self.topology.all_groups("data"):  # a collective: every rank, same order
                group = dist.new_group(ranks, timeout=self._timeout)
                if self.global_rank in ranks:
                    self._control_group = group
        return self._control_group

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.algorithm is not None
        merge = self.algorithm.step()
        if merge is not None:
            self._log(self._metrics(merge))
        return output

    def _metrics(self, merge: Merge) -> dict[str, float]:
        levels = self.algorithm if isinstance(self.algorithm, TwoLevelHPSGD) else None
        return {
            **(levels.metrics() if levels is not None else self._level_metrics(None)),
            "hpsgd/window": float(merge.window),
            "hpsgd/blocked_s": merge.blocked_s,
            "hpsgd/bytes": float(merge.bytes),
            "hpsgd/consensus_distance": merge.distance,
            "hpsgd/merges": float(merge.merges),
            "comm/bytes": float(self.comm_stats.bytes),
            "comm/blocked_s": self.comm_stats.blocked_s,
        }


HPSGDStrategy.__doc__ = (HPSGDStrategy.__doc__ or "").replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="window"))
