"""Tables of the DBS-SGD asynchronous study (:mod:`benchmarks.studies.dbs_async`) from its rows.

Rows written by older versions of the study lack ``ddp`` rows, ``curve`` and ``time_to_target_s``:
their cells print empty, so ``--report`` reads every ``--out`` file the study ever wrote.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# each DBS form against the baselines it is compared with: ASGD's server, and n-softsync's at n = 2
PAIRS = {"dbs_async": ("asgd", "softsync_n2"), "dbs_async_n2": ("softsync_n2", "asgd")}
# the paired differences also set DBS-SGD beside DDP, the synchronous alternative
PAIRED = PAIRS | {"dbs_async": (*PAIRS["dbs_async"], "ddp")}

# two-sided 95 % quantiles of Student's t by degrees of freedom (1-20); beyond 20, 20's (conservative)
_T95: tuple[float, ...] = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
_T95 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """One table row per fit, then each fit's steps, pushes and iteration times."""
    print(
        "| workload | slowdown | seed | strategy | fit wall s | staleness per push | per worker (0, 1, 2) "
        "| mean of workers | max | acc @ equal wall | acc end | time to target s | DBS sizes | DBS samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        by_worker = ", ".join(f"{m:.2f}" for m in r["staleness_by_worker"])
        target = f"{_seconds(r['time_to_target_s'])} (to {r['target']:g})" if "target" in r else ""
        print(
            f"| {r['workload']} | {r['factor']:g}x | {r.get('seed', '')} | {r['strategy']} | {r['wall_s']:.1f} "
            f"| {r['staleness_mean']:.2f} | {by_worker} | {r['staleness_worker_mean']:.2f} | {r['staleness_max']:.0f} "
            f"| {r['acc_equal_wall']:.4f} (at {r['equal_wall_s']:.1f} s) | {r['acc_end']:.4f} | {target} "
            f"| {r['sizes'] or ''} | {r['speeds'] or ''} |"
        )
    for r in rows:
        iteration = ", ".join(f"{1000 * t:.1f}" for t in r["iteration_s"])
        step = 1000 * r["wall_s"] / r["steps"]
        print(
            f"{r['workload']} {r['factor']:g}x {r['strategy']}: {r['steps']} steps on rank 0, pushes by rank "
            f"{r['pushes']}, fit wall per step {step:.1f} ms; "
            f"reply to next push by rank (compute + epoch-end waits) {iteration} ms"
        )
        if "throttled_s" in r:
            cores = ", ".join(f"{c:g}" for c in r["quota_cores"])
            held = ", ".join(f"{t:.1f}" for t in r["throttled_s"])
            print(f"  quotas (cores by rank) {cores}; throttled s by rank over the invocation {held}")


def _mean_seconds(values: list[float | None]) -> str:
    """Mean over the runs that reached the target, and how many did."""
    reached = [v for v in values if v is not None]
    if not reached:
        return f"not reached (0 of {len(values)})"
    return f"{sum(reached) / len(reached):.1f} ({len(reached)} of {len(values)})"


def summary(rows: Sequence[dict[str, Any]], strategies: Sequence[str]) -> None:
    """Means over seeds per workload, factor and strategy; how often each DBS form is at least its
    baselines; and the paired differences with their 95 % intervals (:func:`paired_table`)."""
    keys = sorted({(r["workload"], r["factor"]) for r in rows})
    print(
        "| workload | slowdown | strategy | seeds | fit wall s | staleness per push | mean of workers | max "
        "| acc @ equal wall | time to target s (runs reaching it) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload, factor in keys:
        group = [r for r in rows if (r["workload"], r["factor"]) == (workload, factor)]
        for name in strategies:
            mine = [r for r in group if r["strategy"] == name]
            if not mine:
                continue
            means = ("wall_s", "staleness_mean", "staleness_worker_mean")
            mean = {k: sum(r[k] for r in mine) / len(mine) for k in means}
            accs = [r["acc_equal_wall"] for r in mine]
            ttt = _mean_seconds([r["time_to_target_s"] for r in mine]) if "target" in mine[0] else ""
            print(
                f"| {workload} | {factor:g}x | {name} | {len(mine)} | {mean['wall_s']:.1f} "
                f"| {mean['staleness_mean']:.2f} | {mean['staleness_worker_mean']:.2f} "
                f"| {max(r['staleness_max'] for r in mine):.0f} "
                f"| {sum(accs) / len(accs):.4f} ({min(accs):.4f}-{max(accs):.4f}) | {ttt} |"
            )
    for dbs, baselines in PAIRS.items():
        _win_counts(rows, dbs, baselines)
    paired_table(rows)
    curved = [r | {"best_by_equal_wall": best_by_equal_wall(r)} for r in rows if r.get("curve")]
    if curved:
        paired_table(curved, "best_by_equal_wall")


def best_by_equal_wall(row: dict[str, Any]) -> float:
    """The best accuracy of the fit's curve up to the equal wall time: less noisy than the accuracy
    at that moment, because validation accuracy swings by several points between snapshots when the
    learning rate stays high (on CIFAR-10 for every strategy, DDP included). A fit whose first point
    comes after that time has its first point's, as ``acc_equal_wall`` takes its first snapshot."""
    curve = row["curve"]
    return max((acc for when, acc in curve if when <= row["equal_wall_s"] + 1e-9), default=curve[0][1])


def _win_counts(rows: Sequence[dict[str, Any]], dbs: str, baselines: tuple[str, ...]) -> None:
    runs = {(r["workload"], r["factor"], r.get("seed")): r for r in rows if r["strategy"] == dbs}
    for what in ("staleness_worker_mean", "acc_equal_wall"):
        won = 0
        for key, r in runs.items():
            others = [o for o in rows if (o["workload"], o["factor"], o.get("seed")) == key]
            base = [o[what] for o in others if o["strategy"] in baselines]
            better = r[what] < min(base) if what.startswith("staleness") else r[what] >= max(base)
            won += bool(base) and better
        relation = "lower than" if what.startswith("staleness") else "at least"
        print(f"{dbs}: {what} {relation} {' and '.join(baselines)} in {won} of {len(runs)} runs")


def paired_differences(
    rows: Sequence[dict[str, Any]], a: str, b: str, what: str
) -> dict[tuple[str, float], list[float]]:
    """``a``'s ``what`` minus ``b``'s, per workload and factor, one difference per seed both ran.

    The fits of one seed ran in one invocation, one after the other, from the same initial weights
    and the same straggler quota, so a difference cancels what the seed and that hour's machine
    change for both (a paired comparison).
    """
    by_key = {(r["workload"], r["factor"], r.get("seed"), r["strategy"]): r[what] for r in rows}
    out: dict[tuple[str, float], list[float]] = {}
    for (workload, factor, seed, name), value in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        other = by_key.get((workload, factor, seed, b))
        if name == a and other is not None:
            out.setdefault((workload, factor), []).append(value - other)
    return out


def t_interval(diffs: Sequence[float]) -> tuple[float, float, float] | None:
    """Mean of ``diffs`` and its two-sided 95 % Student-t interval; ``None`` with fewer than 2."""
    n = len(diffs)
    if n < 2:
        return None
    mean = statistics.fmean(diffs)
    half = _T95[min(n - 1, len(_T95)) - 1] * statistics.stdev(diffs) / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_table(rows: Sequence[dict[str, Any]], what: str = "acc_equal_wall") -> None:
    """Each DBS form minus each of its baselines, paired by seed: mean, 95 % interval, and whether the
    interval excludes zero (with 3 seeds an interval is wide: a difference inside it is not shown)."""
    print(f"\n| workload | slowdown | {what}: difference | seeds | mean | 95 % interval | verdict |")
    print("|---|---|---|---|---|---|---|")
    for dbs, baselines in PAIRED.items():
        for base in baselines:
            for (workload, factor), diffs in paired_differences(rows, dbs, base, what).items():
                ci = t_interval(diffs)
                if ci is None:
                    continue
                mean, lo, hi = ci
                verdict = "higher" if lo > 0 else "lower" if hi < 0 else "not resolved"
                print(
                    f"| {workload} | {factor:g}x | {dbs} - {base} | {len(diffs)} | {mean:+.4f} "
                    f"| [{lo:+.4f}, {hi:+.4f}] | {verdict} |"
                )
