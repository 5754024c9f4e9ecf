"""Which rules and allocations go together, decided in one place.

A strategy is a :class:`~lightning_hier.sync.Sync` and an :class:`~lightning_hier.sync.Allocation`;
:func:`check_composition` refuses, at construction, the pairs that have no defined meaning, with
the reason:

- **DBS's shares** (:class:`~lightning_hier.sync.SpeedShares`) change each rank's batch every
  rebalance, so the rule must weigh each rank by its samples: DBS's own weighted gradients
  (:class:`~lightning_hier.sync.ShareWeightedGradients`), a parameter server that weighs each push
  (``dbs_async``), or HPSGD's / Local SGD's window weighted by samples
  (:class:`~lightning_hier.sync.SampleWeights`; ``dbs_hpsgd``, ``dbs_localsgd``), and those only flat:
  in two levels the weights would have to be per level (samples of the node inside it, of each
  node across nodes), which is not built. EASGD's elastic force is symmetric (each replica moves by
  ``alpha (x_i - c)``, the center by ``beta (mean(x) - c)``), so sample weights would break its
  conservation, and LSGD's leader or GRAWA's gradient-norm weights have no derivation with a second
  weighting by samples. The pipeline and the grid are not offered either: the ranks of one model
  (its stages, its Pr grid row) must process the same samples in every step, so a per-rank share
  cannot follow a rank's speed.
- **A shared queue** (:class:`~lightning_hier.sync.SharedQueue`) lets each rank take as many steps
  as its speed allows, so only a rule without lock-step collectives can use it: a parameter server
  whose rank 0 trains too, or GRAWA's asynchronous rounds.
"""

from __future__ import annotations

from lightning_hier.algorithms.dbs_compose import SampleWeightedCenter
from lightning_hier.sync.averaging import AveragingSync
from lightning_hier.sync.base import Allocation, Sync
from lightning_hier.sync.dbs import ShareWeightedGradients, SpeedShares
from lightning_hier.sync.hpsgd import HPSGDSync
from lightning_hier.sync.param_server import ServerSync
from lightning_hier.sync.shared_queue import SharedQueue

_NO_LEVELS = (
    "is not supported with DBS shares: the window's sample weights would have to be per level (inside a node, "
    "across nodes); use the default (flat averaging over all data-parallel ranks)"
)


def check_composition(sync: Sync, allocation: Allocation, owner: str) -> None:
    """Refuse a rule and an allocation that do not go together (see the module docstring).

    Raises:
        ValueError: Naming the two objects, and why.
    """
    weights = sync.weights if isinstance(sync, HPSGDSync | AveragingSync) else None
    if isinstance(allocation, SpeedShares):
        _check_shares(sync, allocation, owner)
    elif weights is not None or isinstance(sync, ShareWeightedGradients):
        raise ValueError(
            f"{owner}: {type(sync).__name__} weighs each rank by its DBS batch share, but the allocation is "
            f"{type(allocation).__name__}; give it the SpeedShares it weighs by."
        )
    if isinstance(allocation, SharedQueue) and sync.lock_step:
        raise ValueError(
            f"{owner}: a shared queue of samples lets the ranks take different numbers of steps, but "
            f"{type(sync).__name__} meets every rank in lock-step collectives; use a parameter server "
            "(ServerSync) or GRAWA's asynchronous rounds (rounds='async')."
        )


def _check_shares(sync: Sync, shares: SpeedShares, owner: str) -> None:
    if isinstance(sync, ShareWeightedGradients | ServerSync):
        if sync.shares is not shares:
            raise ValueError(f"{owner}: {type(sync).__name__} must weigh by the strategy's own SpeedShares.")
        return
    if not isinstance(sync, HPSGDSync | AveragingSync) or sync.weights is None or sync.weights.shares is not shares:
        raise ValueError(
            f"{owner}: DBS's shares change each rank's batch, so {type(sync).__name__} would weigh a slow rank's "
            "few samples like a fast rank's many; pair them with ShareWeightedGradients, a ServerSync weighing "
            "its pushes, or HPSGDSync / Local SGD's AveragingSync with SampleWeights."
        )
    if isinstance(sync, AveragingSync) and not isinstance(sync.policy(), SampleWeightedCenter):
        raise ValueError(
            f"{owner}: DBS's sample weights combine with Local SGD's uniform center only: EASGD's elastic force "
            "is symmetric (sample weights would break its conservation), and LSGD's leader or GRAWA's "
            "gradient-norm weights have no derivation with a second weighting by samples."
        )
    if sync.levels.enabled:
        raise ValueError(f"{owner}: argument `inter_node_every`={sync.levels.inter_node_every!r} {_NO_LEVELS}.")
