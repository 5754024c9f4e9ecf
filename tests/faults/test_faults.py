"""Fault injection: every fault ends the run quickly, non-zero, naming the culprit, leaving nothing behind.

Each cell of :mod:`tests.faults.matrix` runs ``fault_fit.py`` as a subprocess (so the popen launcher
can re-run it for rank 1) with ``timeout=TIMEOUT_S`` and checks, from the moment the fault was
injected: every process of the run (the main one and each rank, by PID) is gone within
``TIMEOUT_S + 30`` s; the exit status is non-zero; the output names the rank at fault; the
checkpoints written before the fault are byte-for-byte unchanged and load; and the run's private
temporary directory holds no ``pytorch-errorfile-*`` left by the fork launcher.

``python -m pytest -m faults --fault-matrix=full`` runs all cells; the default is a covering subset.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.faults.fault_fit import CULPRIT, SIGNALS, digest
from tests.faults.matrix import Cell
from tests.helpers import process_alive

pytestmark = pytest.mark.faults

SCRIPT = Path(__file__).parent / "fault_fit.py"
TIMEOUT_S = 5.0
SLACK_S = 30.0
START_LIMIT_S = 120.0  # from launch to the injected fault (imports and start-up on a loaded machine)


@dataclass
class Outcome:
    returncode: int | None
    output: str
    injected_at: float | None  # time.time() of the injection (first rank to inject)
    ended_at: float  # when the main process and every rank were gone (or the deadline)
    leftovers: list[int]  # PIDs still alive at the deadline (killed by the runner)
    manifest: dict[str, str]
    run_dir: Path


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((run_dir / "pids").glob("[mr]*"))]  # main, rank<r>


def _injected_at(run_dir: Path) -> float | None:
    times = [float(p.read_text()) for p in run_dir.glob("injected[0-9]")]
    return min(times) if times else None


def run_cell(cell: Cell, run_dir: Path, timeout_s: float = TIMEOUT_S) -> Outcome:
    """Run one cell; kill by PID whatever outlives its deadline."""
    tmp = run_dir / "tmp"
    tmp.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    command = [sys.executable, str(SCRIPT), cell.strategy, cell.start_method, cell.fault, str(run_dir), str(timeout_s)]
    start = time.time()
    with open(run_dir / "output.txt", "w") as out:
        # own session: a signal meant for the run never reaches pytest, and the reverse
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=run_dir, env=env, start_new_session=True
        )
        deadline = start + START_LIMIT_S
        while True:
            injected = _injected_at(run_dir)
            if injected is not None:
                deadline = injected + timeout_s + SLACK_S
            running = proc.poll() is None or any(process_alive(p) for p in _pids(run_dir))
            if not running or time.time() > deadline:
                break
            time.sleep(0.2)
        ended = time.time()
        leftovers = [p for p in [proc.pid, *_pids(run_dir)] if process_alive(p)]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    manifest_file = run_dir / "manifest.json"
    return Outcome(
        returncode=proc.returncode if not leftovers else None,
        output=(run_dir / "output.txt").read_text(errors="replace"),
        injected_at=_injected_at(run_dir),
        ended_at=ended,
        leftovers=sorted(set(leftovers)),
        manifest=json.loads(manifest_file.read_text()) if manifest_file.exists() else {},
        run_dir=run_dir,
    )


def names_rank(output: str, rank: int) -> bool:
    """Whether the run's output names ``rank`` as the one that failed (and not some other rank as well)."""
    patterns = (
        rf"[Rr]ank {rank} failed first",
        rf"No failure report from rank\(s\) \[{rank}\]",
        rf"rank {rank} (raised|died|was killed|terminated|exited)",
        rf"rank {rank} \(PID \d+\), which launched it, is gone",
        # Lightning's popen observer, which SIGKILLs the main process when a child rank died
        rf"\[rank: {rank}\] Child process with PID \d+ terminated",
        # the watchdog of a rank that was in no collective when the peer failed (asgd: rank 0 trains
        # beside its server thread), naming the ranks that reported
        rf"because rank\(s\) \[{rank}\] failed",
    )
    return any(re.search(p, output) for p in patterns)


def check(cell: Cell, outcome: Outcome) -> None:
    tail = outcome.output[-4000:]
    assert outcome.injected_at is not None, f"the fault was never injected:\n{tail}"
    assert not outcome.leftovers, f"processes {outcome.leftovers} outlived the deadline (killed):\n{tail}"
    took = outcome.ended_at - outcome.injected_at
    assert took <= TIMEOUT_S + SLACK_S, f"the run took {took:.1f} s after the fault:\n{tail}"
    assert outcome.returncode not in (0, None), f"exit status {outcome.returncode}:\n{tail}"
    if cell.fault in CULPRIT:
        assert names_rank(outcome.output, CULPRIT[cell.fault]), f"rank {CULPRIT[cell.fault]} not named:\n{tail}"
    assert outcome.manifest, "no checkpoint was written before the fault"
    for name, sha in outcome.manifest.items():
        path = outcome.run_dir / "ckpt" / name
        assert path.exists(), f"{name} is gone after the fault"
        # after a signal the run may finish its step and save once more (a complete, new file)
        assert digest(path) == sha or cell.fault in SIGNALS, f"{name} changed after the fault"
    for path in (outcome.run_dir / "ckpt").glob("*.ckpt"):
        assert "state_dict" in torch.load(path, map_location="cpu", weights_only=False), path.name
    left = sorted(p.name for p in (outcome.run_dir / "tmp").glob("pytorch-errorfile-*"))
    assert not left, f"the launcher left {left} in the temporary directory"


def test_fault(cell: Cell, tmp_path: Path) -> None:
    check(cell, run_cell(cell, tmp_path / "run"))


@pytest.mark.parametrize("start_method", ["popen", "fork"])
def test_a_hung_rank_ends_when_rank_0_dies(start_method: str, tmp_path: Path) -> None:
    """With popen, rank 0 is the main process: rank 1, re-parented and stuck, is ended by its watchdog."""
    cell = Cell("mgrawa", start_method, "kill0_hang1")
    check(cell, run_cell(cell, tmp_path / "run"))
