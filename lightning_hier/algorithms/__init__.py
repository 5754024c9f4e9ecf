"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicAveraging, PeriodicSchedule, float_buffers, pull_
from lightning_hier.algorithms.centers import CenterPolicy, ElasticCenter, LeaderCenter, RoundReport, UniformCenter
from lightning_hier.algorithms.dbs import DynamicBatchSize, ThroughputMeter, shard_sizes, split_batch
from lightning_hier.algorithms.dbs_sampler import Allocation, DynamicBatchSampler
from lightning_hier.algorithms.decoupled import DecoupledPipeline
from lightning_hier.algorithms.grawa import GradientWeightedCenter, NormEMA, grad_norms, probe_grad_norms
from lightning_hier.algorithms.hpsgd import HPSGD, Merge

__all__ = [
    "HPSGD",
    "Allocation",
    "CenterPolicy",
    "DecoupledPipeline",
    "DynamicBatchSampler",
    "DynamicBatchSize",
    "ElasticCenter",
    "GradientWeightedCenter",
    "LeaderCenter",
    "LocalSGD",
    "Merge",
    "NormEMA",
    "PeriodicAveraging",
    "PeriodicSchedule",
    "RoundReport",
    "ThroughputMeter",
    "UniformCenter",
    "float_buffers",
    "grad_norms",
    "probe_grad_norms",
    "pull_",
    "shard_sizes",
    "split_batch",
]
