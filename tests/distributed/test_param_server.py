"""The parameter-server service under real gloo groups: scripted arrival order, exactly-once, faults."""

import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_hier.algorithms.param_server import PUSH, ServerCore
from lightning_hier.algorithms.ps_rules import AsgdHandler, FlatModel, SoftsyncHandler
from lightning_hier.algorithms.ps_service import connect
from lightning_hier.testing import run_workers
from lightning_hier.testing.harness import WorkerFailed
from lightning_hier.topology import Topology

W0 = [1.0, 2.0]
LR = 0.1
PUSHES = 2
# pulls of ranks 0, 1, 2, then the pushes in an order no natural arrival would give
SCRIPT = [0, 1, 2, 1, 2, 0, 2, 1, 0]
# by hand: every worker pulls version 0; then (worker, pulled version) -> staleness = version - pulled:
# w1 (v0) at v0: 0 | w2 (v0) at v1: 1 | w0 (v0) at v2: 2 | w2 (v2) at v3: 1 | w1 (v1) at v4: 3 | w0 (v3) at v5: 2
STALENESS = [(1, 0), (2, 1), (0, 2), (2, 1), (1, 3), (0, 2)]


def _grad(rank: int, w: torch.Tensor) -> torch.Tensor:
    return (rank + 1) * w + 1.0


def _replay() -> list[float]:
    """Single-process replay of the script with plain floats (independent of the server's classes)."""
    w = list(W0)
    pulled = {r: list(W0) for r in range(3)}
    for r in SCRIPT[3:]:
        g = [(r + 1) * x + 1.0 for x in pulled[r]]
        w = [x - LR * gi for x, gi in zip(w, g, strict=True)]
        pulled[r] = list(w)
    return w


def _group() -> dist.ProcessGroup:
    dist.init_process_group("gloo")
    return Topology(dist.get_world_size()).build_service_group()  # the dedicated server group


def _scripted() -> dict:
    group = _group()
    rank, world = dist.get_rank(), dist.get_world_size()

    def core() -> ServerCore:
        return ServerCore(AsgdHandler(FlatModel([torch.tensor(W0)], lr=LR)), list(range(world)), trace=True)

    server, worker = connect(core, group, rank, 0, timedelta(seconds=20), order=SCRIPT)
    (w,) = worker.pull()
    for _ in range(PUSHES):
        (w,) = worker.call(PUSH, [_grad(rank, w)])
    worker.done()
    if server is None:
        return {}
    server.join(30)
    means = {w: s.mean_staleness() for w, s in server.core.stats.workers.items()}
    w = server.consensus()[0].tolist()
    return {"trace": server.core.trace, "w": w, "version": server.core.version, "means": means}


def test_scripted_arrival_order_reproduces_hand_computed_staleness_and_weights():
    out = run_workers(_scripted, devices=3, timeout=60)[0]
    assert out["trace"] == STALENESS
    assert out["means"] == {0: 2.0, 1: 1.5, 2: 1.0}  # per worker, from STALENESS
    assert out["version"] == 6
    assert out["w"] == pytest.approx(_replay(), abs=1e-6)


def _random_arrivals(n: int, steps: int) -> dict:
    group = _group()
    rank, world = dist.get_rank(), dist.get_world_size()

    def core() -> ServerCore:
        return ServerCore(SoftsyncHandler(FlatModel([torch.zeros(3)], lr=1.0), world, n), list(range(world)))

    server, worker = connect(core, group, rank, 0, timedelta(seconds=20))
    rng = random.Random(rank)
    worker.pull()
    for _ in range(steps + rank):  # unequal numbers of pushes: the end must still flush
        time.sleep(rng.random() * 0.01)
        worker.call(PUSH, [torch.full((3,), float(rank + 1))], batch_size=1)
    worker.done()
    if server is None:
        return {"pushes": worker.requests}
    server.join(30)
    stats = server.core.stats
    after = server.consensus()[0].clone()
    time.sleep(0.2)  # nothing may be applied after the end
    return {
        "pushes": worker.requests,
        "applied": {w: s.applied for w, s in stats.workers.items()},
        "received": {w: s.pushes for w, s in stats.workers.items()},
        "w": after.tolist(),
        "w_later": server.consensus()[0].tolist(),
        "updates": stats.updates,
        "version": server.core.version,
    }


@pytest.mark.parametrize("n", [1, 3])
def test_every_pushed_gradient_is_applied_exactly_once_and_none_after_the_end(n):
    out = run_workers(_random_arrivals, n, 5, devices=3, timeout=60)
    pushes = {r: o["pushes"] for r, o in enumerate(out)}
    assert pushes == {0: 5, 1: 6, 2: 7}
    assert out[0]["applied"] == pushes and out[0]["received"] == pushes
    # softsync averages each group; with n = W = 3 every gradient is its own update (ASGD)
    if n == 3:
        want = -sum((r + 1) * k for r, k in pushes.items())
        assert out[0]["updates"] == 18 and out[0]["w"] == pytest.approx([want] * 3)
    assert out[0]["version"] == out[0]["updates"]
    assert out[0]["w"] == out[0]["w_later"]


def _silent(victim: int) -> None:
    group = _group()
    rank, world = dist.get_rank(), dist.get_world_size()

    def core() -> ServerCore:
        return ServerCore(AsgdHandler(FlatModel([torch.zeros(2)])), list(range(world)))

    server, worker = connect(core, group, rank, 0, timedelta(seconds=2))
    worker.pull()
    if rank == victim:
        time.sleep(30)  # silent: never pushes
    for _ in range(10):
        worker.call(PUSH, [torch.ones(2)])
        time.sleep(0.05)
    worker.done()
    if server is not None:
        server.join(30)  # raises the serving thread's error


def test_a_silent_worker_fails_the_server_naming_its_rank():
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_workers(_silent, 2, devices=3, timeout=40)
    assert time.monotonic() - start < 25  # the 2 s timeout, not the victim's 30 s sleep
    assert "rank(s) [2] did not answer within 2 s" in str(info.value)
