"""Lightning strategies, one per algorithm (thin adapters over :mod:`lightning_hier.algorithms`)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier.strategies._base import HierStrategy
from lightning_hier.strategies.averaging import LocalSGDStrategy
from lightning_hier.strategies.dbs import DBSStrategy
from lightning_hier.strategies.grid2d import Grid2DStrategy
from lightning_hier.strategies.hpsgd import HPSGDStrategy

STRATEGIES: tuple[type[HierStrategy], ...] = (LocalSGDStrategy, HPSGDStrategy, DBSStrategy, Grid2DStrategy)


def register_all() -> None:
    """Register every strategy name (and its ``_spawn`` / ``_fork`` variants) with Lightning."""
    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)


__all__ = [
    "STRATEGIES",
    "DBSStrategy",
    "Grid2DStrategy",
    "HPSGDStrategy",
    "HierStrategy",
    "LocalSGDStrategy",
    "register_all",
]
