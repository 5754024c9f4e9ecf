"""`python -m benchmarks.run --quick` as a user runs it (root): outputs, skips, and cleanup on SIGTERM."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netns import list_namespaces
from benchmarks.straggler import cgroup_flavour
from tests.benchmarks.conftest import processes_mentioning

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--quick", "--synthetic", "--epochs", "1", "--set", "data.train_size=512", "data.val_size=256"]


def _wait_for(pattern: str, folder: Path, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not list(folder.glob(pattern)):
        assert proc.poll() is None, f"the runner ended (code {proc.returncode}) before {pattern} appeared"
        assert time.monotonic() < deadline, f"{pattern} did not appear within {seconds} s"
        time.sleep(0.2)


def test_quick_run_writes_results_then_sigterm_removes_everything(emulation, tmp_path):
    """One runner: DDP on the straggler workload completes (outputs), Local SGD is interrupted mid-run."""
    pytest.importorskip("matplotlib")
    cgroup = cgroup_flavour() is not None
    cmd = [sys.executable, "-m", "benchmarks.run", *QUICK, "--out", str(tmp_path), "--workloads", "dbs_straggler"]
    cmd += ["--strategies", "localsgd", "--straggler-mode", "cgroup" if cgroup else "delay"]
    with open(tmp_path / "stdout.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        # DDP done; Local SGD started, its rank 1 inside the slowed ranks' CPU-quota cgroup (lhb-<pid>-slow)
        _wait_for("tmp/runs-*/dbs_straggler/localsgd-0/rank1.log", tmp_path, proc, 400)
        assert [n for n in list_namespaces() if n.startswith(f"lhb-{proc.pid}-")]
        assert not cgroup or list(Path("/sys/fs/cgroup").glob(f"**/lhb-{proc.pid}-slow"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = (tmp_path / "stdout.txt").read_text()
    # nothing left: namespaces, the straggler's cgroup, rank processes
    assert [n for n in list_namespaces() if n.startswith(f"lhb-{proc.pid}-")] == [], stdout[-3000:]
    assert not list(Path("/sys/fs/cgroup").glob(f"**/lhb-{proc.pid}-slow"))
    assert processes_mentioning(str(tmp_path)) == []
    # the finished run was written, marked as partial
    results = json.loads((tmp_path / "results.json").read_text())
    entry = results["workloads"]["dbs_straggler"]
    assert results["interrupted"] and list(entry["runs"]) == ["ddp"] and entry["straggler"]["ranks"] == [1]
    ddp = entry["runs"]["ddp"]
    assert min(ddp["tx_bytes"]) > 0 and ddp["epochs"] == 1 and ddp["samples_per_s"] > 0
    assert ddp["straggler_throttled_s"] is not None or not cgroup
    assert (tmp_path / "dbs_straggler.png").stat().st_size > 0
    md = (tmp_path / "results.md").read_text()
    assert "**Interrupted: partial results.**" in md and "| ddp | defaults |" in md and "rank 1 slowed 2x" in md


def test_cleanup_command():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--cleanup"], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode == 0:
        assert proc.stdout.startswith("benchmarks: removed")
    else:  # not root: `ip netns` fails, and says so
        assert "ip" in proc.stderr
