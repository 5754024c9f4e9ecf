"""Run every registered strategy against Lightning's DDP on an emulated cluster (needs root).

Examples::

    python -m benchmarks.run --quick                       # a few minutes: every workload, shrunk
    python -m benchmarks.run                               # full: regenerates results and READMEs
    python -m benchmarks.run --workloads hpsgd_mlp --strategies hpsgd --link 100mbit
    python -m benchmarks.run --list                        # workloads, scenarios, what is registered
    python -m benchmarks.run --report benchmarks/results/results.json   # re-render, no runs
    python -m benchmarks.run --cleanup                     # remove leftovers of killed runs

Each workload runs DDP first, then (full mode) a no-communication reference, then each scenario
whose strategy is registered. Outputs in ``--out``: ``results.json``, ``results.md`` and one
PNG per workload; a full run into the default folder also rewrites the result sections of
``README.md``, ``benchmarks/README.md`` and ``recipes/<paper>/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import leftovers, netns, publish
from benchmarks.scenarios import REPO, SCENARIOS, WORKLOADS, Plan, Scenario, Workload, available_strategies, plan
from benchmarks.straggler import (
    DEFAULT_DELAY_CALLBACK,
    MODES,
    Straggler,
    cgroup_flavour,
    cgroup_parent,
    load_factory,
    remove_stale_cgroups,
)

RESULTS = REPO / "benchmarks" / "results"
QUICK_OUT = RESULTS / "tmp" / "quick"
FIRST_PORT = 29400


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shrunk workloads (a few minutes); no README update")
    p.add_argument("--workloads", nargs="+", metavar="W", help=f"subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--strategies", nargs="+", metavar="S", help="only scenarios of these strategies/labels")
    p.add_argument("--ranks", type=int, default=2, help="ranks (one core each); default 2")
    p.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks sharing a node's namespace (loopback inside); default 1"
    )
    p.add_argument("--name", help="a label in this run's namespace and cgroup names (lhb-<pid>-<name>-...)")
    p.add_argument("--lock", type=Path, help="hold an exclusive flock on this file during each job (shared machines)")
    p.add_argument("--link", help="tc rate of every node's link for all workloads, e.g. 100mbit, 1gbit, unlimited")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data-root", type=Path, help="CIFAR-10 source (default: shared/datasets/cifar10-jpeg.tar.gz)")
    data.add_argument("--synthetic", action="store_true", help="synthetic 3x32x32 data instead of CIFAR-10")
    p.add_argument("--epochs", type=int, help="override every workload's epochs")
    p.add_argument("--set", dest="extra", nargs="+", default=[], metavar="KEY=VALUE", help="extra Hydra overrides")
    p.add_argument("--straggler-mode", choices=MODES, default="cgroup", help="how a straggler is slowed")
    p.add_argument("--straggler-callback", default=DEFAULT_DELAY_CALLBACK, help="delay mode: module:attr factory")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, help="no-communication run (full: on)")
    p.add_argument("--out", type=Path, help=f"output folder (default {RESULTS} or, quick, {QUICK_OUT})")
    p.add_argument("--update-readme", action=argparse.BooleanOptionalAction, help="rewrite README results")
    p.add_argument("--repeats", type=int, default=1, help="run every job N times, interleaved; report the median")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of one run in seconds")
    p.add_argument("--list", action="store_true", help="show workloads and scenarios, run nothing")
    p.add_argument("--report", type=Path, metavar="JSON", help="re-render outputs from a results.json")
    p.add_argument("--cleanup", action="store_true", help="remove leftover namespaces/cgroups of dead runs")
    p.add_argument("--all", action="store_true", help="with --cleanup: every lhb- namespace, live runs too")
    args = p.parse_args(argv)
    default_out = args.out is None
    args.out = args.out or (QUICK_OUT if args.quick else RESULTS)
    args.reference = (not args.quick) if args.reference is None else args.reference
    args.update_readme = (default_out and not args.quick) if args.update_readme is None else args.update_readme
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.ranks < 1 or args.ranks > netns.MAX_RANKS:
        p.error(f"--ranks must be in [1, {netns.MAX_RANKS}], got {args.ranks}")
    if args.ranks_per_node < 1 or args.ranks % args.ranks_per_node:
        p.error(f"--ranks-per-node must be >= 1 and divide --ranks {args.ranks}, got {args.ranks_per_node}")
    if args.name is not None and not re.fullmatch(r"[a-z0-9]{1,8}", args.name):
        p.error(f"--name must be 1 to 8 lowercase letters or digits (it goes into namespace names), got {args.name!r}")
    try:
        netns.parse_rate(args.link or "unlimited")
    except ValueError as err:
        p.error(f"--link: {err}")
    return args


def layout_problem(args: argparse.Namespace, the_plan: Plan) -> str | None:
    """Why a planned two-level workload cannot run on the chosen cluster, or ``None``."""
    nodes = args.ranks // args.ranks_per_node
    two_level = [name for name in the_plan.runs if WORKLOADS[name].two_level]
    if two_level and (nodes < 2 or args.ranks_per_node < 2):
        return (
            f"workload(s) {', '.join(two_level)} need a two-level cluster (at least 2 nodes of at least 2 ranks), "
            f"got --ranks {args.ranks} --ranks-per-node {args.ranks_per_node}; e.g. --ranks 4 --ranks-per-node 2"
        )
    return None


def straggler_problem(args: argparse.Namespace, the_plan: Plan) -> str | None:
    """Why a planned straggler cannot be emulated in the chosen mode, or ``None``."""
    slowed = [name for name in the_plan.runs if WORKLOADS[name].straggler]
    if slowed and args.straggler_mode == "cgroup" and cgroup_flavour() is None:
        return (
            f"workload(s) {', '.join(slowed)} slow a rank, but this host has no cgroup CPU controller; "
            "use --straggler-mode delay"
        )
    return None


def default_data_root() -> Path | None:
    """``shared/datasets/cifar10-jpeg.tar.gz`` beside the repository or one of its parents."""
    for parent in REPO.parents:
        candidate = parent / "shared" / "datasets" / "cifar10-jpeg.tar.gz"
        if candidate.is_file():
            return candidate
    return None


def data_overrides(args: argparse.Namespace) -> list[str]:
    if args.synthetic:
        return ["data=synthetic", "data.input_shape=[3,32,32]", "data.val_size=1024"]
    root = args.data_root or default_data_root()
    if root is None or not Path(root).exists():
        raise SystemExit(
            f"benchmarks: CIFAR-10 not found ({root or 'no shared/datasets'}); pass --data-root or --synthetic"
        )
    return [f"data.root={Path(root).resolve()}"]


def run_overrides(args: argparse.Namespace, workload: Workload, scenario: Scenario, data: list[str]) -> list[str]:
    """The Hydra overrides of one run: experiment, data, the workload's own, quick, strategy, then the user's."""
    out = [f"experiment={workload.experiment}", *data, *workload.overrides]
    out += list(workload.quick) if args.quick else []
    out += scenario.hydra_overrides()
    out += [f"trainer.max_epochs={args.epochs}"] if args.epochs else []
    return out + list(args.extra)


def validate(args: argparse.Namespace, the_plan: Plan, data: list[str]) -> None:
    """Compose every run's config and construct its strategy now, so bad arguments fail before any run."""
    from benchmarks.rank import RUN_OVERRIDES, compose_config, layout_overrides
    from lightning_hier.train import build_strategy

    for name, scenarios in the_plan.runs.items():
        w = WORKLOADS[name]
        for sc in scenarios:
            ranks = sc.ranks or args.ranks
            layout = layout_overrides(ranks, min(ranks, getattr(args, "ranks_per_node", 1)))
            overrides = [*run_overrides(args, w, sc, data), *RUN_OVERRIDES, *layout]
            try:
                build_strategy(compose_config(overrides, str(w.searchpath)))
            except Exception as err:
                raise SystemExit(f"benchmarks: workload {name}, run {sc.label}: invalid configuration: {err}") from err
    if args.straggler_mode == "delay":
        load_factory(args.straggler_callback)


