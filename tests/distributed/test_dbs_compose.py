"""DBS shares inside HPSGD and Local SGD, under real gloo groups, against single-process simulations.

Every rank trains its own replica on batches whose sizes change from step to step (as DBS's
rebalances change them), and the window's change of rank ``i`` must enter the global model with
the weight ``n_i / N`` (samples processed in the window). The references simulate the W workers
in one process and form ``sum_i n_i delta_i / N`` directly from the counted samples.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hier.algorithms import HPSGD
from lightning_hier.algorithms.averaging import PeriodicAveraging
from lightning_hier.algorithms.dbs_compose import SampleWeightedCenter, SampleWindow
from lightning_hier.testing import run_workers
from tests.dbs_compose_reference import weighted_hpsgd, weighted_localsgd
from tests.hpsgd_reference import params_of

STEPS, LR = 11, 0.1
# per-step batch sizes of each rank (a "rebalance" after step 4 and after step 8)
SIZES = {
    2: [[6, 2]] * 4 + [[3, 5]] * 4 + [[7, 1]] * 3,
    4: [[5, 1, 3, 3]] * 4 + [[2, 4, 4, 2]] * 4 + [[1, 1, 5, 5]] * 3,
}
EQUAL = {2: [[4, 4]] * STEPS}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)


def _loss(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(module(batch[0]), batch[1])


def _data(sizes: list[list[int]]):
    def batch(worker: int, step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1000 * worker + step)
        n = sizes[step][worker]
        return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)

    return batch


# ---------------------------------------------------------------------------------------- ranks
def _train(algorithm: str, sizes: list[list[int]], weighted: bool = True, **args: object) -> Tensor:
    """One rank: train on its own batches, weighting each window by its samples; the final model."""
    world, rank = dist.get_world_size(), dist.get_rank()
    net = _net()
    opt, data = _sgd(net), _data(sizes)
    window = SampleWindow()
    if algorithm == "hpsgd":
        hp = HPSGD(net.parameters(), dist.group.WORLD, optimizer=opt, **args)  # type: ignore[arg-type]
    else:
        center = SampleWeightedCenter()
        avg = PeriodicAveraging(net.parameters(), dist.group.WORLD, center, **args)  # type: ignore[arg-type]
    for step in range(STEPS):
        opt.zero_grad()
        _loss(net, data(rank, step)).backward()
        opt.step()
        window.add(sizes[step][rank], sum(sizes[step]))
        weight = window.weight(world) if weighted else 1.0
        if algorithm == "hpsgd":
            hp.change_weight = weight
            hp.step()
            sent = hp.since_launch == 0
        else:
            center.weight = weight
            avg.step()
            sent = avg.schedule.since_sync == 0
        if sent:
            window.reset()
    (hp if algorithm == "hpsgd" else avg).finalize()
    return params_of(net)


def _ranks(cases: list[tuple[str, str, dict]]) -> list[Tensor]:
    dist.init_process_group("gloo")
    return [_train(algorithm, SIZES[dist.get_world_size()], **args) for algorithm, _, args in cases]


MODEL = (_net, _sgd, _loss)
CASES = [
    ("hpsgd", "paper H=2", {"window": 2, "merge": "paper"}),
    ("hpsgd", "eager H=3", {"window": 3, "merge": "eager"}),
    ("localsgd", "tau=3", {"tau": 3}),
]


@pytest.mark.parametrize("world", [2, 4])
def test_window_changes_weighted_by_samples_equal_the_single_process_simulation(world):
    results = run_workers(_ranks, CASES, devices=world, timeout=120)
    sizes = SIZES[world]
    for i, (algorithm, name, args) in enumerate(CASES):
        if algorithm == "hpsgd":
            expected = weighted_hpsgd(*MODEL, _data(sizes), sizes, int(args["window"]), str(args["merge"]))
        else:
            expected = weighted_localsgd(*MODEL, _data(sizes), sizes, int(args["tau"]))
        for rank, result in enumerate(results):
            torch.testing.assert_close(result[i], expected, atol=1e-6, rtol=0, msg=f"{name}, rank {rank}")


def test_with_equal_shares_the_weighted_rule_is_the_plain_mean_bit_for_bit():
    def run() -> list[Tensor]:
        dist.init_process_group("gloo")
        out = []
        for algorithm, _, args in CASES:
            for weighted in (True, False):
                out.append(_train(algorithm, EQUAL[2], weighted=weighted, **args))
        return out

    for result in run_workers(run, devices=2, timeout=120):
        for weighted, plain in zip(result[::2], result[1::2], strict=True):
            assert torch.equal(weighted, plain)
