"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicSchedule, float_buffers

__all__ = ["LocalSGD", "PeriodicSchedule", "float_buffers"]