def prepare_data(data: list[str]) -> None:
    """Decode CIFAR-10 once here, so ranks do not decode it concurrently."""
    root = next((o.split("=", 1)[1] for o in data if o.startswith("data.root=")), None)
    if root is not None:
        from lightning_hier.data import read_cifar10_split

        for split in ("train", "test"):
            read_cifar10_split(root, split)


def clear_leftovers() -> None:
    """Remove what killed runs left, say so, name what could not be removed, and say how to clean up this run.

    The notice goes first to stderr: if this run is killed with SIGKILL, it is the only thing it says.
    """
    removed = netns.cleanup(stale_only=True) + remove_stale_cgroups()
    if removed:
        print(f"[bench] removed leftovers of killed runs: {', '.join(removed)}", flush=True)
    left = leftovers.find(netns.list_namespaces(), cgroup_parent())
    if left:
        print(leftovers.remaining_message(left), file=sys.stderr, flush=True)
    print(leftovers.killed_run_notice(str(os.getpid())), file=sys.stderr, flush=True)


def run_plan(args: argparse.Namespace, the_plan: Plan, data: list[str], results: dict[str, Any]) -> None:
    """Run every planned job on one emulated cluster, filling ``results`` as runs finish.

    On an interruption (or any error) ``results["interrupted"]`` is set and the exception goes on,
    after the ranks, the cgroup and the namespaces are gone.
    """
    work = args.out / "tmp" / f"runs-{dt.datetime.now():%Y%m%d-%H%M%S}"  # rank logs; benchmarks/results/tmp is ignored
    results["meta"]["logs"] = str(work)
    ports = itertools.count(FIRST_PORT)  # a fresh MASTER_PORT per job
    try:
        tag = f"{os.getpid()}-{args.name}" if args.name else None
        link = netns.Link(args.link or "1gbit")
        with netns.EmulatedCluster(args.ranks, link, tag=tag, ranks_per_node=args.ranks_per_node) as cluster:
            for name, scenarios in the_plan.runs.items():
                entry: dict[str, Any] = {"meta": results["meta"], "link": args.link or WORKLOADS[name].link, "runs": {}}
                results["workloads"][name] = entry
                run_workload(args, cluster, WORKLOADS[name], scenarios, data, work / name, ports, entry)
    except BaseException:
        results["interrupted"] = True
        raise


