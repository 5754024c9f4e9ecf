"""Asynchronous GRAWA under real gloo groups and the parameter-server thread: a scripted order against the replay."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_hier.algorithms.grawa_async import GrawaServerHandler
from lightning_hier.algorithms.param_server import ServerCore
from lightning_hier.algorithms.ps_service import connect
from lightning_hier.testing import run_workers
from lightning_hier.topology import Topology
from tests import grawa_async_reference as ref

ORDER = [2, 0, 1, 1, 0, 2, 2, 0, 1]  # rounds (3 per worker), served in this order whatever the arrivals
TAU, STEPS = 2, 7  # 3 full periods and a final partial one per worker


def _fit(variant: str) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    service = Topology(world).build_service_group()
    me = ref.LibraryWorker(rank, variant, TAU, group=dist.group.WORLD)

    def core() -> ServerCore:
        return ServerCore(GrawaServerHandler(me.algo.flat, list(range(world)), variant), list(range(world)))

    server, worker = connect(core, service, rank, 0, timedelta(seconds=20), order=ORDER)
    me.policy.connect(worker.call, lambda: dist.barrier())
    weights = []
    while me.done < STEPS:
        report = me.step()
        if report is not None:
            weights.append(report.weights)
    replica = me.replica()
    me.algo.finalize()
    worker.done()
    if server is not None:
        server.join(30)
    return {"replica": replica, "consensus": me.replica(), "weights": weights}


@pytest.mark.parametrize("variant", ["model", "layer"])
def test_scripted_rounds_over_gloo_match_the_single_process_replay(variant):
    out = run_workers(_fit, variant, devices=3, timeout=60)
    want = ref.replay(ORDER, workers=3, tau=TAU, steps=STEPS, variant=variant)
    for rank in range(3):
        torch.testing.assert_close(out[rank]["replica"], want["replicas"][rank], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[rank]["consensus"], want["consensus"], rtol=0, atol=1e-6)
        mine = [i for i, w in enumerate(ORDER) if w == rank]  # the weights each of its rounds got back
        for got, i in zip(out[rank]["weights"], mine, strict=True):
            torch.testing.assert_close(got, want["weights"][i], rtol=0, atol=1e-6)
