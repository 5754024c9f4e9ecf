"""A fault-tolerant replica started apart from the others (torchrun): its ranks and its launcher.

With ``FaultTolerance(coordinator="host:port", replica=i, replicas=n)`` each replica is a job of
one process, started and restarted by a launcher outside Lightning (torchrun's
``--max-restarts``), and the replicas meet on the coordinator's store
(``python -m lightning_hier.coordinator``). Two small pieces make such a process look to
Lightning like rank ``i`` of ``n``, as under the fork / spawn launcher:

- :class:`ReplicaEnvironment` reports ``global_rank = replica`` and ``world_size = replicas``
  whatever the outside launcher says (torchrun's job has one process, rank 0). Lightning's
  sampler, rank-zero logging and checkpoint writing follow from it: replica ``i`` trains shard
  ``i``, and replica 0 logs.
- :class:`ReplicaLauncher` runs the fit in this process (it creates none) after asking the
  coordinator which start of the replica this is: a restart's fit gets
  :data:`~lightning_hier.strategies._fault_tolerance.LIVE_CHECKPOINT` as ``ckpt_path``, so it
  restores the state a live peer sends it, as the fork launcher's restarts do. A restart that
  comes back after the others finished training ends at once, with exit status 0; one that finds
  no live replica (every replica failed at once) ends at once with status 1, as does every later
  start of the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hier.comm.membership import JobLost, TrainingFinished
from lightning_hier.strategies._fault_tolerance import FaultTolerance, live_fit_args

log = logging.getLogger(__name__)


class ReplicaEnvironment(ClusterEnvironment):
    """Replica ``replica`` of ``replicas``, each a one-process job meeting the others on the coordinator.

    Args:
        fault: The replica's :class:`FaultTolerance` (with ``coordinator``, ``replica``, ``replicas``).
    """

    def __init__(self, fault: FaultTolerance) -> None:
        assert fault.external and fault.replica is not None and fault.replicas is not None
        self.fault = fault
        self._replica, self._replicas = fault.replica, fault.replicas

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self.fault.coordinator_host

    @property
    @override
    def main_port(self) -> int:
        return self.fault.store_port

    @staticmethod
    @override
    def detect() -> bool:
        return True

    @override
    def world_size(self) -> int:
        return self._replicas

    @override
    def set_world_size(self, size: int) -> None:
        pass  # the job's size is the replicas', not the outside launcher's (one process)

    @override
    def global_rank(self) -> int:
        return self._replica

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return 0

    @override
    def node_rank(self) -> int:
        return 0


class ReplicaLauncher(_Launcher):
    """Run the fit of a replica started apart from the others (module docstring).

    Args:
        strategy: The strategy (its ``fault_tolerance`` has a ``coordinator``).
        check: Checks of ``fit``'s arguments, before the fit.
    """

    def __init__(self, strategy: Any, check: Callable[[Any, tuple[Any, ...]], None] | None = None) -> None:
        self._strategy = strategy
        self.check = check

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def kill(self, signum: Any) -> None:
        pass  # it started no process: the outside launcher owns this one

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.check is not None:
            self.check(trainer, args)
        fault: FaultTolerance = self._strategy.fault_tolerance
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        try:
            if fitting and fault.claim_incarnation(self._strategy._init_timeout) > 0:
                args = live_fit_args(args)
            return function(*args, **kwargs)
        except TrainingFinished:
            print(
                f"lightning_hier: replica {fault.replica} was restarted after the others finished training; "
                "it ends without training.",
                flush=True,
            )
            raise SystemExit(0) from None
        except JobLost as err:
            print(f"lightning_hier: replica {fault.replica} cannot rejoin: {err}.", flush=True)
            raise SystemExit(1) from None
