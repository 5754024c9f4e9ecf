"""Failure handling shared by every strategy here (:class:`HierStrategy` and the DDP peers): :class:`FailureGuard`.

What a run guarantees when a rank fails (README, "When a rank fails"):

- the failing rank reports to the :class:`~lightning_hier.comm.FailureBoard` before it unwinds;
  a rank whose collective or point-to-point wait fails names the ranks that reported, and those
  that did not (hung or dead);
- every rank runs a watchdog that ends its process once a peer reported, once the store has been
  unreachable for a few seconds (rank 0 is gone), or once the process that launched it died;
- ranks started by the popen launcher get SIGKILL from the main process when it fails (they may
  be blocked in a collective that never sees a SIGTERM); the fork / spawn launcher ends its
  children itself (:mod:`lightning_hier.strategies._launchers`);
- a run stopped by SIGTERM exits with status 143, not 0: Lightning turns SIGTERM into a
  ``SIGTERMException``, a ``SystemExit`` without a status.
"""

from __future__ import annotations

import os
import signal
import uuid
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_hier.comm import FailureBoard, broadcast_object
from lightning_hier.comm.failures import Parent, is_communication_error
from lightning_hier.strategies._launchers import FitCheck, _ReportingLauncher

GRACE_S = 3.0
"""Longest wait for the peers' reports, and the watchdog's pause before it ends a rank."""
STORE_GRACE_S = 10.0
"""Longest time the store may be unreachable before a rank ends itself."""
END_GRACE_S = 10.0
"""Longest time children may take to end after a failure or a signal (fork / spawn launcher)."""


class FailureGuard:
    """Failure reports, the watchdog and ending the launched ranks of one strategy (see the module docstring).

    The strategy calls :meth:`start` at the end of ``setup_environment`` (the process group
    exists), :meth:`stop` in ``teardown`` and :meth:`on_exception` from its own
    ``on_exception``; each grace period is bounded by the strategy's ``timeout``.

    Args:
        timeout: The strategy's collective timeout (``None``: unbounded).
    """

    def __init__(self, timeout: timedelta | None) -> None:
        self.timeout = timeout
        self.board: FailureBoard | None = None

    def timeout_s(self) -> float:
        return self.timeout.total_seconds() if self.timeout is not None else float("inf")

    def launcher(
        self,
        strategy: ParallelStrategy,
        start_method: str,
        cls: type[_ReportingLauncher] = _ReportingLauncher,
        check: FitCheck | None = None,
    ) -> _ReportingLauncher:
        """The fork / spawn launcher, with this strategy's grace period for ending its children."""
        return cls(strategy, start_method=start_method, grace_s=min(END_GRACE_S, self.timeout_s()), check=check)

    def start(self, strategy: ParallelStrategy) -> None:
        """Open the failure board on the default store and start this rank's watchdog (a collective, once)."""
        if self.board is None:
            token = broadcast_object(uuid.uuid4().hex if strategy.global_rank == 0 else None, 0, dist.group.WORLD)
            timeout_s = self.timeout_s()
            self.board = FailureBoard(
                dist.distributed_c10d._get_default_store(),
                strategy.global_rank,
                strategy.world_size,
                prefix=f"lightning_hier/{token}",
                grace_s=min(GRACE_S, timeout_s / 4),
                store_grace_s=min(STORE_GRACE_S, timeout_s),
            )
        self.board.start_watchdog(parent=launching_parent(strategy))

    def stop(self) -> None:
        if self.board is not None:
            self.board.stop_watchdog()

    def on_exception(self, exception: BaseException, launcher: object) -> None:
        """Report the failure, name the peers that failed, and end ranks the popen launcher started."""
        if isinstance(exception, SIGTERMException) and not exception.code:
            exception.code = 128 + signal.SIGTERM  # Lightning's graceful SIGTERM stop would exit 0
        board = self.board
        if board is not None:
            board.report(f"{type(exception).__name__}: {_first_line(exception)}")
            if is_communication_error(exception):
                _append_message(exception, board.describe(board.wait_for_reports()))
            board.stop_watchdog()
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signal.SIGKILL)  # children blocked in collectives never see SIGTERM


def launching_parent(strategy: ParallelStrategy) -> Parent | None:
    """The process that started this rank, when this job's launcher did (else ``None``).

    fork / spawn: the main process. popen: the main process is rank 0 itself (whose parent, a
    shell, may come and go); the other ranks of its node are its children. Ranks started by
    torchrun or SLURM belong to their launcher, which handles their parent's death.
    """
    launcher = strategy.launcher
    if isinstance(launcher, _ReportingLauncher) and launcher.main_pid is not None:
        return Parent(launcher.main_pid, "the launching process")
    popen_child = isinstance(launcher, _SubprocessScriptLauncher) and strategy.local_rank > 0
    if popen_child and isinstance(strategy.cluster_environment, LightningEnvironment):
        return Parent(os.getppid(), f"rank {strategy.node_rank * len(strategy.parallel_devices or ())}")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else repr(exc)


def _append_message(exc: BaseException, note: str) -> None:
    """Append ``note`` to the exception's message (kept in ``str(exc)`` and in tracebacks)."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
    elif hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)
