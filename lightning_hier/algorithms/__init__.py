"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicSchedule, float_buffers
from lightning_hier.algorithms.dbs import DynamicBatchSize, ThroughputMeter, shard_sizes, split_batch
from lightning_hier.algorithms.dbs_sampler import Allocation, DynamicBatchSampler

__all__ = [
    "Allocation",
    "DynamicBatchSampler",
    "DynamicBatchSize",
    "LocalSGD",
    "PeriodicSchedule",
    "ThroughputMeter",
    "float_buffers",
    "shard_sizes",
    "split_batch",
]
