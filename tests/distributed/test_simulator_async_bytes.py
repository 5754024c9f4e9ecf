"""The asynchronous models' payload bytes and update counts equal what a real 2-rank gloo run
counts: the parameter-server adapter's ``CommStats`` and the server's own counters (ASGD,
n-softsync), and the asynchronous GRAWA rounds' ``CommStats`` (reports and replies)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.algorithms import PeriodicAveraging
from lightning_hier.algorithms.grawa_async import AsyncGradientWeightedCenter, GrawaServerHandler
from lightning_hier.algorithms.param_server import ServerCore
from lightning_hier.algorithms.ps_rules import AsgdHandler, SoftsyncHandler
from lightning_hier.algorithms.ps_service import connect
from lightning_hier.comm import CommStats
from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, predict
from lightning_hier.sync.ps_adapter import PSAdapter
from lightning_hier.testing import run_workers
from lightning_hier.topology import Topology

STEPS, BATCH, TIMEOUT = 12, 4, timedelta(seconds=20)
CLUSTER = Cluster(2, Link(1e-5, 4e-9))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _workload() -> Workload:
    params = list(_model().parameters())
    return Workload(
        "tiny",
        params=sum(p.numel() for p in params),
        batch_size=BATCH,
        samples_per_epoch=BATCH * 2 * STEPS,
        forward_s=1e-4,
        backward_s=2e-4,
        tensors=len(params),
    )


def _loss(model: nn.Module, g: torch.Generator) -> torch.Tensor:
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _served(n: int | None) -> dict:
    """``n``: softsync's n (None: ASGD). Every rank pushes STEPS gradients through PSAdapter."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Topology(world).build_service_group()
    model, stats = _model(), CommStats()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def handler(flat, workers):  # the adapter's HandlerFactory
        return AsgdHandler(flat) if n is None else SoftsyncHandler(flat, workers, n)

    ps = PSAdapter(model, opt, handler, group, rank, world, TIMEOUT, stats)
    ps.start()
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, g).backward()
        ps.push(1.0, BATCH)
    ps.drain()
    out = {"bytes": stats.bytes}
    if ps.server is not None:
        core = ps.server.core
        out |= {"updates": core.stats.updates, "pushes": [s.pushes for s in core.stats.workers.values()]}
    return out


@pytest.mark.parametrize(("strategy", "n"), [("asgd", None), ("softsync", 1), ("softsync", 2)])
def test_parameter_server_payload_and_updates_match_the_run(strategy, n):
    out = run_workers(_served, n, devices=2, timeout=60)
    args = {} if n is None else {"n": n}
    p = predict(strategy, _workload(), CLUSTER, **args)
    assert [o["bytes"] for o in out] == [p.payload_bytes * STEPS] * 2
    group = 2 if n == 1 else 1  # the gradients per server update
    assert out[0]["pushes"] == [STEPS, STEPS]
    assert out[0]["updates"] == 2 * STEPS // group


def _grawa(variant: str, tau: int) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    service = Topology(world).build_service_group()
    model, stats = _model(), CommStats()
    policy = AsyncGradientWeightedCenter(variant)
    avg = PeriodicAveraging(model.parameters(), dist.group.WORLD, policy, tau, stats=stats)

    def core() -> ServerCore:
        return ServerCore(GrawaServerHandler(avg.flat, list(range(world)), variant), list(range(world)))

    server, worker = connect(core, service, rank, 0, TIMEOUT)
    policy.connect(worker.call, dist.barrier)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, g).backward()
        opt.step()
        avg.step()
    worker.done()
    if server is not None:
        server.join(30)
    return stats.bytes


@pytest.mark.parametrize(("name", "variant", "tau"), [("mgrawa", "model", 3), ("lgrawa", "layer", 4)])
def test_async_grawa_payload_matches_comm_stats(name, variant, tau):
    measured = run_workers(_grawa, variant, tau, devices=2, timeout=60)
    p = predict(name, _workload(), CLUSTER, tau=tau, rounds="async", probe="step")
    assert measured == [pytest.approx(p.payload_bytes * STEPS)] * 2
