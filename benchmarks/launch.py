"""Start one job's ranks on the emulated cluster, watch them, and collect their measurements.

Each rank is ``ip netns exec <its namespace> taskset -c <its core> python -m benchmarks.worker``
with a torchrun-style environment; rank 0's namespace address is ``MASTER_ADDR`` and rank 0
hosts the rendezvous store, exactly as on real nodes. Ranks run in their own sessions, so the
runner can end them (and only them) as a group; the first rank that fails ends the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.netns import EmulatedCluster, interrupts_deferred
from benchmarks.straggler import CpuQuota, Straggler
from lightning_hier.testing.harness import _FOREIGN_ENV, _FOREIGN_ENV_PREFIXES, worker_env

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL = 4000


class JobFailed(RuntimeError):
    """A rank failed, died or the job ran past its deadline; the message holds the rank's log tail."""


@dataclass
class JobResult:
    """What one job measured: each rank's worker report plus the runner's own counters.

    ``tx_bytes`` / ``rx_bytes`` are per node (its shaped link: between nodes), ``intra_bytes`` per
    node too (its loopback: between its own ranks); with one rank per node, per rank.
    """

    ranks: list[dict[str, Any]]
    tx_bytes: list[int]
    rx_bytes: list[int]
    launch_s: float
    throttled_s: float | None = None
    cores: list[int] = field(default_factory=list)
    intra_bytes: list[int] = field(default_factory=list)
    ranks_per_node: int = 1


