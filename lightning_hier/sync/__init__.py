"""How replicas agree and how each gets its batches: objects any training loop can drive (no Lightning).

The Lightning strategies hold one :class:`Sync` and one :class:`Allocation` each
(:class:`~lightning_hier.strategies.HierStrategy`); the same objects run in a plain PyTorch or
Lightning Fabric loop through :meth:`Sync.attach`, and on Lightning's own ``ddp`` strategy through
:class:`~lightning_hier.callbacks.OnDDP`.

============================================  =====================================================
:class:`HPSGDSync`                            HPSGD: each window's change all-reduced behind the next
:class:`DiLoCoSync`                           DiLoCo: an outer Nesterov step per window, by fragments
:class:`AveragingSync` (``.localsgd``,        a round every ``tau`` steps: Local SGD, EASGD, LSGD,
``.easgd``, ``.lsgd``, ``.grawa``)            GRAWA
:class:`ShareWeightedGradients`               DBS: gradients weighted by each rank's batch share
:class:`SpeedShares`                          DBS's allocation: batch shares that follow measured speed
:class:`ServerSync`                           a parameter server on rank 0 (``asgd``, ``softsync``)
:class:`Levels`                               flat, or two levels (inside the node, across nodes)
:class:`TorchftSync`                          torchft's ``LocalSGD`` / ``DiLoCo`` (a peer to compare with)
============================================  =====================================================
"""

from lightning_hier.sync.averaging import AveragingSync, NormSource, PullSchedule
from lightning_hier.sync.base import Allocation, Binding, Sync
from lightning_hier.sync.dbs import ShareWeightedGradients, SpeedShares
from lightning_hier.sync.dbs_compose import SampleWeights
from lightning_hier.sync.diloco import DiLoCoSync
from lightning_hier.sync.hpsgd import HPSGDSync
from lightning_hier.sync.levels import Levels
from lightning_hier.sync.param_server import ServerShards, ServerSync
from lightning_hier.sync.shared_queue import SharedQueue
from lightning_hier.sync.torchft_peer import TorchftSync

__all__ = [
    "Allocation",
    "AveragingSync",
    "Binding",
    "DiLoCoSync",
    "HPSGDSync",
    "Levels",
    "NormSource",
    "PullSchedule",
    "SampleWeights",
    "ServerShards",
    "ServerSync",
    "ShareWeightedGradients",
    "SharedQueue",
    "SpeedShares",
    "Sync",
    "TorchftSync",
]
