"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicSchedule, float_buffers
from lightning_hier.algorithms.decoupled import DecoupledPipeline

__all__ = ["DecoupledPipeline", "LocalSGD", "PeriodicSchedule", "float_buffers"]