def job_layout(cluster: EmulatedCluster, ranks: int) -> tuple[int, int]:
    """``(ranks per node, nodes)`` of a job on the first ``ranks`` ranks of ``cluster``.

    Raises:
        ValueError: ``ranks`` exceeds the cluster, or fills a node only partly beyond the first.
    """
    per_node = cluster.ranks_per_node
    if not 1 <= ranks <= cluster.ranks or (ranks > per_node and ranks % per_node):
        raise ValueError(
            f"run_job: `ranks` must be in [1, {cluster.ranks}] and, beyond one node, a multiple of its "
            f"{per_node} ranks, got {ranks}."
        )
    return (ranks, 1) if ranks < per_node else (per_node, ranks // per_node)


def rank_env(cluster: EmulatedCluster, rank: int, port: int, run_id: str, ranks: int | None = None) -> dict[str, str]:
    """The environment of ``rank`` in a job on the first ``ranks`` ranks (default all): the runner's,
    minus other launchers' variables, plus torchrun's."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV and not k.startswith(_FOREIGN_ENV_PREFIXES)}
    devices, nodes = job_layout(cluster, cluster.ranks if ranks is None else ranks)
    env.update(worker_env(rank, devices=devices, num_nodes=nodes, port=port, run_id=run_id))
    del env["TORCHELASTIC_USE_AGENT_STORE"]  # rank 0 hosts the store at MASTER_ADDR, as on real nodes
    env["MASTER_ADDR"] = cluster.address(0)
    env["GLOO_SOCKET_IFNAME"] = cluster.interface
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return env


def pinned_cores(ranks: int) -> list[int]:
    """One core per rank (round-robin over this process's allowed cores when there are fewer)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[r % len(cores)] for r in range(ranks)]


def run_job(
    cluster: EmulatedCluster,
    spec: dict[str, Any],
    run_dir: Path,
    port: int,
    timeout_s: float,
    straggler: Straggler | None = None,
    ranks: int | None = None,
) -> JobResult:
    """Run the worker spec on the first ``ranks`` ranks of ``cluster``; return the collected measurements.

    Args:
        cluster: The (built) emulated cluster; ``cluster.ranks_per_node`` ranks per namespace.
        spec: The worker spec (see :func:`benchmarks.worker.run_rank`); ``out_dir``, ``ranks`` and
            ``ranks_per_node`` are set here, from the cluster.
        run_dir: Directory for the spec, the rank logs and the rank reports.
        port: ``MASTER_PORT`` of this job (use a fresh one per job).
        timeout_s: Deadline for the whole job.
        straggler: A cgroup-mode straggler to apply (delay mode travels in ``spec``).
        ranks: How many of the cluster's ranks the job uses (default all; 1: one process).

    Raises:
        JobFailed: A rank exited non-zero, or the deadline passed; all ranks were ended.
        ValueError: ``ranks`` does not fit the cluster (see :func:`job_layout`).
    """
    ranks = cluster.ranks if ranks is None else ranks
    per_node, _ = job_layout(cluster, ranks)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    layout = {"ranks": ranks, "ranks_per_node": per_node}
    spec_path.write_text(json.dumps({**spec, **layout, "out_dir": str(run_dir)}, indent=1))
    cores = pinned_cores(ranks)
    before = [cluster.counters(n) for n in range(cluster.nodes)]
    start = time.perf_counter()
    with _quota(straggler, cluster.tag) as quota:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            _start(cluster, spec_path, run_dir, port, cores, quota, straggler, procs, ranks)
            _wait(procs, run_dir, timeout_s)
        finally:
            end_ranks(procs)
        throttled = quota.throttled_s() if quota is not None else None
    launch_s = time.perf_counter() - start
    after = [cluster.counters(n) for n in range(cluster.nodes)]
    reports = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    return JobResult(
        ranks=reports,
        tx_bytes=[a["tx"] - b["tx"] for a, b in zip(after, before, strict=True)],
        rx_bytes=[a["rx"] - b["rx"] for a, b in zip(after, before, strict=True)],
        launch_s=launch_s,
        throttled_s=throttled,
        cores=cores,
        intra_bytes=[a["intra_tx"] - b["intra_tx"] for a, b in zip(after, before, strict=True)],
        ranks_per_node=per_node,
    )


@contextmanager
def _quota(straggler: Straggler | None, tag: str) -> Iterator[CpuQuota | None]:
    if straggler is None or straggler.mode != "cgroup":
        yield None
        return
    # one cgroup for every slowed rank (a slow node): ranks x 1/factor of a core between them
    quota = CpuQuota(f"lhb-{tag}-slow", straggler.factor, cores=len(straggler.ranks))
    try:
        yield quota
    finally:
        quota.remove()


def _start(
    cluster: EmulatedCluster,
    spec_path: Path,
    run_dir: Path,
    port: int,
    cores: list[int],
    quota: CpuQuota | None,
    straggler: Straggler | None,
    procs: list[subprocess.Popen[bytes]],
    ranks: int,
) -> None:
    """Start the first ``ranks`` ranks, appending each to ``procs`` (owned by the caller, who ends them)."""
    run_id = uuid.uuid4().hex[:12]
    # an interrupt inside Popen, after the fork, would leave a started rank untracked (and its
    # cgroup busy): interrupts wait until every rank is in `procs`
    with interrupts_deferred():
        for rank in range(ranks):
            argv = [*cluster.exec_prefix(rank), "taskset", "-c", str(cores[rank])]
            argv += [sys.executable, "-m", "benchmarks.worker", str(spec_path)]
            slow = quota is not None and straggler is not None and rank in straggler.ranks
            with open(run_dir / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=REPO,
                        env=rank_env(cluster, rank, port, run_id, ranks),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: ended as a whole, never by name
                        preexec_fn=quota.join if slow and quota is not None else None,
                    )
                )


def _wait(procs: list[subprocess.Popen[bytes]], run_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            raise JobFailed(f"rank {rank} exited with code {codes[rank]}.\n{_tail(run_dir / f'rank{rank}.log')}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise JobFailed(
                f"rank(s) {running} still running after {timeout_s:.0f} s; ended.\n"
                f"{_tail(run_dir / f'rank{running[0]}.log')}"
            )
        time.sleep(0.2)


def end_ranks(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the process groups of ranks still running (each rank leads its own session)."""
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.is_file() else "(no log)"
    return f"--- last lines of {path} ---\n{text[-LOG_TAIL:]}"
