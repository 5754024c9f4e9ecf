"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicSchedule, float_buffers
from lightning_hier.algorithms.hpsgd import HPSGD, Merge

__all__ = ["HPSGD", "LocalSGD", "Merge", "PeriodicSchedule", "float_buffers"]
