"""The DBS-SGD asynchronous study's code path, on the built-in digits (three forked ranks)."""

import json

import pytest

from benchmarks.studies._dbs_async_report import print_rows, summary
from benchmarks.studies.dbs_async import STRATEGIES, _work
from lightning_hier.testing import run_workers


@pytest.mark.parametrize("sampler", ["split", "shared"])
def test_study_fits_each_strategy_and_reads_staleness_and_accuracy_at_equal_wall_time(sampler, capsys):
    rows = run_workers(_work, ["digits"], [2.0], 0, "", "", "spin", None, sampler, devices=3, timeout=120)[0]
    assert [r["strategy"] for r in rows] == list(STRATEGIES)
    equal = min(r["wall_s"] for r in rows)
    for r in rows:
        assert r["equal_wall_s"] == equal and 0.0 <= r["acc_equal_wall"] <= 1.0 and r["acc_end"] > 0.1
        assert r["epochs"] == 1  # the workload's own (no --epochs)
        assert r["staleness_max"] >= r["staleness_mean"] >= 0.0
        assert r["staleness_max"] >= max(r["staleness_by_worker"])
        assert r["staleness_worker_mean"] == pytest.approx(sum(r["staleness_by_worker"]) / 3)
        assert r["target"] == 0.5 and len(r["curve"]) >= 2
        times = [t for t, _ in r["curve"]]
        assert times == sorted(times) and times[-1] == pytest.approx(r["wall_s"], abs=0.5)
        reached = [t for t, acc in r["curve"] if acc >= 0.5]
        assert r["time_to_target_s"] == (reached[0] if reached else None)
        if r["strategy"] == "ddp":  # synchronous: no server, no staleness
            assert r["pushes"] == [] and r["staleness_max"] == 0.0
        else:
            assert len(r["pushes"]) == 3 and min(r["pushes"]) > 0
    dbs = rows[0]
    assert sum(dbs["sizes"]) == 48 and len(dbs["speeds"]) == 3  # rebalanced at least once (by the server if shared)
    rows = json.loads(json.dumps(rows))  # what --out writes and --report reads
    print_rows(rows)
    summary(rows, list(STRATEGIES))
    out = capsys.readouterr().out
    assert "| digits | 2x | dbs_async_n2 | 1 |" in out and "| digits | 2x | ddp | 1 |" in out
    assert "dbs_async: acc_equal_wall at least asgd and softsync_n2 in " in out and " of 1 runs" in out
