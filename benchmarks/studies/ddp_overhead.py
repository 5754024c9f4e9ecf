"""Where DDP's time goes on a compute-bound CNN: per-step wall and CPU time of DDP's variants.

Two ranks, gloo over loopback (the benchmark's ``unlimited`` link), each process pinned to its own
core with one intra-op thread, as a benchmark rank is. Pure torch (no Lightning), the workload's
model and batch on random data, SGD with Nesterov momentum. Every variant runs in the same two
processes, interleaved step by step (a step of each in turn, each step starting at a barrier), so
that the machine's load falls on all of them alike:

- ``local``: no communication (the benchmark's ``no-comm``);
- ``allreduce``: local steps, then one blocking all-reduce of the flattened gradients (what the
  gradient reduction costs when nothing hides it);
- ``ddp``: ``DistributedDataParallel`` as Lightning builds it (25 MiB buckets, buffers broadcast);
- ``ddp-nobuf``: ``broadcast_buffers=False``;
- ``ddp-noop``: DDP with a communication hook that sends nothing (DDP's bookkeeping and the
  buffers' broadcast); ``ddp-noop-nobuf``: nor the buffers;
- ``ddp-1bucket``: one bucket (``bucket_cap_mb`` large, so the reduction starts after the backward).

For each variant it prints the median per step of: wall time; the main thread's time on a CPU,
runnable but waiting for its core (other processes had it), and asleep (blocked: waiting for the
peer or gloo's thread), from ``/proc/thread-self/schedstat``; the process's CPU time (all threads);
the slower rank's wall time per step (``paced``: what a step that synchronises at its end takes);
and the simulator's jitter estimate of that pace from each rank's own spread
(:mod:`lightning_hier.simulator.jitter`). Run
from the repository root::

    python -m benchmarks.studies.ddp_overhead --model cnn --steps 20
"""

import argparse
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean, stdev
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.schedstat import thread_schedstat
from lightning_hier.models import mlp, small_cnn
from lightning_hier.simulator.jitter import expected_max_normal, gini_sigma

COLUMNS = ("wall", "run", "queued", "asleep", "process")
VARIANTS = ("local", "allreduce", "ddp", "ddp-nobuf", "ddp-noop", "ddp-noop-nobuf", "ddp-1bucket")


def _model(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """The benchmark workload's network, one sample's shape and the per-rank batch."""
    if name == "cnn":
        return small_cnn((3, 32, 32), 10), (3, 32, 32), 128
    return mlp((3, 32, 32), 10, hidden=(1024, 1024, 1024)), (3, 32, 32), 512


# no `from __future__ import annotations` here: DDP checks the hook's annotation is the class itself
def _noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _wrap(variant: str, net: nn.Module) -> nn.Module:
    if not variant.startswith("ddp"):
        return net
    ddp = DistributedDataParallel(
        net,
        broadcast_buffers="nobuf" not in variant,
        bucket_cap_mb=10_000 if variant == "ddp-1bucket" else 25,
    )
    if variant.startswith("ddp-noop"):
        ddp.register_comm_hook(None, _noop_hook)
    return ddp


def _reduce_after(variant: str, net: nn.Module) -> Callable[[], None]:
    if variant != "allreduce":
        return lambda: None

    def reduce() -> None:
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)

    return reduce


@dataclass
class _Run:
    """One variant's model, optimizer and batch, stepped in turn with the others'."""

    model: nn.Module
    reduce: Callable[[], None]
    optimizer: torch.optim.Optimizer
    x: Tensor
    y: Tensor
    rows: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def build(cls, variant: str, base: nn.Module, shape: tuple[int, ...], batch: int) -> "_Run":
        net = copy.deepcopy(base)
        g = torch.Generator().manual_seed(dist.get_rank())
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return cls(_wrap(variant, net), _reduce_after(variant, net), optimizer, x, y)

    def step(self, record: bool) -> None:
        dist.barrier()  # every variant's step starts with both ranks ready
        w0, (r0, q0), p0 = time.perf_counter(), thread_schedstat(), time.process_time()
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.reduce()
        self.optimizer.step()
        wall, (r1, q1), proc = time.perf_counter() - w0, thread_schedstat(), time.process_time() - p0
        if record:
            run, queued = r1 - r0, q1 - q0
            self.rows.append(
                {"wall": wall, "run": run, "queued": queued, "asleep": wall - run - queued, "process": proc}
            )


def _rank(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # type: ignore[operator]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    base, shape, batch = _model(args.model)
    runs = {v: _Run.build(v, base, shape, batch) for v in args.variants}
    for i in range(args.steps + 3):  # 3 warm-up steps (allocators, DDP's bucket rebuild at step 2)
        for run in runs.values():  # interleaved step by step: the machine's load falls on all alike
            run.step(record=i >= 3)
    results[rank] = {v: run.rows for v, run in runs.items()}
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.ddp_overhead", description=__doc__)
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--port", type=int, default=29671)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_rank, args=(args, args.port, results), nprocs=2, start_method="spawn")
    print(f"{args.model}: mean per step over {args.steps} steps (ms), rank 0 | rank 1; variants interleaved by step")
    print(f"load average before: {load}, after: {os.getloadavg()}")
    print("main thread: run (on a CPU), queued (runnable, waiting for its core), asleep (blocked); process: CPU;")
    print("paced: the mean over steps of the slower rank's wall time (what a step synchronised at its end takes)")
    print("jitter: mean + gini_sigma(each rank's wall times) / sqrt(pi), the simulator's pace from one rank's spread")
    print(
        f"{'variant':15s}" + "".join(f"{key:>16s}" for key in (*COLUMNS, "wall std")) + f"{'paced':>8s}{'jitter':>8s}"
    )
    for variant in args.variants:
        rows = [results[rank][variant] for rank in (0, 1)]
        cells = [
            f"{mean(r[key] for r in rows[0]) * 1e3:7.1f} |{mean(r[key] for r in rows[1]) * 1e3:6.1f}" for key in COLUMNS
        ]
        cells.append(f"{stdev(r['wall'] for r in rows[0]) * 1e3:7.1f} |{stdev(r['wall'] for r in rows[1]) * 1e3:6.1f}")
        paced = mean(max(a["wall"], b["wall"]) for a, b in zip(*rows, strict=True)) * 1e3
        walls = [[r["wall"] for r in rank_rows] for rank_rows in rows]
        jitter = mean(mean(w) + gini_sigma(w) * expected_max_normal(2) for w in walls) * 1e3
        print(f"{variant:15s}" + "".join(f"{c:>16s}" for c in cells) + f"{paced:8.1f}{jitter:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
