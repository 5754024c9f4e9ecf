"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicSchedule, float_buffers
from lightning_hier.algorithms.dbs import DynamicBatchSize, ThroughputMeter, shard_sizes, split_batch
from lightning_hier.algorithms.dbs_sampler import Allocation, DynamicBatchSampler
from lightning_hier.algorithms.hpsgd import HPSGD, Merge

__all__ = [
    "HPSGD",
    "Allocation",
    "DynamicBatchSampler",
    "DynamicBatchSize",
    "LocalSGD",
    "Merge",
    "PeriodicSchedule",
    "ThroughputMeter",
    "float_buffers",
    "shard_sizes",
    "split_batch",
]
