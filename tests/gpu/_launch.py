"""Start smoke-test ranks as separate processes and collect what each one reported.

Each rank is ``python -m tests.gpu._worker`` with a case given as JSON. A case with ``world > 1``
gets the environment of processes started by hand (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``, ``LOCAL_RANK=0``, ``WORLD_SIZE``): Lightning's ``LightningEnvironment`` then sees
processes created externally (``LOCAL_RANK`` is set), launches nothing, and with
``Trainer(devices=1, num_nodes=world)`` every rank uses the first device of its "node". A case
with ``world == 1`` gets none of these, as a user's ``python train.py`` would.

Many cases run at once (at most ``max_procs`` processes); a case still running after
``timeout_s`` is killed, and a rank whose peer failed gets ``grace_s`` to end by itself first.
No pytest import here: :func:`run_cases` is also called from throwaway scripts (e.g. with
``accelerator="cpu"`` to check this launcher on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# variables of other launchers / schedulers that would make Lightning pick another cluster environment
_FOREIGN_PREFIXES = ("SLURM_", "LSB_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "GROUP_", "ROLE_", "JSM_")
_FOREIGN = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOG_TAIL_LINES = 60
TRACEBACK_LINES = 40


@dataclass(frozen=True)
class Case:
    """One smoke run: a registered strategy name, its arguments and the number of ranks.

    Args:
        id: Unique label (the pytest id).
        name: Name in Lightning's ``StrategyRegistry`` (``'localsgd'``, ``'ddp'``, ...).
        kwargs: Arguments on top of the registry's; with none and ``backend=None`` the Trainer
            gets the bare name (the strategy at its default arguments).
        world: Number of ranks (processes), one device each.
        backend: ``process_group_backend`` to pass, or ``None`` for the strategy's default.
        mode: ``'fit'`` (fit, save a checkpoint, resume from it) or ``'probe'`` (which gloo
            operations accept tensors on the accelerator's device; no strategy).
    """

    id: str
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    world: int = 1
    backend: str | None = None
    mode: str = "fit"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Case:
        return Case(**json.loads(text))


@dataclass
class Outcome:
    """What the ranks of one case left behind."""

    case: Case
    results: list[dict[str, Any] | None]  # each rank's JSON report, None when it wrote none
    returncodes: list[int | None]  # None: killed at the deadline
    timed_out: bool
    seconds: float
    logs: list[str]  # the tail of each rank's stdout + stderr

    def describe(self) -> str:
        """A readable account of every rank: exit status, errors and the tail of its output."""
        lines = [f"case {self.case.id}: {self.case.to_json()} ({self.seconds:.0f} s)"]
        if self.timed_out:
            lines.append("TIMED OUT: ranks still running at the deadline were killed")
        for rank, (result, code, log) in enumerate(zip(self.results, self.returncodes, self.logs, strict=True)):
            lines.append(f"--- rank {rank}: exit {describe_exit(code)}")
            for stage, report in (result or {}).get("stages", {}).items():
                if not report.get("ok"):
                    lines.append(f"  stage {stage!r} failed: {report.get('error')}")
                    trace = report.get("traceback", "").rstrip().splitlines()[-TRACEBACK_LINES:]
                    lines.append("  " + "\n  ".join(trace))
            if result is None:
                lines.append("  (no report written)")
            lines.append(f"  last lines of its output:\n    {log.rstrip().replace(chr(10), chr(10) + '    ')}")
        return "\n".join(lines)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "none (killed at the deadline)"
    if code < 0:
        try:
            return f"{code} (signal {signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (signal {-code})"
    return str(code)


@dataclass
class _Running:
    case: Case
    procs: list[subprocess.Popen[bytes]]
    log_paths: list[Path]
    result_paths: list[Path]
    started: float
    deadline: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(case: Case, rank: int, port: int) -> dict[str, str]:
    """The environment of one rank: this one without other launchers' variables, plus the job's."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not k.startswith(_FOREIGN_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONUNBUFFERED"] = "1"
    if case.world > 1:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NODE_RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(case.world),
        )
    return env


