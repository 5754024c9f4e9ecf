"""The chaos study's bookkeeping: kills matched with the survivors' membership logs, the table's arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.studies.chaos import Killer, parse, recovery, report


def test_recovery_matches_each_kill_with_the_log_of_its_departure_and_its_return(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text(
        "100.200 lightning_hier: replica 0: world [0, 2] at 1.0\n"
        "101.500 lightning_hier: replica 0: replica(s) [1] left at step 15; their steps since step 7 are lost\n"
        "101.510 lightning_hier: replica 2: replica(s) [1] left at step 15; their steps since step 7 are lost\n"
        "104.000 lightning_hier: replica 1 rejoined at point 3 (step 23)\n"
        "130.250 lightning_hier: replica 0: replica(s) [2, 1] left at step 99; their steps since step None are lost\n"
        "a line of Lightning's own\n"
    )
    kills = [{"replica": 1, "at": 100.0}, {"replica": 2, "at": 130.0}, {"replica": 0, "at": 150.0}]
    assert recovery(kills, log) == {
        "detected_s": [1.5, 0.25, None],
        "rejoined_s": [4.0, None, None],
        "lost_steps": [16, None, None],
    }


def test_report_gives_the_wall_time_lost_per_failure_against_the_clean_run():
    rows = [
        {"mode": "clean", "wall_s": 100.0, "launches": 1, "kills": [], "accuracy": 0.5},
        {"mode": "relaunch", "wall_s": 130.0, "launches": 4, "kills": [{}, {}, {}], "accuracy": 0.5},
    ]
    rows.append(
        {"mode": "tolerant", "wall_s": 99.0, "launches": 1, "kills": [{}, {}], "accuracy": 0.5}
        | {"detected_s": [0.5, 1.5], "rejoined_s": [2.0, None], "lost_steps": [10, 30]}
    )
    rows.append({"mode": "torchrun_clean", "wall_s": 120.0, "launches": 1, "kills": [], "accuracy": 0.5})
    rows.append({"mode": "torchrun", "wall_s": 126.0, "launches": 1, "kills": [{}, {}], "accuracy": 0.5})
    table = report(rows, replica_steps=400)
    assert "| relaunch | 130.0 | 3 | 4 | 0.5000 | 10.00 | - | - | - |" in table
    assert "| tolerant | 99.0 | 2 | 1 | 0.5000 | -0.50 | 1.00 | 2.00 | 20 (10.0% of all) |" in table
    assert rows[1]["lost_per_failure_s"] == 10.0
    assert rows[4]["lost_per_failure_s"] == 3.0  # against the torchrun run without kills, not the forked one


def test_the_killer_kills_live_replicas_round_robin_by_their_pid_files(tmp_path):
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for replica, proc in enumerate(sleepers):
            (tmp_path / f"replica{replica}.pid").write_text(str(proc.pid))
        with Killer(tmp_path, replicas=2, every=0.2) as killer:
            deadline = time.monotonic() + 10
            while len(killer.kills) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert [k["replica"] for k in killer.kills] == [1, 0]
        assert [p.wait(timeout=10) for p in sleepers] == [-9, -9]
    finally:
        for proc in sleepers:
            if proc.poll() is None:
                os.kill(proc.pid, 9)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        parse(["--kill-every", "0", "--data-root", str(tmp_path)])
    with pytest.raises(SystemExit):
        parse(["--replicas", "0", "--data-root", str(tmp_path)])
