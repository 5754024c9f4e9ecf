"""The fork / spawn launcher of a fault-tolerant run: it hosts the coordination store and restarts dead replicas.

:class:`ElasticLauncher` is the :class:`~lightning_hier.strategies._launchers._ReportingLauncher`
(signal forwarding, no leftover processes, failing ranks named) with two differences:

- the replicas' coordination store (a ``TCPStore`` on ``MASTER_ADDR``, a free port) is hosted
  by a process of the launcher's own (:class:`~lightning_hier.comm.rendezvous.StoreApart`), so a
  replica's death never takes the store with it (in a fail-fast run rank 0 hosts it);
- a replica that dies (any exit status but 0: ``kill -9``, an error, out of memory) is started
  again, up to ``max_restarts`` times per replica, with ``ckpt_path`` pointing at the live state
  of a peer (:data:`~lightning_hier.strategies._fault_tolerance.LIVE_CHECKPOINT`). The launch
  ends when every replica has ended, or ``init_timeout`` after the first replica finished its
  fit (the longest the end of training waits for a restart; a replica still running then hangs,
  and gets SIGKILL); it fails when one ended with an error after its last restart, or when
  replica 0 (whose result Lightning hands back to the main process) never finished.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hier.comm.membership import EXIT_REJOIN
from lightning_hier.comm.rendezvous import StoreApart
from lightning_hier.strategies._fault_tolerance import FaultTolerance, live_fit_args
from lightning_hier.strategies._launchers import FitCheck, _ReportingLauncher

log = logging.getLogger(__name__)

POLL_S = 0.05


class ElasticLauncher(_ReportingLauncher):
    """Launch the replicas of a fault-tolerant run, host their store, restart those that die (module docstring).

    Args:
        strategy: The strategy whose replicas are launched (its ``fault_tolerance`` set).
        start_method: ``'spawn'`` or ``'fork'``.
        grace_s: How long replicas may take to end after a failure or a forwarded signal.
        check: Checks the launched function's arguments in the main process first.
        finish_s: How long the others may run on after a replica finished its fit (the strategy's
            ``init_timeout``: the end of training's wait for a restart).
    """

    def __init__(
        self, strategy: Any, start_method: str, grace_s: float, check: FitCheck | None, finish_s: float
    ) -> None:
        super().__init__(strategy, start_method=start_method, grace_s=grace_s, check=check)
        self.finish_s = finish_s

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.check is not None:
            self.check(trainer, args)
        fault: FaultTolerance | None = getattr(self._strategy, "fault_tolerance", None)
        assert fault is not None
        env = self._strategy.cluster_environment
        assert env is not None
        self.main_pid = os.getpid()
        self._signalled = False
        os.environ["MASTER_PORT"] = str(env.main_port)
        context = mp.get_context(self._start_method)
        return_queue = context.SimpleQueue()
        extra = []
        if self._start_method == "spawn":
            extra = [_GlobalStateSnapshot.capture()]

        def start(index: int, incarnation: int) -> mp.Process:
            fault.incarnation = incarnation
            fit_args = args
            if incarnation > 0 and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                fit_args = live_fit_args(args)
            process = context.Process(  # type: ignore[attr-defined]  # every start method's context has it
                target=self._wrapping_function,
                args=(index, trainer, function, fit_args, kwargs, return_queue, *extra),
                name=f"lightning-hier-replica-{index}",
            )
            process.start()
            return process

        replicas = len(self._strategy.parallel_devices or ())
        restarts = [0] * replicas
        failed: dict[int, str] = {}
        output = None
        # once a replica has finished its fit, the others are at most the end of training's wait for
        # restarts (init_timeout) behind it; one still running after that hangs, and would hang the launch
        finished_at: float | None = None
        grace_s = self.grace_s
        with self._forwarding_signals(), StoreApart(env.main_address, timedelta(seconds=60)) as store:
            fault.store_port, fault.store_prefix = store.port, f"lightning_hier/{uuid.uuid4().hex}"
            try:
                self.procs = [start(i, 0) for i in range(replicas)]
                running = set(range(replicas))
                while running:
                    while not return_queue.empty():
                        output = return_queue.get()
                    for index in sorted(running):
                        process = self.procs[index]
                        if process.is_alive():
                            continue
                        process.join()
                        code = process.exitcode
                        if code == 0:
                            running.discard(index)
                            finished_at = finished_at or time.monotonic()
                        elif restarts[index] < fault.max_restarts:
                            restarts[index] += 1
                            how = _how(code)
                            log.warning(
                                "lightning_hier: replica %d %s; restarting it (%d of %d)",
                                index,
                                how,
                                restarts[index],
                                fault.max_restarts,
                            )
                            marks = dist.PrefixStore(fault.store_prefix, store.client())
                            marks.set(f"restarting/{index}", "1")  # the end of training waits for it
                            self.procs[index] = start(index, restarts[index])
                        else:
                            failed[index] = _how(code) if code != EXIT_REJOIN else "could not rejoin"
                            running.discard(index)
                    if running and finished_at is not None and time.monotonic() > finished_at + self.finish_s:
                        for index in running:
                            failed[index] = (
                                f"was still running init_timeout={self.finish_s:g} s after another replica finished"
                            )
                        grace_s = 0.0  # they have had their time: SIGKILL at once
                        break
                    time.sleep(POLL_S)
                while not return_queue.empty():
                    output = return_queue.get()
            finally:
                self._end_children(grace_s)  # before the store goes
        why = "; ".join(f"replica {i} {how}, after {restarts[i]} restart(s)" for i, how in failed.items())
        if output is None:
            raise RuntimeError(f"lightning_hier: the fault-tolerant fit ended without replica 0's result ({why}).")
        if failed:
            log.warning("lightning_hier: replicas that did not finish: %s", why)
        if trainer is None:
            return output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(output, trainer)
        return output.trainer_results


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
