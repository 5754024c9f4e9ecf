"""How gloo's messages cross the emulated link: one way, both ways at once, and as an all-reduce.

Two ranks in an :class:`~benchmarks.netns.EmulatedCluster`, one core each (as root)::

    python -m benchmarks.link_probe --link 1gbit --mb 16.8 --rounds 30

Each round first synchronises the ranks (a barrier, then ``--gap`` seconds idle, as between a
training step's messages) and times one transfer of ``--mb`` megabytes:

- ``one way``: rank 0 sends, rank 1 receives (point-to-point);
- ``both ways``: each rank sends to the other and receives from it at once, as the two messages
  of a pipeline boundary (activations forward, their gradients back) can cross;
- ``two conns``: the same on two process groups, one TCP connection per direction (as the
  decoupled pipeline sends them);
- ``all-reduce``: a gloo all-reduce of the same size (each rank sends and receives it once).

It prints every round's milliseconds, the median, and the share of ``both ways`` rounds slower
than 1.5 times the one-way median, i.e. rounds in which the two directions went one after the
other instead of side by side (docs/lightning.md, section 10, reports what this measured).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from statistics import median
from typing import Any

from benchmarks import netns
from benchmarks.launch import end_ranks, pinned_cores, rank_env

MODES = ("one way", "both ways", "two conns", "all-reduce")
SERIALISED = 1.5  # a crossing slower than this many one-way medians went one direction after the other


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.link_probe", description=__doc__.split("\n")[0])
    p.add_argument("--link", default="1gbit", help="tc rate of both nodes' links, e.g. 100mbit, 1gbit, unlimited")
    p.add_argument("--mb", type=float, default=8.0, help="megabytes per transfer (default 8)")
    p.add_argument("--rounds", type=int, default=20, help="timed transfers per mode (default 20)")
    p.add_argument("--gap", type=float, default=0.05, help="idle seconds before each transfer (default 0.05)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank, started by the probe
    args = p.parse_args(argv)
    if not args.mb > 0 or args.rounds < 1 or args.gap < 0:
        p.error(f"--mb must be > 0, --rounds >= 1 and --gap >= 0, got {args.mb}, {args.rounds}, {args.gap}")
    try:
        netns.parse_rate(args.link)
    except ValueError as err:
        p.error(f"--link: {err}")
    return args


def _transfers(rank: int, words: int) -> dict[str, Callable[[], None]]:
    import torch
    import torch.distributed as dist

    out, into = torch.ones(words), torch.empty(words)
    back = dist.new_group([0, 1])  # a second connection: rank 1 sends to rank 0 on it

    def one_way() -> None:
        _wait(dist.isend(out, 1) if rank == 0 else dist.irecv(into, 0))

    def both_ways() -> None:
        for work in (dist.isend(out, 1 - rank), dist.irecv(into, 1 - rank)):
            _wait(work)

    def two_conns() -> None:
        send = dist.isend(out, 1, group=None) if rank == 0 else dist.isend(out, 0, group=back)
        recv = dist.irecv(into, 1, group=back) if rank == 0 else dist.irecv(into, 0, group=None)
        for work in (send, recv):
            _wait(work)

    transfers = (one_way, both_ways, two_conns, lambda: dist.all_reduce(into))
    return dict(zip(MODES, transfers, strict=True))


def _wait(work: Any) -> None:
    if work is not None:  # None only for ranks outside the group, which these two never are
        work.wait()


def worker(args: argparse.Namespace) -> None:
    """One rank: time every mode's rounds; rank 0 prints them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    times: dict[str, list[float]] = {}
    for mode, transfer in _transfers(rank, int(args.mb * 1e6 / 4)).items():
        transfer()  # warm-up: connects the pair
        times[mode] = []
        for _ in range(args.rounds):
            dist.barrier()
            time.sleep(args.gap)
            start = time.perf_counter()
            transfer()
            dist.barrier()  # ends when both ranks have their message
            times[mode].append(time.perf_counter() - start)
    if rank == 0:
        print(report(times, args.mb), flush=True)
    dist.destroy_process_group()


def report(times: dict[str, list[float]], mb: float) -> str:
    """Every mode's rounds (ms), median and megabits per second; the share of serialised crossings."""
    lines = []
    for mode, ts in times.items():
        m = median(ts)
        rounds = " ".join(f"{1000 * t:.0f}" for t in ts)
        lines.append(f"{mode:>10}: median {1000 * m:7.1f} ms ({8 * mb / m:6.0f} Mbit/s each way); rounds: {rounds}")
    if "one way" in times and "both ways" in times:
        slow = SERIALISED * median(times["one way"])
        serial = sum(t > slow for t in times["both ways"])
        lines.append(
            f"both ways slower than {SERIALISED} x the one-way median (the directions took turns): "
            f"{serial} of {len(times['both ways'])} rounds"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    problem = netns.requirements_problem()
    if problem:
        print(f"link_probe: the emulated cluster is unavailable: {problem}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "benchmarks.link_probe", "--worker", "--mb", str(args.mb)]
    command += ["--rounds", str(args.rounds), "--gap", str(args.gap), "--link", args.link]
    with netns.EmulatedCluster(2, netns.Link(args.link), tag=f"probe{os.getpid()}") as cluster:
        procs = [
            subprocess.Popen(
                [*cluster.exec_prefix(r), "taskset", "-c", str(core), *command],
                env=rank_env(cluster, r, port=29_531, run_id=f"probe{os.getpid()}"),
                start_new_session=True,  # its own process group: end_ranks kills what it started
            )
            for r, core in enumerate(pinned_cores(2))
        ]
        try:
            # a finite limit: a rank that hangs must not keep the namespaces alive
            codes = [p.wait(timeout=120 + len(MODES) * args.rounds * (args.gap + 30)) for p in procs]
        finally:
            end_ranks(procs)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
