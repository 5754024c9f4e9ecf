"""Lightning adapter of DiLoCo (registered as ``diloco``, ``diloco_spawn``, ``diloco_fork``).

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105, 2023), with the fragments, overlap and mixing of Streaming DiLoCo (arXiv
2501.18512, 2025). The algorithm lives in :mod:`lightning_hier.algorithms.diloco`, its binding to
a model and optimizers in :class:`~lightning_hier.sync.DiLoCoSync`; this class only builds that
object.
"""

from __future__ import annotations

from typing import Any

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.diloco import DiLoCoSync


class DiLoCoStrategy(HierStrategy):
    """DiLoCo: Local SGD with the module's own optimizer inside and an outer Nesterov step every window.

    The model is not wrapped in DDP. Each rank trains alone with the optimizer of
    ``configure_optimizers`` (the *inner* optimizer: AdamW in the paper) for ``window`` steps;
    then the replicas' mean change ``u = mean_w (x_w - S)`` is all-reduced and moves the global
    model by an outer SGD step with Nesterov momentum on the outer gradient ``-u``
    (``S <- S + outer_lr (u + outer_momentum M)``), and every replica restarts from ``S``. The
    inner optimizer's state carries over. With ``outer_lr=1`` and ``outer_momentum=0`` this is
    ``localsgd``.

    Streaming: ``fragments=F`` cuts the parameters into ``F`` contiguous groups of about equal
    size that synchronise at staggered steps (fragment ``f`` when ``step mod window ==
    round((f + 1) window / F) mod window``), so the link carries ``1/F`` of the model at a time; a
    fragment's reduction runs behind ``fragment_sync_delay`` steps of compute before it is
    applied, and the replica then keeps ``fragment_update_alpha`` of its own newest values
    (``x <- alpha x + (1 - alpha) S``). Validation during fit and the checkpoint's
    ``state_dict`` hold ``S``; at the end of fit every fragment takes a last outer step on the
    changes since its last synchronisation and every rank holds ``S``. The exact rules are in
    :mod:`lightning_hier.algorithms.diloco`.

    Args:
        window: ``H``, inner optimizer steps between two synchronisations of a fragment (gradient
            accumulation does not change it). The paper uses 500 on language models; on an epoch
            of a few hundred steps, 16 to 64.
        outer_lr: Outer learning rate (the paper's 0.7).
        outer_momentum: Outer Nesterov momentum in ``[0, 1)`` (the paper's 0.9).
        fragments: ``F``, staggered fragments (1: the whole model every ``window`` steps).
        fragment_sync_delay: Steps of compute a fragment's reduction overlaps with, in
            ``[0, window)`` (0: applied at once).
        fragment_update_alpha: Share of the replica's own newest values kept when a fragment's
            update lands, in ``[0, 1)`` (0: the replica becomes ``S``).
        compression: The outer gradient on the wire: ``'none'`` (float32), ``'bf16'`` (with error
            feedback), ``'int8'`` or ``'int4'`` (blockwise absmax, round half to even, error
            feedback; the quantized all-reduce keeps a rank's bytes at about two quantized
            payloads whatever the number of ranks). The global model stays float32.
        sync_buffers: Average floating-point buffers (BatchNorm statistics) every ``window`` steps.
        bucket_size_mb: Size bound of one flat buffer (MiB, >= 0.001).
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ...; ``fault_tolerance`` with ``fragments=1``,
            ``fragment_sync_delay=0`` and ``compression`` ``'none'`` or ``'bf16'``).

    Logged whenever a fragment is sent or applied: ``diloco/syncs`` (fragments sent so far),
    ``comm/bytes`` and ``comm/blocked_s``.

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="diloco_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> strategy = DiLoCoStrategy(window=32, fragments=4, compression="int4")
        >>> strategy.sync.fragments
        4
    """

    strategy_name = "diloco"

    def __init__(
        self,
        window: int = 64,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        compression: str = "none",
        sync_buffers: bool = True,
        bucket_size_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        sync = DiLoCoSync(
            window,
            outer_lr,
            outer_momentum,
            fragments,
            fragment_sync_delay,
            fragment_update_alpha,
            compression,
            sync_buffers,
            bucket_size_mb,
            owner=type(self).__name__,
        )
        super().__init__(sync=sync, **kwargs)
