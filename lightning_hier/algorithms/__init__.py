"""The math of each method as plain torch state machines (no Lightning, no Hydra)."""

from lightning_hier.algorithms.averaging import LocalSGD, PeriodicAveraging, PeriodicSchedule, float_buffers, pull_
from lightning_hier.algorithms.centers import CenterPolicy, ElasticCenter, LeaderCenter, RoundReport, UniformCenter
from lightning_hier.algorithms.dbs import DynamicBatchSize, ThroughputMeter, shard_sizes, split_batch
from lightning_hier.algorithms.dbs_sampler import Allocation, DynamicBatchSampler
from lightning_hier.algorithms.decoupled import DecoupledPipeline
from lightning_hier.algorithms.diloco import DiLoCo
from lightning_hier.algorithms.grawa import GradientWeightedCenter, NormEMA, grad_norms, probe_grad_norms
from lightning_hier.algorithms.hpsgd import HPSGD, Merge
from lightning_hier.algorithms.param_server import DONE, PULL, PUSH, Handler, Reply, Request, ServerCore, ServerStats
from lightning_hier.algorithms.ps_link import ServerLink
from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel, SoftsyncHandler
from lightning_hier.algorithms.ps_service import LocalClient, ParameterServer, RemoteClient, Worker, connect

__all__ = [
    "DONE",
    "HPSGD",
    "PULL",
    "PUSH",
    "Allocation",
    "AsgdHandler",
    "CenterPolicy",
    "DecoupledPipeline",
    "DiLoCo",
    "DynamicBatchSampler",
    "DynamicBatchSize",
    "ElasticCenter",
    "FlatModel",
    "GradientWeightedCenter",
    "Handler",
    "LeaderCenter",
    "LocalClient",
    "LocalSGD",
    "Merge",
    "NormEMA",
    "ParameterServer",
    "PeriodicAveraging",
    "PeriodicSchedule",
    "RemoteClient",
    "Reply",
    "Request",
    "RoundReport",
    "ServerCore",
    "ServerLink",
    "ServerStats",
    "SoftsyncHandler",
    "ThroughputMeter",
    "UniformCenter",
    "Worker",
    "connect",
    "float_buffers",
    "grad_norms",
    "probe_grad_norms",
    "pull_",
    "shard_sizes",
    "split_batch",
]
