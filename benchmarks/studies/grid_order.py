"""Does the grid planner order the grids as their measured step times do? (issue 17)

On an emulated cluster (one network namespace per rank, ``tc tbf`` links; :mod:`benchmarks.netns`)
every factorisation ``Pr x Pc`` of the ranks trains a workload for a few steps with the plain-torch
grid layers; each step (forward, backward, gradient reduction, SGD) is timed on every rank and the
slowest rank's median counts. Next to it: the planner's predicted communication per step, with
alpha and beta measured on the live world group first (:func:`lightning_hier.planner.measure_link`).
The prediction has no compute term, so the comparison is of orders, not of times.

Needs root. It is a timing: run it on an otherwise idle machine::

    python -m benchmarks.studies.grid_order --ranks 2 --rate 100mbit

Namespaces are named ``lhb-<tag>-*`` (default tag ``grid``) and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.netns import EmulatedCluster, Link
from lightning_hier.layers import GradientReducer, GridCommStats, GridContext, to_grid
from lightning_hier.models import mlp, small_cnn
from lightning_hier.planner import measure_link, plan_grids
from lightning_hier.topology import Topology, factorizations

WORKLOADS = {
    # (network factory, input shape, global batch)
    "mlp": (lambda: mlp((3, 32, 32), 10, hidden=(1024, 1024)), (3, 32, 32), 64),
    "cnn": (lambda: small_cnn((3, 32, 32), 10, channels=(16, 32), hidden=32), (3, 32, 32), 128),
}


def _worker(workload: str, pr: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = GridContext.from_groups(Topology(world, model=pr).build(rank), GridCommStats())
    make, shape, batch = WORKLOADS[workload]
    torch.manual_seed(0)
    ref = make()
    link = measure_link(None)
    predicted = {p.grid: p.time_s for p in plan_grids(ref, batch, world, input_shape=shape, links=link)}
    net = to_grid(ref, grid, torch.zeros(1, *shape))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    reducer = GradientReducer(net, grid)
    b = batch // grid.pc
    x, y = torch.randn(b, *shape), torch.randint(0, 10, (b,))
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        reducer.reduce()
        opt.step()
        times.append(time.perf_counter() - start)
    mine = torch.tensor([statistics.median(times[2:])])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {
        "workload": workload,
        "grid": [pr, world // pr],
        "measured_s": float(mine),
        "predicted_s": predicted[(pr, world // pr)],
        "alpha": link.alpha,
        "beta": link.beta,
    }


def _run_grid(cluster: EmulatedCluster, workload: str, pr: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR=cluster.address(0), MASTER_PORT="29517", WORLD_SIZE=str(cluster.ranks))
    env["GLOO_SOCKET_IFNAME"] = cluster.interface
    argv = [sys.executable, "-m", "benchmarks.studies.grid_order", "--worker", workload, str(pr), str(steps)]
    procs = [
        subprocess.Popen(
            [*cluster.exec_prefix(r), *argv], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True
        )
        for r in range(cluster.ranks)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"grid_order: a rank failed on {workload} Pr={pr}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every grid of every workload; print one JSON line per grid and a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tag", default="grid")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workload, pr, steps = args.worker
        print(json.dumps(_worker(workload, int(pr), int(steps))))
        return 0
    rows: list[dict[str, Any]] = []
    with EmulatedCluster(args.ranks, Link(rate=args.rate), tag=args.tag) as cluster:
        for workload in args.workloads:
            for pr, _ in factorizations(args.ranks):
                rows.append(_run_grid(cluster, workload, pr, args.steps))
                print(json.dumps(rows[-1]), flush=True)
    for workload in args.workloads:
        mine = [r for r in rows if r["workload"] == workload]
        by_pred = [tuple(r["grid"]) for r in sorted(mine, key=lambda r: r["predicted_s"])]
        by_meas = [tuple(r["grid"]) for r in sorted(mine, key=lambda r: r["measured_s"])]
        print(f"{workload}: predicted order {by_pred}, measured order {by_meas}, equal: {by_pred == by_meas}")
        for r in mine:
            predicted, measured = float(r["predicted_s"]) * 1e3, float(r["measured_s"]) * 1e3
            print(f"  {r['grid']}: predicted comm {predicted:.2f} ms, measured step {measured:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