def run_workload(
    args: argparse.Namespace,
    cluster: netns.EmulatedCluster,
    w: Workload,
    scenarios: list[Scenario],
    data: list[str],
    work: Path,
    ports: Iterator[int],
    entry: dict[str, Any],
) -> None:
    """Run one workload's scenarios ``args.repeats`` times, interleaved; ``entry`` holds the median runs.

    Interleaving the repeats spreads slow phases of a shared machine over every strategy instead of
    penalising whichever ran during them.
    """
    from benchmarks.launch import JobFailed, run_job
    from benchmarks.report import compare, median_run, summarize

    cluster.set_link(netns.Link(entry["link"]))
    straggler = w.straggler_spec(args.straggler_mode, args.straggler_callback, args.ranks_per_node)
    if straggler is not None and max(straggler.ranks) >= args.ranks:
        straggler = None
    entry["straggler"] = _straggler_info(straggler)
    done: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for sc in scenarios:
            if "error" in entry["runs"].get(sc.label, {}):
                continue
            ranks = sc.ranks or args.ranks
            spec = {"ranks": ranks, "searchpath": str(w.searchpath), "overrides": run_overrides(args, w, sc, data)}
            spec["delay"] = _delay(straggler)
            tag = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"[bench] {w.name} / {sc.label}{tag}: {' '.join(sc.hydra_overrides())}", flush=True)
            started = time.perf_counter()
            try:
                with exclusive(args.lock):
                    job = run_job(
                        cluster,
                        spec,
                        work / f"{sc.label}-{repeat}",
                        next(ports),
                        args.timeout,
                        _cgroup(straggler),
                        ranks,
                    )
                done.setdefault(sc.label, []).append(summarize(sc, job))
                entry["runs"][sc.label] = median_run(done[sc.label])
                print(f"[bench]   {_progress(done[sc.label][-1])}", flush=True)
            except JobFailed as err:
                entry["runs"][sc.label] = {"label": sc.label, "strategy": sc.strategy, "error": str(err)}
                print(f"[bench]   FAILED after {time.perf_counter() - started:.0f} s: {err}", flush=True)
            entry["comparison"] = compare(w, entry["runs"])


