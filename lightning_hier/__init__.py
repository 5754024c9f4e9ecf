"""lightning-hier: five distributed-training algorithms as PyTorch Lightning strategies.

Importing the package registers every strategy name with Lightning, so
``Trainer(strategy="hpsgd")`` (and ``"hpsgd_spawn"``, ``"hpsgd_fork"``) work.
"""

from lightning_hier.strategies import (
    STRATEGIES,
    DBSStrategy,
    DDPCommHookStrategy,
    DecoupledStrategy,
    EasgdStrategy,
    GrawaStrategy,
    Grid2DStrategy,
    HierStrategy,
    HPSGDStrategy,
    LocalSGDStrategy,
    LsgdStrategy,
    register_all,
)
from lightning_hier.topology import Topology

__version__ = "0.1.0"

register_all()

__all__ = [
    "STRATEGIES",
    "DBSStrategy",
    "DDPCommHookStrategy",
    "DecoupledStrategy",
    "EasgdStrategy",
    "GrawaStrategy",
    "Grid2DStrategy",
    "HPSGDStrategy",
    "HierStrategy",
    "LocalSGDStrategy",
    "LsgdStrategy",
    "Topology",
    "__version__",
]
