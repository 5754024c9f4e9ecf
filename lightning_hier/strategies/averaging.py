"""Lightning adapters of the model-averaging family.

:class:`LocalSGDStrategy` (registered as ``localsgd``, ``localsgd_spawn``, ``localsgd_fork``):
Local SGD, uniform averaging every ``tau`` optimizer steps (Stich, ICLR 2019; Lin et al.,
ICLR 2020). The algorithm lives in :mod:`lightning_hier.algorithms.averaging`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_hier import _validate as v
from lightning_hier.algorithms.averaging import LocalSGD, float_buffers
from lightning_hier.strategies._algorithm import AlgorithmStrategy

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer


class LocalSGDStrategy(AlgorithmStrategy[LocalSGD]):
    """Local SGD: replicas train independently and are averaged every ``tau`` steps.

    Args:
        tau: Averaging period in optimizer steps (gradient accumulation does not change it).
        sync_buffers: Also average floating-point buffers (BatchNorm statistics) at each round.
        bucket_size_mb: Size bound of the flat buffers reduced in one call (MiB).
        **kwargs: See :class:`~lightning_hier.strategies._base.HierStrategy` (``timeout``,
            ``start_method``, ...).

    Example:
        >>> import lightning.pytorch as pl
        >>> import lightning_hier  # registers the names
        >>> trainer = pl.Trainer(strategy="localsgd_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "localsgd"

    def __init__(self, tau: int = 8, sync_buffers: bool = True, bucket_size_mb: float = 25.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.tau = v.check_int(owner, "tau", tau, minimum=1)
        self.sync_buffers = v.check_bool(owner, "sync_buffers", sync_buffers)
        self.bucket_size_mb = v.check_float(owner, "bucket_size_mb", bucket_size_mb, low=0.0, low_inclusive=False)
        self.algorithm = None

    def _setup_algorithm(self, trainer: pl.Trainer) -> None:
        self._require_single_optimizer()
        module: nn.Module = self.lightning_module  # type: ignore[assignment]
        self.algorithm = LocalSGD(
            module.parameters(),
            group=self.groups.data,
            tau=self.tau,
            buffers=float_buffers(module) if self.sync_buffers else (),
            bucket_bytes=int(self.bucket_size_mb * 2**20),
            stats=self.comm_stats,
        )

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.algorithm is not None
        if self.algorithm.step():
            self._log(
                {"comm/rounds": float(self.algorithm.schedule.rounds), "comm/bytes": float(self.comm_stats.bytes)}
            )
        return output
