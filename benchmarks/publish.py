"""Write a results document out: JSON, markdown, plots, and the README sections that show them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from benchmarks.report import check_target, diagnosis, meta_line, targets_table, update_file, workload_section
from benchmarks.scenarios import REPO, SCENARIOS, WORKLOADS

RECIPES = ("hpsgd", "grawa", "dbs", "decoupled", "grid2d", "two_level")
# an absolute path inside any text: a slash not preceded by a word, a dot, a colon or a slash (not "MB/s",
# not "./x", not "https://"), up to the next space, quote, bracket or separator
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/[^\s'\"`,;()\[\]{}<>|]+")


def plotting_problem() -> str | None:
    """Why plots cannot be drawn (matplotlib missing), or ``None``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is missing: pip install -e '.[bench]'"
    return None


def target_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every scenario target of the table: met, missed (by how much, where the time went) or pending."""
    checks = []
    for sc in SCENARIOS:
        for target in sc.targets:
            result = results["workloads"].get(sc.workload)
            check = check_target(sc, target, result)
            if check["status"] == "missed" and result is not None:
                check["note"] += f"; {diagnosis(result, sc.label)}"
            checks.append(check)
    return checks


def render(results: dict[str, Any], plot_dir: Path, base: Path, workloads: list[str] | None = None) -> str:
    """Markdown of the results; plot links relative to ``base`` (the folder of the file it goes into)."""
    meta = results["meta"]
    done = {w: e for w, e in results["workloads"].items() if "comparison" in e}  # at least one run finished
    names = [w for w in done if workloads is None or w in workloads]
    parts = [meta_line(meta), ""]
    if results.get("interrupted"):
        parts += ["**Interrupted: partial results.**", ""]
    checks = [c for c in target_checks(results) if workloads is None or c["workload"] in workloads]
    if checks:
        parts += ["Targets (ratios against DDP or a peer in the same invocation):", "", targets_table(checks), ""]
    for name in names:
        plot = plot_dir / f"{name}.png"
        link = os.path.relpath(plot, base) if plot.is_file() else None
        parts += [workload_section(WORKLOADS[name], results["workloads"][name], meta, link), ""]
    skipped = [s for s in results.get("skipped", []) if workloads is None or s["workload"] in workloads]
    if skipped:
        parts.append("Not run: " + "; ".join(f"{s['workload']} / {s['label']} ({s['reason']})" for s in skipped) + ".")
    return "\n".join(parts).strip() + "\n"


def carry_over(results: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """``results`` plus the workloads of ``previous`` that this invocation did not run (nor skip).

    So ``python -m benchmarks.run --workloads dbs_straggler`` refreshes the DBS tables and keeps
    every other workload's last measurement, each labelled with the invocation it came from.
    """
    merged = {**results, "workloads": dict(results["workloads"]), "skipped": list(results.get("skipped", []))}
    touched = set(results["workloads"]) | {s["workload"] for s in results.get("skipped", [])}
    for name, entry in previous.get("workloads", {}).items():
        if name not in touched and name in WORKLOADS:
            merged["workloads"][name] = {"meta": previous["meta"], **entry}
    merged["skipped"] += [s for s in previous.get("skipped", []) if s["workload"] not in touched]
    return merged


def relative_paths(value: Any, root: Path = REPO) -> Any:
    """``value`` (a results document) with every absolute path in its strings made relative to ``root``.

    Results are committed: the logs folder, a ``--data-root`` or an error message naming a rank's
    log would otherwise hold the directory layout of the machine that ran the benchmark.
    """
    if isinstance(value, dict):
        return {k: relative_paths(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_paths(v, root) for v in value]
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(lambda m: os.path.relpath(m.group(0), root), value)
    return value


def write_outputs(results: dict[str, Any], out: Path, update_readme: bool) -> None:
    """``results.json``, ``results.md`` and one PNG per workload in ``out``; optionally the READMEs.

    Paths in them are relative to the repository root (see :func:`relative_paths`).

    With ``update_readme`` the workloads of the previous ``results.json`` in ``out`` that this
    invocation did not touch are kept (see :func:`carry_over`).
    """
    from benchmarks.plots import plot_workload

    out.mkdir(parents=True, exist_ok=True)
    results = relative_paths(results)  # paths in results.json and the tables: relative to the repository
    previous = out / "results.json"
    if update_readme and previous.is_file():
        results = carry_over(results, json.loads(previous.read_text()))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    for name, result in results["workloads"].items():
        if "comparison" in result and any("error" not in r for r in result["runs"].values()):
            plot_workload(WORKLOADS[name], result, out / f"{name}.png")
    (out / "results.md").write_text(render(results, out, out))
    if not update_readme:
        return
    summary = [meta_line(results["meta"]), "", targets_table(target_checks(results))]
    update_file(REPO / "README.md", "summary", "\n".join(summary))
    update_file(REPO / "benchmarks" / "README.md", "results", render(results, out, REPO / "benchmarks"))
    for recipe in RECIPES:
        mine = [name for name, w in WORKLOADS.items() if w.recipe == recipe]
        readme = REPO / "recipes" / recipe / "README.md"
        if any(w in results["workloads"] for w in mine) and readme.is_file():
            update_file(readme, "results", render(results, out, readme.parent, mine))
