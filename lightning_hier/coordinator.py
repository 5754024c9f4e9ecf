"""The coordination store of a fault-tolerant run whose replicas are separate jobs (torchrun).

Under the fork / spawn launcher a process the launcher starts hosts the replicas' store. When each
replica is its own job, started and restarted by torchrun (``--max-restarts``), the store must
outlive every replica: this process hosts it, for one run, and ends once the replicas have
finished training (``finished`` written by the last round) and ``--linger-s`` has passed (a
replica restarted in between learns there that it has nothing left to do)::

    python -m lightning_hier.coordinator --host 10.0.0.1 --port 29600 &
    torchrun --standalone --nproc-per-node=1 --max-restarts=3 train.py ...  # each replica, with
    #   fault_tolerance=FaultTolerance(coordinator="10.0.0.1:29600", replica=i, replicas=n)

It holds heartbeat counters, arrivals, decisions and votes of
:mod:`lightning_hier.comm.membership` (a few bytes a round); no model state goes through it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_hier.comm.membership import RUN_PREFIX
from lightning_hier.comm.rendezvous import host_store

POLL_S = 0.5


def serve(host: str, port: int, linger_s: float = 10.0, timeout_s: float = 600.0) -> None:
    """Host the store on ``host:port`` (``port`` 0: a free one) until the run finishes, then ``linger_s`` more.

    Prints ``lightning_hier coordinator: listening on HOST:PORT`` once the store accepts clients.
    """
    try:
        store, bound = host_store(host, port, timedelta(seconds=timeout_s))
    except OSError as err:
        raise SystemExit(f"lightning_hier coordinator: cannot listen on {host}:{port}: {err.strerror}") from err
    run = dist.PrefixStore(RUN_PREFIX, store)
    print(f"lightning_hier coordinator: listening on {host}:{bound}", flush=True)
    while not run.check(["finished"]):
        time.sleep(POLL_S)
    print(f"lightning_hier coordinator: training finished; ending in {linger_s:g} s", flush=True)
    time.sleep(linger_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hier.coordinator",
        description="Host the coordination store of one fault-tolerant run whose replicas are separate jobs.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on, the one the replicas connect to (default 127.0.0.1: one machine; "
        "use the node's address, or 0.0.0.0, when replicas run on other nodes)",
    )
    parser.add_argument("--port", type=int, default=29600, help="port (default 29600; 0: a free one, printed)")
    parser.add_argument(
        "--linger-s",
        type=float,
        default=10.0,
        help="seconds to stay up after training finished (default 10)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"argument --port must be in [0, 65535], got {args.port}")
    if args.linger_s < 0:
        parser.error(f"argument --linger-s must be >= 0, got {args.linger_s}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        serve(args.host, args.port, args.linger_s)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
