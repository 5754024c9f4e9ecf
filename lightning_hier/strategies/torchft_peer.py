"""torchft's Local SGD and DiLoCo under Lightning (registered as ``torchft_local_sgd`` and ``torchft_diloco``).

torchft (PyPI ``torchft``; install with ``pip install 'lightning-hier[torchft]'``) is what a user
who wants fault-tolerant Local SGD or DiLoCo reaches for, so the benchmarks run it as a peer. The
rule, the lighthouse and the stores it needs are :class:`~lightning_hier.sync.TorchftSync`; this
class only builds that object and hands it to the adapter.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.sync.torchft_peer import TorchftSync

REGISTRY_NAMES = {"torchft_local_sgd": "local_sgd", "torchft_diloco": "diloco"}


class TorchftStrategy(HierStrategy):
    """torchft's ``LocalSGD`` or ``DiLoCo``: one torchft replica per rank, its lighthouse on rank 0.

    The model is not wrapped in DDP. Each rank trains alone with the optimizer of
    ``configure_optimizers``; every ``sync_every`` steps torchft's hook forms a quorum through the
    lighthouse and all-reduces, per parameter tensor, the parameters (``local_sgd``) or the
    pseudo-gradients that its outer Nesterov step applies (``diloco``). Validation during fit sees
    each rank's own replica; at the end of fit the replicas are averaged once more if they took
    steps since their last synchronisation. What differs from torchft on its own is listed in
    :mod:`lightning_hier.sync.torchft_peer`.

    Args:
        algorithm: ``'local_sgd'`` or ``'diloco'``.
        sync_every: Optimizer steps between two synchronisations (default 8, as ``localsgd``'s ``tau``).
        outer_lr: ``diloco``: the outer learning rate (the paper's 0.7).
        outer_momentum: ``diloco``: the outer Nesterov momentum in ``[0, 1)`` (the paper's 0.9).
        **kwargs: See :class:`~lightning_hier.strategies.HierStrategy` (``timeout``,
            ``start_method``, ...; not ``fault_tolerance``: torchft's own is run with a fixed
            membership here).

    Raises:
        ImportError: torchft is not installed.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(strategy="torchft_diloco_fork", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> TorchftStrategy("diloco", sync_every=16).sync.sync_every  # doctest: +SKIP
        16
    """

    def __init__(
        self,
        algorithm: str = "local_sgd",
        sync_every: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        **kwargs: Any,
    ) -> None:
        sync = TorchftSync(algorithm, sync_every, outer_lr, outer_momentum, owner=type(self).__name__)
        super().__init__(sync=sync, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``torchft_local_sgd``, ``torchft_diloco`` and their ``_spawn`` / ``_fork`` names."""
        for name, algorithm in REGISTRY_NAMES.items():
            cls._register_family(strategy_registry, name, algorithm=algorithm)
