"""The spawn / fork launcher of every strategy here: failure reports, signals, no leftovers.

``start_method="popen"`` uses Lightning's own ``_SubprocessScriptLauncher`` (its failure handling
is in :mod:`lightning_hier.strategies._failure`); the multiprocessing start methods use
:class:`_ReportingLauncher`, Lightning's ``_MultiProcessingLauncher`` plus:

- in each child, the strategy's ``on_exception`` runs before an error propagates (Lightning calls
  it in the main process only), so the failing rank reports and its peers can name it;
- in the main process, SIGINT and SIGTERM are forwarded to the children (unless the process
  ignores them). Lightning would catch the ``KeyboardInterrupt`` in the main process only and then
  wait, at interpreter exit, for children that train on to the end; a SIGTERM would end the main
  process alone;
- when the launch ends in any way but success, children still alive after ``grace_s`` get
  SIGKILL and are reaped, and the error names the global rank of the child that failed;
- the ``pytorch-errorfile-*.pickle`` files in which torch passes a failed child's traceback to
  the main process are removed (torch reads them but never deletes them): their names are drawn
  in the main process during the launch, so the launch points ``tempfile`` there at a directory
  of its own and removes them from it afterwards (the children use the usual one).
- a spawned child whose work is done (its result handed to the main process) ends as a forked
  child ends, with ``os._exit``, after the interpreter's Python-level exit steps (non-daemon
  threads joined, ``atexit`` callbacks, stdio flushed) but without the interpreter's
  finalization, which the process groups' worker threads could otherwise abort
  (:func:`_exit_without_finalizing`).

Strategies with their own launcher subclass it (``grid2d``).
"""

from __future__ import annotations

import atexit
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing import util as mp_util
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
from typing_extensions import override

FORWARDED = (signal.SIGINT, signal.SIGTERM)
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


FitCheck = Callable[[Any, tuple[Any, ...]], None]
"""``check(trainer, args)``: raises before any rank starts when ``trainer.fit(*args)`` cannot run."""


class _ReportingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher with failure reports, signal forwarding and clean-up (module docstring).

    Args:
        strategy: The strategy whose ranks are launched.
        start_method: ``'spawn'``, ``'fork'`` or ``'forkserver'``.
        grace_s: How long children may take to end after a failure or a forwarded signal
            before they get SIGKILL.
        check: Checks the launched function's arguments in the main process first (``None``: none).
    """

    def __init__(
        self, strategy: Any, start_method: str = "spawn", grace_s: float = 10.0, check: FitCheck | None = None
    ) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self.grace_s = grace_s
        self.check = check
        self.main_pid: int | None = None
        """PID of the process that launched the ranks (each rank's watchdog ends it when it is gone)."""
        self._handlers: dict[signal.Signals, _Handler] = {}
        self._signalled = False
        self._tempdir: str | None = None  # tempfile's directory outside the launch

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.check is not None:
            self.check(trainer, args)
        self.main_pid = os.getpid()
        self._signalled = False
        with self._forwarding_signals(), _error_files_apart() as self._tempdir:
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except (ProcessRaisedException, ProcessExitedException) as exc:
                _name_rank(exc, self._global_rank(exc.error_index))
                raise
            finally:
                self._end_children()

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        # a forked child inherited the forwarding handlers and the error files' directory
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        tempfile.tempdir = self._tempdir
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exc:
            self._strategy.on_exception(exc)
            raise
        if self._start_method == "spawn":  # fork and forkserver children end with os._exit already
            _exit_without_finalizing()

    @contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set handlers; a signal then ends this process only
            return
        # a signal this process ignores (SIGINT in a job started with `&` or nohup) stays ignored
        self._handlers = {s: signal.getsignal(s) for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN}
        for signum in self._handlers:
            signal.signal(signum, self._forward)
        try:
            yield
        finally:
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)
            self._handlers = {}

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.kill(signum)
        if self._signalled:
            return  # a second signal while the children are being ended: forwarded only
        self._signalled = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SIGTERMException(128 + signum)  # the exit status a shell reports for a signal

    def _end_children(self, grace_s: float | None = None) -> None:
        """SIGKILL children alive after ``grace_s`` (``None``: the launcher's) and reap them all."""
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join()

    def _global_rank(self, index: int) -> int:
        strategy = self._strategy
        return strategy.node_rank * len(strategy.parallel_devices or ()) + index

    @override
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_handlers"] = {}  # spawn: a fresh interpreter has its default handlers (and may not unpickle ours)
        return state


class _CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher, checking the launched function's arguments before the children start."""

    def __init__(self, check: FitCheck, *args: Any) -> None:
        super().__init__(*args)
        self.check = check

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.check(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def _exit_without_finalizing() -> NoReturn:
    """End this spawned child, its work done, as a forked child ends: ``os._exit`` instead of finalization.

    Nothing destroys the process groups before a rank's process ends (the strategy, a DDP wrapper
    or user code may hold them), so their gloo worker threads outlive the training. A worker that
    completed the last collective (a user's ``all_gather`` in ``on_train_end``) wakes the waiting
    main thread first and drops the finished work after; dropping it releases the work's tensors,
    and releasing a tensor that Python also holds takes the GIL. When the worker gets the CPU
    only after the main thread has reached ``sys.exit`` and begun finalizing the interpreter
    (a loaded machine), taking the GIL ends the worker with ``pthread_exit``, whose unwinding
    through that noexcept destructor calls ``std::terminate``: "terminate called without an
    active exception", and the rank dies of SIGABRT although its fit succeeded.

    So the exit steps user code can observe run here, in the interpreter's order (what
    ``BaseProcess._bootstrap`` runs after the target: multiprocessing's finalizers, the join of
    non-daemon threads; then the ``atexit`` callbacks; then stdio is flushed), and the process
    ends without the interpreter's finalization (module teardown and collection), as fork and
    forkserver children end (those skip the ``atexit`` callbacks too, which are their parent's).
    """
    code = 0
    try:
        mp_util._exit_function()  # type: ignore[attr-defined]
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        mp_util._flush_std_streams()  # type: ignore[attr-defined]
        os._exit(code)


def _name_rank(exc: ProcessRaisedException | ProcessExitedException, rank: int) -> None:
    if isinstance(exc, ProcessExitedException):
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
    else:
        how = "raised the error above"
    exc.msg = f"{exc.msg}\nlightning_hier: rank {rank} {how} (PID {exc.error_pid})."
    exc.args = (exc.msg,)


@contextmanager
def _error_files_apart() -> Iterator[str | None]:
    """Point ``tempfile`` at a new directory; remove torch's error files from it (and it, if empty) at the end.

    Yields the directory ``tempfile`` used before (the children's).
    """
    before = tempfile.tempdir
    apart = tempfile.mkdtemp(prefix="lightning-hier-launch-")
    tempfile.tempdir = apart
    try:
        yield before
    finally:
        tempfile.tempdir = before
        for path in Path(apart).glob("pytorch-errorfile-*"):
            path.unlink(missing_ok=True)
        with suppress(OSError):  # anything else that landed here stays
            os.rmdir(apart)
