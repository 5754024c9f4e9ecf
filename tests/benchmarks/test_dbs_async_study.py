"""The DBS-SGD asynchronous study's code path, on the built-in digits (three forked ranks)."""

import json

import pytest

from benchmarks.studies._dbs_async_report import (
    best_by_equal_wall,
    paired_differences,
    paired_table,
    print_rows,
    summary,
    t_interval,
)
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
        assert times == sorted(times) and times[-1] == r["wall_s"]  # the last snapshot ends the fit
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


def _row(strategy: str, seed: int, acc: float, factor: float = 2.0) -> dict:
    return {"workload": "mnist", "factor": factor, "seed": seed, "strategy": strategy, "acc_equal_wall": acc}


def test_paired_differences_pair_each_seed_with_the_same_seeds_baseline():
    rows = [_row("dbs_async", 0, 0.90), _row("asgd", 0, 0.85), _row("dbs_async", 1, 0.80), _row("asgd", 1, 0.82)]
    rows += [_row("dbs_async", 2, 0.5), _row("asgd", 0, 0.1, factor=4.0)]  # no partner: left out
    diffs = paired_differences(rows, "dbs_async", "asgd", "acc_equal_wall")
    assert diffs.keys() == {("mnist", 2.0)}
    assert diffs[("mnist", 2.0)] == pytest.approx([0.05, -0.02])


def test_t_interval_is_the_students_t_interval_of_the_mean():
    assert t_interval([0.3]) is None
    mean, lo, hi = t_interval([1.0, 2.0, 3.0])
    # mean 2, sample sd 1, t(0.975, df=2) = 4.303: 2 -/+ 4.303 / sqrt(3)
    assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - 2.4843, 2.0 + 2.4843), abs=1e-4)
    mean, lo, hi = t_interval([0.01] * 30)  # beyond the table: still an interval, here of width 0
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.01)


def test_paired_table_calls_an_interval_above_zero_higher_and_one_across_zero_not_resolved(capsys):
    rows = [_row("dbs_async", s, 0.9 + 0.01 * s) for s in range(3)] + [_row("asgd", s, 0.8) for s in range(3)]
    rows += [_row("dbs_async", s, 0.8 + (-0.1 if s else 0.1), 4.0) for s in range(3)]
    rows += [_row("asgd", s, 0.8, 4.0) for s in range(3)]
    paired_table(rows)
    out = capsys.readouterr().out
    lines = {line.split(" | ")[1]: line for line in out.splitlines() if "dbs_async - asgd" in line}
    assert lines["2x"].startswith("| mnist | 2x | dbs_async - asgd | 3 | +0.1100 |")
    assert lines["2x"].endswith("| higher |")
    assert lines["4x"].startswith("| mnist | 4x | dbs_async - asgd | 3 | -0.0333 |")
    assert lines["4x"].endswith("| not resolved |")


def test_the_best_by_equal_wall_time_is_the_curves_maximum_up_to_that_time(capsys):
    row = {"equal_wall_s": 2.0, "curve": [(0.5, 0.4), (1.0, 0.7), (2.0, 0.6), (3.0, 0.9)]}
    assert best_by_equal_wall(row) == 0.7  # not the later 0.9, not the 0.6 at the moment itself
    # a fit whose first point comes after the equal wall time (the fastest run's end): its first point
    assert best_by_equal_wall({"equal_wall_s": 0.4, "curve": [(0.5, 0.4), (1.0, 0.7)]}) == 0.4
    rows = [_row("dbs_async", s, 0.0) | {"equal_wall_s": 1.0, "curve": [(1.0, 0.9 + 0.01 * s)]} for s in range(3)]
    rows += [_row("asgd", s, 0.0) | {"equal_wall_s": 1.0, "curve": [(1.0, 0.8)]} for s in range(3)]
    paired_table([r | {"best_by_equal_wall": best_by_equal_wall(r)} for r in rows], "best_by_equal_wall")
    assert "| mnist | 2x | dbs_async - asgd | 3 | +0.1100 |" in capsys.readouterr().out