def _start(case: Case, accelerator: str, workdir: Path, timeout_s: float) -> _Running:
    folder = workdir / case.id
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs, results = [], [], []
    for rank in range(case.world):
        result, log = folder / f"rank{rank}.json", folder / f"rank{rank}.log"
        cmd = [sys.executable, "-m", "tests.gpu._worker", "--case", case.to_json(), "--accelerator", accelerator]
        cmd += ["--result", str(result), "--folder", str(folder)]
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=rank_env(case, rank, port),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed as a whole
                )
            )
        logs.append(log)
        results.append(result)
    now = time.monotonic()
    return _Running(case, procs, logs, results, now, now + timeout_s)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except OSError as exc:
        return f"(no output: {exc})"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        report: dict[str, Any] = json.loads(path.read_text())
        return report
    except (OSError, ValueError):
        return None


def _finish(run: _Running, timed_out: bool) -> Outcome:
    codes = [None if timed_out and p.returncode is None else p.returncode for p in run.procs]
    _kill(run.procs)
    return Outcome(
        case=run.case,
        results=[_read(p) for p in run.result_paths],
        returncodes=codes,
        timed_out=timed_out,
        seconds=time.monotonic() - run.started,
        logs=[_tail(p) for p in run.log_paths],
    )


def _not_started(case: Case) -> Outcome:
    note = "not started: the run's time budget was spent"
    return Outcome(case, [None] * case.world, [None] * case.world, True, 0.0, [note] * case.world)


def _poll(run: _Running, grace_s: float) -> Outcome | None:
    """The outcome once every rank ended or the deadline passed; ``None`` while it runs."""
    codes = [p.poll() for p in run.procs]
    if all(c is not None for c in codes):
        return _finish(run, timed_out=False)
    if any(c not in (None, 0) for c in codes):  # a rank failed: its peers get grace_s to end
        run.deadline = min(run.deadline, time.monotonic() + grace_s)
    if time.monotonic() >= run.deadline:
        return _finish(run, timed_out=True)
    return None


def run_cases(
    cases: list[Case],
    accelerator: str,
    workdir: Path,
    timeout_s: float = 180.0,
    grace_s: float = 45.0,
    max_procs: int = 8,
    budget_s: float = float("inf"),
) -> dict[str, Outcome]:
    """Run every case (its ranks as processes), several at once; return the outcomes by case id.

    Args:
        cases: What to run.
        accelerator: The Trainer's ``accelerator`` (``'gpu'``; ``'cpu'`` to check this launcher).
        workdir: Where each case gets a folder (logs, reports, its checkpoint).
        timeout_s: Longest a case may run; its ranks are killed then.
        grace_s: Longest a rank may outlive a failed peer.
        max_procs: Most processes running at once.
        budget_s: Longest the whole call may take: then running cases are killed (timed out) and
            cases not started yet are reported as such.
    """
    pending = list(cases)
    running: list[_Running] = []
    done: dict[str, Outcome] = {}
    end = time.monotonic() + budget_s
    try:
        while pending or running:
            if time.monotonic() >= end:
                done.update({r.case.id: _finish(r, timed_out=True) for r in running})
                done.update({c.id: _not_started(c) for c in pending})
                return done
            busy = sum(r.case.world for r in running)
            while pending and (not running or busy + pending[0].world <= max_procs):
                case = pending.pop(0)
                running.append(_start(case, accelerator, workdir, timeout_s))
                busy += case.world
            for run in list(running):
                outcome = _poll(run, grace_s)
                if outcome is not None:
                    running.remove(run)
                    done[run.case.id] = outcome
            time.sleep(0.2)
    finally:
        for run in running:
            _kill(run.procs)
    return done
