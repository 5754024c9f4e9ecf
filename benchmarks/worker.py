"""One rank of a benchmark run: ``python -m benchmarks.worker <spec.json>``.

The runner starts one per rank, inside the rank's network namespace, with a torchrun-style
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's namespace address, ...); the
rank fits the run described by the spec (:func:`benchmarks.rank.run_rank`) and writes its
measurements to ``<out_dir>/rank<RANK>.json``. The spec is checked before Lightning is imported,
so a broken spec fails in a second rather than after the imports.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.straggler import load_factory


def delay_callbacks(spec: dict[str, Any]) -> list[Any]:
    """The delay-mode straggler callback of ``spec["delay"]`` (built on every rank; it slows its ``ranks``)."""
    delay = spec.get("delay")
    if not delay:
        return []
    return [load_factory(delay["callback"])(ranks=[int(r) for r in delay["ranks"]], factor=float(delay["factor"]))]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m benchmarks.worker <spec.json>")
    spec = json.loads(Path(args[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    callbacks = delay_callbacks(spec)
    from benchmarks.rank import run_rank  # Lightning, Hydra, torch: seconds of imports

    result = run_rank(spec, callbacks)
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
