"""Failure handling shared by every strategy here (:class:`HierStrategy` and the DDP peers).

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
from typing_extensions import override

from lightning_hier.comm import FailureBoard, broadcast_object
from lightning_hier.comm.failures import Parent, is_communication_error
from lightning_hier.strategies._launchers import _ReportingLauncher

GRACE_S = 3.0
"""Longest wait for the peers' reports, and the watchdog's pause before it ends a rank."""
STORE_GRACE_S = 10.0
"""Longest time the store may be unreachable before a rank ends itself."""
END_GRACE_S = 10.0
"""Longest time children may take to end after a failure or a signal (fork / spawn launcher)."""


class FailureHandling(ParallelStrategy):
    """Mixin: failure reports, the watchdog, ending the launched ranks (see the module docstring).

    A strategy calls :meth:`_start_failure_board` at the end of ``setup_environment`` (the
    process group exists) and :meth:`_stop_failure_board` in ``teardown``; each grace period is
    bounded by the strategy's ``timeout``.
    """

    _timeout: timedelta | None
    _failures: FailureBoard | None = None

    def _timeout_s(self) -> float:
        return self._timeout.total_seconds() if self._timeout is not None else float("inf")

    def _reporting_launcher(
        self, start_method: str, cls: type[_ReportingLauncher] = _ReportingLauncher
    ) -> _ReportingLauncher:
        """The fork / spawn launcher, with this strategy's grace period for ending its children."""
        return cls(self, start_method=start_method, grace_s=min(END_GRACE_S, self._timeout_s()))

    def _start_failure_board(self) -> None:
        if self._failures is None:
            token = broadcast_object(uuid.uuid4().hex if self.global_rank == 0 else None, 0, dist.group.WORLD)
            timeout_s = self._timeout_s()
            self._failures = FailureBoard(
                dist.distributed_c10d._get_default_store(),
                self.global_rank,
                self.world_size,
                prefix=f"lightning_hier/{token}",
                grace_s=min(GRACE_S, timeout_s / 4),
                store_grace_s=min(STORE_GRACE_S, timeout_s),
            )
        self._failures.start_watchdog(parent=self._launching_parent())

    def _stop_failure_board(self) -> None:
        if self._failures is not None:
            self._failures.stop_watchdog()

    def _launching_parent(self) -> Parent | None:
        """The process that started this rank, when this job's launcher did (else ``None``).

        fork / spawn: the main process. popen: the main process is rank 0 itself (whose parent, a
        shell, may come and go); the other ranks of its node are its children. Ranks started by
        torchrun or SLURM belong to their launcher, which handles their parent's death.
        """
        launcher = self.launcher
        if isinstance(launcher, _ReportingLauncher) and launcher.main_pid is not None:
            return Parent(launcher.main_pid, "the launching process")
        popen_child = isinstance(launcher, _SubprocessScriptLauncher) and self.local_rank > 0
        if popen_child and isinstance(self.cluster_environment, LightningEnvironment):
            return Parent(os.getppid(), f"rank {self.node_rank * len(self.parallel_devices or ())}")
        return None

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if isinstance(exception, SIGTERMException) and not exception.code:
            exception.code = 128 + signal.SIGTERM  # Lightning's graceful SIGTERM stop would exit 0
        board = self._failures
        if board is not None:
            board.report(f"{type(exception).__name__}: {_first_line(exception)}")
            if is_communication_error(exception):
                _append_message(exception, board.describe(board.wait_for_reports()))
            board.stop_watchdog()
        launcher = self.launcher
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signal.SIGKILL)  # children blocked in collectives never see SIGTERM


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else repr(exc)


def _append_message(exc: BaseException, note: str) -> None:
    """Append ``note`` to the exception's message (kept in ``str(exc)`` and in tracebacks)."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
    elif hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)
