"""From rank reports to comparisons: per-run summaries, ratios against DDP, targets, markdown.

Pure functions over plain dicts (the JSON written by the runner), so the report can be rebuilt
from a saved ``results.json`` without running anything (``python -m benchmarks.run --report``).

Time axis: *training* time, i.e. wall time of the fit minus the time spent validating (the same
validation work for every strategy, and a measurement artefact rather than training).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

from benchmarks.predicted import predicted_table
from benchmarks.scenarios import BASELINE, NO_COMM, ONE_PROCESS, Scenario, Target, Workload
from lightning_hier.simulator.jitter import gini_sigma

if TYPE_CHECKING:
    from benchmarks.launch import JobResult

MiB = 2**20


def summarize(scenario: Scenario, job: JobResult) -> dict[str, Any]:
    """One run's numbers from its rank reports and the runner's link counters."""
    ranks = job.ranks
    world = len(ranks)
    replicas = int(ranks[0].get("replicas", world))
    epochs = int(ranks[0]["epochs"])
    train_s = max(float(r["train_s"]) for r in ranks)
    # ranks of one data-parallel replica (pipeline stages, grid rows) see the same samples
    samples = sum(int(r["samples"]) for r in ranks) * replicas / world
    comm = [r["comm"] for r in ranks if r.get("comm")]
    return {
        "label": scenario.label,
        "strategy": scenario.strategy,
        "args": dict(scenario.args),
        "overrides": list(scenario.overrides),
        "strategy_config": ranks[0].get("strategy_config"),
        "epochs": epochs,
        "steps": int(ranks[0]["steps"]),
        "rank_steps": [int(r["steps"]) for r in ranks],  # unequal with sampler='shared'
        "samples": samples,
        "val_samples": ranks[0].get("val_samples"),  # rank 0's, over the fit
        "train_s": train_s,
        "wall_s": max(float(r["wall_s"]) for r in ranks),
        "launch_s": job.launch_s,
        "samples_per_s": samples / train_s if train_s > 0 else math.nan,
        "epoch_s": train_s / epochs if epochs else math.nan,
        "timeline": ranks[0]["timeline"],
        "final_acc": _final_acc(ranks[0]["timeline"]),
        "tx_bytes": job.tx_bytes,
        "rx_bytes": job.rx_bytes,
        "bytes_per_epoch": sum(job.tx_bytes) / world / epochs if epochs else math.nan,
        "ranks": world,
        "ranks_per_node": job.ranks_per_node,
        "intra_bytes": job.intra_bytes,
        "intra_bytes_per_epoch": sum(job.intra_bytes) / world / epochs if epochs else math.nan,
        "payload_bytes": [int(c["bytes"]) for c in comm] if comm else None,
        "start_broadcast": ranks[0].get("start_broadcast", True),  # absent: recorded before the library could skip it
        "blocked_s": max(float(c["blocked_s"]) for c in comm) if comm else None,
        "blocked_estimated": False,
        "peak_rss_mb": max(float(r["peak_rss_mb"]) for r in ranks),
        "straggler_throttled_s": job.throttled_s,
        "straggler_slept_s": max(float(r.get("straggler_slept_s", 0.0)) for r in ranks),
        "strategy_metrics": ranks[0].get("strategy_metrics", {}),
        "cores": job.cores,
        "model": {
            key: ranks[0].get(key)
            for key in ("parameters", "float_buffers", "tensors", "tensor_words", "tensor_shapes")
        },
        # the simulator's jitter (benchmarks/predicted.py): the ranks' mean spread of a step's time
        "step_jitter_s": mean(gini_sigma(r["step_s"]) for r in ranks) if all(r.get("step_s") for r in ranks) else None,
        # load on a shared machine: the share of the fit the ranks' training threads waited for their cores
        "queued_share": _queued_share(ranks),
    }


def _queued_share(ranks: list[dict[str, Any]]) -> float | None:
    """The ranks' mean share of the fit's wall time spent runnable but waiting for the core (None: not recorded)."""
    if not all(r.get("queued_s") is not None and r.get("wall_s") for r in ranks):
        return None
    return mean(float(r["queued_s"]) / float(r["wall_s"]) for r in ranks)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median training time (the lower one of an even count), with every repeat's samples/s."""
    ordered = sorted(runs, key=lambda r: r["train_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["repeats"] = [r["samples_per_s"] for r in runs]
    return median


def _final_acc(timeline: list[dict[str, float]]) -> float:
    return float(timeline[-1]["val_acc"]) if timeline else math.nan


def acc_at(timeline: list[dict[str, float]], seconds: float) -> float:
    """Validation accuracy known at training time ``seconds`` (the last validation before it)."""
    known = [p["val_acc"] for p in timeline if p["train_s"] <= seconds + 1e-9]
    return float(known[-1]) if known else math.nan


def time_to(timeline: list[dict[str, float]], accuracy: float) -> float | None:
    """Training time of the first validation reaching ``accuracy`` (``None``: never reached)."""
    return next((float(p["train_s"]) for p in timeline if p["val_acc"] >= accuracy), None)


def compare(workload: Workload, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Add the cross-run numbers of one workload: ratios to DDP, equal-time accuracy, targets.

    Args:
        workload: The workload the runs share.
        runs: Run summaries by label (failed runs hold only ``error``).

    Returns:
        ``{"equal_time_s": T, "rows": {label: {...ratios...}}}``; ``samples_per_s_vs_one_process``
        divides by the single-process run of the same invocation (NaN without one). Runs that
        expose no blocked time (DDP and its peers, DDP with torch's communication hooks) get
        ``blocked_s`` estimated as their training time minus the no-communication reference's,
        when it ran (not the single-process run: it has no link to block on).
    """
    done = {k: r for k, r in runs.items() if "error" not in r}
    base = done.get(BASELINE)
    trained = [r["train_s"] for k, r in done.items() if k != NO_COMM]
    equal_t = min(trained) if trained else math.nan
    ref = done.get(NO_COMM)
    for label, run in done.items():
        if ref is not None and label not in (NO_COMM, ONE_PROCESS) and run["blocked_s"] is None:
            run["blocked_s"] = max(0.0, run["train_s"] - ref["train_s"])
            run["blocked_estimated"] = True
    rows: dict[str, dict[str, Any]] = {}
    for label, run in done.items():
        row = {
            "time_to_target_s": time_to(run["timeline"], workload.target_acc),
            "acc_at_equal_time": acc_at(run["timeline"], equal_t),
        }
        for metric in ("samples_per_s", "epoch_s", "bytes_per_epoch", "final_acc"):
            row[f"{metric}_ratio"] = _ratio(run[metric], base[metric]) if base is not None else math.nan
        row["final_acc_delta"] = run["final_acc"] - base["final_acc"] if base is not None else math.nan
        one = done.get(ONE_PROCESS)  # single-process backprop of the same invocation, where the workload has it
        row["samples_per_s_vs_one_process"] = _ratio(run["samples_per_s"], one["samples_per_s"]) if one else math.nan
        rows[label] = row
    return {"equal_time_s": equal_t, "rows": rows}


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def check_target(scenario: Scenario, target: Target, result: dict[str, Any] | None) -> dict[str, Any]:
    """Whether ``scenario`` reached its target in ``result`` (its workload's results), and if not, by how much."""
    check: dict[str, Any] = {
        "workload": scenario.workload,
        "label": scenario.label,
        "metric": target.metric,
        "target": target.describe(),
        "why": target.why,
    }
    runs = (result or {}).get("runs", {})
    run = runs.get(scenario.label)
    if run is None:
        return {**check, "status": "pending", "note": "not run (strategy not registered or not selected)"}
    if "error" in run:
        return {**check, "status": "failed", "note": run["error"].splitlines()[0]}
    other = runs.get(target.versus)
    if other is None or "error" in other:
        return {**check, "status": "n/a", "note": f"no {target.versus} run to compare with"}
    mine, theirs = (_metric(result, name, target.metric) for name in (scenario.label, target.versus))  # type: ignore[arg-type]
    if mine is None or theirs is None:  # a time to target that was never reached
        status = "met" if mine is not None and target.op == "<=" else "missed"
        who = "this run" if mine is None else target.versus
        return {**check, "status": status, "note": f"{who} never reached the target accuracy"}
    ratio = _ratio(mine, theirs)
    check["ratio"] = ratio
    if math.isnan(ratio):
        return {**check, "status": "n/a", "note": f"no {target.metric} for {target.versus}"}
    if target.met(ratio):
        return {**check, "status": "met", "note": ""}
    gap = abs(ratio - target.value) / target.value
    return {**check, "status": "missed", "note": f"missed by {gap:.0%} ({ratio:.3g} vs {target.describe()})"}


def _metric(result: dict[str, Any], label: str, metric: str) -> float | None:
    """One run's value of ``metric``: from its summary or from the workload's comparison rows."""
    run = result["runs"][label]
    if metric in run:
        return float(run[metric])
    value = result["comparison"]["rows"][label][metric]
    return None if value is None else float(value)


def diagnosis(result: dict[str, Any], label: str) -> str:
    """Where one step's time goes, from the runs' own measurements (used in notes on missed targets)."""
    runs = result["runs"]
    parts = []
    for name in dict.fromkeys((label, BASELINE, NO_COMM)):
        run = runs.get(name)
        if not run or "error" in run or not run["steps"]:
            continue
        step = run["train_s"] / run["steps"]
        text = f"{name} {step * 1e3:.0f} ms/step"
        if run.get("blocked_s") is not None:
            kind = "est. blocked" if run.get("blocked_estimated") else "blocked"
            text += f" ({kind} {run['blocked_s'] / run['steps'] * 1e3:.0f} ms)"
        parts.append(text)
    return "; ".join(parts)


# ---------------------------------------------------------------------------------- markdown
def _fmt(value: float | None, spec: str = ".3g", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def _args(run: dict[str, Any]) -> str:
    items = [f"{k}={v}" for k, v in run["args"].items()] + list(run.get("overrides", []))
    return ", ".join(items) if items else "defaults"


def workload_table(workload: Workload, result: dict[str, Any], two_level: bool = False) -> str:
    """Markdown table of one workload's runs, with ratios against DDP (``two_level``: with the bytes
    each rank sent inside its node, beside those between nodes)."""
    comp = result["comparison"]
    intra = " intra MB/epoch/rank |" if two_level else ""
    one = ONE_PROCESS in result["runs"]  # "x one process": divided by that run of the same invocation
    head = (
        f"| run | arguments | samples/s | x DDP |{' x one process |' if one else ''} epoch s | x DDP "
        f"| time to {workload.target_acc:.0%} s "
        f"| val acc | vs DDP | acc @ {_fmt(comp['equal_time_s'], '.0f')} s | MB/epoch/rank | x DDP |{intra}"
        " blocked s | peak MiB |"
    )
    columns = 14 + two_level + one
    lines = [head, "|" + "---|" * columns]
    for label, run in result["runs"].items():
        if "error" in run:
            cells = " |" * (columns - 2)
            lines.append(f"| {label} | failed: {run['error'].splitlines()[0][:120]} |{cells}")
            continue
        intra = f" {_fmt(run.get('intra_bytes_per_epoch', math.nan) / MiB, '.1f')} |" if two_level else ""
        row = comp["rows"][label]
        blocked = _fmt(run["blocked_s"], ".1f") + (" (est.)" if run.get("blocked_estimated") else "")
        lines.append(
            f"| {label} | {_args(run)} | {_fmt(run['samples_per_s'], '.0f')}{_spread(run)} "
            f"| {_fmt(row['samples_per_s_ratio'], '.2f')} "
            + (f"| {_fmt(row.get('samples_per_s_vs_one_process'), '.2f')} " if one else "")
            + f"| {_fmt(run['epoch_s'], '.1f')} | {_fmt(row['epoch_s_ratio'], '.2f')} "
            f"| {_fmt(row['time_to_target_s'], '.0f')} | {_fmt(run['final_acc'], '.3f')} "
            f"| {_fmt(row['final_acc_delta'], '+.3f')} | {_fmt(row['acc_at_equal_time'], '.3f')} "
            f"| {_fmt(run['bytes_per_epoch'] / MiB, '.1f')} | {_fmt(row['bytes_per_epoch_ratio'], '.3f')} |{intra}"
            f" {blocked} | {_fmt(run['peak_rss_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def _spread(run: dict[str, Any]) -> str:
    repeats = run.get("repeats") or []
    return f" ({min(repeats):.0f}-{max(repeats):.0f})" if len(repeats) > 1 else ""


def targets_table(checks: list[dict[str, Any]]) -> str:
    lines = ["| check | workload | ratio | target | status | note |", "|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {c['label']} {c['metric']} | {c['workload']} | {_fmt(c.get('ratio'), '.3f')} | {c['target']} "
            f"| {c['status']} | {c['note']} |"
        )
    return "\n".join(lines)


def workload_section(workload: Workload, result: dict[str, Any], meta: dict[str, Any], plot: str | None) -> str:
    """Heading, setting, table and plot of one workload (``meta``: the document's; a workload carried
    over from an earlier invocation says so with its own)."""
    own = result.get("meta", meta)
    slow = result.get("straggler")
    straggler = f", {_slowed(slow)} slowed {slow['factor']:g}x ({slow['mode']})" if slow else ""
    parts = [f"#### `{workload.name}`: {workload.description}", ""]
    if own.get("date") != meta.get("date"):
        parts += [f"From an earlier invocation: {meta_line(own)}", ""]
    parts += [
        f"{_layout(own)}, {result.get('link', workload.link)} links{straggler}; recipe "
        f"`recipes/{workload.recipe}` experiment `{workload.experiment}`. Equal-time accuracy at "
        f"{_fmt(result['comparison']['equal_time_s'], '.0f')} s of training (the fastest run's total).",
        "",
        workload_table(workload, result, two_level=int(own.get("ranks_per_node", 1)) > 1),
    ]
    if NO_COMM in result["runs"]:
        parts += [
            "",
            f"`{NO_COMM}`: the same compute without communication (Local SGD with tau = 10^9), the throughput "
            "limit; its accuracy is that of replicas averaged once at the end, not a baseline.",
        ]
    if int(own.get("ranks_per_node", 1)) > 1:
        parts += ["", "MB/epoch/rank: bytes on the links between nodes; intra MB: on each node's loopback."]
    else:  # the simulator models one flat ring of ranks, not two levels
        parts += [
            "",
            "Predicted by the simulator (`lightning_hier.simulator`, calibrated on this invocation's `no-comm` run; "
            "`benchmarks/predicted.py` lists the assumptions):",
            "",
            predicted_table(result, int(own.get("ranks", 2))),
        ]
    if plot:
        parts += ["", f"![{workload.name}]({plot})"]
    return "\n".join(parts)


def _layout(meta: dict[str, Any]) -> str:
    ranks, per_node = int(meta["ranks"]), int(meta.get("ranks_per_node", 1))
    if per_node == 1:
        return f"{ranks} ranks"
    return f"{ranks // per_node} nodes x {per_node} ranks (loopback inside a node)"


def _slowed(slow: dict[str, Any]) -> str:
    ranks = slow.get("ranks", [slow.get("rank")])  # results written before slow nodes name one "rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


BUSY_LOAD_PER_CPU = 0.25  # a load average above this share of the cores marks a run as preliminary
BUSY_CPU_SHARE = 0.10  # as does other work using this share of the cores' time when the runs start


# runner options that only say where a run wrote or how it queued, not what it measured
_PRIVATE_OPTIONS = {"--out": 1, "--name": 1, "--lock": 1, "--timeout": 1, "--no-update-readme": 0, "--update-readme": 0}


def public_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options that name a run's output folder, label, lock or time limit."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in _PRIVATE_OPTIONS:
            skip = _PRIVATE_OPTIONS[arg]
        else:
            out.append(arg)
    return out


def meta_line(meta: dict[str, Any]) -> str:
    """Provenance of a results document: when, what, where, with which arguments, how busy.

    The line goes into pages a user reads: the commit (kept in the JSON) and the runner's own
    bookkeeping options (:func:`public_argv`) are left out.

    "Busy" is judged by the CPU share other processes used just before the runs (``cpu_busy``)
    when it was measured, else by the 1-minute load average (which lags behind earlier runs).
    """
    mode = "quick" if meta.get("quick") else "full"
    load, cpus, share = meta["load_avg"][0], meta["host_cpus"], meta.get("cpu_busy")
    busy = share > BUSY_CPU_SHARE if share is not None else load > BUSY_LOAD_PER_CPU * cpus
    args = " ".join(public_argv(meta.get("argv", []))) or "(defaults)"
    at_start = (
        f"CPU {share:.0%} busy and load average {load:.1f} at start"
        if share is not None
        else (f"load average {load:.1f} at start")
    )
    line = (
        f"_{mode} run {meta['date']}, arguments `{args}`, {cpus} cores, "
        f"{at_start}; torch {meta['torch']}, lightning {meta['lightning']}._"
    )
    if not busy:
        return line
    why = f"{share:.0%} of the CPU in use" if share is not None else f"load {load:.1f} on {cpus} cores"
    return f"**Preliminary: the machine was busy ({why}).** {line}"


def replace_between(text: str, name: str, content: str) -> str:
    """Replace what lies between ``<!-- bench:<name>:start -->`` and ``<!-- bench:<name>:end -->``.

    Raises:
        ValueError: The markers are missing.
    """
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{content.strip()}\n{end}", text, count=1)


def update_file(path: Path, name: str, content: str) -> None:
    path.write_text(replace_between(path.read_text(), name, content))
