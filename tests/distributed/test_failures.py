"""A rank that raises or hangs fails the whole fit quickly, names the rank, and leaves no process behind.

The popen launcher's side of the same promise (the script re-run for rank 1) is checked by the
fault cells ``ddp_post_local_sgd-popen-raise`` and ``decoupled-popen-hang`` of ``tests/faults``.
"""

import os
import re
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest

from lightning_hier.testing import WorkerFailed, run_workers
from tests.distributed.scripts.failing_fit import fit


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_raising_rank_is_named_by_its_peers():
    with pytest.raises(WorkerFailed, match="rank 1 raised ValueError: rank one broke"):
        run_workers(partial(fit, timeout=4.0), "raise", devices=2, timeout=60)


def test_hung_rank_fails_the_fit_within_the_timeout_and_is_named():
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_workers(partial(fit, timeout=4.0), "hang", devices=2, timeout=60)
    elapsed = time.monotonic() - start
    # rank 0's collective timed out (4 s) and it names the silent rank; the watchdog ended rank 1
    assert "No failure report from rank(s) [1]" in str(info.value)
    assert info.value.rank == 0
    assert elapsed < 30, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_fork_launcher_fails_fast_and_leaves_no_orphans_or_files(mode, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torch puts the children's error files
    # children this test did not start (multiprocessing's resource tracker after an earlier
    # spawn test) are not orphans of this fit
    before = set(_children(os.getpid()))
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fit(mode, start_method="fork", timeout=4.0)
    elapsed = time.monotonic() - start
    assert re.search(r"rank one broke|No failure report from rank\(s\) \[1\]", str(info.value)), str(info.value)
    assert re.search(r"lightning_hier: rank [01] (raised|exited|was killed)", str(info.value)), str(info.value)
    assert elapsed < 30, f"took {elapsed:.1f} s"
    time.sleep(0.5)
    assert set(_children(os.getpid())) - before == set()
    assert list(tmp_path.iterdir()) == []  # no pytorch-errorfile-*.pickle left behind


def test_a_rank_that_starts_late_joins_within_init_timeout():
    """Start-up waits up to init_timeout; only collectives after start-up use the short timeout."""

    def late_start() -> int:
        if os.environ["RANK"] == "1":
            time.sleep(6)  # longer than `timeout`, shorter than `init_timeout`
        return fit("none", samples=16, timeout=3, init_timeout=60)

    assert run_workers(late_start, devices=2, timeout=90) == [2, 2]  # 16 samples, 2 ranks, batch 4
