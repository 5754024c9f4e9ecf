"""Throughput against worker count for every strategy, each with its best arguments, and a recommendation.

The rows are this library's strategies and torch's DDP hooks (PostLocalSGD, PowerSGD, fp16), so a
recommendation can name a peer. Each family's arguments are searched over a small grid (window,
tau, pipeline stages, the planner's grid); :func:`tune` keeps the *smallest* period whose
throughput is within ``tolerance`` of the family's best, since a longer period or window only adds
staleness once communication is hidden. :func:`recommend` prefers a synchronous strategy
(staleness 0) unless another one is more than ``tolerance`` faster, and among those DDP's exact
gradients over fp16's and PowerSGD's compressed ones.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_hier.planner.cost import Layer
from lightning_hier.simulator.inputs import Cluster, Workload
from lightning_hier.simulator.prediction import Prediction
from lightning_hier.simulator.registry import predict

CANDIDATES: dict[str, list[dict[str, Any]]] = {
    "ddp": [{}],
    "dbs": [{}],
    "hpsgd": [{"window": h} for h in (1, 2, 4, 8, 16, 32, 64)],
    "diloco": [{"window": h} for h in (8, 16, 32, 64, 128)],
    "localsgd": [{"tau": t} for t in (2, 4, 8, 16, 32, 64)],
    "easgd": [{"tau": t} for t in (2, 4, 8, 16, 32, 64)],
    "lsgd": [{"tau": t} for t in (2, 4, 8, 16, 32, 64)],
    "mgrawa": [{"tau": t} for t in (4, 8, 16, 32, 64)],
    "lgrawa": [{"tau": t} for t in (4, 8, 16, 32, 64)],
    "decoupled": [{"pipe": k} for k in (2, 4, 8)],
    "grid2d": [{}],
    "asgd": [{}],
    "softsync": [{"n": n} for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)],
    "dbs_async": [{}],
    "mgrawa-async": [{"tau": t, "rounds": "async"} for t in (4, 8, 16, 32, 64)],
    "lgrawa-async": [{"tau": t, "rounds": "async"} for t in (4, 8, 16, 32, 64)],
    "asgd-shared": [{"sampler": "shared"}],
    "dbs_async-shared": [{"sampler": "shared"}],
    "mgrawa-async-shared": [{"tau": t, "rounds": "async", "sampler": "shared"} for t in (4, 8, 16, 32, 64)],
    "ddp_post_local_sgd": [{"model_averaging_period": t} for t in (2, 4, 8, 16, 32, 64)],
    "ddp_powersgd": [{"powersgd_rank": r} for r in (8, 4, 2, 1)],
    "ddp_fp16": [{}],
    "torchft_local_sgd": [{"sync_every": t} for t in (2, 4, 8, 16, 32, 64)],
    "torchft_diloco": [{"sync_every": h} for h in (8, 16, 32, 64, 128)],
}
"""Arguments searched per row (the period, window or softsync's ``n`` in increasing order; PowerSGD's rank
in decreasing order: the least compression within the tolerance is kept)."""
ROW_MODEL = {
    "mgrawa-async": "mgrawa",
    "lgrawa-async": "lgrawa",
    "asgd-shared": "asgd",
    "dbs_async-shared": "dbs_async",
    "mgrawa-async-shared": "mgrawa",
}
"""Rows that are another model with other arguments (GRAWA's asynchronous rounds, the shared queue)."""
ROWS = tuple(CANDIDATES)


def _feasible(
    strategy: str, args: dict[str, Any], workload: Workload, cluster: Cluster, layers: Sequence[Layer]
) -> bool:
    if strategy == "decoupled":
        pipe = int(args["pipe"])
        return bool(workload.blocks) and pipe <= len(workload.blocks) and cluster.workers % pipe == 0
    if strategy == "grid2d":
        return bool(layers)
    if strategy == "softsync":
        return int(args["n"]) <= cluster.workers
    if strategy == "ddp_powersgd":
        return bool(workload.tensor_shapes)
    return True


def tune(
    strategy: str, workload: Workload, cluster: Cluster, layers: Sequence[Layer] = (), tolerance: float = 0.05
) -> Prediction | None:
    """The row's smallest-period prediction within ``tolerance`` of its best throughput (None: infeasible)."""
    found: list[Prediction] = []
    model = ROW_MODEL.get(strategy, strategy)
    for args in CANDIDATES[strategy]:
        if not _feasible(model, args, workload, cluster, layers):
            continue
        extra: dict[str, Any] = {"layers": layers} if model == "grid2d" else {}
        try:
            found.append(predict(model, workload, cluster, **args, **extra))
        except ValueError:
            continue  # e.g. no grid satisfies the planner's constraints
    if not found:
        return None
    best = max(p.samples_per_s for p in found)
    return next(p for p in found if p.samples_per_s >= (1 - tolerance) * best)


def sweep(
    strategies: Sequence[str],
    workload: Workload,
    cluster: Cluster,
    workers: Sequence[int],
    speeds: Any = None,
    layers: Sequence[Layer] = (),
) -> dict[int, dict[str, Prediction]]:
    """``{W: {strategy: tuned prediction}}``; ``speeds(W)`` gives the speeds of ``W`` workers (None: equal)."""
    out: dict[int, dict[str, Prediction]] = {}
    for w in workers:
        c = replace(cluster, workers=w, speeds=tuple(speeds(w)) if speeds is not None else ())
        row = {s: p for s in strategies if (p := tune(s, workload, c, layers)) is not None}
        out[w] = row
    return out


COMPRESSED = ("ddp_fp16", "ddp_powersgd")
"""Synchronous, but their gradients are rounded or low-rank: picked after the exact ones."""


def recommend(row: dict[str, Prediction], tolerance: float = 0.05) -> Prediction:
    """The fastest strategy, or a synchronous one within ``tolerance`` of it (exact gradients first)."""
    best = max(row.values(), key=lambda p: p.samples_per_s)
    synchronous = [p for p in row.values() if p.staleness == 0 and p.strategy != "no-comm"]
    fast_sync = [p for p in synchronous if p.samples_per_s >= (1 - tolerance) * best.samples_per_s]
    exact = [p for p in fast_sync if p.strategy not in COMPRESSED]
    return max(exact or fast_sync, key=lambda p: p.samples_per_s) if fast_sync else best


def crossover(results: dict[int, dict[str, Prediction]], strategy: str, baseline: str = "ddp") -> int | None:
    """The smallest worker count from which ``strategy`` stays faster than ``baseline`` (None: never)."""
    counts = sorted(results)
    for i, w in enumerate(counts):
        if all(
            strategy in results[v]
            and baseline in results[v]
            and results[v][strategy].samples_per_s > results[v][baseline].samples_per_s
            for v in counts[i:]
        ):
            return w
    return None


def _crossing_text(count: int | None, smallest: int) -> str:
    if count is None:
        return "never"
    return f"<= {count}" if count == smallest else str(count)  # already faster at the smallest count swept


def _args_text(p: Prediction) -> str:
    keys = ("window", "tau", "pipe", "grid", "n", "rounds", "sampler", "model_averaging_period", "powersgd_rank")
    short = {"model_averaging_period": "period", "powersgd_rank": "rank"}
    shown = {short.get(k, k): v for k, v in p.args.items() if k in keys and v not in ("sync", "split")}
    return ",".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in shown.items())


