"""``finalize()`` may run more than once per fit: twice in a row changes nothing, and training goes on.

The strategies finish their algorithm right after the step they predict to be the fit's last
(:mod:`lightning_hier.strategies._finish`); a wrong guess means finalize, then more steps, then
finalize again. On real gloo groups: a second ``finalize`` is a no-op without communication, and
after more local steps the next ``finalize`` again leaves one model on every rank.
"""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightning_hier.algorithms import HPSGD, ElasticCenter, LeaderCenter, PeriodicAveraging, UniformCenter
from lightning_hier.algorithms.diloco import DiLoCo
from lightning_hier.comm import CommStats
from lightning_hier.testing import run_workers

ALGORITHMS: dict[str, Callable[[list[torch.nn.Parameter], CommStats], HPSGD | PeriodicAveraging | DiLoCo]] = {
    "hpsgd": lambda p, s: HPSGD(p, dist.group.WORLD, window=3, stats=s),
    "diloco": lambda p, s: DiLoCo(p, dist.group.WORLD, window=3, fragments=2, delay=1, stats=s),
    "localsgd": lambda p, s: PeriodicAveraging(p, dist.group.WORLD, UniformCenter(), tau=3, stats=s),
    "easgd": lambda p, s: PeriodicAveraging(p, dist.group.WORLD, ElasticCenter(0.5), tau=3, stats=s),
    "lsgd": lambda p, s: PeriodicAveraging(p, dist.group.WORLD, LeaderCenter(), tau=3, lam=0.5, rho=0.1, stats=s),
}


def _local_steps(algo: HPSGD | PeriodicAveraging, params: list[torch.nn.Parameter], rank: int, steps: int) -> None:
    """Stand-in for optimizer steps: each rank moves its replica its own way."""
    for k in range(steps):
        with torch.no_grad():
            for i, p in enumerate(params):
                p.add_(0.1 * (rank + 1) * (k + 1) + 0.01 * i)
        if isinstance(algo, PeriodicAveraging):
            algo.observe(torch.tensor(float(rank + k)))
        algo.step()


def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


def _finalize_again_and_train_on(name: str) -> dict[str, object]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3)), torch.nn.Parameter(torch.ones(4))]
    stats = CommStats()
    algo = ALGORITHMS[name](params, stats)
    _local_steps(algo, params, rank, 4)  # a partial window / period is left at the end
    algo.finalize()
    first, sent = _flat(params), stats.bytes
    algo.finalize()
    again, sent_again = _flat(params), stats.bytes
    _local_steps(algo, params, rank, 5)  # the guess was wrong: training goes on
    algo.finalize()
    return {"first": first, "again": again, "no_bytes": sent_again == sent, "end": _flat(params)}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_finalize_twice_is_a_no_op_and_training_goes_on(name):
    r0, r1 = run_workers(_finalize_again_and_train_on, name, devices=2)
    for r in (r0, r1):
        assert torch.equal(r["again"], r["first"]) and r["no_bytes"]
    assert torch.equal(r0["first"], r1["first"])
    assert torch.equal(r0["end"], r1["end"]) and not torch.equal(r0["end"], r0["first"])
