"""Every generated block of the repository's pages, and every generated file, from the committed results.

A generated block is the text between ``<!-- bench:<name>:start -->`` and ``<!-- bench:<name>:end -->``
in a README, a recipe's README or a page of ``docs/``. :func:`pages` builds all of them in memory
from the result sets under ``benchmarks/results/`` (one per workload and study) and names the
file each one comes from; ``python -m benchmarks.publish`` writes them, or with ``--check`` says
which differ from what is committed (``tests/benchmarks/test_publish.py``).

Which block comes from which result set (under ``benchmarks/results/``):

- ``results.json`` (the benchmark: every strategy against DDP): the README's ``headline`` and one
  block per family, ``benchmarks/README.md``'s ``results``, each recipe's ``results``;
- ``two_level/results.json``: ``recipes/two_level/README.md``'s ``results``, the README's ``two-level``;
- ``simulator/*.json`` (runs measured beside the simulator's prediction): ``simulator-accuracy`` in
  ``docs/guide/simulator.md`` and the README, and the file ``simulator/tally.md``;
- ``dbs_async/*.json`` (DBS-SGD's asynchronous form): ``recipes/dbs/README.md``'s ``dbs-async``;
- ``grawa_flatness/{digits,cifar10}.json``: ``recipes/grawa/README.md``'s ``grawa-flatness-digits``
  and ``grawa-flatness-cifar10``;
- ``decoupled/*.json`` (the pipeline against one process; the cut): ``recipes/decoupled/README.md``'s
  ``decoupled-speedup`` and ``decoupled-layer-cut``;
- the simulator's presets (predictions, not measurements): ``recipes/README.md``'s
  ``scaling-<model>-<link>`` and their plots.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import MiB, meta_line, replace_between, targets_table
from benchmarks.scenarios import BASELINE, NO_COMM, ONE_PROCESS, REPO, SCENARIOS, WORKLOADS

RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
BENCH_README = REPO / "benchmarks" / "README.md"
RECIPES = REPO / "recipes"
SIMULATOR_PAGE = REPO / "docs" / "guide" / "simulator.md"
RECIPE_NAMES = ("hpsgd", "grawa", "dbs", "decoupled", "grid2d")  # recipes shown by the benchmark's results.json
TOLERANCE = 0.15  # the simulator's accuracy: a prediction within 15 % of the measurement counts as a hit

# The README's table "which strategy, measured": one run per kind of cluster, its workload and file.
HEADLINES: tuple[tuple[str, str, str, str], ...] = (
    ("results.json", "hpsgd_mlp_100mbit", "hpsgd-auto", "slow link (100 Mbit/s), 21 MB model"),
    ("results.json", "hpsgd_mlp", "hpsgd-d1", "1 Gbit/s, all-reduce as long as a step's compute"),
    ("results.json", "hpsgd_cnn", "hpsgd-auto", "1 Gbit/s, compute-bound"),
    ("results.json", "hpsgd_cnn_10mbit", "hpsgd-d2", "very slow link (10 Mbit/s), compute-bound CNN"),
    ("results.json", "grawa_cnn", "mgrawa", "1 Gbit/s, fewest bytes"),
    ("results.json", "dbs_straggler", "dbs", "one rank 2x slower"),
    ("two_level/results.json", "two_level_dbs", "dbs_hpsgd", "slow node and slow link between nodes"),
    ("two_level/results.json", "two_level_mlp", "hpsgd-2level", "2 nodes x 2 ranks, 100 Mbit/s between nodes"),
)
# The README's family tables: (block, [(result set, workload, runs or None for all)]).
FAMILIES: tuple[tuple[str, tuple[tuple[str, str, tuple[str, ...] | None], ...]], ...] = (
    (
        "hpsgd",
        (
            (
                "results.json",
                "hpsgd_mlp_100mbit",
                (
                    "ddp",
                    "hpsgd",
                    "diloco-w16-int4",
                    "localsgd",
                    "ddp+postlocalsgd",
                    "ddp+powersgd",
                    "ddp+fp16",
                    "torchft-localsgd",
                    "torchft-diloco-w16",
                ),
            ),
            (
                "results.json",
                "hpsgd_mlp",
                ("ddp", "hpsgd", "hpsgd-d1", "localsgd", "ddp+postlocalsgd", "ddp+powersgd"),
            ),
            (
                "results.json",
                "hpsgd_cnn",
                ("ddp", "hpsgd", "hpsgd-auto", "hpsgd-d1", "ddp+postlocalsgd", "ddp+powersgd", "ddp+fp16"),
            ),
        ),
    ),
    ("dbs", (("results.json", "dbs_straggler", None),)),
    ("decoupled", (("results.json", "decoupled_cnn", None),)),
    ("averaging", (("results.json", "grawa_cnn", None),)),
    ("grid2d", (("results.json", "grid2d_mlp", None),)),
    (
        "two-level",
        (("two_level/results.json", "two_level_mlp", None), ("two_level/results.json", "two_level_dbs", None)),
    ),
)
SCALING = (("cnn", "1gbit"), ("cnn", "10gbit"), ("mlp", "1gbit"), ("mlp", "10gbit"))
SCALING_WORKERS = ("2", "4", "8", "16", "32", "64", "128", "256", "512", "1024")


@dataclass
class Pages:
    """The new text of every page with a generated block, every generated file, and the plots to draw."""

    text: dict[Path, str] = field(default_factory=dict)
    plots: list[tuple[Callable[[], object], Path]] = field(default_factory=list)

    def block(self, path: Path, name: str, content: str) -> None:
        """Set the block ``name`` of the page at ``path`` (markers ``<!-- bench:<name>:start/end -->``)."""
        current = self.text[path] if path in self.text else path.read_text()
        self.text[path] = replace_between(current, name, content)

    def file(self, path: Path, content: str) -> None:
        """A whole generated file."""
        self.text[path] = content

    def plot(self, draw: Callable[[], object], path: Path) -> None:
        self.plots.append((draw, path))

    def differences(self) -> list[Path]:
        """The pages and files whose committed text differs from the generated one."""
        return [p for p, t in self.text.items() if not p.is_file() or p.read_text() != t]

    def write(self, plots: bool = True) -> list[Path]:
        """Write what differs (and, with ``plots``, draw every plot); returns the paths written."""
        written = []
        for path in self.differences():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.text[path])
            written.append(path)
        if plots:
            for draw, path in self.plots:
                draw()
                written.append(path)
        return written


def rel(path: Path) -> str:
    """A path as the pages write it: relative to the repository root."""
    return path.relative_to(REPO).as_posix()


def source(*paths: Path, what: str = "") -> str:
    """The line under a generated block that names the files its numbers come from."""
    names = ", ".join(f"`{rel(p)}`" for p in paths)
    return f"_Source: {names}{what}; regenerate with `python -m benchmarks.publish`._"


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


# --- the benchmark's results.json ---------------------------------------------------------------


def target_checks(results: dict[str, Any], workloads: list[str] | None = None) -> list[dict[str, Any]]:
    """Every scenario target: met, missed (by how much, where the time went) or pending."""
    from benchmarks.report import check_target, diagnosis

    checks = []
    for sc in SCENARIOS:
        if workloads is not None and sc.workload not in workloads:
            continue
        for target in sc.targets:
            result = results["workloads"].get(sc.workload)
            check = check_target(sc, target, result)
            if check["status"] == "missed" and result is not None:
                check["note"] += f"; {diagnosis(result, sc.label)}"
            checks.append(check)
    return checks


def render(results: dict[str, Any], plot_dir: Path, base: Path, workloads: list[str] | None = None) -> str:
    """Markdown of the results; plot links relative to ``base`` (the folder of the file it goes into)."""
    from benchmarks.report import workload_section

    meta = results["meta"]
    done = {w: e for w, e in results["workloads"].items() if "comparison" in e}  # at least one run finished
    names = [w for w in done if workloads is None or w in workloads]
    parts = [meta_line(meta), ""]
    if results.get("interrupted"):
        parts += ["**Interrupted: partial results.**", ""]
    checks = target_checks(results, workloads)
    if checks:
        parts += ["Targets (ratios against DDP or a peer in the same invocation):", "", targets_table(checks), ""]
    for name in names:
        plot = plot_dir / f"{name}.png"
        link = os.path.relpath(plot, base) if plot.is_file() or has_plot(results["workloads"][name]) else None
        parts += [workload_section(WORKLOADS[name], results["workloads"][name], meta, link), ""]
    skipped = [s for s in results.get("skipped", []) if workloads is None or s["workload"] in workloads]
    if skipped:
        parts.append("Not run: " + "; ".join(f"{s['workload']} / {s['label']} ({s['reason']})" for s in skipped) + ".")
    return "\n".join(parts).strip() + "\n"


def has_plot(result: dict[str, Any]) -> bool:
    """Whether a workload's plot is drawn: it has a comparison and at least one run that did not fail."""
    return "comparison" in result and any("error" not in r for r in result["runs"].values())


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def compact_table(entries: list[tuple[str, dict[str, Any], tuple[str, ...] | None]]) -> str:
    """One line per run of each ``(workload, result, runs)``: the ratios a user compares."""
    from benchmarks.report import _args

    lines = [
        "| workload | run | arguments | samples/s x DDP | time to target (x DDP) | acc at equal time "
        "| final acc | MB/epoch/rank (x DDP) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result, labels in entries:
        workload = WORKLOADS[name]
        comp, runs = result["comparison"], result["runs"]
        base = comp["rows"].get(BASELINE, {}).get("time_to_target_s")
        first = True
        for label in labels or list(runs):
            run, row = runs.get(label), comp["rows"].get(label)
            if run is None or row is None or label in (NO_COMM, ONE_PROCESS):
                continue
            ttt = row["time_to_target_s"]
            ratio = f" ({ttt / base:.2f})" if ttt is not None and base else ""
            tt = f"{ttt:.0f} s{ratio}" if ttt is not None else "not reached"
            where = f"`{name}` ({workload.target_acc:.0%})" if first else ""
            first = False
            lines.append(
                f"| {where} | {label} | {_args(run)} | {_f(row['samples_per_s_ratio'], '.2f')} | {tt} "
                f"| {_f(row['acc_at_equal_time'], '.3f')} | {_f(run['final_acc'], '.3f')} "
                f"| {_f(run['bytes_per_epoch'] / MiB, '.1f')} ({_f(row['bytes_per_epoch_ratio'], '.3f')}) |"
            )
    return "\n".join(lines)


def _dates(results: dict[str, Any], workloads: list[str]) -> str:
    dates = sorted({str(results["workloads"][w].get("meta", results["meta"])["date"])[:10] for w in workloads})
    return ", measured " + " and ".join(dates)


def headline_table(sets: dict[str, dict[str, Any]]) -> str:
    """The README's "which strategy, measured": one run per kind of cluster, against DDP."""
    from benchmarks.report import _args

    lines = [
        "| cluster | workload | strategy | samples/s x DDP | time to target x DDP | final acc (DDP's) |",
        "|---|---|---|---|---|---|",
    ]
    for name, workload, label, cluster in HEADLINES:
        result = sets[name]["workloads"][workload]
        run, row = result["runs"][label], result["comparison"]["rows"][label]
        base = result["comparison"]["rows"][BASELINE]["time_to_target_s"]
        ttt = row["time_to_target_s"]
        ratio = f"{ttt / base:.2f}" if ttt is not None and base else "not reached" if ttt is None else "-"
        strategy = f"`{run.get('strategy', label)}` {_args(run)}".replace(" defaults", "")
        lines.append(
            f"| {cluster} | `{workload}` | {strategy} | {_f(row['samples_per_s_ratio'], '.2f')} | {ratio} "
            f"| {_f(run['final_acc'], '.3f')} ({_f(result['runs'][BASELINE]['final_acc'], '.3f')}) |"
        )
    return "\n".join(lines)


def benchmark_blocks(pages: Pages, results: dict[str, Any], plot_dir: Path) -> None:
    """The blocks that show ``results.json`` whole: the benchmarks README's and each recipe's."""
    pages.block(
        BENCH_README,
        "results",
        render(results, plot_dir, BENCH_README.parent) + "\n" + source(plot_dir / "results.json"),
    )
    for recipe in RECIPE_NAMES:
        mine = [name for name, w in WORKLOADS.items() if w.recipe == recipe and name in results["workloads"]]
        readme = RECIPES / recipe / "README.md"
        if mine and readme.is_file():
            text = render(results, plot_dir, readme.parent, mine) + "\n" + source(plot_dir / "results.json")
            pages.block(readme, "results", text)


def _plots(pages: Pages, results: dict[str, Any], folder: Path) -> None:
    from benchmarks.plots import plot_workload

    for name, result in results["workloads"].items():
        if has_plot(result):

            def draw(name: str = name, result: dict[str, Any] = result) -> object:
                return plot_workload(WORKLOADS[name], result, folder / f"{name}.png")

            pages.plot(draw, folder / f"{name}.png")


def results_md(results: dict[str, Any], folder: Path) -> str:
    return render(results, folder, folder)


# --- the studies ---------------------------------------------------------------------------------


def simulator_tally() -> tuple[str, str]:
    """The simulator's accuracy over the current measurements: (summary block, whole table)."""
    from benchmarks.tally import latest_cells, tally_table

    folder = RESULTS / "simulator"
    paths = sorted(folder.glob("*.json"))
    rows = latest_cells(paths)
    rate = sum(abs(c.rate_error) <= TOLERANCE for c in rows)
    nbytes = sum(abs(c.bytes_error) <= TOLERANCE for c in rows)
    worst = sorted(rows, key=lambda c: -abs(c.rate_error))[:3]
    worst_bytes = max(rows, key=lambda c: abs(c.bytes_error))
    links = sorted({c.link for c in rows})
    ranks = sorted({c.ranks for c in rows})
    summary = "\n".join(
        [
            f"Over the {len(rows)} measured runs of `{rel(folder)}/` ({len(paths)} invocations; "
            f"{len({c.workload for c in rows})} workloads; links {', '.join(links)}; "
            f"{' and '.join(str(r) for r in ranks)} ranks; a run measured in several invocations counted once, "
            "at its newest measurement), the prediction is within "
            f"{TOLERANCE:.0%} of the measured samples/s for **{rate} of {len(rows)}** and of the bytes per "
            f"epoch for **{nbytes} of {len(rows)}**. Largest errors in samples/s: "
            + ", ".join(
                f"{100 * c.rate_error:+.0f} % ({c.label}, `{c.workload}`, {c.link}, {c.ranks} ranks)" for c in worst
            )
            + f"; in bytes: {100 * worst_bytes.bytes_error:+.0f} % ({worst_bytes.label}, `{worst_bytes.workload}`).",
            "",
            "```bash",
            "python -m benchmarks.tally --latest benchmarks/results/simulator/*.json   # every run, one row each",
            "```",
            "",
            source(folder / "tally.md", what=" (the table of every run)"),
        ]
    )
    table = "\n".join(
        [
            "# The simulator beside every current measurement",
            "",
            "Generated by `python -m benchmarks.publish` from the files of this folder: one row per run the",
            "simulator predicts (workload, link, ranks, run), each counted once at its newest measurement",
            "(`python -m benchmarks.tally --latest benchmarks/results/simulator/*.json`). `source` is the",
            "file's name; `queued` is the share of the run, and of its calibration run, spent waiting for a core.",
            "",
            tally_table(rows, TOLERANCE),
            "",
        ]
    )
    return summary, table


def _captured(run: Callable[[], object]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run()
    return out.getvalue().strip()


def dbs_async_block() -> str:
    """DBS-SGD's asynchronous form against ASGD, n-softsync and DDP: means, counts, paired differences."""
    from benchmarks.studies._dbs_async_report import summary

    folder = RESULTS / "dbs_async"
    paths = sorted(folder.glob("*.json"))
    rows = [row for path in paths for row in json.loads(path.read_text())]
    order = list(dict.fromkeys(r["strategy"] for r in rows))
    text = _captured(lambda: summary(rows, order))
    lines = []
    for line in text.splitlines():  # the counts print as plain lines: make them a list
        lines.append(f"- {line}" if line and not line.startswith("|") else line)
    same_rule = [
        _same_rule_count(rows, dbs, base) for dbs, base in (("dbs_async", "asgd"), ("dbs_async_n2", "softsync_n2"))
    ]
    first = next((i for i, line in enumerate(lines) if line.startswith("- ")), len(lines))
    lines[first:first] = same_rule
    seeds = {w: len({r["seed"] for r in rows if r["workload"] == w}) for w in sorted({r["workload"] for r in rows})}
    what = " (" + ", ".join(f"{w}: {n} seeds" for w, n in seeds.items()) + ")"
    return "\n".join(lines) + "\n\n" + source(folder, what=what)


def _same_rule_count(rows: list[dict[str, Any]], dbs: str, base: str) -> str:
    """How often a DBS form's per-worker staleness is below the baseline with its server rule, run by run."""
    by_run: dict[tuple[Any, ...], dict[str, float]] = {(r["workload"], r["factor"], r.get("seed")): {} for r in rows}
    for r in rows:
        by_run[(r["workload"], r["factor"], r.get("seed"))][r["strategy"]] = r["staleness_worker_mean"]
    runs = [fits for fits in by_run.values() if dbs in fits and base in fits]
    lower = sum(fits[dbs] < fits[base] for fits in runs)
    return f"- {dbs}: staleness_worker_mean lower than {base} (the same server rule) in {lower} of {len(runs)} runs"


def grawa_flatness_block(name: str, target: float | None) -> str:
    from benchmarks.studies.grawa_flatness import _table

    path = RESULTS / "grawa_flatness" / f"{name}.json"
    return _table(json.loads(path.read_text()), target) + "\n\n" + source(path)


def decoupled_blocks(pages: Pages) -> None:
    """The pipeline against single-process backprop (1 Gbit/s) and the two cuts (1 Gbit/s, unlimited)."""
    from benchmarks.report import workload_table

    readme = RECIPES / "decoupled" / "README.md"
    speedup = RESULTS / "decoupled" / "speedup-1gbit.json"
    doc = json.loads(speedup.read_text())
    parts = []
    for name, result in doc["workloads"].items():
        parts += [
            f"`{name}` ({WORKLOADS[name].description}); {meta_line(result.get('meta', doc['meta']))}",
            "",
            workload_table(WORKLOADS[name], result),
            "",
        ]
    pages.block(readme, "decoupled-speedup", "\n".join(parts) + "\n" + source(speedup))
    parts = []
    files = [RESULTS / "decoupled" / f"layer-cut-{link}.json" for link in ("1gbit", "unlimited")]
    for path in files:
        doc = json.loads(path.read_text())
        ((name, result),) = doc["workloads"].items()
        parts += [
            f"{result.get('link')} links; {meta_line(doc['meta'])}",
            "",
            workload_table(WORKLOADS[name], result),
            "",
        ]
    pages.block(readme, "decoupled-layer-cut", "\n".join(parts) + "\n" + source(*files))


def scaling_block(pages: Pages, model: str, link: str) -> None:
    """The simulator's predicted samples/s from 2 to 1,024 workers, and its plot (about 12 s each).

    The same sweep as ``python -m lightning_hier.simulator predict --workload MODEL --link LINK``
    with its defaults (ring all-reduce, no stragglers, no jitter), computed once for the table and
    the plot.
    """
    from lightning_hier.simulator.__main__ import _cluster, _parser, load_workload, workload_layers
    from lightning_hier.simulator.inputs import parse_speeds
    from lightning_hier.simulator.sweep import format_sweep, plot_sweep, sweep

    plot = RECIPES / "scaling" / f"{model}_{link}.png"
    args = _parser().parse_args(["predict", "--workload", model, "--link", link, "--workers", *SCALING_WORKERS])
    workload = load_workload(args.workload)
    cluster = _cluster(args)
    results = sweep(
        args.strategies,
        workload,
        cluster,
        args.workers,
        lambda w: parse_speeds(args.stragglers, w),
        workload_layers(workload),
    )
    rate = 32 / cluster.link.beta / 1e9
    title = (
        f"{workload.name}: batch {workload.batch_size}/worker, link {rate:.3g} Gbit/s "
        f"(alpha {cluster.link.alpha:.3g} s), {cluster.algorithm} all-reduce, stragglers {args.stragglers}: "
        "predicted samples/s"
    )
    table = [line for line in format_sweep(results, title).splitlines() if line.startswith("|")]
    command = f"python -m lightning_hier.simulator predict --workload {model} --link {link} --plot {rel(plot)}"
    body = "\n".join(table) + f"\n\n_Predicted by `{command}` (the simulator's preset `{model}`)._"
    pages.block(RECIPES / "README.md", f"scaling-{model}-{link}", body)
    pages.plot(lambda: plot_sweep(results, title, str(plot)), plot)


# --- everything ----------------------------------------------------------------------------------


def pages(predictions: bool = True) -> Pages:
    """Every generated block and file from the committed results (``predictions``: also the scaling tables)."""
    out = Pages()
    main = load("results.json")
    two_level = load("two_level/results.json")
    sets = {"results.json": main, "two_level/results.json": two_level}

    benchmark_blocks(out, main, RESULTS)
    out.file(RESULTS / "results.md", results_md(main, RESULTS))
    _plots(out, main, RESULTS)

    folder = RESULTS / "two_level"
    readme = RECIPES / "two_level" / "README.md"
    out.block(readme, "results", render(two_level, folder, readme.parent) + "\n" + source(folder / "results.json"))
    out.file(folder / "results.md", results_md(two_level, folder))
    _plots(out, two_level, folder)

    out.block(
        README, "headline", headline_table(sets) + "\n\n" + source(RESULTS / "results.json", folder / "results.json")
    )
    for block, entries in FAMILIES:
        resolved = [(w, sets[s]["workloads"][w], labels) for s, w, labels in entries]
        names = sorted({s for s, _, _ in entries})
        dates = "".join(_dates(sets[s], [w for t, w, _ in entries if t == s]) for s in names)
        files = [RESULTS / s for s in names]
        out.block(README, block, compact_table(resolved) + "\n\n" + source(*files, what=dates))

    summary, table = simulator_tally()
    out.block(SIMULATOR_PAGE, "simulator-accuracy", summary)
    out.block(README, "simulator-accuracy", summary.split("\n\n")[0] + "\n\n" + source(RESULTS / "simulator"))
    out.file(RESULTS / "simulator" / "tally.md", table)

    out.block(RECIPES / "dbs" / "README.md", "dbs-async", dbs_async_block())
    grawa = RECIPES / "grawa" / "README.md"
    out.block(grawa, "grawa-flatness-digits", grawa_flatness_block("digits", None))
    out.block(grawa, "grawa-flatness-cifar10", grawa_flatness_block("cifar10", 0.35))
    decoupled_blocks(out)
    if predictions:
        for model, link in SCALING:
            scaling_block(out, model, link)
    return out
