"""The fork / spawn launcher of a fault-tolerant run: it hosts the coordination store and restarts dead replicas.

:class:`ElasticLauncher` is the :class:`~lightning_hier.strategies._launchers._ReportingLauncher`
(signal forwarding, no leftover processes, failing ranks named) with two differences:

- the main process hosts the replicas' coordination store (a ``TCPStore`` on ``MASTER_ADDR``,
  a free port), so a replica's death never takes the store with it (in a fail-fast run rank 0
  hosts it);
- a replica that dies (any exit status but 0: ``kill -9``, an error, out of memory) is started
  again, up to ``max_restarts`` times per replica, with ``ckpt_path`` pointing at the live state
  of a peer (:data:`~lightning_hier.strategies._fault_tolerance.LIVE_CHECKPOINT`). The launch
  ends when every replica has ended; it fails when one ended with an error after its last
  restart, or when replica 0 (whose result Lightning hands back to the main process) never
  finished.
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
from lightning_hier.comm.rendezvous import host_store
from lightning_hier.strategies._fault_tolerance import FaultTolerance, live_fit_args
from lightning_hier.strategies._launchers import _ReportingLauncher

log = logging.getLogger(__name__)

POLL_S = 0.05


class ElasticLauncher(_ReportingLauncher):
    """Launch the replicas of a fault-tolerant run, host their store, restart those that die (module docstring)."""

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
        store, port = host_store(env.main_address, 0, timedelta(seconds=60))
        fault.store_port, fault.store_prefix = port, f"lightning_hier/{uuid.uuid4().hex}"
        marks = dist.PrefixStore(fault.store_prefix, store)
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
        with self._forwarding_signals():
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
                            print(f"lightning_hier: replica {index} {how}; restarting it", flush=True)
                            marks.set(f"restarting/{index}", "1")  # the end of training waits for it
                            self.procs[index] = start(index, restarts[index])
                        else:
                            failed[index] = _how(code) if code != EXIT_REJOIN else "could not rejoin"
                            running.discard(index)
                    time.sleep(POLL_S)
                while not return_queue.empty():
                    output = return_queue.get()
            finally:
                self._end_children()
                del store
        if output is None:
            why = "; ".join(f"replica {i} {how} after {restarts[i]} restart(s)" for i, how in failed.items())
            raise RuntimeError(f"lightning_hier: the fault-tolerant fit ended without replica 0's result ({why}).")
        if failed:
            log.warning("lightning_hier: replicas that did not finish: %s", failed)
        if trainer is None:
            return output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(output, trainer)
        return output.trainer_results


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
