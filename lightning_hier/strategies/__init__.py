"""Lightning strategies: one adapter (:class:`HierStrategy`) that holds a rule and an allocation, and thin constructors.

Each registered name builds its objects (:mod:`lightning_hier.sync`) and hands them to the adapter;
``decoupled`` and ``grid2d`` are subclasses of it; the ``ddp_*`` peers are Lightning's DDP with one
of torch's communication hooks; ``torchft_*`` run torchft's Local SGD and DiLoCo through the adapter.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier.strategies._checkpoint import CheckpointError
from lightning_hier.strategies._fault_tolerance import FaultTolerance
from lightning_hier.strategies._finite import NonFiniteError
from lightning_hier.strategies.adapter import HierStrategy
from lightning_hier.strategies.averaging import EasgdStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.strategies.dbs import DBSStrategy
from lightning_hier.strategies.dbs_async import AsyncDBSStrategy
from lightning_hier.strategies.dbs_compose import DBSHPSGDStrategy, DBSLocalSGDStrategy
from lightning_hier.strategies.decoupled import DecoupledStrategy
from lightning_hier.strategies.diloco import DiLoCoStrategy
from lightning_hier.strategies.grawa import GrawaStrategy
from lightning_hier.strategies.grid2d import Grid2DStrategy
from lightning_hier.strategies.hpsgd import HPSGDStrategy
from lightning_hier.strategies.param_server import AsgdStrategy, SoftsyncStrategy
from lightning_hier.strategies.peers import DDPCommHookStrategy
from lightning_hier.strategies.torchft_peer import TorchftStrategy

STRATEGIES: tuple[type[HierStrategy], ...] = (
    LocalSGDStrategy,
    EasgdStrategy,
    LsgdStrategy,
    GrawaStrategy,
    HPSGDStrategy,
    DiLoCoStrategy,
    DBSStrategy,
    DecoupledStrategy,
    Grid2DStrategy,
    AsgdStrategy,
    SoftsyncStrategy,
    AsyncDBSStrategy,
    DBSHPSGDStrategy,
    DBSLocalSGDStrategy,
)


def register_all() -> None:
    """Register every strategy name (and its ``_spawn`` / ``_fork`` variants) with Lightning.

    Besides :data:`STRATEGIES`, the peers: those of :class:`DDPCommHookStrategy` (a ``DDPStrategy``,
    not a :class:`HierStrategy`): ``ddp_post_local_sgd``, ``ddp_powersgd``, ``ddp_fp16``; and
    :class:`TorchftStrategy`'s ``torchft_local_sgd`` and ``torchft_diloco`` (built only where
    torchft is installed).
    """
    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)
    DDPCommHookStrategy.register_strategies(StrategyRegistry)
    TorchftStrategy.register_strategies(StrategyRegistry)


__all__ = [
    "STRATEGIES",
    "AsgdStrategy",
    "AsyncDBSStrategy",
    "CheckpointError",
    "DBSHPSGDStrategy",
    "DBSLocalSGDStrategy",
    "DBSStrategy",
    "DDPCommHookStrategy",
    "DecoupledStrategy",
    "DiLoCoStrategy",
    "EasgdStrategy",
    "FaultTolerance",
    "GrawaStrategy",
    "Grid2DStrategy",
    "HPSGDStrategy",
    "HierStrategy",
    "LocalSGDStrategy",
    "LsgdStrategy",
    "NonFiniteError",
    "SoftsyncStrategy",
    "TorchftStrategy",
    "register_all",
]
