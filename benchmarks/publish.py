"""Write results out (JSON, markdown, plots) and regenerate every generated block of the pages.

``python -m benchmarks.publish`` rewrites, from the committed results under ``benchmarks/results/``,
every generated table of the README, the recipes' READMEs, ``benchmarks/README.md`` and the docs
(the blocks between ``<!-- bench:<name>:start -->`` and ``<!-- bench:<name>:end -->``), the
generated files (``results.md``, ``simulator/tally.md``) and every plot; :mod:`benchmarks.pages`
lists which block comes from which result set. Options::

    python -m benchmarks.publish                    # write what differs, draw every plot
    python -m benchmarks.publish --check            # write nothing; exit 1 naming what differs
    python -m benchmarks.publish --no-plots         # tables only
    python -m benchmarks.publish --no-predictions   # without the simulator's scaling tables (slow: ~2 min)

A benchmark run (``python -m benchmarks.run``) writes its ``results.json`` with :func:`write_outputs`,
which also rewrites the blocks that show it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks import pages as pages_module
from benchmarks.pages import Pages, benchmark_blocks, render, target_checks
from benchmarks.scenarios import REPO, WORKLOADS

__all__ = ["carry_over", "main", "plotting_problem", "relative_paths", "render", "target_checks", "write_outputs"]

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
    """``results.json``, ``results.md`` and one PNG per workload in ``out``; optionally the pages.

    Paths in them are relative to the repository root (see :func:`relative_paths`).

    With ``update_readme`` the workloads of the previous ``results.json`` in ``out`` that this
    invocation did not touch are kept (see :func:`carry_over`), and the blocks that show the
    benchmark (README, ``benchmarks/README.md``, the recipes) are rewritten from it.
    """
    from benchmarks.plots import plot_workload

    out.mkdir(parents=True, exist_ok=True)
    results = relative_paths(results)  # paths in results.json and the tables: relative to the repository
    previous = out / "results.json"
    if update_readme and previous.is_file():
        results = carry_over(results, json.loads(previous.read_text()))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    for name, result in results["workloads"].items():
        if pages_module.has_plot(result):
            plot_workload(WORKLOADS[name], result, out / f"{name}.png")
    (out / "results.md").write_text(render(results, out, out))
    if not update_readme:
        return
    if out.resolve() == pages_module.RESULTS.resolve():  # the committed results: every page that shows them
        pages_module.pages(predictions=False).write(plots=False)
        return
    pages = Pages()
    benchmark_blocks(pages, results, out)
    pages.write(plots=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publish", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated block differs")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the plots")
    parser.add_argument(
        "--no-predictions", action="store_true", help="leave out the simulator's scaling tables (about 2 minutes)"
    )
    args = parser.parse_args(argv)
    generated = pages_module.pages(predictions=not args.no_predictions)
    if args.check:
        stale = generated.differences()
        for path in stale:
            print(f"differs from what `python -m benchmarks.publish` writes: {path.relative_to(REPO)}", file=sys.stderr)
        if not stale:
            print(f"every generated block and file is current ({len(generated.text)} files checked)")
        return 1 if stale else 0
    problem = None if args.no_plots else plotting_problem()
    if problem:
        print(f"plots not drawn: {problem}", file=sys.stderr)
    for path in generated.write(plots=not args.no_plots and problem is None):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
