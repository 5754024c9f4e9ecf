"""Run a function in N forked worker processes that look like ranks started by torchrun.

The parent hosts the rendezvous store on an OS-assigned port; each forked worker gets a
torchrun-style environment, so a plain ``Trainer(devices=N, num_nodes=M)`` built inside it
*joins* the job instead of launching one: the real multi-process code path, with real process
groups, in about a third of a second per fit. Nothing leaks into the parent: workers are forked,
their environment changes stay in them, and they leave with ``os._exit`` (never returning into
the parent's stack, e.g. pytest's).

Failures become exceptions in the parent, within a deadline:

- a worker that raises: :class:`WorkerFailed` carrying that rank's traceback (the rank that
  failed *first* is named, not the peers whose collectives broke afterwards);
- a worker that dies without a result: :class:`WorkerFailed` with its exit code;
- a worker still running at the deadline: :class:`WorkerTimeout`; all workers are killed.

Example:
    >>> from lightning_hier.testing import run_workers
    >>> import torch.distributed as dist
    >>> def rank_times_ten() -> int:
    ...     dist.init_process_group("gloo")
    ...     return dist.get_rank() * 10
    >>> run_workers(rank_times_ten, devices=2)  # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_hier.comm.failures import is_communication_error

T = TypeVar("T")

# environment of other launchers that would make Lightning detect the wrong cluster
_FOREIGN_ENV_PREFIXES = ("SLURM_", "LSB_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "GROUP_", "ROLE_")
_FOREIGN_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class WorkerFailed(RuntimeError):
    """A worker raised or died. ``rank`` is the first failing rank, ``details`` its traceback."""

    def __init__(self, message: str, rank: int, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details


class WorkerTimeout(WorkerFailed, TimeoutError):
    """Workers were still running at the deadline (a hang); they were killed."""


@dataclass(frozen=True)
class _Report:
    rank: int
    ok: bool
    value: Any = None
    summary: str = ""
    traceback: str = ""
    communication: bool = False


def worker_env(rank: int, devices: int, num_nodes: int, port: int, run_id: str) -> dict[str, str]:
    """The torchrun-style environment of ``rank`` in a ``num_nodes x devices`` job on this host."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(devices * num_nodes),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % devices),
        "LOCAL_WORLD_SIZE": str(devices),
        "GROUP_RANK": str(rank // devices),
        "NODE_RANK": str(rank // devices),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(devices * num_nodes),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }


def run_workers(
    fn: Callable[..., T],
    *args: Any,
    devices: int = 2,
    num_nodes: int = 1,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[T]:
    """Call ``fn(*args, **kwargs)`` in ``devices * num_nodes`` forked ranks; return results by rank.

    Args:
        fn: Runs in every worker. It may build a ``Trainer(devices=devices, num_nodes=num_nodes)``
            or call ``torch.distributed.init_process_group()`` (env:// is set up). Its return
            value must be picklable.
        *args: Positional arguments for ``fn``.
        devices: Processes per simulated node.
        num_nodes: Number of simulated nodes (all on this host).
        timeout: Deadline in seconds for the whole run.
        **kwargs: Keyword arguments for ``fn``.

    Raises:
        WorkerFailed: A worker raised or died.
        WorkerTimeout: A worker had not finished at the deadline.
    """
    if devices < 1 or num_nodes < 1:
        raise ValueError(f"run_workers: devices and num_nodes must be >= 1, got {devices} and {num_nodes}.")
    world = devices * num_nodes
    ctx = mp.get_context("fork")
    run_id = uuid.uuid4().hex[:12]
    procs: list[mp.process.BaseProcess] = []
    readers: list[mpc.Connection] = []
    port_writers: list[mpc.Connection] = []
    store: dist.TCPStore | None = None
    try:
        # Fork every worker *before* the store exists: the store's server thread takes locks
        # while it serves connections, and a child forked at that moment inherits them held.
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            port_reader, port_writer = ctx.Pipe(duplex=False)
            layout = (rank, devices, num_nodes, run_id)
            proc = ctx.Process(
                target=_worker_main, args=(fn, args, kwargs, layout, port_reader, writer), name=f"rank{rank}"
            )
            proc.start()
            writer.close()
            port_reader.close()
            procs.append(proc)
            readers.append(reader)
            port_writers.append(port_writer)
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        for port_writer in port_writers:
            port_writer.send(store.port)
        return _collect(procs, readers, timeout)
    finally:
        _kill(procs)
        for conn in readers + port_writers:
            conn.close()
        del store


def _worker_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: tuple[int, int, int, str],
    port_conn: Any,
    conn: Any,
) -> None:
    code = 0
    rank, devices, num_nodes, run_id = layout
    try:
        port = port_conn.recv()  # sent once every worker exists and the store is up
        port_conn.close()
        env = worker_env(rank, devices, num_nodes, port, run_id)
        for key in list(os.environ):
            if key.startswith(_FOREIGN_ENV_PREFIXES) or key in _FOREIGN_ENV:
                del os.environ[key]
        os.environ.update(env)
        torch.set_num_threads(1)
        try:
            report = _Report(rank, True, fn(*args, **kwargs))
        except BaseException as exc:
            report = _Report(
                rank,
                False,
                summary=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                communication=is_communication_error(exc),
            )
            code = 1
        # plain pickle: multiprocessing's pickler ships tensors as shared-memory handles that die
        # with this process, which exits right after sending
        try:
            conn.send_bytes(pickle.dumps(report))
        except Exception as exc:  # e.g. an unpicklable result
            conn.send_bytes(pickle.dumps(_Report(rank, False, summary=f"could not send the result: {exc!r}")))
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _collect(procs: list[mp.process.BaseProcess], readers: list[mpc.Connection], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    reports: dict[int, _Report] = {}
    dead: dict[int, int | None] = {}
    failure_seen_at: float | None = None
    while len(reports) + len(dead) < len(procs):
        now = time.monotonic()
        # after a first failure, give the other ranks a moment to report their own errors
        if failure_seen_at is not None and now - failure_seen_at > 5.0:
            break
        if now >= deadline:
            missing = [r for r in range(len(procs)) if r not in reports and r not in dead]
            raise (
                _failure(reports, dead)
                if (dead or _errors(reports))
                else WorkerTimeout(
                    f"rank(s) {missing} did not finish within {timeout:.0f} s (hung?); all workers were killed.",
                    rank=missing[0],
                )
            )
        waitables: list[Any] = []
        for rank, (proc, reader) in enumerate(zip(procs, readers, strict=True)):
            if rank not in reports and rank not in dead:
                waitables += [reader, proc.sentinel]
        ready = set(mpc.wait(waitables, timeout=min(0.5, deadline - now)))
        for rank, (proc, reader) in enumerate(zip(procs, readers, strict=True)):
            if rank in reports or rank in dead or not ({reader, proc.sentinel} & ready):
                continue
            if reader.poll():
                try:
                    reports[rank] = pickle.loads(reader.recv_bytes())
                    continue
                except (EOFError, OSError):
                    pass
            if not proc.is_alive():
                proc.join()
                dead[rank] = proc.exitcode
        if failure_seen_at is None and (dead or _errors(reports)):
            failure_seen_at = time.monotonic()
    if dead or _errors(reports):
        raise _failure(reports, dead)
    return [reports[r].value for r in range(len(procs))]


def _errors(reports: dict[int, _Report]) -> list[_Report]:
    return [r for r in reports.values() if not r.ok]


def _failure(reports: dict[int, _Report], dead: dict[int, int | None]) -> WorkerFailed:
    errors = _errors(reports)
    # the root cause is a real error; peers' broken collectives are consequences
    primary = next((e for e in errors if not e.communication), errors[0] if errors else None)
    lines: list[str] = []
    if primary is not None:
        lines.append(f"rank {primary.rank} raised {primary.summary}")
        rank, details = primary.rank, primary.traceback
    else:
        rank, code = next(iter(sorted(dead.items())))
        lines.append(f"rank {rank} died with {_describe_exit(code)} before reporting a result")
        details = ""
    lines += [f"  also: rank {e.rank} raised {e.summary.splitlines()[0]}" for e in errors if e is not primary]
    lines += [f"  also: rank {r} died with {_describe_exit(c)}" for r, c in sorted(dead.items()) if r != rank]
    message = "\n".join(lines)
    if details:
        message += f"\n\n--- traceback of rank {rank} ---\n{details}"
    return WorkerFailed(message, rank=rank, details=details)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _kill(procs: list[mp.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