@contextmanager
def exclusive(lock: Path | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (as ``flock -x``) for the block; nothing when ``None``.

    Per job rather than per invocation: on a shared machine each timed job then excludes the
    others' timings, while the ratios still come from runs of one invocation.
    """
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _skipped(the_plan: Plan) -> list[dict[str, str]]:
    return [{"workload": s.workload, "label": s.label, "reason": why} for s, why in the_plan.skipped]


def _straggler_info(straggler: Straggler | None) -> dict[str, Any] | None:
    if straggler is None:
        return None
    return {"ranks": list(straggler.ranks), "factor": straggler.factor, "mode": straggler.mode}


def _delay(straggler: Straggler | None) -> dict[str, Any] | None:
    if straggler is None or straggler.mode != "delay":
        return None
    return {"ranks": list(straggler.ranks), "factor": straggler.factor, "callback": straggler.callback}


def _cgroup(straggler: Straggler | None) -> Straggler | None:
    return straggler if straggler is not None and straggler.mode == "cgroup" else None


def _progress(run: dict[str, Any]) -> str:
    return (
        f"{run['samples_per_s']:.0f} samples/s, {run['epoch_s']:.1f} s/epoch, val acc {run['final_acc']:.3f}, "
        f"{sum(run['tx_bytes']) / run['ranks'] / 2**20:.1f} MiB sent between nodes per rank"
    )


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    import lightning
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": (commit.stdout.strip() or "unknown") + ("+dirty" if dirty else ""),
        "quick": args.quick,
        "ranks": args.ranks,
        "ranks_per_node": args.ranks_per_node,
        "synthetic": args.synthetic,
        "straggler_mode": args.straggler_mode,
        "host_cpus": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "cpu_busy": cpu_busy_fraction(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "argv": sys.argv[1:],
    }


def cpu_busy_fraction(seconds: float = 2.0) -> float | None:
    """Share of all cores' time spent busy over the next ``seconds`` (``/proc/stat``; None elsewhere).

    The 1-minute load average lags: right after a previous benchmark it still counts that
    benchmark's ranks. This samples what other processes are doing when the runs start.
    """

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = ticks()
        time.sleep(seconds)
        total1, idle1 = ticks()
    except OSError:
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def show_list(the_plan: Plan) -> None:
    for name, w in WORKLOADS.items():
        straggler = f", rank {w.straggler[0]} x{w.straggler[1]:g}" if w.straggler else ""
        straggler += f", node {w.slow_node[0]} x{w.slow_node[1]:g}" if w.slow_node else ""
        straggler += ", two-level" if w.two_level else ""
        own = f" {' '.join(w.overrides)}" if w.overrides else ""
        print(f"{name}: {w.description} [{w.link}{straggler}] recipes/{w.recipe}/experiment/{w.experiment}.yaml{own}")
        for sc in (s for s in SCENARIOS if s.workload == name):
            status = "ready" if sc in the_plan.runs.get(name, []) else "skipped (not registered)"
            print(f"    {sc.label:<16} {' '.join(sc.hydra_overrides()):<60} {status}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cleanup:
        removed = netns.cleanup(stale_only=not args.all) + remove_stale_cgroups()
        print(f"benchmarks: removed {', '.join(removed) if removed else 'nothing'}")
        return 0
    if args.report is not None:
        publish.write_outputs(json.loads(args.report.read_text()), args.out, args.update_readme)
        return 0
    the_plan = plan(available_strategies(REPO / "conf"), args.workloads, args.strategies, args.reference)
    if args.list:
        show_list(the_plan)
        return 0
    for sc, why in the_plan.skipped:
        print(f"[bench] skipping {sc.workload} / {sc.label}: {why}", flush=True)
    if not the_plan.runs:
        print("benchmarks: nothing to run (no selected scenario has a registered strategy)")
        return 1
    problem = (
        layout_problem(args, the_plan)
        or netns.requirements_problem()
        or publish.plotting_problem()
        or straggler_problem(args, the_plan)
    )
    if problem:
        print(f"benchmarks: {problem}", file=sys.stderr)
        return 2
    data = data_overrides(args)
    validate(args, the_plan, data)
    prepare_data(data)
    clear_leftovers()
    leftovers.exit_on_termination()  # unwinds through the finally blocks that remove ranks and namespaces
    results: dict[str, Any] = {"meta": metadata(args), "workloads": {}, "skipped": _skipped(the_plan)}
    try:
        run_plan(args, the_plan, data, results)
    finally:
        if any(e.get("runs") for e in results["workloads"].values()):  # partial results too, never the READMEs
            publish.write_outputs(results, args.out, args.update_readme and not results.get("interrupted"))
    failed = [f"{w}/{k}" for w, e in results["workloads"].items() for k, r in e["runs"].items() if "error" in r]
    print(f"[bench] wrote {args.out}" + (f"; FAILED runs: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
