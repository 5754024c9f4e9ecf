"""The simulator's payload bytes per step equal what the algorithms' own CommStats count on a
real 2-rank gloo run (the same model, the same arguments, a whole number of rounds)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.algorithms import (
    HPSGD,
    ElasticCenter,
    GradientWeightedCenter,
    LeaderCenter,
    PeriodicAveraging,
    UniformCenter,
    float_buffers,
)
from lightning_hier.comm import CommStats
from lightning_hier.planner import Link
from lightning_hier.simulator import Cluster, Workload, predict
from lightning_hier.testing import run_workers

STEPS = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _workload(model: nn.Module) -> Workload:
    params = list(model.parameters())
    return Workload(
        "tiny",
        params=sum(p.numel() for p in params),
        batch_size=4,
        samples_per_epoch=4 * 2 * STEPS,
        forward_s=0.0,
        backward_s=0.0,
        buffers=sum(b.numel() for b in float_buffers(model)),
        tensors=len(params),
    )


def _train(model: nn.Module, algorithm, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if hasattr(algorithm, "observe"):
            algorithm.observe(loss.detach())
        algorithm.step()


POLICIES = {
    "localsgd": lambda: UniformCenter(),
    "easgd": lambda: ElasticCenter(0.1),
    "lsgd": lambda: LeaderCenter(),
    "mgrawa": lambda: GradientWeightedCenter("model"),
    "lgrawa": lambda: GradientWeightedCenter("layer"),
}


def _averaging_bytes(name: str, tau: int) -> int:
    dist.init_process_group("gloo")
    model, stats = _model(), CommStats()
    avg = PeriodicAveraging(
        model.parameters(), dist.group.WORLD, POLICIES[name](), tau, buffers=float_buffers(model), stats=stats
    )
    _train(model, avg, STEPS)
    return stats.bytes


def _hpsgd_bytes(window: int, compression: str) -> int:
    dist.init_process_group("gloo")
    model, stats = _model(), CommStats()
    hp = HPSGD(
        model.parameters(), dist.group.WORLD, window, compression=compression, buffers=float_buffers(model), stats=stats
    )
    _train(model, hp, 1 + STEPS)  # the first window is the first step alone, then STEPS / window windows
    return stats.bytes


CLUSTER = Cluster(2, Link(1e-5, 4e-9))


@pytest.mark.parametrize(("name", "tau"), [("localsgd", 4), ("easgd", 4), ("lsgd", 8), ("mgrawa", 4), ("lgrawa", 8)])
def test_averaging_payload_matches_comm_stats(name, tau):
    measured = run_workers(_averaging_bytes, name, tau, devices=2, timeout=60)
    args = {"probe": "step"} if "grawa" in name else {}
    predicted = predict(name, _workload(_model()), CLUSTER, tau=tau, **args)
    assert measured == [predicted.payload_bytes * STEPS] * 2


@pytest.mark.parametrize(("window", "compression"), [(2, "none"), (4, "bf16")])
def test_hpsgd_payload_matches_comm_stats(window, compression):
    measured = run_workers(_hpsgd_bytes, window, compression, devices=2, timeout=60)
    predicted = predict("hpsgd", _workload(_model()), CLUSTER, window=window, compression=compression)
    per_window = predicted.payload_bytes * window
    assert measured == [per_window * (STEPS // window + 1)] * 2  # + the first step's launch
