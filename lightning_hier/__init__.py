"""lightning-hier: five distributed-training algorithms as PyTorch Lightning strategies.

Importing the package registers every strategy name with Lightning, so
``Trainer(strategy="localsgd")`` (and ``"localsgd_spawn"``, ``"localsgd_fork"``) work.
"""

from lightning_hier.strategies import (
    STRATEGIES,
    DecoupledStrategy,
    Grid2DStrategy,
    HierStrategy,
    LocalSGDStrategy,
    register_all,
)
from lightning_hier.topology import Topology

__version__ = "0.1.0"

register_all()

__all__ = [
    "STRATEGIES",
    "DecoupledStrategy",
    "Grid2DStrategy",
    "HierStrategy",
    "LocalSGDStrategy",
    "Topology",
    "__version__",
]