def format_sweep(results: dict[int, dict[str, Prediction]], title: str) -> str:
    """Markdown: samples/s per strategy (rows) and worker count (columns), tuned arguments, the pick."""
    counts = sorted(results)
    names = list(dict.fromkeys(s for row in results.values() for s in row))
    lines = [title, "", "| strategy | " + " | ".join(f"W={w}" for w in counts) + " | crosses DDP at |"]
    lines.append("|---" * (len(counts) + 2) + "|")
    for name in names:
        cells = []
        for w in counts:
            p = results[w].get(name)
            cells.append(
                "-" if p is None else f"{p.samples_per_s:,.0f}" + (f" ({_args_text(p)})" if _args_text(p) else "")
            )
        cross = "-" if name == "ddp" else _crossing_text(crossover(results, name), counts[0])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cross} |")
    picks = [recommend(results[w]) for w in counts]
    lines.append("| **recommended** | " + " | ".join(f"{p.strategy} {_args_text(p)}".strip() for p in picks) + " | |")
    return "\n".join(lines)


def format_detail(row: dict[str, Prediction], workers: int) -> str:
    """Markdown: every number of each strategy's prediction at one worker count."""
    lines = [
        f"At W={workers}:",
        "",
        "| strategy | arguments | samples/s | step ms | epoch s | blocked ms/step | MB/step/worker | staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(row.values(), key=lambda p: -p.samples_per_s):
        lines.append(
            f"| {p.strategy} | {_args_text(p) or '-'} | {p.samples_per_s:,.0f} | {1e3 * p.step_s:.1f} | "
            f"{p.epoch_s:.1f} | {1e3 * p.blocked_s:.1f} | {p.wire_bytes / 1e6:.2f} | {p.staleness:g} |"
        )
    return "\n".join(lines)


def plot_sweep(results: dict[int, dict[str, Prediction]], title: str, path: str) -> None:
    """Predicted samples/s against workers (log-log), one line per strategy (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(results)
    names = list(dict.fromkeys(s for row in results.values() for s in row))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        xs = [w for w in counts if name in results[w]]
        ax.plot(xs, [results[w][name].samples_per_s for w in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted samples/s")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
