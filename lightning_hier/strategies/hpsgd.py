"""Lightning adapter of HPSGD (registered as ``hpsgd``, ``hpsgd_spawn``, ``hpsgd_fork``).

Hierarchical Parallel SGD (Zhou, Ye, Zhang and Lv, arXiv 2009.02701, 2020): each window's
all-reduce of the model change runs in the background while the next window computes. The
algorithm lives in :mod:`lightning_hier.algorithms.hpsgd`, its binding to a model and optimizers
in :class:`~lightning_hier.sync.HPSGDSync`; this class only builds that object.
"""

from __future__ import annotations

from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.hpsgd import HPSGDSync
from lightning_hier.sync.levels import TWO_LEVEL_ARGS, Levels


class HPSGDStrategy(HierStrategy):
    """HPSGD: replicas train locally; each window's change is all-reduced behind the next window.

    The model is not wrapped in DDP: there is no per-step gradient all-reduce. Every ``window``
    optimizer steps the replica's change over the window is launched as an asynchronous SUM
    all-reduce; when the next window closes it is waited for, the global model ``S`` advances by
    the average change (one window stale) and the replica restarts from ``S`` plus its own
    newest change (``merge='eager'``, the default) or from ``S`` alone (``merge='paper'``, Zhou
    et al.'s rule, which needs light inner momentum). Validation during fit and the checkpoint's
    ``state_dict`` hold the newest model every rank agrees on (``S`` advanced by the window in
    flight; nothing more is sent), equal on every rank; it lags the replicas by the steps since
    the last launch, which the end of fit merges too, so no update is lost. The exact rules are in
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
        compression: ``'none'`` (float32 window changes), ``'bf16'`` (bfloat16 with error feedback:
            half the bytes), ``'int8'`` or ``'int4'`` (blockwise absmax quantization, round half to
            even, with error feedback, reduced by the quantized all-reduce of
            :mod:`lightning_hier.comm.quantized`: about a quarter or an eighth of the bytes, and
            a rank sends about two quantized payloads whatever the number of ranks). The global
            model stays float32. The quantized forms are flat only (no ``inter_node_every``).
        sync_buffers: Average floating-point buffers (BatchNorm statistics) at each merge, with
            the same one-window staleness as the parameters. ``False``: buffers stay local and
            each rank evaluates ``S`` with its own buffers.
        reset_optimizer_state: Clear the inner optimizer's state (momentum, Adam moments) at every
            merge; by default it carries over.
        bucket_size_mb: Size bound of one flat buffer (MiB, >= 0.001): the parameters are views of a few
            buckets, so a very large model is reduced in a few calls, not one per tensor.
        delay: Optimizer steps from a window's launch to its merge, in ``[1, window]``. ``None``
            (default): ``window``, the paper's schedule, where the average merged is one window old.
            A smaller delay brings the others' changes in sooner (less staleness: better accuracy
            with momentum) and leaves the reduction ``delay`` steps of compute to hide behind;
            the launches stay every ``window`` steps. ``'auto'``: the first two windows merge at
            their end; the second's reduction is timed on every rank (from its launch to its
            completion, beside the steps' compute), and every later window merges after the
            fewest steps that hide such a reduction to within a quarter step
            (:func:`~lightning_hier.algorithms.hpsgd.auto_delay`; agreed by one all-reduce;
            logged as ``hpsgd/delay``): one step on a fast link, the whole window on a slow one,
            without knowing which beforehand. A delay below ``window`` (or
            ``'auto'``) needs ``merge='eager'``, mode ``'fixed'`` and one level.
    {two_level}
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ...).

    Logged at every merge (also kept in ``last_metrics``): ``hpsgd/window`` (steps in the window
    just closed), ``hpsgd/delay`` (steps from a launch to its merge), ``hpsgd/blocked_s``
    (seconds waiting for the previous reduction: ~0 when it was hidden), ``hpsgd/bytes`` (bytes
    launched for this window), ``hpsgd/consensus_distance`` (``||x - S||`` on this rank),
    ``hpsgd/merges``, and the running totals ``comm/bytes`` and ``comm/blocked_s``; with
    ``inter_node_every`` also ``comm/bytes_intra``, ``comm/bytes_inter`` and
    (``intra_node='window'``) ``hpsgd/inter_merges``.

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
        >>> strategy.sync.window
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
        delay: int | str | None = None,
        inter_node_every: int | None = None,
        intra_node: str = "window",
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        levels = Levels(owner, inter_node_every, intra_node)
        sync = HPSGDSync(
            window,
            mode,
            merge,
            outer_lr,
            outer_momentum,
            compression,
            sync_buffers,
            reset_optimizer_state,
            bucket_size_mb,
            delay=delay,
            levels=levels,
            owner=owner,
        )
        super().__init__(sync=sync, **kwargs)


HPSGDStrategy.__doc__ = (HPSGDStrategy.__doc__ or "").replace("    {two_level}", TWO_LEVEL_ARGS.format(unit="window"))
